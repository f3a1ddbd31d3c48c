"""Names a node's threads for the operating system, so `top -H`, `ps -L` and
`/proc/<pid>/task/*/comm` tell the Raft tick, notifier and archive threads apart
(Python names its threads for itself only). Linux; elsewhere a no-op."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
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


__all__ = ["name_os_thread"]
