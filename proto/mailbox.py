"""Calls into an asyncio loop from other threads, one wake-up per batch.

`loop.call_soon_threadsafe` writes to the loop's self-pipe on every call, and the
loop reads it back on its next turn: with thousands of subscriptions, a call per
event was the largest single cost left in a subscriber process (the self-pipe's
write and read, 14% of its samples) and a visible one on the node handing rows to
streams. A `Mailbox` queues the calls and wakes the loop once for all that arrive
before it runs them. Calls run in the order posted.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any


class Mailbox:
    """Callbacks for one loop, posted from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the registry below must not keep loops alive
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop soon. Raises RuntimeError if the loop is closed."""
        with self._lock:
            self._calls.append((fn, args))
            if len(self._calls) > 1:
                return  # a wake-up is on its way and will run this call too
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._run)
        except RuntimeError:
            with self._lock:
                self._calls.clear()
            raise

    def _run(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        loop = self._loop()
        for fn, args in calls:
            try:
                fn(*args)
            except Exception as exc:  # as the loop treats a failing callback: log, go on
                assert loop is not None  # it is running this
                loop.call_exception_handler(
                    {"message": f"exception in mailbox call {fn!r}", "exception": exc}
                )


_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = (
    weakref.WeakKeyDictionary()
)
_BY_LOOP_LOCK = threading.Lock()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The mailbox of `loop` (one per loop, made on first use)."""
    with _BY_LOOP_LOCK:
        box = _BY_LOOP.get(loop)
        if box is None:
            box = _BY_LOOP[loop] = Mailbox(loop)
        return box


__all__ = ["Mailbox", "mailbox"]
