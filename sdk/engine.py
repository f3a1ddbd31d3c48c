"""The SDK's asyncio loop: every stream and write pipeline of a client runs on it over
grpc.aio channels (one per node), so a process can hold thousands of streams and
keep many writes in flight without a thread each. A `Client` runs its loop in a
background thread; an `AsyncClient` runs on the caller's own loop (no thread)."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, Final, TypeVar

import grpc
from grpc import aio

from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.proto.codec import ERROR_CODE_KEY, LEADER_HINT_KEY, RETRY_AFTER_KEY
from sevendb.proto.mailbox import mailbox
from sevendb.proto.threads import name_os_thread
from sevendb.sdk.tls import TLS, aio_channel

T = TypeVar("T")


_STATUS_BY_VALUE: Final = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The gRPC status with this number (as carried in a message); UNKNOWN if none."""
    return _STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def leader_hint(exc: aio.AioRpcError) -> str | None:
    """The `sevendb-leader` trailer of a failed call (the node to try next)."""
    return trailer(exc, LEADER_HINT_KEY)


def trailer(exc: aio.AioRpcError, key: str) -> str | None:
    for k, value in exc.trailing_metadata() or ():
        if k == key:
            return value if isinstance(value, str) else value.decode()
    return None


class Engine:
    """An event loop with one channel per node address (TLS unless `tls` is None):
    a new loop in a daemon thread, or with `loop` the caller's running loop (then
    the caller's thread is the loop's thread, and `aclose` closes the channels)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        tls: TLS | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.tls = tls
        self.loop = loop or asyncio.new_event_loop()
        self.mailbox = mailbox(self.loop)
        """Calls into the loop from other threads, one wake-up per batch."""
        self._channels: dict[str, aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.SevenDBStub] = {}
        self._rotation = itertools.count(random.randrange(1 << 16))
        self.holders: dict[int, str] = {}
        """Loop only: the node each bucket's last stream was established on (its
        notifier lease holder then): where a new subscription of it goes first."""
        self._thread: threading.Thread | None = None
        self._loop_ident = threading.get_ident()
        if loop is None:
            self._thread = threading.Thread(target=self._run, name="sevendb-sdk", daemon=True)
            self._thread.start()
            assert self._thread.ident is not None
            self._loop_ident = self._thread.ident

    def _run(self) -> None:
        name_os_thread()  # `sevendb-sdk` in top -H and ps -L, too
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self._finish()

    def _finish(self) -> None:
        """As `asyncio.run` ends: the tasks still pending are cancelled and run to
        their end, then the loop is closed. (Left in the stopped loop's queue, they
        kept their calls, and a call keeps its channel's connection open, on the
        node too: each closed client left one per node until the garbage collector
        found the cycle.)"""
        loop = self.loop
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    @property
    def threaded(self) -> bool:
        """Does the loop run in a thread of the engine's own (a `Client`'s)?"""
        return self._thread is not None

    def on_loop_thread(self) -> bool:
        """Is the caller on the loop's thread (a callback)? It must not wait on the loop."""
        return threading.get_ident() == self._loop_ident

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run `coro` on the loop (from any thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the loop from a coroutine of any loop: directly on this
        one, through `submit` from another (an application's own loop using a
        thread-loop `Client`'s subscription)."""
        try:
            here = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            here = False
        if here:
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def stub(self, address: str) -> pb_grpc.SevenDBStub:
        """Only on the loop. One channel and one stub per address (a stub builds a
        callable per method: not something to do per call)."""
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._channels[address] = aio_channel(address, self.tls)
            stub = self._stubs[address] = pb_grpc.SevenDBStub(channel)
        return stub

    def any_endpoint(self) -> str:
        return self.endpoints[next(self._rotation) % len(self.endpoints)]

    async def aclose(self) -> None:
        """On the loop: close the channels (all an engine on the caller's loop holds)."""
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for channel in channels:
            await channel.close()

    def close(self) -> None:
        """Close the channels and stop the loop's thread (not on the loop's thread)."""
        if self.loop.is_running():
            self.submit(self.aclose()).result(5)
            if self._thread is not None:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(5)


__all__ = [
    "ERROR_CODE_KEY",
    "LEADER_HINT_KEY",
    "RETRY_AFTER_KEY",
    "Engine",
    "leader_hint",
    "status_code",
    "trailer",
]
