"""The `Session` call: many Subscribe and Reconnect streams on one gRPC call.

Each stream runs exactly as on its own call (`streams.py`), in a task that queues
its messages; the call sends what is queued as one SessionResponse, so the events
of many subscriptions share a gRPC message (and a loop turn on both ends). A
stream's failure or bad request ends that stream only, with the `StreamEnd` its own
call would have ended with. What cannot be told apart from an open stream's end (a
`stream_id` already open) or cannot be read at all (a malformed request) ends the
whole call INVALID_ARGUMENT instead (docs/wire.md, Sessions).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Final, TypeAlias

import grpc

from sevendb.cluster.server.edge import Call
from sevendb.cluster.server.errors import Failure
from sevendb.cluster.server.sinks import session_batch
from sevendb.cluster.server.streams import Streams
from sevendb.outbox import limits
from sevendb.proto import sevendb_pb2 as pb

log = logging.getLogger(__name__)

SESSION_STREAMS_MAX: Final = limits.SUBSCRIPTIONS_PER_BUCKET_MAX
"""Most streams open at once on one Session call."""
REQUESTS_PER_MESSAGE_MAX: Final = 4096
"""Most requests in one SessionRequests message (the SDK sends at most 256): a client
cannot hold the loop with one message of a million requests."""
SESSION_RESPONSE_BYTES: Final = 1024 * 1024
"""A SessionResponse takes queued items until it is about this large."""

Out: TypeAlias = "asyncio.Queue[pb.SessionItem | Failure | None]"
"""What a Session call sends: stream items; then None (the call ends normally) or the
Failure that ends it."""


class Sessions:
    """The Session handler of one node."""

    def __init__(self, streams: Streams) -> None:
        self._streams = streams

    async def session(
        self, requests: AsyncIterator[pb.SessionRequests], call: Call
    ) -> AsyncIterator[bytes]:
        """Serve one Session call (see the module docstring); it ends when the client
        closes it, or half-closes it and its streams are over. It yields encoded
        SessionResponses (`_responses`)."""
        out: Out = asyncio.Queue()
        streams: dict[int, asyncio.Task[None]] = {}
        reader = asyncio.get_running_loop().create_task(
            self._requests(requests, call.principal, streams, out)
        )
        reader.add_done_callback(functools.partial(_requests_done, out))
        try:
            async for response in _responses(out):
                yield response
        finally:
            reader.cancel()
            for task in list(streams.values()):
                task.cancel()

    async def _requests(
        self,
        requests: AsyncIterator[pb.SessionRequests],
        principal: str,
        streams: dict[int, asyncio.Task[None]],
        out: Out,
    ) -> None:
        """Open and close a Session's streams as its requests say; once the client has
        half-closed the call and the streams are over, end the call (None)."""
        loop = asyncio.get_running_loop()
        try:
            async for batch in requests:
                if len(batch.requests) > REQUESTS_PER_MESSAGE_MAX:
                    raise Failure.invalid(
                        f"a SessionRequests message carries at most {REQUESTS_PER_MESSAGE_MAX} "
                        f"requests, not {len(batch.requests)}"
                    )
                for request in batch.requests:
                    self._request(request, principal, streams, out, loop)
        except Failure as failure:  # malformed, too many requests, an open stream_id reused
            out.put_nowait(failure)
            return
        while streams:
            await asyncio.gather(*streams.values(), return_exceptions=True)
        out.put_nowait(None)

    def _request(
        self,
        request: pb.SessionRequest,
        principal: str,
        streams: dict[int, asyncio.Task[None]],
        out: Out,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Open or close one stream; raises the Failure that ends the whole call."""
        sid = request.stream_id
        op = request.WhichOneof("op")
        if op == "close":
            task = streams.pop(sid, None)
            if task is not None:
                task.cancel()
            return
        if sid in streams:  # its StreamEnd would end the open stream
            raise Failure.invalid(f"stream {sid} is already open on this session")
        refused = _refused(op, len(streams))
        if refused is not None:
            _item(out, sid, refused.stream_end())
            return
        queue_item = functools.partial(_item, out, sid)
        push: Callable[[pb.SessionItem | pb.StreamMessage], None] = queue_item
        new_batch = session_batch(sid)
        messages = (
            self._streams.subscribe(principal, request.subscribe, new_batch, push)
            if op == "subscribe"
            else self._streams.reconnect(principal, request.reconnect, new_batch, push)
        )
        task = streams[sid] = loop.create_task(_stream(sid, messages, queue_item))
        task.add_done_callback(functools.partial(_forget, streams, sid))


