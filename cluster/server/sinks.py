"""How an attached stream's rows become the messages it sends: `StreamSink` carries
rows from a notifier thread to the stream's handler on the event loop, `Encoder`
packs them into EventBatches (and marks where catch-up ends), and `EventEncoder`
builds each row's protobuf once for every stream it goes out on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Final, Generic, TypeAlias, TypeVar

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.model import Delta, OutboxRow, delta_bytes
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto.mailbox import mailbox

STREAM_BATCH_EVENTS_MAX: Final = 4096
"""Most events one EventBatch of a call's own stream carries: deliveries queued while
its task was busy share one. (A Session's stream sends each delivery as it lands.)"""
STREAM_MESSAGE_BYTES: Final = 1024 * 1024
"""An EventBatch takes events until it is about this large (an entry, so an event, is
at most 2 MiB: every message stays below gRPC's 4 MiB)."""


class EventEncoder:
    """DataEvent messages for outbox rows; on the event loop only.

    The rows of one source entry share their EmitSeq and usually their Delta, and go
    out on every matching subscription's stream: each is built as a message (a
    delta's changes also packed, for streams that take them so) once and copied into
    the events (building from Python objects cost several times the copy). The most
    recent are kept, each with its object so that its id is not reused, up to `count`
    of them and about `bytes_max` of keys and values.
    """

    def __init__(self, count: int = 4096, bytes_max: int = 32 * 1024 * 1024) -> None:
        self._count = count
        self._bytes_max = bytes_max
        self._bytes = 0
        self._built: dict[int, list[Any]] = {}

    def add(self, batch: pb.EventBatch, row: OutboxRow, packed: bool = False) -> int:
        """Append the row's DataEvent to `batch`, built in place: a DataEvent made on
        its own is copied again by `EventBatch(events=...)` (2.1 -> 0.9 us an event).
        `packed`: its changes in `packed_changes` (the stream asked for them so).
        Returns about how many bytes the event takes."""
        event = batch.events.add(sub_id=row.sub_id)
        seq, seq_size = self._message(row.emit_seq)
        prev, prev_size = self._message(row.prev_emit_seq)
        event.emit_seq.CopyFrom(seq)
        event.prev_emit_seq.CopyFrom(prev)
        delta = row.delta
        if packed:
            event.packed_changes, delta_size = self._packed(delta)
            event.delta.commit_time_ms = delta.commit_time_ms
        else:
            message, delta_size = self._message(delta)
            event.delta.CopyFrom(message)
        return seq_size + prev_size + delta_size + len(row.sub_id)

    def _message(self, part: EmitSeq | Delta) -> tuple[Any, int]:
        hit = self._get(part)
        if hit[1] is None:
            hit[1] = codec.seq_to_pb(part) if isinstance(part, EmitSeq) else codec.delta_to_pb(part)
        return hit[1], hit[3]

    def _packed(self, delta: Delta) -> tuple[bytes, int]:
        hit = self._get(delta)
        if hit[2] is None:
            hit[2] = codec.pack_changes(delta.changes)
        return hit[2], hit[3]

    def _get(self, part: EmitSeq | Delta) -> list[Any]:
        """`part`'s entry: [part, message or None, packed changes or None, size]."""
        hit = self._built.get(id(part))
        if hit is None or hit[0] is not part:
            size = 64
            if isinstance(part, Delta):
                size += part.size_bytes if part.size_bytes >= 0 else delta_bytes(part.changes)
            hit = self._built[id(part)] = [part, None, None, size]
            self._bytes += size
            while len(self._built) > self._count or self._bytes > self._bytes_max:
                oldest = next(iter(self._built))
                self._bytes -= self._built.pop(oldest)[3]
        return hit


M = TypeVar("M", pb.StreamMessage, pb.SessionItem)
NewBatch: TypeAlias = Callable[[], tuple[M, pb.StreamMessage]]
"""Makes what a stream sends its next events in, and the `events` StreamMessage to
fill inside it: the message itself on a call of its own, or a Session's item (so
events are built in place, never copied into the item)."""


def event_message() -> tuple[pb.StreamMessage, pb.StreamMessage]:
    """An empty `events` StreamMessage (the oneof set even while it holds none)."""
    message = pb.StreamMessage()
    message.events.SetInParent()
    return message, message


def session_batch(stream_id: int) -> NewBatch[pb.SessionItem]:
    def new() -> tuple[pb.SessionItem, pb.StreamMessage]:
        item = pb.SessionItem(stream_id=stream_id)
        item.message.events.SetInParent()
        return item, item.message

    return new


class StreamSink:
    """Carries one stream's rows from a notifier thread to its handler on the loop.

    The notifier's flow-control window bounds what can be queued here."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._mailbox = mailbox(loop)  # a notifier pass wakes the loop once, not per stream
        self._queue: asyncio.Queue[tuple[OutboxRow, ...] | str] = asyncio.Queue()
        self._closed: str | None = None
        self._pushing: tuple[Callable[[Sequence[OutboxRow]], None], asyncio.Future[str]] | None
        self._pushing = None
        """While set (`push_to`), deliveries go to the callable until the future is done."""
        self.fenced = False
        """Set by `fence`: a newer stream of the same subscription took over."""

    def deliver(self, rows: tuple[OutboxRow, ...]) -> None:
        self._put(rows)

    def close(self, reason: str) -> None:
        self._put(reason)

    def fence(self) -> None:
        """A newer stream of this subscription attached: close this one, for good (its
        handler sees `fenced` and ends it with a status that says so)."""
        self.fenced = True
        self.close("the subscription was resumed on a newer stream")

    def _put(self, item: tuple[OutboxRow, ...] | str) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the node is stopping
            self._mailbox.post(self._land, item)

    def _land(self, item: tuple[OutboxRow, ...] | str) -> None:
        # A done future: the stream closed, failed, or its task was cancelled (closed
        # by the client, or its call ended) and has not yet run `stop`; nothing may
        # reach the call after that.
        if self._pushing is None or self._pushing[1].done():
            self._queue.put_nowait(item)
            return
        push, ended = self._pushing
        if isinstance(item, str):
            ended.set_result(item)
            return
        try:
            push(item)
        except Exception as exc:  # a bug: end the stream, loudly
            ended.set_exception(exc)

    async def get(self) -> list[OutboxRow] | str:
        """The rows queued so far (at least one), or why the stream closed."""
        if self._closed is not None:
            return self._closed
        first = await self._queue.get()
        if isinstance(first, str):
            return first
        rows = list(first)
        while len(rows) < STREAM_BATCH_EVENTS_MAX and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, str):
                self._closed = item
                break
            rows.extend(item)
        return rows

    def push_to(self, push: Callable[[Sequence[OutboxRow]], None]) -> asyncio.Future[str]:
        """From now on hand each delivery to `push` where it lands on the loop (what
        is queued first), instead of queueing it for `get`. The future resolves with
        why the stream closed, or fails with what `push` raised."""
        ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if self._closed is not None:
            ended.set_result(self._closed)
            return ended
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, str):
                ended.set_result(item)
                return ended
            push(item)
        self._pushing = (push, ended)
        return ended

    def stop(self) -> None:
        """Push nothing more (the stream is over)."""
        self._pushing = None


class Encoder(Generic[M]):
    """A stream's rows as the messages it sends: events in batches of about
    STREAM_MESSAGE_BYTES at most (far below gRPC's 4 MiB a message) and, while a
    catch-up head is set, `CaughtUp` right after the event that reaches it, so no
    live event is ever interleaved before catch-up ends."""

    def __init__(
        self,
        events: EventEncoder,
        sub_id: str,
        catch_up_head: EmitSeq | None,
        new_batch: NewBatch[M],
        packed: bool = False,
    ) -> None:
        self._events = events
        self._sub_id = sub_id
        self._head = catch_up_head
        self._new_batch: NewBatch[M] = new_batch
        self._packed = packed

    def __call__(self, rows: Sequence[OutboxRow]) -> list[M | pb.StreamMessage]:
        out: list[M | pb.StreamMessage] = []
        head = self._head
        batch, message = self._new_batch()
        size = 0
        for row in rows:
            if size >= STREAM_MESSAGE_BYTES:
                out.append(batch)
                batch, message = self._new_batch()
                size = 0
            if head is not None and row.emit_seq > head:
                if message.events.events:
                    out.append(batch)
                    batch, message = self._new_batch()
                    size = 0
                out.append(self._caught_up(head))
                head = None
            size += self._events.add(message.events, row, self._packed)
        out.append(batch)
        if head is not None and rows[-1].emit_seq == head:
            out.append(self._caught_up(head))
            head = None
        self._head = head
        return out

    def _caught_up(self, head: EmitSeq) -> pb.StreamMessage:
        return pb.StreamMessage(
            caught_up=pb.CaughtUp(sub_id=self._sub_id, head_emit_seq=codec.seq_to_pb(head))
        )


__all__ = [
    "STREAM_BATCH_EVENTS_MAX",
    "STREAM_MESSAGE_BYTES",
    "Encoder",
    "EventEncoder",
    "NewBatch",
    "StreamSink",
    "event_message",
    "session_batch",
]
