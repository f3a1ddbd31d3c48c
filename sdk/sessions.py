"""Every subscription stream of a client to one node over one `Session` call.

A bucket stream of a `Subscription` is a Subscribe or a Reconnect. On calls of
their own, thousands of subscriptions made every event a gRPC message on its own
stream, read by its own task, on both ends. Here they share one bidi `Session`
call per node: the node packs what is due on any of them into one message, and
one reader task hands each stream its messages: queued for the stream's task to
read, or, once the stream is open, straight to a handler (`push_to`), so that a
delivery wakes no task of its own. The other way, one writer task sends every
request queued by the time the call can take a write in one `SessionRequests`
message: subscriptions made together open their streams in one message.

A `SessionStream` behaves as its own call would: `read()` returns its messages in
order, then `aio.EOF` when it ends normally, or raises the `AioRpcError` that call
would have ended with (status, details, and the leader hint and error code as
trailers); `cancel()` closes it on the node. When the session call itself fails,
every stream on it fails the same way, and the next stream opened to that node
starts a new session. Every node of a cluster runs one version (docs/emission.md),
so a node that answers `Session` with UNIMPLEMENTED is refused like any other
UNIMPLEMENTED, not served a call per stream. Loop only.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Callable
from typing import Any, Final

import grpc
from grpc import aio

from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk.engine import Engine, status_code

REQUESTS_PER_MESSAGE: Final = 256
"""Most requests in one SessionRequests message (each is at most ~1.5 KB, so a
message stays far below the nodes' limit on received messages)."""


def _end_error(end: pb.StreamEnd) -> aio.AioRpcError | None:
    """The error a stream's own call would have ended with; None for a normal end."""
    if end.code == 0:
        return None
    return aio.AioRpcError(
        status_code(end.code),
        aio.Metadata(),
        aio.Metadata(*codec.trailers(end.leader, end.error)),
        end.message,
    )


def _copy(error: aio.AioRpcError) -> aio.AioRpcError:
    return aio.AioRpcError(
        error.code(), aio.Metadata(), error.trailing_metadata() or aio.Metadata(), error.details()
    )


class SessionStream:
    """One Subscribe or Reconnect on a session, read like its own call.

    Once its opening message is read, a stream may `push_to` a handler: the session's
    reader then hands it each later message as it arrives, with no task woken per
    message, and `read()` is left with the stream's end."""

    def __init__(self, stream_id: int, close: Callable[[int], None]) -> None:
        self.stream_id = stream_id
        self._close = close
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._push: Callable[[Any], bool] | None = None

    async def read(self) -> Any:
        """The next `StreamMessage`, or `aio.EOF`; raises how the stream failed."""
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            except asyncio.CancelledError:
                self.cancel()  # the reading task is stopping: the node stops sending
                raise
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def push_to(self, handler: Callable[[Any], bool]) -> None:
        """Hand this and every later message to `handler` (queued ones first), on the
        loop, as the reader takes them. `handler` returns False to stop: `read()` then
        returns `aio.EOF`. An exception it raises stops it too, raised by `read()`."""
        self._push = handler
        while self._push is not None and self._items and _is_message(self._items[0]):
            self._offer(self._items.popleft())

    def cancel(self) -> None:
        """Close the stream on the node (idempotent)."""
        self._close(self.stream_id)

    def _put(self, item: Any) -> None:
        if self._push is not None and _is_message(item):
            self._offer(item)
        else:
            self._queue(item)

    def _offer(self, message: Any) -> None:
        assert self._push is not None
        try:
            more = self._push(message)
        except Exception as exc:  # the reader serves every stream: never let it fail
            self._push = None
            self._queue(exc, first=True)
            return
        if not more:
            self._push = None
            self._queue(aio.EOF, first=True)

    def _queue(self, item: Any, *, first: bool = False) -> None:
        if first:
            self._items.appendleft(item)
        else:
            self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _is_message(item: Any) -> bool:
    return item is not aio.EOF and not isinstance(item, BaseException)


class _Session:
    def __init__(self, engine: Engine, target: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.target = target
        self.closed = False
        self._call = engine.stub(target).Session(metadata=metadata)
        self._streams: dict[int, SessionStream] = {}
        self._ids = itertools.count(1)
        self._requests: asyncio.Queue[pb.SessionRequest] = asyncio.Queue()
        loop = engine.loop
        self._reader: asyncio.Task[None] | None = loop.create_task(self._read())
        self._writer: asyncio.Task[None] | None = loop.create_task(self._write())
        self._reader.add_done_callback(self._release)
        self._writer.add_done_callback(self._release)

    def open(self, request: pb.SessionRequest) -> SessionStream:
        stream = SessionStream(next(self._ids), self.close_stream)
        request.stream_id = stream.stream_id
        self._streams[stream.stream_id] = stream
        self._requests.put_nowait(request)
        return stream

    def close_stream(self, stream_id: int) -> None:
        if self._streams.pop(stream_id, None) is not None and not self.closed:
            self._requests.put_nowait(pb.SessionRequest(stream_id=stream_id, close=True))

    async def _write(self) -> None:
        """One write at a time (grpc.aio allows no more), of every request queued by
        then (at most `REQUESTS_PER_MESSAGE`): streams opened together, as many
        subscriptions made at once open theirs, share a message. No timer waits for
        more: a lone request goes at once."""
        queue = self._requests
        try:
            while True:
                batch = [await queue.get()]
                while not queue.empty() and len(batch) < REQUESTS_PER_MESSAGE:
                    batch.append(queue.get_nowait())
                await self._call.write(pb.SessionRequests(requests=batch))
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
            error = _copy(exc)  # not `exc`: its traceback holds this frame, and the call
        except asyncio.CancelledError:
            error = aio.AioRpcError(
                grpc.StatusCode.CANCELLED, aio.Metadata(), aio.Metadata(), "session closed"
            )
            raise
        finally:
            self.closed = True
            assert self._writer is not None
            self._writer.cancel()
            self._call.cancel()
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                # An error of its own each: one raised in thousands of tasks would
                # collect all their tracebacks.
                stream._put(aio.EOF if error is None else _copy(error))

    def _release(self, _: object) -> None:
        """Once both tasks are over: let go of the call and of the tasks (whose
        exceptions' tracebacks hold the call too). A call keeps its channel's
        connection open, on the node too, for as long as it exists: a closed client
        held one per node until the garbage collector found the cycles."""
        reader, writer = self._reader, self._writer
        if reader is not None and writer is not None and reader.done() and writer.done():
            self._reader = self._writer = None
            del self._call


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
