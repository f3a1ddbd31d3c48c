"""Names a node's threads for the operating system, so `top -H`, `ps -L` and
`/proc/<pid>/task/*/comm` tell the Raft tick, notifier and archive threads apart
(Python names its threads for itself only; Linux, elsewhere a no-op), and makes a
thread's long CPU-bound work hand the GIL over promptly (`prompt_handover`)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Iterator
from typing import Final

_PR_SET_NAME: Final = 15
_NAME_BYTES_MAX: Final = 15  # the kernel keeps 16 bytes with the final NUL

_libc = (
    ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None
)


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread `name` (default: its Python name), cut to 15 bytes, as
    its OS name. Never raises: a name is a convenience."""
    if _libc is None:
        return
    raw = (name or threading.current_thread().name).encode("utf-8", "replace")
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw[:_NAME_BYTES_MAX]), 0, 0, 0)


HANDOVER_SWITCH_INTERVAL_S: Final = 0.0005
"""The interpreter's switch interval while some thread runs `prompt_handover` work
(CPython's default: 0.005 s)."""

_handover_lock = threading.Lock()
_handover_depth = 0
_handover_saved = 0.0


@contextlib.contextmanager
def prompt_handover() -> Iterator[None]:
    """Run the block with the process's GIL switch interval at
    `HANDOVER_SWITCH_INTERVAL_S`, then put back what it was (nested and concurrent
    uses, in any threads, restore it when the last one ends).

    A thread that spends hundreds of milliseconds of CPU in Python (a snapshot being
    packed) keeps the GIL until another thread has waited the switch interval for
    it. The Raft loop thread gives the GIL up at every poll, socket call and fsync,
    and waits up to that interval to get it back each time: at CPython's 5 ms, a
    tick that makes ten such calls took ~50 ms longer on each node, for as long as
    the snapshot ran (docs/performance.md, "Writes stalled behind snapshots"). A
    shorter interval for the whole process costs throughput when nothing of the
    kind runs (docs/performance.md, stop 20), so it is shortened only meanwhile."""
    global _handover_depth, _handover_saved
    with _handover_lock:
        if _handover_depth == 0:
            _handover_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_handover_saved, HANDOVER_SWITCH_INTERVAL_S))
        _handover_depth += 1
    try:
        yield
    finally:
        with _handover_lock:
            _handover_depth -= 1
            if _handover_depth == 0:
                sys.setswitchinterval(_handover_saved)


__all__ = ["HANDOVER_SWITCH_INTERVAL_S", "name_os_thread", "prompt_handover"]