def _refused(op: str | None, open_streams: int) -> Failure | None:
    """Why a request to open a stream is refused (that stream alone), if it is."""
    if op is None:
        return Failure.invalid("SessionRequest without op")
    if open_streams >= SESSION_STREAMS_MAX:
        return Failure(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"a session holds at most {SESSION_STREAMS_MAX} streams",
        )
    return None


async def _responses(out: Out) -> AsyncIterator[bytes]:
    """What is queued, as encoded SessionResponses of up to about
    SESSION_RESPONSE_BYTES (or one item alone if it is larger: never more than a
    stream's own call would have carried), until the call ends (raising the Failure
    that ends it). A SessionResponse's encoding is its items' encodings one after
    another, so each item is encoded once, as it is taken: a SessionResponse built of
    them would copy each, and its size would encode each again."""
    carried: bytes | None = None
    ended, end = False, None
    while not ended:
        if carried is None:
            first = await out.get()
            if not isinstance(first, pb.SessionItem):
                end = first
                break
            carried = _encoded(first)
        parts, size, carried = [carried], len(carried), None
        while not out.empty():
            item = out.get_nowait()
            if not isinstance(item, pb.SessionItem):
                ended, end = True, item
                break
            encoded = _encoded(item)
            if size + len(encoded) > SESSION_RESPONSE_BYTES:
                carried = encoded
                break
            parts.append(encoded)
            size += len(encoded)
        yield b"".join(parts)
    if end is not None:
        raise end


_ITEMS_TAG: Final = b"\x0a"
"""SessionResponse.items: field 1, length-delimited."""


def _encoded(item: pb.SessionItem) -> bytes:
    """`item` as one element of SessionResponse.items, encoded."""
    data = item.SerializeToString()
    n = len(data)
    if n < 0x80:
        return _ITEMS_TAG + bytes((n,)) + data
    length = bytearray()
    while n >= 0x80:
        length.append(n & 0x7F | 0x80)
        n >>= 7
    length.append(n)
    return _ITEMS_TAG + bytes(length) + data


def _requests_done(out: Out, reader: asyncio.Task[None]) -> None:
    """A Session's request reader failed (a bug): log it and end the call."""
    if not reader.cancelled() and reader.exception() is not None:
        log.error("session request reader failed", exc_info=reader.exception())
        out.put_nowait(None)


def _item(out: Out, sid: int, message: pb.SessionItem | pb.StreamMessage | pb.StreamEnd) -> None:
    """Queue what Session stream `sid` sends: events already in their item, or a
    message or end to put in one (rare, small)."""
    if isinstance(message, pb.StreamMessage):
        message = pb.SessionItem(stream_id=sid, message=message)
    elif isinstance(message, pb.StreamEnd):
        message = pb.SessionItem(stream_id=sid, end=message)
    out.put_nowait(message)


def _forget(streams: dict[int, asyncio.Task[None]], sid: int, task: asyncio.Task[None]) -> None:
    if streams.get(sid) is task:  # not a newer stream that reused the id
        del streams[sid]


async def _stream(
    sid: int,
    messages: AsyncIterator[pb.SessionItem | pb.StreamMessage],
    push: Callable[[pb.SessionItem | pb.StreamMessage | pb.StreamEnd], None],
) -> None:
    """Queue one stream's messages, then its end. Cancelled: closed, nothing sent."""
    try:
        async for message in messages:
            push(message)
        end = pb.StreamEnd()
    except Failure as failure:
        end = failure.stream_end()
    except Exception:
        log.exception("session stream %d failed", sid)
        end = pb.StreamEnd(code=grpc.StatusCode.INTERNAL.value[0], message="internal error")
    push(end)


__all__ = ["SESSION_RESPONSE_BYTES", "SESSION_STREAMS_MAX", "Sessions"]
