"""The Raft loop: one thread that ticks every replica of a node process, over one
poll of all their sockets, instead of pysyncobj's thread per SyncObj (why and the
measurements: docs/raft.md, "A tick thread per SyncObj")."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import pysyncobj.transport as _pysyncobj_transport
from pysyncobj.monotonic import monotonic as _monotonic

from sevendb.proto.threads import name_os_thread

if TYPE_CHECKING:
    from .node import RaftNode

__all__ = [
    "LoopPoller",
    "LoopTransport",
    "RaftLoop",
]

logger = logging.getLogger(__name__)

_LOOP_IDLE_S: Final = 0.1
"""The longest a `RaftLoop` polls with no replica due (it then checks that the
interpreter's main thread is alive, as pysyncobj's tick thread does)."""
_POLL_IN: Final = select.POLLIN
_POLL_OUT: Final = select.POLLOUT
_POLL_ERR: Final = select.POLLERR | select.POLLHUP | select.POLLNVAL


class RaftLoop:
    """One thread that ticks every Raft replica of a process.

    pysyncobj gives every SyncObj a tick thread of its own, which polls that
    replica's sockets and then runs its Raft step. A node hosts a replica per
    bucket, and those threads contend for one GIL: on the 2-core dev VM, stock
    pysyncobj with 4 groups in 3 processes made 6,405 writes/s (32 in flight)
    with a thread per group and 9,280 with one thread ticking all four
    (docs/performance.md, stop 25). Here the replicas
    of a process share one poll of all their sockets (pysyncobj's ``_poller`` of
    each is a `LoopPoller` view of it), and each pass ticks the replicas whose
    sockets or wake-up pipe had an event, or whose own timeout is due: a replica
    is ticked exactly when its own thread would have woken.

    `BucketReplica` creates a loop of its own when none is given; a node passes
    one loop to all its replicas. Replicas are attached once built (`attach`: no
    callback of a replica runs before) and detached by `BucketReplica.close`,
    which destroys the SyncObj inside the loop. The thread ends after `close`, or
    when the interpreter's main thread has ended (as pysyncobj's does)."""

    def __init__(self, name: str = "raft") -> None:
        self.name = name
        self._poll = select.poll()
        self._fds: dict[int, tuple[RaftNode, Callable[[int, int], None]]] = {}
        self._nodes: tuple[RaftNode, ...] = ()
        self._ready: set[RaftNode] = set()
        """Replicas with an event since their last tick (loop thread only)."""
        self._calls: list[Callable[[], None]] = []
        self._calls_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll.register(self._wake_r, _POLL_IN)
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

    # -- other threads -----------------------------------------------------------------

    def attach(self, node: RaftNode) -> None:
        """Start ticking `node`, with the subscriptions its construction made."""
        if self._closing:
            raise RuntimeError(f"{self.name}: the Raft loop is closed")
        self._call(lambda: self._attach(node))

    def detach(self, node: RaftNode) -> None:
        """Stop ticking `node` and destroy it (its transport's sockets, its journal's
        pysyncobj side) in the loop thread; returns once done."""
        done = threading.Event()

        def run() -> None:
            try:
                self._nodes = tuple(n for n in self._nodes if n is not node)
                self._ready.discard(node)
                node._doDestroy()
            finally:
                done.set()

        if not self._thread.is_alive() or threading.current_thread() is self._thread:
            run()
        else:
            self._call(run)
            while not done.wait(1.0) and self._thread.is_alive():
                pass
            if not done.is_set():  # the loop ended meanwhile
                run()

    def close(self) -> None:
        """End the thread; call it once every replica is detached. Idempotent."""
        with self._calls_lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        if threading.current_thread() is self._thread:
            return  # it ends after this pass; its pipe stays open
        self._thread.join()
        with self._calls_lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _call(self, fn: Callable[[], None]) -> None:
        with self._calls_lock:
            self._calls.append(fn)
        self._wake()

    def _wake(self) -> None:
        with self._calls_lock, contextlib.suppress(BlockingIOError):  # full: awake
            if not self._closed:
                os.write(self._wake_w, b"w")

    # -- the loop thread ---------------------------------------------------------------

    def _attach(self, node: RaftNode) -> None:
        self._nodes = (*self._nodes, node)
        node._loop_poller.activate()
        self._ready.add(node)

    def subscribe(
        self, node: RaftNode, fd: int, callback: Callable[[int, int], None], mask: int
    ) -> None:
        """pysyncobj's ``Poller.subscribe`` for `node`'s socket or pipe `fd` (its
        ``POLL_EVENT_TYPE`` mask: 1 read, 2 write, 4 error)."""
        events = (_POLL_IN if mask & 1 else 0) | (_POLL_OUT if mask & 2 else 0)
        if mask & 4:
            events |= _POLL_ERR
        self._fds[fd] = (node, callback)
        self._poll.register(fd, events)
        if threading.current_thread() is not self._thread:
            self._wake()  # a poll in progress does not watch the new fd

    def unsubscribe(self, fd: int) -> None:
        if self._fds.pop(fd, None) is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._poll.unregister(fd)

    def _run(self) -> None:
        name_os_thread(self.name)
        main = threading.main_thread()
        while not self._closing and main.is_alive():
            if self._calls:
                with self._calls_lock:
                    calls, self._calls = self._calls, []
                for call in calls:
                    try:
                        call()
                    except Exception:
                        logger.exception("%s: a call in the Raft loop failed", self.name)
            now = _monotonic()
            ready, self._ready = self._ready, set()
            wake_at = now + _LOOP_IDLE_S
            for node in self._nodes:
                if node in ready or node._poll_until <= now:
                    node.tick()
                wake_at = min(wake_at, node._poll_until)
            self._dispatch(self._poll.poll(max(0.0, wake_at - _monotonic()) * 1000))

    def _dispatch(self, events: list[tuple[int, int]]) -> None:
        fds = self._fds
        for fd, event in events:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(fd, 4096):
                        pass
                continue
            entry = fds.get(fd)
            if entry is None:
                continue  # unsubscribed by an earlier callback of this pass
            node, callback = entry
            self._ready.add(node)
            mask = (1 if event & _POLL_IN else 0) | (2 if event & _POLL_OUT else 0)
            if event & _POLL_ERR:
                mask |= 4
            try:
                callback(fd, mask)
            except Exception:
                # As pysyncobj's thread waited a tick period after an exception: the
                # replica's sockets are read again at its next tick, not at once.
                logger.exception("bucket %d: a Raft socket callback failed", node._owner.bucket)
                node._loop_poller.suspend()
                node._poll_until = _monotonic() + node._tick_s


class LoopPoller:
    """What one replica's pysyncobj sees as its ``_poller``: subscriptions go to the
    `RaftLoop`'s poll while the replica is attached (held back before, so that none
    of its callbacks runs until it is whole; and after `suspend`), and ``poll``
    does nothing (the loop polls for every replica at once, after ticking them)."""

    def __init__(self, loop: RaftLoop, node: RaftNode) -> None:
        self._loop = loop
        self._node = node
        self._subscribed: dict[int, tuple[Callable[[int, int], None], int]] = {}
        self._active = False

    def activate(self) -> None:
        """In the loop thread, once the replica is attached (and after `suspend`)."""
        if self._active:
            return
        self._active = True
        for fd, (callback, mask) in self._subscribed.items():
            self._loop.subscribe(self._node, fd, callback, mask)

    def suspend(self) -> None:
        """In the loop thread: nothing of this replica is read until `activate` (its
        next tick does, unless it is in fail-stop: then it behaves as a crashed
        replica, its sockets open and unread)."""
        if self._active:
            self._active = False
            for fd in self._subscribed:
                self._loop.unsubscribe(fd)

    def subscribe(self, fd: int, callback: Callable[[int, int], None], mask: int) -> None:
        self._subscribed[fd] = (callback, mask)
        if self._active:
            self._loop.subscribe(self._node, fd, callback, mask)

    def unsubscribe(self, fd: int) -> None:
        self._subscribed.pop(fd, None)
        if self._active:
            self._loop.unsubscribe(fd)

    def poll(self, timeout: float) -> None:
        """The end of pysyncobj's tick: the loop polls instead."""


class LoopTransport(_pysyncobj_transport.TCPTransport):  # type: ignore[misc]
    """pysyncobj's TCP transport, but a failed bind waits out ``bindRetryTime``
    before the next attempt: a SyncObj without a tick thread of its own binds in
    its constructor, in a loop that would otherwise spin (syncobj.py:289-294)."""

    _lastBindAttemptTime: float

    def tryGetReady(self) -> None:
        if not self.ready:
            wait = self._lastBindAttemptTime + self._syncObj.conf.bindRetryTime - _monotonic()
            if wait > 0:
                time.sleep(wait)
        super().tryGetReady()
