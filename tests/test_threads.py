"""proto/threads.py: a node's threads, and a client's loop thread, carry their names to
the operating system; long CPU-bound work shortens the GIL switch interval meanwhile."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from sevendb.proto.threads import HANDOVER_SWITCH_INTERVAL_S, name_os_thread, prompt_handover


def _os_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_thread_gets_its_python_name_or_the_given_one_cut_to_15_bytes() -> None:
    seen: dict[str, str] = {}

    def run(key: str, name: str | None) -> None:
        name_os_thread(name)
        seen[key] = _os_name(threading.get_native_id())

    threads = [
        threading.Thread(target=run, args=("own", None), name="notifier-b7"),
        threading.Thread(target=run, args=("given", "raft-b123456789012345"), name="x"),
    ]
    for t in threads:
        t.start()
        t.join()
    assert seen == {"own": "notifier-b7", "given": "raft-b123456789"}
    main = threading.main_thread().native_id
    assert main is not None and _os_name(main) != "notifier-b7"  # only the caller


def test_a_client_names_its_loop_thread() -> None:
    from sevendb.sdk.engine import Engine

    engine = Engine(["127.0.0.1:1"], None)  # no call is made: the loop thread alone
    try:
        native = engine.submit(_native_id()).result(5)
        assert _os_name(native) == "sevendb-sdk"
    finally:
        engine.close()


async def _native_id() -> int:
    return threading.get_native_id()


def test_prompt_handover_shortens_the_switch_interval_until_the_last_user_ends() -> None:
    before = sys.getswitchinterval()
    assert before > HANDOVER_SWITCH_INTERVAL_S  # CPython's 5 ms
    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with prompt_handover():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with prompt_handover():
        assert sys.getswitchinterval() == HANDOVER_SWITCH_INTERVAL_S
        t.start()
        assert inside.wait(10)
    assert sys.getswitchinterval() == HANDOVER_SWITCH_INTERVAL_S  # the other one still runs
    leave.set()
    t.join()
    assert sys.getswitchinterval() == before
    try:
        with prompt_handover():
            raise ValueError("boom")
    except ValueError:
        pass
    assert sys.getswitchinterval() == before
