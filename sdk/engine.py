"""The SDK's background asyncio loop: one thread per `Client` runs every stream and
write pipeline over grpc.aio channels (one per node), so a process can hold
thousands of streams and keep many writes in flight without a thread each."""

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
    """An event loop in a daemon thread, with one channel per node address (TLS
    unless `tls` is None)."""

    def __init__(self, endpoints: Sequence[str], tls: TLS | None) -> None:
        self.endpoints = list(endpoints)
        self.tls = tls
        self.loop = asyncio.new_event_loop()
        self.mailbox = mailbox(self.loop)
        """Calls into the loop from other threads, one wake-up per batch."""
        self._channels: dict[str, aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.SevenDBStub] = {}
        self._rotation = itertools.count(random.randrange(1 << 16))
        self._thread = threading.Thread(target=self._run, name="sevendb-sdk", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_os_thread()  # `sevendb-sdk` in top -H and ps -L, too
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def on_loop_thread(self) -> bool:
        """Is the caller on the loop's thread (a callback)? It must not wait on the loop."""
        return threading.get_ident() == self._thread.ident

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run `coro` on the loop (from any thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

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

    def close(self) -> None:
        async def shutdown() -> None:
            for channel in self._channels.values():
                await channel.close()

        if self.loop.is_running():
            self.submit(shutdown()).result(5)
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
