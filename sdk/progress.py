"""When the SDK persists cursors and sends acks, pure: a position is persisted after
the application processed it and *before* the ack that covers it (docs/emission.md).

Per bucket stream, three positions move forward in this order:

* ``processed`` - the application has finished with the event (it asked for the
  next one, or the subscription is closing);
* ``flushed`` - that position is in the durable cursor store (when there is one)
  and an ack for it has been sent; a reconnect resumes from here, so a purge can
  never overtake what is durable;
* ``confirmed`` - the server answered that ack (accepted, or already covered).

`Progress` decides when to flush (every `every_events` processed events or
`interval_s` after the first unflushed one) and which acks to send again. Time
is an argument; no I/O (`sevendb.sdk.flusher` does that around it).

**Per-change delivery** (`SubscribeOptions(per_change=True)`): the application
processes an entry's changes one at a time, each at its position ``(emit_seq, i)``.
A stream's ``processed`` position - and so the ack, which the node takes per entry -
reaches an entry only once its last change is processed; the changes processed of
the entry after it are its *partial*, ``(emit_seq, n)``: persisted with the cursor,
never acked. A restarted process resumes after the last whole entry; the node
delivers the partial entry again, and `undone_changes` skips the ``n`` changes
already processed.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

from sevendb.outbox.emitseq import EmitSeq

Partial: TypeAlias = tuple[EmitSeq, int]
"""(emit_seq, n): the first n changes of the entry at emit_seq were processed."""


@dataclass(slots=True)
class _Stream:
    sub_id: str
    start: EmitSeq
    processed: EmitSeq
    flushed: EmitSeq
    confirmed: EmitSeq
    ack_sent_s: float = 0.0
    partial: Partial | None = None
    """Per-change delivery: changes processed of the entry after `processed`."""
    partial_saved: Partial | None = None
    """... and as last handed out to be persisted."""


@dataclass(frozen=True, slots=True)
class Flush:
    """Positions to persist, then acknowledge: (bucket, sub_id, position); and what to
    persist (a superset: a stream whose partial entry moved, too):
    (bucket, sub_id, position, partial)."""

    positions: tuple[tuple[int, str, EmitSeq], ...]
    saves: tuple[tuple[int, str, EmitSeq, Partial | None], ...] = ()


def undone_changes(emit_seq: EmitSeq, size: int, partial: Partial | None) -> range:
    """Per-change delivery: the indexes of an entry's `size` changes still to deliver -
    all of them, unless `partial` says the first n of this very entry were processed
    (a process resumed mid-entry)."""
    done = partial[1] if partial is not None and partial[0] == emit_seq else 0
    return range(min(done, size), size)


class Progress:
    """Processed / flushed / confirmed positions of one subscription's bucket streams."""

    def __init__(self, *, every_events: int, interval_s: float, resend_after_s: float) -> None:
        if every_events < 1 or interval_s <= 0 or resend_after_s <= 0:
            raise ValueError("every_events >= 1, interval_s > 0 and resend_after_s > 0")
        self._every = every_events
        self._interval_s = interval_s
        self._resend_s = resend_after_s
        self._streams: dict[int, _Stream] = {}
        self._unflushed = 0
        self._first_unflushed_s: float | None = None

    def start(
        self, bucket: int, sub_id: str, position: EmitSeq, partial: Partial | None = None
    ) -> None:
        """A bucket's stream (re)starts at `position` (its SubAck start or a saved
        cursor): everything up to it counts as processed, flushed and confirmed, and so
        do the changes `partial` (a saved cursor's) says were processed of the next
        entry."""
        stream = _Stream(sub_id, position, position, position, position)
        if partial is not None and partial[0] > position:
            stream.partial = stream.partial_saved = partial
        self._streams[bucket] = stream

    def forget(self, bucket: int) -> None:
        """The bucket's stream was dropped (its subscription is gone on the server)."""
        self._streams.pop(bucket, None)

    def flushed(self, bucket: int) -> EmitSeq | None:
        """Where a reconnect of this bucket's stream resumes."""
        stream = self._streams.get(bucket)
        return None if stream is None else stream.flushed

    def processed(
        self, bucket: int, sub_id: str, position: EmitSeq, now_s: float, count: int = 1
    ) -> None:
        """The application finished every event of the stream up to `position`
        (`count` of them since the last call)."""
        stream = self._streams.get(bucket)
        if stream is None or stream.sub_id != sub_id or position <= stream.processed:
            return  # an event of a replaced stream, or a duplicate
        stream.processed = position
        if stream.partial is not None and stream.partial[0] <= position:
            stream.partial = None  # that entry is whole now
        self._counted(now_s, count)

    def processed_change(
        self,
        bucket: int,
        sub_id: str,
        emit_seq: EmitSeq,
        index: int,
        size: int,
        now_s: float,
        count: int = 1,
    ) -> None:
        """Per-change delivery: the application finished the changes of the stream up
        to change `index` of the `size` of the entry at `emit_seq` (`count` changes
        since the last call). The entry counts as processed - and may be acked - only
        with its last change; before that it is the stream's partial entry."""
        if index + 1 >= size:
            self.processed(bucket, sub_id, emit_seq, now_s, count)
            return
        stream = self._streams.get(bucket)
        if stream is None or stream.sub_id != sub_id or emit_seq <= stream.processed:
            return
        done = (emit_seq, index + 1)
        if stream.partial is not None and done <= stream.partial:
            return  # a duplicate
        stream.partial = done
        self._counted(now_s, count)

    def _counted(self, now_s: float, count: int) -> None:
        self._unflushed += count
        if self._first_unflushed_s is None:
            self._first_unflushed_s = now_s

    def due(self, now_s: float) -> bool:
        """Should the caller `take_flush` now?"""
        if self._unflushed >= self._every:
            return True
        if self._first_unflushed_s is not None and now_s - self._first_unflushed_s >= (
            self._interval_s
        ):
            return True
        return any(
            s.confirmed < s.flushed and now_s - s.ack_sent_s >= self._resend_s
            for s in self._streams.values()
        )

    def next_due_s(self, now_s: float) -> float | None:
        """Seconds until `due` may turn true by time alone (None: only by events)."""
        waits = []
        if self._first_unflushed_s is not None:
            waits.append(self._first_unflushed_s + self._interval_s - now_s)
        waits.extend(
            s.ack_sent_s + self._resend_s - now_s
            for s in self._streams.values()
            if s.confirmed < s.flushed
        )
        return max(0.0, min(waits)) if waits else None

    def take_flush(self, now_s: float, *, final: bool = False) -> Flush:
        """The positions to persist and then ack: every stream processed past its
        flushed position, plus unconfirmed acks overdue for a resend. Marks them
        flushed and sent. `final` (a closing subscription) takes every stream that
        processed anything: its acks are sent again to be confirmed as applied, also
        those confirmed as queued."""
        out = []
        saves = []
        for bucket in sorted(self._streams):
            s = self._streams[bucket]
            resend = (
                s.processed > s.start
                if final
                else s.confirmed < s.flushed and now_s - s.ack_sent_s >= self._resend_s
            )
            ack = s.processed > s.flushed or resend
            if ack:
                s.flushed = s.processed
                s.ack_sent_s = now_s
                out.append((bucket, s.sub_id, s.flushed))
            if ack or s.partial != s.partial_saved:
                s.partial_saved = s.partial
                saves.append((bucket, s.sub_id, s.flushed, s.partial))
        self._unflushed = 0
        self._first_unflushed_s = None
        return Flush(tuple(out), tuple(saves))

    def confirmed(self, bucket: int, sub_id: str, position: EmitSeq) -> None:
        """The server accepted (or had already covered) the ack for `position`."""
        s = self._streams.get(bucket)
        if s is not None and s.sub_id == sub_id and position > s.confirmed:
            s.confirmed = min(position, s.flushed)


