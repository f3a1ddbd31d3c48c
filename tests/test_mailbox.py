"""proto/mailbox.py: calls posted from other threads run on the loop, in order, with one
wake-up for everything posted before the loop gets to them."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from sevendb.proto.mailbox import Mailbox, mailbox


def test_calls_posted_while_the_loop_is_busy_share_one_wake_up() -> None:
    loop = asyncio.new_event_loop()
    wakeups = 0
    original = loop.call_soon_threadsafe

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal wakeups
        wakeups += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
    box = Mailbox(loop)
    seen: list[int] = []
    posted = threading.Event()

    def poster() -> None:
        for i in range(100):
            box.post(seen.append, i)
        box.post(lambda: 1 / 0)  # a failing call is reported, and the next ones still run
        box.post(seen.append, 100)
        posted.set()

    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))

    async def main() -> None:
        threading.Thread(target=poster).start()
        assert posted.wait(10)  # the loop is held up (busy) until every call is posted
        while len(seen) < 101:
            await asyncio.sleep(0.001)

    try:
        loop.run_until_complete(asyncio.wait_for(main(), 10))
    finally:
        loop.close()
    assert seen == list(range(101))
    assert wakeups == 1  # not one per call (102)
    assert len(errors) == 1 and isinstance(errors[0]["exception"], ZeroDivisionError)


def test_one_mailbox_per_loop_and_a_closed_loop_refuses() -> None:
    loop = asyncio.new_event_loop()
    assert mailbox(loop) is mailbox(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        mailbox(loop).post(print)
    with pytest.raises(RuntimeError):  # nothing was left queued that would block a retry
        mailbox(loop).post(print)


def test_the_registry_does_not_keep_a_loop_alive() -> None:
    import gc
    import weakref

    loop = asyncio.new_event_loop()
    mailbox(loop)
    ref = weakref.ref(loop)
    loop.close()
    del loop
    gc.collect()
    assert ref() is None
