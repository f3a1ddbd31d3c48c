"""Every subscription stream of a client to one node over one `Session` call.

A bucket stream of a `Subscription` is a Subscribe or a Reconnect. On calls of
their own, thousands of subscriptions made every event a gRPC message on its own
stream, read by its own task, on both ends. Here they share one bidi `Session`
call per node: the node packs what is due on any of them into one message, and
one reader task hands each stream its messages.

A `SessionStream` behaves as its own call would: `read()` returns its messages in
order, then `aio.EOF` when it ends normally, or raises the `AioRpcError` that call
would have ended with (status, details, and the leader hint and error code as
trailers); `cancel()` closes it on the node. When the session call itself fails,
every stream on it fails the same way, and the next stream opened to that node
starts a new session. Loop only.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import grpc
from grpc import aio

from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk.engine import ERROR_CODE_KEY, LEADER_HINT_KEY, Engine, status_code


def _end_error(end: pb.StreamEnd) -> aio.AioRpcError | None:
    """The error a stream's own call would have ended with; None for a normal end."""
    if end.code == 0:
        return None
    trailers = []
    if end.leader:
        trailers.append((LEADER_HINT_KEY, end.leader))
    if end.error:
        trailers.append((ERROR_CODE_KEY, end.error))
    return aio.AioRpcError(
        status_code(end.code),
        aio.Metadata(),
        aio.Metadata(*trailers),
        end.message,
    )


def _copy(error: aio.AioRpcError) -> aio.AioRpcError:
    return aio.AioRpcError(
        error.code(), aio.Metadata(), error.trailing_metadata() or aio.Metadata(), error.details()
    )


class SessionStream:
    """One Subscribe or Reconnect on a session, read like its own call."""

    def __init__(self, session: _Session, stream_id: int) -> None:
        self._session = session
        self.stream_id = stream_id
        self._items: asyncio.Queue[Any] = asyncio.Queue()

    async def read(self) -> Any:
        """The next `StreamMessage`, or `aio.EOF`; raises how the stream failed."""
        try:
            item = await self._items.get()
        except asyncio.CancelledError:
            self.cancel()  # the reading task is stopping: the node stops sending
            raise
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._session.close_stream(self.stream_id)

    def _put(self, item: Any) -> None:
        self._items.put_nowait(item)


class _Session:
    def __init__(self, engine: Engine, target: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.target = target
        self.closed = False
        self._call = engine.stub(target).Session(metadata=metadata)
        self._streams: dict[int, SessionStream] = {}
        self._ids = itertools.count(1)
        self._requests: asyncio.Queue[pb.SessionRequest] = asyncio.Queue()
        loop = engine.loop
        self._reader = loop.create_task(self._read())
        self._writer = loop.create_task(self._write())

    def open(self, request: pb.SessionRequest) -> SessionStream:
        stream = SessionStream(self, next(self._ids))
        request.stream_id = stream.stream_id
        self._streams[stream.stream_id] = stream
        self._requests.put_nowait(request)
        return stream

    def close_stream(self, stream_id: int) -> None:
        if self._streams.pop(stream_id, None) is not None and not self.closed:
            self._requests.put_nowait(pb.SessionRequest(stream_id=stream_id, close=True))

    async def _write(self) -> None:
        """One write at a time (grpc.aio allows no more)."""
        try:
            while True:
                await self._call.write(await self._requests.get())
        except (aio.AioRpcError, aio.UsageError, asyncio.InvalidStateError):
            pass  # the call is over: the reader tells the streams

    async def _read(self) -> None:
        error: aio.AioRpcError | None = None
        try:
            while (response := await self._call.read()) is not aio.EOF:
                for item in response.items:
                    stream = self._streams.get(item.stream_id)
                    if stream is None:
                        continue  # closed here; the node had sent this before it knew
                    if item.HasField("end"):
                        del self._streams[item.stream_id]
                        stream._put(_end_error(item.end) or aio.EOF)
                    else:
                        stream._put(item.message)
        except aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = aio.AioRpcError(
                grpc.StatusCode.CANCELLED, aio.Metadata(), aio.Metadata(), "session closed"
            )
            raise
        finally:
            self.closed = True
            self._writer.cancel()
            self._call.cancel()
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                # An error of its own each: one raised in thousands of tasks would
                # collect all their tracebacks.
                stream._put(aio.EOF if error is None else _copy(error))


class Sessions:
    """The client's sessions, one per node address. Loop only."""

    def __init__(self, engine: Engine, metadata: tuple[tuple[str, str], ...]) -> None:
        self._engine = engine
        self._metadata = metadata
        self._by_target: dict[str, _Session] = {}

    def subscribe(self, target: str, request: pb.SubscribeRequest) -> SessionStream:
        return self._session(target).open(pb.SessionRequest(subscribe=request))

    def reconnect(self, target: str, request: pb.ReconnectRequest) -> SessionStream:
        return self._session(target).open(pb.SessionRequest(reconnect=request))

    def _session(self, target: str) -> _Session:
        session = self._by_target.get(target)
        if session is None or session.closed:
            session = self._by_target[target] = _Session(self._engine, target, self._metadata)
        return session


__all__ = ["SessionStream", "Sessions"]
