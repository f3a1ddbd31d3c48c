"""The notifier's decisions for one bucket, pure (docs/contract.md §4-§6, §10).

The replica that holds a bucket's notifier lease streams the bucket's outbox to
its subscribers. This module decides *what* to do; the gRPC notifier and the
simulator perform it:

* who should hold the lease (`default_lease_holder`, `rendezvous_lease_holder`)
  and when to propose a LEASE entry (`needs_lease`);
* per connected subscriber stream (`NotifierCore`): where it is, what to send
  next within a flow-control window (events and bytes), when to resend, when a
  subscriber is too slow to keep its stream (`slow_streams`), which client acks to
  batch into one OUTBOX_PURGE, and which OUTBOX_WRITE covers the rows computed
  since the last one (including what a predecessor left);
* which rows may leave, by `EmissionMode`: those whose OUTBOX_WRITE committed
  (`LITERAL`, the contract's literal order) or those whose source entry committed
  and applied (`DERIVED`, one Raft round; the OUTBOX_WRITE is then a checkpoint);
* lifecycles (docs/emission.md): which subscriptions an OUTBOX_PURGE expires or
  keeps alive, and which idle producers it forgets.

No I/O, clock, randomness or threads: time arrives as `now_ms`, the bucket state
as a `BucketStateMachine` the caller keeps applying committed entries to.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

import xxhash

from sevendb.outbox import limits
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import Ack, Lease, OutboxPurge, OutboxWrite
from sevendb.outbox.lifecycle import expirable_subscriptions
from sevendb.outbox.model import (
    AckOutcome,
    AckStatus,
    OutboxRow,
    ReconnectDecision,
    ReconnectStatus,
    delta_bytes,
)
from sevendb.outbox.state import BucketStateMachine

WINDOW_EVENTS_DEFAULT: Final = 256
"""Events sent on one stream and not yet acknowledged before sending pauses."""
RESEND_AFTER_MS_DEFAULT: Final = 2_000
"""A stream whose acks made no progress this long is rewound to its acked point."""
BATCH_EVENTS_MAX: Final = 1024
"""Most events `next_batches` returns per call, all streams together."""
OUTBOX_WRITES_IN_FLIGHT_DEFAULT: Final = 4
"""OUTBOX_WRITEs a holder pipelines: the next is proposed before the last commits,
so a row waits for one Raft round after its write applies, not up to two."""
OUTBOX_RETRY_MS_DEFAULT: Final = 1_000
"""An OUTBOX_WRITE not committed this long is taken as lost: propose from the log."""
WINDOW_BYTES_DEFAULT: Final = 8 * 1024 * 1024
"""Bytes (keys and values, about) sent on one stream and not yet acknowledged before
sending pauses (one event is always let through, however large)."""
SLOW_STREAM_MS_DEFAULT: Final = 60_000
"""A stream with events in flight whose acks made no progress this long is ended
(`slow_streams`): the subscriber resumes from its cursor on a new stream."""
ATTACH_GRACE_MS_DEFAULT: Final = 60_000
"""A new lease holder expires no subscription with nothing to acknowledge for this
long after taking the lease (or the stall window, if shorter): its clients are
still reconnecting to it, and it cannot tell them from clients that are gone."""
SLOW_SUBSCRIBER: Final = "SLOW_SUBSCRIBER"
"""How `slow_streams`' closures are named: the reason a host closes such a stream
with starts with it (docs/wire.md: the stream ends UNAVAILABLE with
`sevendb-error: SLOW_SUBSCRIBER`)."""
CHECKPOINT_INTERVAL_MS_DEFAULT: Final = 50
"""DERIVED: an OUTBOX_WRITE (a checkpoint) is proposed at most this often."""


class EmissionMode(StrEnum):
    """When a row may leave the lease holder (docs/emission.md, "Emission modes")."""

    DERIVED = "derived"
    """Once its source entry committed and this replica applied it: the rows are a
    deterministic function of the committed log, as durable as that entry, so one
    Raft round. OUTBOX_WRITE becomes an asynchronous checkpoint of the rows' digest
    (at most every `checkpoint_interval_ms`, one in flight): a replica whose rows
    differ still quarantines itself, but only once the checkpoint applies, after the
    holder may have sent them."""
    LITERAL = "literal"
    """Once the OUTBOX_WRITE covering it committed (contract §4 in its literal
    order: two Raft rounds; every replica checked the digest of the rows before any
    holder sends them). OUTBOX_WRITEs are pipelined (`outbox_writes_in_flight`)."""


@dataclass(frozen=True, slots=True)
class NotifierConfig:
    """Per-stream flow control and batching (all bounded; see the constants)."""

    window_events: int = WINDOW_EVENTS_DEFAULT
    resend_after_ms: int = RESEND_AFTER_MS_DEFAULT
    acks_per_purge_max: int = limits.ACKS_PER_PURGE_MAX
    expires_per_purge_max: int = limits.EXPIRES_PER_PURGE_MAX
    outbox_writes_in_flight: int = OUTBOX_WRITES_IN_FLIGHT_DEFAULT
    outbox_retry_ms: int = OUTBOX_RETRY_MS_DEFAULT
    window_bytes: int = WINDOW_BYTES_DEFAULT
    slow_stream_ms: int = SLOW_STREAM_MS_DEFAULT
    producer_idle_ms: int = limits.PRODUCER_IDLE_MS_DEFAULT
    attach_grace_ms: int = ATTACH_GRACE_MS_DEFAULT
    emission: EmissionMode = EmissionMode.DERIVED
    checkpoint_interval_ms: int = CHECKPOINT_INTERVAL_MS_DEFAULT

    def __post_init__(self) -> None:
        if self.window_events < 1 or self.window_bytes < 1:
            raise ValueError("window_events and window_bytes must be >= 1")
        if self.resend_after_ms < 1 or self.slow_stream_ms < 1:
            raise ValueError("resend_after_ms and slow_stream_ms must be >= 1")
        if self.producer_idle_ms < 1 or self.attach_grace_ms < 0:
            raise ValueError("producer_idle_ms must be >= 1 and attach_grace_ms >= 0")
        if not 1 <= self.acks_per_purge_max <= limits.ACKS_PER_PURGE_MAX:
            raise ValueError(f"acks_per_purge_max must be in [1, {limits.ACKS_PER_PURGE_MAX}]")
        if not 1 <= self.expires_per_purge_max <= limits.EXPIRES_PER_PURGE_MAX:
            raise ValueError(
                f"expires_per_purge_max must be in [1, {limits.EXPIRES_PER_PURGE_MAX}]"
            )
        if self.outbox_writes_in_flight < 1 or self.outbox_retry_ms < 1:
            raise ValueError("outbox_writes_in_flight and outbox_retry_ms must be >= 1")
        if not isinstance(self.emission, EmissionMode):
            raise ValueError(f"emission must be an EmissionMode, not {self.emission!r}")
        if self.checkpoint_interval_ms < 1:
            raise ValueError("checkpoint_interval_ms must be >= 1")


# ---- the lease ---------------------------------------------------------------------


def default_lease_holder(leader: str) -> str:
    """By default the Raft leader emits (docs/contract.md §6)."""
    return leader


def rendezvous_lease_holder(bucket_uuid: str, epoch_counter: int, replicas: Iterable[str]) -> str:
    """Rendezvous choice keyed on `(bucket_uuid, epoch)`: the replica with the highest
    xxh64 of `"{bucket_uuid}/{epoch_counter}/{replica}"`; equal hashes go to the
    smaller name. Every replica computes the same answer from the same inputs."""
    best = ""
    best_hash = -1
    for replica in sorted(replicas):
        score = xxhash.xxh64_intdigest(f"{bucket_uuid}/{epoch_counter}/{replica}".encode())
        if score > best_hash:
            best, best_hash = replica, score
    if not best:
        raise ValueError("rendezvous_lease_holder needs at least one replica")
    return best


def needs_lease(
    sm: BucketStateMachine, me: str, desired_holder: str, now_ms: int = 0
) -> Lease | None:
    """The LEASE entry `me` should propose, if the committed holder is not the desired
    one and `me` is. Until it commits (and fences the previous holder), `me` emits
    nothing."""
    if desired_holder != me or sm.lease_holder == me:
        return None
    return Lease(me, now_ms)


# ---- streams -----------------------------------------------------------------------


class _Everyone:
    """Contains every name: while a new holder settles, no subscription with nothing
    to acknowledge is expired, attached or not."""

    def __contains__(self, item: object) -> bool:
        return True


class AttachStatus(StrEnum):
    ATTACHED = "ATTACHED"
    """The stream is registered; `next_batches` sends what follows `after`."""
    NOT_HOLDER = "NOT_HOLDER"
    """This replica does not hold the lease (per its applied state): try `holder`."""
    BEHIND = "BEHIND"
    """The client has processed more than this replica applied, or names a subscription
    it has not applied (yet): a newer holder exists or this one is catching up. Retry
    later or elsewhere; never judge from stale state."""
    REFUSED = "REFUSED"
    """`decision` says why (STALE_SEQUENCE, INVALID_SEQUENCE, SUBSCRIPTION_NOT_FOUND)."""
    ACK_PENDING = "ACK_PENDING"
    """A durable subscription resumed by name while a transaction holds an ack of it
    until its marker (`message` names it): its acknowledged position may still move.
    Retry once the transaction has ended (Kafka's unstable offset)."""


@dataclass(frozen=True, slots=True)
class Attach:
    status: AttachStatus
    decision: ReconnectDecision | None = None
    holder: str = ""
    message: str = ""


@dataclass(slots=True)
class _Stream:
    sub_id: str
    principal: str
    position: EmitSeq
    """emit_seq of the last event sent (or the attach point)."""
    acked: EmitSeq
    """The client confirmed everything up to here (attach point or its acks)."""
    last_progress_ms: int
    in_flight: deque[EmitSeq] = field(default_factory=deque)
    """Sent after `acked`, in emit_seq order: the flow-control window."""
    sends: deque[tuple[EmitSeq, int]] = field(default_factory=deque)
    """(last emit_seq, `row_bytes` total) of each batch in flight: the byte window
    counts a batch until its last event is acknowledged (per event, the books cost
    more than the rest of a send)."""
    in_flight_bytes: int = 0
    waiting_since_ms: int | None = None
    """Since when events have been in flight without the acks moving (kept across
    resends); None while nothing is in flight."""

    def take(self, rows: tuple[OutboxRow, ...], size: int, now_ms: int) -> None:
        if not self.in_flight:
            self.last_progress_ms = now_ms
            if self.waiting_since_ms is None:
                self.waiting_since_ms = now_ms
        self.in_flight.extend(row.emit_seq for row in rows)
        self.position = rows[-1].emit_seq
        self.sends.append((self.position, size))
        self.in_flight_bytes += size

    def acked_to(self, up_to: EmitSeq, now_ms: int) -> None:
        self.acked = up_to
        while self.in_flight and self.in_flight[0] <= up_to:
            self.in_flight.popleft()
        while self.sends and self.sends[0][0] <= up_to:
            self.in_flight_bytes -= self.sends.popleft()[1]
        self.position = max(self.position, up_to)
        self.last_progress_ms = now_ms
        self.waiting_since_ms = now_ms if self.in_flight else None

    def rewind(self, now_ms: int) -> None:
        """Resend from the acknowledged point (the wait goes on)."""
        self.position = self.acked
        self.in_flight.clear()
        self.sends.clear()
        self.in_flight_bytes = 0
        self.last_progress_ms = now_ms


def row_bytes(row: OutboxRow) -> int:
    """About how much an event weighs on the wire (its keys and values, plus a fixed
    overhead for its positions): what the byte window counts."""
    size = row.delta.size_bytes
    return 64 + (size if size >= 0 else delta_bytes(row.delta.changes))


class NotifierCore:
    """The lease holder's per-bucket notifier state: streams, window, queued acks.

    Everything it returns is derived from the caller's state machine, so a new
    holder with an empty `NotifierCore` resumes exactly where the log says.
    """

    def __init__(self, me: str, config: NotifierConfig | None = None) -> None:
        self._me = me
        self._config = config if config is not None else NotifierConfig()
        self._streams: dict[str, _Stream] = {}
        self._order: list[str] = []
        """sub_ids of `_streams`, sorted (kept so, not re-sorted on every pass)."""
        self._ready: set[str] = set()
        """Streams that may have rows to send (new rows, an opened window, attached)."""
        self._waiting: set[str] = set()
        """Streams waiting for acks (`_Stream.waiting_since_ms` set): the only ones with
        a resend timer or a slow-stream clock, so the once-a-second checks look at
        these, not at every stream (an idle one costs them nothing)."""
        self._acks: dict[str, Ack] = {}
        self._outbox_flight: deque[tuple[int, int]] = deque()
        """(through_index, proposed at ms) of this holder's OUTBOX_WRITEs in flight."""
        self._since_ms: int | None = None
        """When this core first judged expiries (about when it took the lease)."""
        self._last_checkpoint_ms: int | None = None
        """DERIVED: when this holder last proposed an OUTBOX_WRITE."""

    @property
    def me(self) -> str:
        return self._me

    @property
    def config(self) -> NotifierConfig:
        return self._config

    def holds_lease(self, sm: BucketStateMachine) -> bool:
        """Fencing: emit only while the applied state names this replica."""
        return sm.lease_holder == self._me

    def sendable_through(self, sm: BucketStateMachine) -> int | None:
        """The highest source index whose rows may leave (None: every row kept, each
        computed from an applied, hence committed, entry)."""
        if self._config.emission is EmissionMode.LITERAL:
            return sm.outboxed_through
        return None

    # ---- attach / detach -------------------------------------------------------

    def attach(
        self, sm: BucketStateMachine, sub_id: str, principal: str, after: EmitSeq, now_ms: int
    ) -> Attach:
        """A client (re)connects after `after`, the last emit_seq it processed."""
        if not self.holds_lease(sm):
            return Attach(
                AttachStatus.NOT_HOLDER,
                holder=sm.lease_holder,
                message=f"{self._me} does not hold the lease of {sm.bucket_uuid}",
            )
        if after.bucket_uuid == sm.bucket_uuid and after.commit_index > sm.applied_index:
            return Attach(
                AttachStatus.BEHIND,
                holder=sm.lease_holder,
                message=f"client is at {after}; {self._me} applied only {sm.applied_index}",
            )
        decision = sm.decide_reconnect(sub_id, principal, after)
        if decision.status is ReconnectStatus.SUBSCRIPTION_NOT_FOUND and not decision.not_owner:
            # Maybe a SUBSCRIBE this replica has not applied yet: one starting in the
            # past leaves the client at a position it did apply. Only a current
            # replica can say the subscription does not exist (the node makes sure it
            # is with a read barrier, then asks `decide_reconnect` itself).
            return Attach(
                AttachStatus.BEHIND,
                holder=sm.lease_holder,
                message=f"no subscription {sub_id} applied here (through {sm.applied_index})",
            )
        if decision.status is not ReconnectStatus.OK:
            return Attach(AttachStatus.REFUSED, decision, message=decision.message)
        return self._register(sm, sub_id, principal, after, now_ms, decision)

    def _register(
        self,
        sm: BucketStateMachine,
        sub_id: str,
        principal: str,
        after: EmitSeq,
        now_ms: int,
        decision: ReconnectDecision,
    ) -> Attach:
        if sub_id not in self._streams:
            bisect.insort(self._order, sub_id)
        self._streams[sub_id] = _Stream(sub_id, principal, after, after, now_ms)
        self._ready.add(sub_id)
        self._waiting.discard(sub_id)
        # Reconnecting after `after` says the client processed it: an ack.
        self._queue_ack(sm, sub_id, principal, after)
        return Attach(AttachStatus.ATTACHED, decision)

    def detach(self, sub_id: str) -> None:
        if self._streams.pop(sub_id, None) is not None:
            self._order.pop(bisect.bisect_left(self._order, sub_id))
            self._ready.discard(sub_id)
            self._waiting.discard(sub_id)

    def streams(self) -> tuple[str, ...]:
        return tuple(self._order)

    def position(self, sub_id: str) -> EmitSeq | None:
        stream = self._streams.get(sub_id)
        return None if stream is None else stream.position

    def in_flight(self, sub_id: str) -> int:
        stream = self._streams.get(sub_id)
        return 0 if stream is None else len(stream.in_flight)

    def closed_streams(
        self, sm: BucketStateMachine, among: Iterable[str] | None = None
    ) -> tuple[str, ...]:
        """Attached streams whose subscription is gone or was dropped for stalling
        (of those named `among`, if given, else of all): the adapter ends them (the
        client's reconnect then learns why)."""
        gone = []
        candidates = self._order if among is None else sorted(set(among) & self._streams.keys())
        for sub_id in candidates:
            sub = sm.subs.get(sub_id)
            if sub is None or sub.principal != self._streams[sub_id].principal:
                gone.append(sub_id)
        return tuple(gone)

    def slow_streams(self, now_ms: int) -> tuple[str, ...]:
        """Attached streams whose subscriber acknowledged nothing for `slow_stream_ms`
        while events were in flight: the host ends them (reason `SLOW_SUBSCRIBER`)
        rather than resend to them for ever; the subscriber resumes from its cursor
        on a new stream, and its subscription is untouched (it expires only if it
        acknowledges nothing for the stall window)."""
        limit = self._config.slow_stream_ms
        return tuple(
            sub_id
            for sub_id in sorted(self._waiting)
            if (since := self._streams[sub_id].waiting_since_ms) is not None
            and now_ms - since >= limit
        )

    # ---- sending ---------------------------------------------------------------

    def mark_ready(self, sub_ids: Iterable[str]) -> None:
        """These subscriptions got newly outboxed rows: look at them on the next
        `next_batches(full=False)`."""
        self._ready.update(s for s in sub_ids if s in self._streams)

    def mark_in_flight_ready(self) -> None:
        """Mark the streams with events in flight ready, so that the next pass over the
        ready streams checks their resend timers: only they have one, and any other
        stream with rows to send is ready already when its host marks the streams
        the applied effects name (`mark_ready`). Only streams waiting for acks are
        looked at, so neither this nor its host's once-a-second pass after it touches
        an idle stream (a scan of every stream took 85 ms with 10,000 idle ones on
        the 2-core host; docs/performance.md, "Idle subscriptions")."""
        streams = self._streams
        self._ready.update([s for s in self._waiting if streams[s].in_flight])

    def stream_count(self) -> int:
        return len(self._streams)

    def next_batches(
        self, sm: BucketStateMachine, max_events: int, now_ms: int, *, full: bool = True
    ) -> list[tuple[str, tuple[OutboxRow, ...]]]:
        """Outboxed rows to send now, per stream (sub_id order), each in emit_seq order.

        Only rows after the stream's position and within its window. A stream whose
        acks stalled for `resend_after_ms` is first rewound to its acked point
        (at-least-once: the client's cursor drops what it already processed).

        `full=False` looks only at streams that may have something to send (attached,
        acked, or `mark_ready`); a full pass also checks every stream's resend timer.
        Both send the same rows to a stream that has any: a busy notifier with many
        idle streams need not scan them all on every pass.
        """
        if not self.holds_lease(sm):
            return []
        budget = min(max_events, BATCH_EVENTS_MAX)
        through = self.sendable_through(sm)
        out: list[tuple[str, tuple[OutboxRow, ...]]] = []
        candidates: list[str]
        if full:
            candidates = self._order
        else:
            # A new set each pass: a set that once held many streams (10,000 attached
            # at once) keeps its table, and iterating it cost ~50-100 us a pass even
            # with one stream in it (docs/performance.md).
            candidates, self._ready = sorted(self._ready), set()
        ready = self._ready
        for pos, sub_id in enumerate(candidates):
            if budget <= 0:
                if not full:
                    ready.update(candidates[pos:])  # not looked at: still ready
                break
            stream = self._streams[sub_id]
            if (
                stream.in_flight
                and now_ms - stream.last_progress_ms >= self._config.resend_after_ms
            ):
                stream.rewind(now_ms)
            room = min(budget, self._config.window_events - len(stream.in_flight))
            if room <= 0 or stream.in_flight_bytes >= self._config.window_bytes:
                ready.discard(sub_id)  # an ack opens the window (and marks it)
                continue
            rows = self._rows_after(sm, sub_id, stream.position, through)[:room]
            if len(rows) < room:
                ready.discard(sub_id)  # everything sendable so far is sent
            elif not full:
                ready.add(sub_id)  # more than this pass could take
            rows, size = self._within_bytes(stream, rows)  # may leave it unready
            if not rows:
                continue
            stream.take(rows, size, now_ms)
            self._waiting.add(sub_id)
            budget -= len(rows)
            out.append((sub_id, rows))
        return out

    def _within_bytes(
        self, stream: _Stream, rows: tuple[OutboxRow, ...]
    ) -> tuple[tuple[OutboxRow, ...], int]:
        """The first of `rows` that fit the stream's byte window (at least one if none
        is in flight), and their `row_bytes` total."""
        room = self._config.window_bytes - stream.in_flight_bytes
        total = 0  # all of them, usually: counted inline, no call per row
        for row in rows:
            size = row.delta.size_bytes
            total += 64 + (size if size >= 0 else delta_bytes(row.delta.changes))
        if total <= room:
            return rows, total
        taken = 0
        for i, row in enumerate(rows):
            size = row_bytes(row)
            if taken + size > room and (i or stream.in_flight):
                self._ready.discard(stream.sub_id)  # an ack opens the window
                return rows[:i], taken
            taken += size
        return rows, taken

    def _rows_after(
        self, sm: BucketStateMachine, sub_id: str, position: EmitSeq, through: int | None
    ) -> tuple[OutboxRow, ...]:
        """The rows a stream at `position` may be sent (`sendable_through`)."""
        return sm.subs.outbox_rows(sub_id, position, through)

    # ---- acks and purges -------------------------------------------------------

    def on_client_ack(
        self, sm: BucketStateMachine, sub_id: str, principal: str, up_to: EmitSeq, now_ms: int
    ) -> AckOutcome:
        """A cumulative client ack. Validated against the applied state
        (`check_ack`), opens the stream's window and is queued for the next purge."""
        outcome = self._queue_ack(sm, sub_id, principal, up_to)
        stream = self._streams.get(sub_id)
        if (
            stream is not None
            and stream.principal == principal
            and outcome.status in (AckStatus.ACCEPTED, AckStatus.DUPLICATE)
            and up_to > stream.acked
        ):
            stream.acked_to(up_to, now_ms)
            if stream.waiting_since_ms is None:
                self._waiting.discard(sub_id)
            self._ready.add(sub_id)
        return outcome

    def _queue_ack(
        self, sm: BucketStateMachine, sub_id: str, principal: str, up_to: EmitSeq
    ) -> AckOutcome:
        outcome = sm.subs.check_ack(sub_id, principal, up_to)
        if outcome.status is not AckStatus.ACCEPTED:
            return outcome
        through = self.sendable_through(sm)
        if through is not None and up_to.commit_index > through:
            # The state machine keeps rows from their apply; this mode never sent any
            # past its OUTBOX_WRITEs (contract §10: no ack of what was never sent).
            return AckOutcome(
                sub_id, AckStatus.FUTURE, f"ack {up_to} is beyond the outboxed {through}"
            )
        if self.ack_queued(sub_id, principal, up_to):
            queued = self._acks[sub_id]
            status = AckStatus.DUPLICATE if queued.up_to == up_to else AckStatus.REGRESSIVE
            return AckOutcome(sub_id, status, f"{queued.up_to} is already queued")
        self._acks[sub_id] = Ack(sub_id, principal, up_to)
        return outcome

    def ack_queued(self, sub_id: str, principal: str, up_to: EmitSeq) -> bool:
        """Is an ack at or past `up_to` queued for the next purge?"""
        queued = self._acks.get(sub_id)
        return queued is not None and queued.principal == principal and queued.up_to >= up_to

    def queued_acks(self) -> tuple[Ack, ...]:
        return tuple(self._acks[sub_id] for sub_id in sorted(self._acks))

    def purge_entry(
        self,
        sm: BucketStateMachine,
        lease_index: int,
        now_ms: int,
        stall_window_ms: int,
        *,
        expire: bool = True,
    ) -> OutboxPurge | None:
        """One OUTBOX_PURGE batching the queued acks and, with `expire`, the
        lifecycle decisions (`lifecycle`), or None. Acks stay queued until the
        applied state covers them, so a purge lost with a leader change is proposed
        again. (The lifecycle decisions scan every subscription, stream and producer:
        a notifier with many makes them less often than it purges.)"""
        if not self.holds_lease(sm):
            return None
        acks = self._acks_to_purge(sm)
        expired, touch, producers = (
            self.lifecycle(sm, now_ms, stall_window_ms) if expire else ((), (), ())
        )
        if not acks and not expired and not touch and not producers:
            return None
        return OutboxPurge(
            lease_index,
            acks,
            expired,
            stall_window_ms,
            now_ms,
            touch,
            producers,
            self._config.producer_idle_ms,
        )

    def lifecycle(
        self, sm: BucketStateMachine, now_ms: int, stall_window_ms: int
    ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
        """(subscriptions to expire, to keep alive, producers to forget), each bounded
        by `expires_per_purge_max` (docs/emission.md, lifecycles):

        * expire every subscription idle past the window, except one with nothing to
          acknowledge whose client is attached here, or that may still be
          reconnecting to this new holder (`attach_grace_ms`);
        * keep alive each attached one with nothing to acknowledge whose last sign
          of life is older than a quarter of the window, so that it never expires
          while its client stays (only an ack keeps one with rows alive);
        * forget every producer idle past `producer_idle_ms`.
        """
        if self._since_ms is None:
            self._since_ms = now_ms
        most = self._config.expires_per_purge_max
        settling = now_ms - self._since_ms < min(self._config.attach_grace_ms, stall_window_ms)
        keep: Container[str] = _Everyone() if settling else self._streams
        expired = expirable_subscriptions(sm, now_ms, stall_window_ms, keep)[:most]
        touch = []
        for sub_id in self._order:
            sub = sm.subs.get(sub_id)
            stale_ms = 0 if sub is None else now_ms - sub.last_active_ms
            if sub is not None and not sub.rows and stale_ms > stall_window_ms // 4:
                touch.append(sub_id)
                if len(touch) >= limits.TOUCHES_PER_PURGE_MAX:
                    break
        producers = sm.producers.idle(now_ms, self._config.producer_idle_ms)[:most]
        return expired, tuple(touch), producers

    def _acks_to_purge(self, sm: BucketStateMachine) -> tuple[Ack, ...]:
        """The queued acks still to apply (at most `acks_per_purge_max`); those the
        applied state covers (or made moot) are dropped from the queue."""
        acks = []
        for sub_id in sorted(self._acks):
            ack = self._acks[sub_id]
            if sm.subs.check_ack(ack.sub_id, ack.principal, ack.up_to).status is AckStatus.ACCEPTED:
                acks.append(ack)
            else:
                del self._acks[sub_id]  # covered (or moot): nothing left to propose
        return tuple(acks[: self._config.acks_per_purge_max])

    def outbox_entry(
        self, sm: BucketStateMachine, lease_index: int, now_ms: int
    ) -> OutboxWrite | None:
        """The next OUTBOX_WRITE to propose: every computed row neither outboxed nor
        covered by one of this holder's OUTBOX_WRITEs in flight, including what a
        predecessor left behind (the first range starts where the log says outboxing
        stopped). None if nothing waits, if `outbox_writes_in_flight` are in flight
        (LITERAL), or if one is in flight or the last left less than
        `checkpoint_interval_ms` ago (DERIVED). The caller reports what it proposed
        with `outbox_proposed`."""
        if not self.holds_lease(sm):
            return None
        after = self.outbox_after(sm, now_ms)
        return None if after is None else sm.propose_outbox_write(lease_index, now_ms, after)

    def outbox_after(self, sm: BucketStateMachine, now_ms: int) -> int | None:
        """Where the next OUTBOX_WRITE starts: after the newest one in flight (0: at
        the log's outboxed point), or None while none may be proposed (see
        `outbox_entry`)."""
        flight = self._outbox_flight
        while flight and flight[0][0] <= sm.outboxed_through:
            flight.popleft()  # committed (or covered by a predecessor's)
        if flight and now_ms - flight[0][1] >= self._config.outbox_retry_ms:
            flight.clear()  # lost or rejected: the ones after it cannot apply either
        if self._config.emission is EmissionMode.DERIVED:
            last = self._last_checkpoint_ms
            due = last is None or now_ms - last >= self._config.checkpoint_interval_ms
            return 0 if due and not flight else None
        if len(flight) >= self._config.outbox_writes_in_flight:
            return None
        return flight[-1][0] if flight else 0

    def outbox_proposed(self, entry: OutboxWrite, now_ms: int) -> None:
        """`entry` (from `outbox_entry`) is proposed: the next one starts after it."""
        self._outbox_flight.append((entry.through_index, now_ms))
        self._last_checkpoint_ms = now_ms

    def outbox_lost(self) -> None:
        """An OUTBOX_WRITE in flight ended without taking effect (rejected, or its
        proposal failed). Those after it will be rejected too (their ranges start
        where it ends): the next proposal starts again from the log."""
        self._outbox_flight.clear()


__all__ = [
    "ATTACH_GRACE_MS_DEFAULT",
    "BATCH_EVENTS_MAX",
    "CHECKPOINT_INTERVAL_MS_DEFAULT",
    "RESEND_AFTER_MS_DEFAULT",
    "SLOW_STREAM_MS_DEFAULT",
    "SLOW_SUBSCRIBER",
    "WINDOW_BYTES_DEFAULT",
    "WINDOW_EVENTS_DEFAULT",
    "row_bytes",
    "Attach",
    "AttachStatus",
    "EmissionMode",
    "NotifierConfig",
    "NotifierCore",
    "default_lease_holder",
    "needs_lease",
    "rendezvous_lease_holder",
]
