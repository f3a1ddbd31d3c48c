"""Names a node's threads for the operating system, so `top -H`, `ps -L` and
`/proc/<pid>/task/*/comm` tell the Raft tick, notifier and archive threads apart
(Python names its threads for itself only; Linux, elsewhere a no-op), and makes a
long CPU-bound piece of work run in a child process with a GIL of its own
(`start_forked`)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
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


_PR_SET_PDEATHSIG: Final = 1
_CHILD_FAILED: Final = 70
"""A forked child's exit status when its function raised (EX_SOFTWARE)."""


class ForkedChild:
    """A child process `start_forked` started: `wait` for its end, or `kill` it."""

    def __init__(self, pid: int, name: str) -> None:
        self.pid = pid
        self.name = name
        self._code: int | None = None

    def wait(self) -> None:
        """Wait for the child's end without the GIL; raises ChildProcessError if its
        function raised or it was killed. Once ended, a later call returns (or raises)
        at once."""
        if self._code is None:
            _, status = os.waitpid(self.pid, 0)
            self._code = os.waitstatus_to_exitcode(status)
        code = self._code
        if code != 0:
            raise ChildProcessError(
                f"{self.name}: child process {self.pid} "
                + (f"was killed by signal {-code}" if code < 0 else f"failed (exit status {code})")
            )

    def kill(self) -> None:
        """End the child (SIGKILL) if it still runs, and reap it."""
        if self._code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            self.wait()


def start_forked(fn: Callable[[], None], name: str) -> ForkedChild:
    """Run `fn` in a forked child process; returns at once (Linux).

    A thread of the node that spends hundreds of milliseconds of CPU in Python (a
    snapshot being packed) shares the process's one GIL with the Raft loop and the
    gRPC loop: each waits for it at every poll, send and fsync, and writes slow to
    tens of milliseconds for as long as it runs (docs/performance.md, "Snapshots
    packed in a child process"). The child has a GIL of its own, and it sees the
    process's memory as it was at the fork (copy-on-write): the state of this
    instant, without copying anything first.

    Only the calling thread goes on in the child: `fn` must not wait for locks other
    threads may hold (logging, gRPC, the replica's apply lock) and must not use gRPC.
    Its garbage collector is off: it runs `fn` once and ends, and a collection there
    writes into the header of every object it walks, copying the parent's pages (a
    snapshot's child: 0.26-0.35 s of CPU instead of 0.33-0.41, ~4,000 fewer page
    faults; docs/performance.md). The child ends with `os._exit` (no atexit, no
    buffered output of the parent's flushed twice), prints a traceback to stderr
    when `fn` raises, and is killed (SIGKILL) if the calling thread ends first, so a
    node killed meanwhile leaves no child writing into its data directory."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; measured by its exit status
        code = _CHILD_FAILED
        gc.disable()
        try:
            if _libc is not None:
                _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() == parent:  # else the parent ended before the prctl
                name_os_thread(name)
                fn()
                code = 0
        except BaseException:
            with contextlib.suppress(BaseException):
                traceback.print_exc()
        finally:
            os._exit(code)
    return ForkedChild(pid, name)


__all__ = ["ForkedChild", "name_os_thread", "start_forked"]