class _Ordered(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...

    def __le__(self, other: Any, /) -> bool: ...


P = TypeVar("P", bound=_Ordered)
"""A position in a stream: an entry's emit_seq, or a change's (emit_seq, i, size)."""


class Acked(Enum):
    """What `Outstanding.ack` found."""

    PENDING = "pending"
    """Acked now (the processed position may not have moved: an earlier one is out)."""
    ALREADY = "already"
    """Acked before (or of a stream that was replaced since): nothing to do."""
    UNKNOWN = "unknown"
    """Never handed to the application: a caller's mistake."""


@dataclass(slots=True)
class _Handed(Generic[P]):
    sub_id: str
    order: collections.deque[P] = field(default_factory=collections.deque)
    """Positions handed out and not yet covered by the processed position, in order."""
    open: set[P] = field(default_factory=set)
    """Those not acked yet."""
    processed: P | None = None


class Outstanding(Generic[P]):
    """Explicit acks (`AckMode.EXPLICIT`): the events handed to the application and
    not acked yet, per bucket stream. Acks may come in any order; a stream's
    processed position moves only over the acked prefix of what was handed out, so
    the cumulative ack a node receives never covers an event not acked yet (or
    nak'd). Positions are an entry's emit_seq, or (per-change delivery) a change's
    (emit_seq, i, size)."""

    def __init__(self) -> None:
        self._streams: dict[int, _Handed[P]] = {}

    def handed(self, bucket: int, sub_id: str, position: P) -> None:
        """The application was given this event (again, for a nak'd one)."""
        stream = self._streams.get(bucket)
        if stream is None or stream.sub_id != sub_id:  # new, or its stream was replaced
            stream = self._streams[bucket] = _Handed[P](sub_id)
        if position not in stream.open and (
            stream.processed is None or position > stream.processed
        ):
            stream.order.append(position)
            stream.open.add(position)

    def is_open(self, bucket: int, sub_id: str, position: P) -> bool:
        """Handed out and not acked yet?"""
        stream = self._streams.get(bucket)
        return stream is not None and stream.sub_id == sub_id and position in stream.open

    def ack(self, bucket: int, sub_id: str, position: P) -> tuple[Acked, P | None, int]:
        """Ack one event: (what was found, the stream's new processed position or None
        if it did not move, how many events that position newly covers)."""
        stream = self._streams.get(bucket)
        if stream is None or stream.sub_id != sub_id:
            return (Acked.ALREADY if stream is not None else Acked.UNKNOWN), None, 0
        if position not in stream.open:
            known = stream.processed is not None and position <= stream.processed
            return (Acked.ALREADY if known or position in stream.order else Acked.UNKNOWN), None, 0
        stream.open.discard(position)
        covered = 0
        while stream.order and stream.order[0] not in stream.open:
            stream.processed = stream.order.popleft()
            covered += 1
        return Acked.PENDING, (stream.processed if covered else None), covered


__all__ = ["Acked", "Flush", "Outstanding", "Partial", "Progress", "undone_changes"]
