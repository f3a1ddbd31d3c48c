"""The checker: the invariants of docs/sim.md, verified from outside the code under test.

It keeps its own model of the bucket, written from the contract (docs/core.md,
docs/emission.md) rather than from `outbox/state.py`: it follows the globally
committed log and computes, per subscription, the stream the application must see,
and compares everything the simulated system does with it — raft-safety,
determinism, effective-once, visibility, purge-safety, bounded, monotonic,
isolation, reconnect, durability (no acknowledged write lost), lifecycle (only an
owner's UNSUBSCRIBE or idleness past the configured stall window ends a
subscription, and an ended one holds no slot) and liveness. A violation raises
`Violation` at once, naming the invariant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from sevendb.notifier.core import Attach, AttachStatus
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    EpochCreate,
    ExpectKind,
    HistoryTrim,
    InitProducer,
    Lease,
    OpKind,
    OutboxPurge,
    OutboxWrite,
    Start,
    StartKind,
    Subscribe,
    SubscribeBatch,
    Txn,
    TxnAction,
    TxnOutcome,
    TxnWrite,
    Unsubscribe,
    Write,
    WriteBatch,
    decode_entry,
)
from sevendb.outbox.model import (
    Applied,
    EpochResult,
    HistoryTrimResult,
    InitProducerResult,
    LeaseResult,
    OutboxRow,
    OutboxWriteResult,
    PurgeResult,
    ReconnectStatus,
    RowsPending,
    RowsPurged,
    SubscribeBatchResult,
    SubscribeResult,
    TxnResult,
    TxnWriteResult,
    UnsubscribeResult,
    WriteBatchResult,
    WriteResult,
)
from sevendb.outbox.query import QueryKind
from sevendb.outbox.state import BucketStateMachine

from .txn_model import TxnModel, op_changes, tag_of

INVARIANTS: Final = (
    "raft-safety",
    "determinism",
    "effective-once",
    "visibility",
    "purge-safety",
    "bounded",
    "monotonic",
    "isolation",
    "reconnect",
    "durability",
    "liveness",
    "lifecycle",
    "atomicity",
    "read-committed",
)

RowKey = tuple[object, ...]
"""A row as plain data: (sub_id, emit_seq, prev_emit_seq, changes, commit_time_ms)."""


class Violation(Exception):
    def __init__(self, invariant: str, message: str) -> None:
        assert invariant in INVARIANTS, invariant
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
        self.message = message


def _seq(seq: EmitSeq) -> tuple[str, int, int]:
    return (seq.bucket_uuid, seq.epoch_counter, seq.commit_index)


def row_key(row: OutboxRow) -> RowKey:
    changes = tuple((c.key, int(c.op), c.value, c.version) for c in row.delta.changes)
    return (
        row.sub_id,
        _seq(row.emit_seq),
        _seq(row.prev_emit_seq),
        changes,
        row.delta.commit_time_ms,
    )


# ---- the model -----------------------------------------------------------------------


@dataclass(slots=True)
class MSub:
    """One incarnation of a subscription (a sub_id may be reused after UNSUBSCRIBE)."""

    sub_id: str
    incarnation: int
    principal: str
    kind: QueryKind
    arg: str
    start: EmitSeq
    head: EmitSeq
    acked: EmitSeq
    last_active_ms: int
    stale: bool = False
    ended: str = ""
    durable: str = ""
    rows: list[tuple[EmitSeq, RowKey]] = field(default_factory=list)
    """Its outbox: computed (the source entry committed), not acknowledged."""
    stream: list[RowKey] = field(default_factory=list)
    """Every row computed for it, in order: what its application must process."""

    def matches(self, key: str) -> bool:
        if self.kind is QueryKind.KEY:
            return key == self.arg
        if self.kind is QueryKind.PREFIX:
            return key.startswith(self.arg)
        return True

    @property
    def last_row(self) -> EmitSeq:
        return self.rows[-1][0] if self.rows else self.acked


Summary = tuple[object, ...]


class Model:
    """The bucket as the contract describes it, fed the committed log in order.

    `emission` is the holders' emission mode (docs/emission.md): with "derived" a row
    may be sent once its source entry committed, with "literal" once the OUTBOX_WRITE
    covering it committed."""

    def __init__(
        self, bucket_uuid: str, emission: str = "derived", stall_window_ms: int | None = None
    ) -> None:
        if emission not in ("derived", "literal"):
            raise ValueError(f"unknown emission mode {emission!r}")
        self.bucket_uuid = bucket_uuid
        self.emission = emission
        self.stall_window_ms = stall_window_ms
        """The configured stall window: an expiry of a subscription that acknowledged
        (or was kept alive) within it is a lifecycle violation, whatever window the
        entry names. None: the entry's window is taken as configured."""
        self.epoch = 1
        self.lease_holder = ""
        self.lease_index = 0
        self.applied = 0
        self.outboxed_through = 0
        self.versions: dict[str, int] = {}
        self.subs: dict[str, MSub] = {}
        """Current incarnation by sub_id (ended ones stay until replaced)."""
        self.incarnations: dict[tuple[str, tuple[str, int, int]], MSub] = {}
        self.pending: list[tuple[int, list[tuple[MSub, EmitSeq, RowKey]]]] = []
        self.sendable: dict[str, dict[EmitSeq, RowKey]] = {}
        """Every row that ever became sendable under the mode, by sub_id and emit_seq
        (for visibility)."""
        self.summaries: dict[int, Summary] = {}
        self.accepted_acks: list[tuple[str, str, EmitSeq]] = []
        self._next_incarnation = 0
        self.history: list[tuple[EmitSeq, int, tuple[tuple[str, int, bytes, int], ...]]] = []
        """The retained history: (emit_seq, commit time, changes) of every source entry
        that changed something, oldest first, after `history_after`."""
        self.history_after = EmitSeq(bucket_uuid, 1, 0)
        self.history_after_ms = 0
        self._replayed: list[RowKey] = []
        """Rows the SUBSCRIBEs of the entry being applied replayed from the history."""
        self.txns = TxnModel()
        """Transactions (sim/txn_model.py): this bucket coordinates and takes part."""

    def seq(self, index: int) -> EmitSeq:
        return EmitSeq(self.bucket_uuid, self.epoch, index)

    def incarnation(self, sub_id: str, start: EmitSeq) -> MSub | None:
        return self.incarnations.get((sub_id, _seq(start)))

    def live(self) -> list[MSub]:
        return [s for s in self.subs.values() if not s.ended]

    def idle(self, now_ms: int, window_ms: int) -> list[str]:
        """Live subscriptions with no ack, subscribe or keep-alive within the window:
        the ones an OUTBOX_PURGE may expire (docs/contract.md §8)."""
        return [
            s.sub_id
            for s in sorted(self.live(), key=lambda s: s.sub_id)
            if now_ms - s.last_active_ms > window_ms
        ]

    def apply(self, index: int, data: bytes) -> Summary:
        """Apply one committed entry; returns the result the core must also reach."""
        self.applied = index
        entry = decode_entry(data)
        summary: Summary
        if isinstance(entry, Write):
            summary = self._write(index, entry)
        elif isinstance(entry, WriteBatch):
            summary = self._write_batch(index, entry)
        elif isinstance(entry, Subscribe):
            self._replayed = []
            summary = (*self._subscribe(index, entry), tuple(self._replayed))
        elif isinstance(entry, SubscribeBatch):
            self._replayed = []
            subscribed = tuple(self._subscribe(index, s) for s in entry.subscribes)
            summary = ("SB", subscribed, tuple(self._replayed))
        elif isinstance(entry, HistoryTrim):
            summary = self._history_trim(index, entry)
        elif isinstance(entry, Unsubscribe):
            sub = self.subs.get(entry.sub_id)
            if sub is None or sub.ended:
                summary = ("U", "SUBSCRIPTION_NOT_FOUND")
            elif sub.principal != entry.principal:
                summary = ("U", "NOT_OWNER")
            else:
                sub.ended = "unsubscribed"
                sub.rows.clear()
                summary = ("U", None)
        elif isinstance(entry, OutboxWrite):
            summary = self._outbox_write(index, entry)
        elif isinstance(entry, OutboxPurge):
            summary = self._purge(entry)
        elif isinstance(entry, EpochCreate):
            if entry.epoch_counter != self.epoch + 1:
                summary = ("E", self.epoch, "STALE_EPOCH")
            else:
                self.epoch = entry.epoch_counter
                summary = ("E", self.epoch, None)
        elif isinstance(entry, Lease):
            self.lease_holder, self.lease_index = entry.holder, index
            summary = ("L", entry.holder)
        elif isinstance(entry, Txn):
            summary = self._txn(index, entry)
        elif isinstance(entry, TxnWrite):
            if entry.acks:
                raise Violation("determinism", "the model does not cover acks in transactions")
            summary = ("TW", self.txns.write(entry, self.versions), ())
        else:
            assert isinstance(entry, InitProducer)
            raise Violation("determinism", "the model does not cover idempotent producers")
        self.summaries[index] = summary
        return summary

    def _txn(self, index: int, entry: Txn) -> Summary:
        """A TXN entry: its code, and at a COMMIT marker the rows of what it made
        visible. A COMPLETE of a committed transaction whose writes here were never
        marked would lose them: the atomicity invariant."""
        key = (entry.txn_id, entry.number)
        complete = entry.action is TxnAction.COMPLETE and key in self.txns.pending
        if complete and self.txns.decided.get(key) is TxnOutcome.COMMIT:
            raise Violation(
                "atomicity",
                f"transaction {key} decided COMMIT was completed at {index} without its "
                f"marker: {len(self.txns.pending[key].ops)} writes never visible",
            )
        if entry.coordinator_side:
            return ("T", self.txns.coordinator(entry), ())
        if entry.action is TxnAction.JOIN:
            return ("T", self.txns.join(entry), ())
        changes = op_changes(self.txns.mark(index, entry), self.versions)
        return ("T", None, self._rows(index, changes, entry.now_ms))

    def _write_ops(self, entry: Write) -> tuple[str | None, list[tuple[str, int, bytes, int]]]:
        """One write, atomically: its refusal code, or the changes it made."""
        if entry.producer is not None:
            raise Violation("determinism", "the model does not cover idempotent producers")
        for op in entry.ops:
            version = self.versions.get(op.key)
            exp = op.expected
            ok = (
                exp.kind is ExpectKind.ANY
                or (exp.kind is ExpectKind.NOT_EXISTS and version is None)
                or (exp.kind is ExpectKind.EXACT and version == exp.version)
            )
            if not ok:
                return "PRECONDITION_FAILED", []
        changes: list[tuple[str, int, bytes, int]] = []
        for op in entry.ops:
            version = self.versions.get(op.key)
            if op.kind is OpKind.SET:
                new = 1 if version is None else version + 1
                self.versions[op.key] = new
                changes.append((op.key, int(OpKind.SET), op.value, new))
            elif version is not None:
                del self.versions[op.key]
                changes.append((op.key, int(OpKind.DEL), b"", version))
        return None, changes

    def _rows(
        self, index: int, changes: list[tuple[str, int, bytes, int]], now_ms: int
    ) -> tuple[RowKey, ...]:
        """One row per live subscription any change matches (sub_id order): the delta of
        one committed source entry for that subscription."""
        emit = self.seq(index)
        if changes:
            self.history.append((emit, now_ms, tuple(changes)))
        made: list[tuple[MSub, EmitSeq, RowKey]] = []
        for sub_id in sorted(self.subs):
            sub = self.subs[sub_id]
            if sub.ended or sub.stale:
                continue
            picked = tuple(c for c in changes if sub.matches(c[0]))
            if not picked:
                continue
            key: RowKey = (sub_id, _seq(emit), _seq(sub.head), picked, now_ms)
            sub.head = emit
            sub.stream.append(key)
            sub.rows.append((emit, key))
            if self.emission == "derived":
                self.sendable.setdefault(sub_id, {})[emit] = key
            made.append((sub, emit, key))
        if made:
            self.pending.append((index, made))
        return tuple(k for _, _, k in made)

    def _write(self, index: int, entry: Write) -> Summary:
        code, changes = self._write_ops(entry)
        return ("W", code, self._rows(index, changes, entry.now_ms))

    def _write_batch(self, index: int, entry: WriteBatch) -> Summary:
        codes = []
        changes: list[tuple[str, int, bytes, int]] = []
        for write in entry.writes:
            code, some = self._write_ops(write)
            codes.append(code)
            changes.extend(some)
        return ("WB", tuple(codes), self._rows(index, changes, entry.writes[-1].now_ms))

    def _subscribe(self, index: int, entry: Subscribe) -> Summary:
        named = [
            s
            for s in self.live()
            if entry.durable and (s.principal, s.durable) == (entry.principal, entry.durable)
        ]
        existing = named[0] if named else self.subs.get(entry.sub_id)
        if existing is not None and not existing.ended:
            refused = None
            query = (entry.query.kind, entry.query.arg)
            if existing.principal != entry.principal:
                refused = "NOT_OWNER"
            elif existing.durable != entry.durable or (existing.kind, existing.arg) != query:
                refused = "SUBSCRIPTION_EXISTS"
            if refused is not None:
                return ("S", None, False, refused, entry.sub_id, None)
            began, acked = _seq(existing.start), _seq(existing.acked)
            return ("S", began, True, None, existing.sub_id, acked)
        start = self._start_at(index, entry.start)
        if isinstance(start, str):
            return ("S", None, False, start, entry.sub_id, None)
        arg = "" if entry.query.kind is QueryKind.ALL else entry.query.arg
        self._next_incarnation += 1
        sub = MSub(
            entry.sub_id,
            self._next_incarnation,
            entry.principal,
            entry.query.kind,
            arg,
            start,
            start,
            start,
            entry.now_ms,
            durable=entry.durable,
        )
        self.subs[entry.sub_id] = sub
        self.incarnations[(entry.sub_id, _seq(start))] = sub
        self._replay(index, sub)
        return ("S", _seq(start), False, None, entry.sub_id, _seq(start))

    def _start_at(self, index: int, start: Start) -> EmitSeq | str:
        """docs/core.md, "Start positions": the position, or the refusal's code."""
        if start.kind is StartKind.LATEST:
            return self.seq(index)
        if start.kind is StartKind.EARLIEST:
            return self.history_after
        if start.kind is StartKind.TIME:
            if self.history_after.commit_index and start.time_ms <= self.history_after_ms:
                return "STALE_SEQUENCE"
            before = self.history_after
            for emit, when, _ in self.history:
                if when >= start.time_ms:
                    break
                before = emit
            return before
        after = start.after
        assert after is not None
        if after.bucket_uuid != self.bucket_uuid or after >= self.seq(index):
            return "INVALID_ARGUMENT"
        if after < self.history_after:
            return "STALE_SEQUENCE"
        return after

    def _replay(self, index: int, sub: MSub) -> None:
        """A subscription starting in the past: a row per retained change set after its
        start that it matches, sendable at once (a function of committed entries;
        pending a checkpoint all the same)."""
        made: list[tuple[MSub, EmitSeq, RowKey]] = []
        for emit, when, changes in self.history:
            picked = tuple(c for c in changes if sub.matches(c[0]))
            if emit <= sub.start or not picked:
                continue
            key: RowKey = (sub.sub_id, _seq(emit), _seq(sub.head), picked, when)
            sub.head = emit
            sub.stream.append(key)
            sub.rows.append((emit, key))
            self.sendable.setdefault(sub.sub_id, {})[emit] = key
            made.append((sub, emit, key))
            self._replayed.append(key)
        if made:
            self.pending.append((index, made))

    def _history_trim(self, index: int, entry: HistoryTrim) -> Summary:
        dropped = 0
        while self.history and self.history[0][0].commit_index <= min(entry.through_index, index):
            self.history_after, self.history_after_ms, _ = self.history.pop(0)
            dropped += 1
        return ("H", dropped, _seq(self.history_after))

    def _lease_ok(self, lease_index: int) -> bool:
        return self.lease_index != 0 and lease_index == self.lease_index

    def _outbox_write(self, index: int, entry: OutboxWrite) -> Summary:
        if not self._lease_ok(entry.lease_index):
            return ("O", 0, False, "STALE_LEASE")
        if entry.through_index <= self.outboxed_through:
            return ("O", 0, True, None)
        if entry.from_index != self.outboxed_through:
            return ("O", 0, False, "STALE_RANGE")
        if entry.through_index >= index:
            return ("O", 0, False, "INVALID_ARGUMENT")
        kept = 0
        while self.pending and self.pending[0][0] <= entry.through_index:
            _, made = self.pending.pop(0)
            for sub, emit, key in made:
                if self.subs.get(sub.sub_id) is sub and not sub.ended and not sub.stale:
                    if self.emission == "literal":
                        self.sendable.setdefault(sub.sub_id, {})[emit] = key
                    kept += 1
        self.outboxed_through = entry.through_index
        return ("O", kept, False, None)

    def check_ack(self, sub_id: str, principal: str, up_to: EmitSeq) -> str:
        sub = self.subs.get(sub_id)
        if sub is None or sub.ended == "unsubscribed":  # an expired one: STALE below
            return "SUBSCRIPTION_NOT_FOUND"
        if sub.principal != principal:
            return "NOT_OWNER"
        if sub.stale:
            return "STALE"
        if up_to.bucket_uuid != self.bucket_uuid:
            return "FUTURE"
        if up_to < sub.acked:
            return "REGRESSIVE"
        if up_to == sub.acked:
            return "DUPLICATE"
        if up_to > sub.last_row:
            return "FUTURE"
        return "ACCEPTED"

    def _purge(self, entry: OutboxPurge) -> Summary:
        if not self._lease_ok(entry.lease_index):
            return ("P", "STALE_LEASE", (), (), 0)
        statuses = []
        purged = 0
        self.accepted_acks = []
        for ack in entry.acks:
            status = self.check_ack(ack.sub_id, ack.principal, ack.up_to)
            statuses.append(status)
            if status == "ACCEPTED":
                sub = self.subs[ack.sub_id]
                while sub.rows and sub.rows[0][0] <= ack.up_to:
                    sub.rows.pop(0)
                    purged += 1
                sub.acked = ack.up_to
                sub.last_active_ms = entry.now_ms
                self.accepted_acks.append((ack.sub_id, ack.principal, ack.up_to))
        for sub_id in entry.touch:  # keep-alives count only with nothing to acknowledge
            touched = self.subs.get(sub_id)
            if touched is not None and not touched.ended and not touched.rows:
                touched.last_active_ms = max(touched.last_active_ms, entry.now_ms)
        idle = self.idle(entry.now_ms, entry.stall_window_ms)
        window = self.stall_window_ms or entry.stall_window_ms
        expired = []
        for sub_id in entry.expire:
            if sub_id in idle:
                sub = self.subs[sub_id]
                if entry.now_ms - sub.last_active_ms <= window:
                    raise Violation(
                        "lifecycle",
                        f"OUTBOX_PURGE expires {sub_id} (dropping {len(sub.rows)} rows), "
                        f"active {entry.now_ms - sub.last_active_ms} ms ago, within the "
                        f"{window} ms stall window",
                    )
                sub.stale = True
                sub.ended = "stale"
                sub.rows.clear()
                idle.remove(sub_id)
                expired.append(sub_id)
        return ("P", None, tuple(statuses), tuple(expired), purged)


def _subscribed(result: SubscribeResult) -> Summary:
    code = None if result.error is None else str(result.error.code)
    start = None if result.start is None else _seq(result.start)
    acked = None if result.acked is None else _seq(result.acked)
    return ("S", start, result.existing, code, result.sub_id, acked)


def summarize(applied: Applied) -> Summary:
    """The core's answer for one entry, in the model's terms."""
    result = applied.result
    rows: list[RowKey] = []
    for effect in applied.effects:
        if isinstance(effect, RowsPending):
            rows.extend(row_key(r) for r in effect.rows)
    if isinstance(result, WriteBatchResult):
        codes = tuple(None if r.error is None else str(r.error.code) for r in result.results)
        return ("WB", codes, tuple(rows))
    if isinstance(result, SubscribeBatchResult):
        return ("SB", tuple(_subscribed(r) for r in result.results), tuple(rows))
    if isinstance(result, HistoryTrimResult):
        return ("H", result.dropped, _seq(result.retained_after))
    code = None if result.error is None else str(result.error.code)
    if isinstance(result, WriteResult):
        return ("W", code, tuple(rows))
    if isinstance(result, SubscribeResult):
        return (*_subscribed(result), tuple(rows))
    if isinstance(result, UnsubscribeResult):
        return ("U", code)
    if isinstance(result, OutboxWriteResult):
        return ("O", result.rows, result.already, code)
    if isinstance(result, PurgeResult):
        if code is not None:
            return ("P", code, (), (), 0)
        statuses = tuple(str(o.status) for o in result.acks)
        return ("P", None, statuses, result.expired, result.purged_rows)
    if isinstance(result, EpochResult):
        return ("E", result.epoch.epoch_counter, code)
    if isinstance(result, LeaseResult):
        return ("L", result.holder)
    if isinstance(result, TxnResult):
        return ("T", code, tuple(rows))
    if isinstance(result, TxnWriteResult):
        return ("TW", code, tuple(rows))
    assert isinstance(result, InitProducerResult)
    return ("I", code)


# ---- the checker ---------------------------------------------------------------------


@dataclass(slots=True)
class AppStream:
    """What one application processed for one subscription incarnation."""

    sub_id: str
    start: EmitSeq
    principal: str
    processed: list[RowKey] = field(default_factory=list)
    last: EmitSeq | None = None
    active: bool = True


class Checker:
    def __init__(
        self,
        bucket_uuid: str,
        *,
        tolerate_divergence: bool = False,
        emission: str = "derived",
        stall_window_ms: int | None = None,
    ) -> None:
        self.model = Model(bucket_uuid, emission, stall_window_ms)
        self.tolerate_divergence = tolerate_divergence
        """PLN-01: a replica may diverge (a broken planner) if it quarantines itself
        and nothing it computed reaches a client; `diverged` names such replicas."""
        self.diverged: dict[str, str] = {}
        self.committed: list[tuple[int, bytes]] = [(0, b"")]
        """Index -> (term, data) of every committed entry; index 0 is a sentinel."""
        self.digests: dict[int, str] = {}
        self.confirmed: dict[str, EmitSeq] = {}
        """sub_id -> the highest position its owner acknowledged or reconnected from."""
        self.apps: dict[tuple[str, tuple[str, int, int]], AppStream] = {}
        self.receipts: Counter[tuple[str, EmitSeq, str]] = Counter()
        """(sub_id, emit_seq, sending replica) -> how often a client received it."""
        self.acked_writes: set[int] = set()
        """Raft indexes of writes whose client was told they committed."""
        self.checks = 0
        self.received = 0
        self.processed = 0
        self.duplicates_dropped = 0

    # ---- the log -------------------------------------------------------------------

    @property
    def commit_index(self) -> int:
        return len(self.committed) - 1

    def on_commit(self, index: int, term: int, data: bytes) -> None:
        """The leader committed `index` (called in index order, once each)."""
        self.checks += 1
        if index <= self.commit_index:
            if self.committed[index] != (term, data):
                raise Violation("raft-safety", f"index {index} committed twice, differently")
            return
        if index != self.commit_index + 1:
            raise Violation("raft-safety", f"commit jumped from {self.commit_index} to {index}")
        self.committed.append((term, data))
        if data:
            summary = self.model.apply(index, data)
            if summary[0] == "P" and summary[1] is None:
                self._check_purge_acks(index)

    def on_write_acked(self, index: int) -> None:
        """A client was told its write committed at `index`."""
        self.acked_writes.add(index)

    def on_leader(
        self, name: str, term: int, base: int, entry_at: Callable[[int], tuple[int, bytes] | None]
    ) -> None:
        """`name` won the election of `term` with a log after `base` (`entry_at` gives
        its (term, data) per index): it must hold every committed entry, or the group
        would serve a shorter history and overwrite acknowledged writes."""
        self.checks += 1
        missing = [
            index
            for index in range(base + 1, self.commit_index + 1)
            if entry_at(index) != self.committed[index]
        ]
        if missing:
            writes = sum(1 for index in missing if index in self.acked_writes)
            raise Violation(
                "durability",
                f"{name} leads term {term} without {len(missing)} committed entries "
                f"({missing[0]}..{missing[-1]}; {writes} acknowledged writes among them)",
            )

    def _check_purge_acks(self, index: int) -> None:
        for sub_id, principal, up_to in self.model.accepted_acks:
            sub = self.model.subs[sub_id]
            if principal != sub.principal:
                raise Violation("isolation", f"{principal} acked {sub_id} of {sub.principal}")
            confirmed = self.confirmed.get(sub_id)
            if confirmed is None or up_to > confirmed:
                raise Violation(
                    "purge-safety",
                    f"OUTBOX_PURGE at {index} acks {sub_id} up to {up_to}; its owner "
                    f"acknowledged only {confirmed}",
                )

    def on_apply(self, replica: str, index: int, data: bytes, applied: Applied | None) -> None:
        """A replica applied `index` (a no-op or a rejected entry has `applied` None)."""
        self.checks += 1
        if index > self.commit_index:
            raise Violation("visibility", f"{replica} applied {index} before it committed")
        if data and self.committed[index][1] != data:
            raise Violation("raft-safety", f"{replica} applied a different entry at {index}")
        if applied is None or replica in self.diverged:
            return
        for effect in applied.effects:
            if isinstance(effect, RowsPending):
                for row in effect.rows:
                    self._check_read_committed(replica, row)
        expected = self.model.summaries.get(index)
        actual = summarize(applied)
        if expected != actual:
            message = f"{replica} at {index}: the core reached {actual}, the model {expected}"
            if not self.tolerate_divergence:
                raise Violation("determinism", message)
            self.diverged[replica] = message
            return
        for effect in applied.effects:
            if isinstance(effect, RowsPurged):
                for row in effect.rows:
                    confirmed = self.confirmed.get(row.sub_id)
                    if confirmed is None or row.emit_seq > confirmed:
                        raise Violation(
                            "purge-safety",
                            f"{replica} purged {row.sub_id} {row.emit_seq}; "
                            f"owner acked {confirmed}",
                        )

    def _check_read_committed(self, replica: str, row: OutboxRow) -> None:
        """A row made sendable holds a transaction's change only at that transaction's
        COMMIT marker (docs/transactions.md): never as it was written, never of an
        aborted or open one."""
        for change in row.delta.changes:
            owner = tag_of(change.value)
            if owner is None:
                continue
            at = row.emit_seq.commit_index
            if self.model.txns.committed_at.get(owner) != at:
                raise Violation(
                    "read-committed",
                    f"{replica} made {row.sub_id} a row at {at} holding {change.key}="
                    f"{change.value!r} of transaction {owner}, whose COMMIT marker is at "
                    f"{self.model.txns.committed_at.get(owner)}",
                )

    def on_digest(self, replica: str, index: int, digest: str) -> None:
        self.checks += 1
        if replica in self.diverged:
            return
        seen = self.digests.setdefault(index, digest)
        if seen != digest:
            raise Violation(
                "determinism", f"{replica} at raft index {index}: digest {digest}, others {seen}"
            )

    def on_compact(
        self, replica: str, new_base: int, sm: BucketStateMachine, now_ms: int, window_ms: int
    ) -> None:
        """A replica truncated its log through `new_base`: never past the safety point."""
        self.checks += 1
        bound = sm.applied_index
        for sub in sm.subs.sorted():
            idle = now_ms - sub.last_active_ms > window_ms
            if sub.rows and not idle:
                bound = min(bound, sub.acked.commit_index)
        if new_base > bound:
            raise Violation(
                "bounded", f"{replica} truncated its log through {new_base}, past {bound}"
            )

    # ---- clients -------------------------------------------------------------------

    def on_subscribed(self, principal: str, sub_id: str, start: EmitSeq) -> None:
        """A client learned its stream's start (SubAck) and will process from there."""
        key = (sub_id, _seq(start))
        sub = self.model.incarnation(sub_id, start)
        if sub is None:
            raise Violation(
                "visibility", f"{principal} got SubAck {sub_id} at {start}, uncommitted"
            )
        if sub.principal != principal:
            raise Violation("isolation", f"{principal} was handed {sub_id} of {sub.principal}")
        self.apps.setdefault(key, AppStream(sub_id, start, principal))

    def on_durable_resume(self, principal: str, sub_id: str, start: EmitSeq, acked: EmitSeq) -> int:
        """A client process that kept nothing (no cursor file) resumed its durable
        subscription by name: its stream continues after `acked`, the server's
        position. That must be one the application reached (otherwise events were
        acknowledged that it never processed: a gap); what it processed after it
        comes again, and is processed again (at-least-once for that tail, which the
        client cannot drop: it kept nothing). Returns how many events that is."""
        self.checks += 1
        app = self.apps.get((sub_id, _seq(start)))
        if app is None or app.principal != principal:
            raise Violation("isolation", f"{principal} resumed durable {sub_id} it never had")
        reached = start if app.last is None else app.last
        if acked > reached:
            raise Violation(
                "effective-once",
                f"{principal}'s durable {sub_id} resumes after {acked}; its application "
                f"processed only up to {reached} (a gap)",
            )
        emits = [k[1] for k in app.processed]
        if acked != start and _seq(acked) not in emits:
            raise Violation(
                "effective-once",
                f"{principal}'s durable {sub_id} resumes after {acked}, "
                "a position its application never processed",
            )
        kept = app.processed[: emits.index(_seq(acked)) + 1 if acked != start else 0]
        again = len(app.processed) - len(kept)
        app.processed = kept
        app.last = acked if kept else None
        app.active = True
        return again

    def on_confirm(self, principal: str, sub_id: str, position: EmitSeq) -> None:
        """The owner says it processed everything up to `position` (ack or reconnect)."""
        sub = self.model.subs.get(sub_id)
        if sub is None or sub.principal != principal:
            return  # not an owner's word: it must never purge anything
        if position > self.confirmed.get(sub_id, position):
            self.confirmed[sub_id] = position
        else:
            self.confirmed.setdefault(sub_id, position)

    def on_receive(self, principal: str, sub_id: str, row: OutboxRow, replica: str = "") -> None:
        """A client received an event (maybe a duplicate, maybe on a stale stream)."""
        self.checks += 1
        self.received += 1
        self.receipts[(sub_id, row.emit_seq, replica)] += 1
        if row.sub_id != sub_id:
            raise Violation("isolation", f"event of {row.sub_id} sent on a stream of {sub_id}")
        sendable = self.model.sendable.get(sub_id, {}).get(row.emit_seq)
        if sendable is None:
            when = "its source entry" if self.model.emission == "derived" else "its OUTBOX_WRITE"
            raise Violation(
                "visibility",
                f"{principal} received {sub_id} {row.emit_seq} before {when} committed",
            )
        if sendable != row_key(row):
            raise Violation("visibility", f"{sub_id} {row.emit_seq} differs from the committed row")
        owner = self._owner_of_row(sub_id, row.emit_seq)
        if owner != principal:
            raise Violation("isolation", f"{principal} received {sub_id} of {owner}")
        if not row.prev_emit_seq < row.emit_seq:
            raise Violation("monotonic", f"{sub_id} {row.emit_seq} chains from {row.prev_emit_seq}")

    def _owner_of_row(self, sub_id: str, emit: EmitSeq) -> str:
        sub = self.model.subs.get(sub_id)
        owner = "" if sub is None else sub.principal
        for (sid, _), inc in self.model.incarnations.items():
            if sid == sub_id and inc.start < emit <= inc.head:
                owner = inc.principal
        return owner

    def on_process(self, principal: str, sub_id: str, start: EmitSeq, row: OutboxRow) -> None:
        """The application processed an event of its subscription `(sub_id, start)`."""
        self.checks += 1
        self.processed += 1
        app = self.apps.get((sub_id, _seq(start)))
        sub = self.model.incarnation(sub_id, start)
        if app is None or sub is None:
            raise Violation("effective-once", f"{principal} processed {sub_id} it never subscribed")
        key = row_key(row)
        pos = len(app.processed)
        if app.last is not None and row.emit_seq <= app.last:
            raise Violation(
                "effective-once" if key in app.processed else "monotonic",
                f"{principal} processed {sub_id} {row.emit_seq} after {app.last} "
                f"({'duplicate' if key in app.processed else 'reorder'})",
            )
        if pos >= len(sub.stream) or sub.stream[pos] != key:
            missing = sub.stream[pos][1] if pos < len(sub.stream) else None
            raise Violation(
                "effective-once",
                f"{principal} processed {sub_id} {row.emit_seq} as event #{pos + 1}; "
                f"the committed stream has {missing} there (gap or foreign event)",
            )
        app.processed.append(key)
        app.last = row.emit_seq

    def on_attach(
        self, principal: str, sub_id: str, after: EmitSeq, attach: Attach, owner_client: bool
    ) -> None:
        """A (re)connect got an answer; `owner_client` is False for an impostor."""
        self.checks += 1
        sub = self.model.subs.get(sub_id)
        owner = "" if sub is None else sub.principal
        if attach.status is AttachStatus.ATTACHED and owner != principal:
            raise Violation("isolation", f"{principal} attached to {sub_id} of {owner}")
        if attach.status is not AttachStatus.REFUSED or not owner_client:
            return
        assert attach.decision is not None
        status = attach.decision.status
        if status is ReconnectStatus.STALE_SEQUENCE:
            inc = self._incarnation_at(sub_id, after)
            if inc is None or not inc.stale:
                raise Violation(
                    "reconnect", f"STALE_SEQUENCE for {sub_id} after {after}, which is not stale"
                )
            return
        inc = self._incarnation_at(sub_id, after)
        if inc is not None and inc.ended == "unsubscribed":
            return
        raise Violation(
            "reconnect",
            f"{status.name} for {principal}'s {sub_id} after {after}: {attach.decision.message}",
        )

    def _incarnation_at(self, sub_id: str, after: EmitSeq) -> MSub | None:
        found = None
        for (sid, _), inc in self.model.incarnations.items():
            if sid == sub_id and inc.start <= after:
                found = inc
        return found

    def model_has_live(self, sub_id: str) -> bool:
        sub = self.model.subs.get(sub_id)
        return sub is not None and not sub.ended

    def end_stream(self, sub_id: str, start: EmitSeq) -> None:
        app = self.apps.get((sub_id, _seq(start)))
        if app is not None:
            app.active = False

    # ---- the end -------------------------------------------------------------------

    def pending_work(self) -> list[str]:
        """What still keeps the run from quiescence (empty: everything is delivered)."""
        todo = []
        for txn_id, number in self.model.txns.due():
            todo.append(f"transaction {txn_id}/{number} decided, not complete")
        for txn_id, state in sorted(self.model.txns.ids.items()):
            if state.open() is not None:
                todo.append(f"transaction {txn_id} open")
        if self.model.pending:
            todo.append(f"{sum(len(m) for _, m in self.model.pending)} rows not outboxed")
        for sub in self.model.live():
            if sub.rows:
                todo.append(f"{sub.sub_id}: {len(sub.rows)} rows unacknowledged")
        for app in self.apps.values():
            inc = self.model.incarnation(app.sub_id, app.start)
            if app.active and inc is not None and not inc.ended:
                outstanding = len(inc.stream) - len(app.processed)
                if outstanding:
                    todo.append(f"{app.sub_id}: {outstanding} events not processed")
        return todo

    def final(
        self,
        replicas: Iterable[tuple[str, int, BucketStateMachine]],
        quarantined: Iterable[str] = (),
    ) -> None:
        """After quiescence: everything delivered, outbox drained, replicas agree,
        every diverged replica quarantined."""
        todo = self.pending_work()
        if todo:
            raise Violation("liveness", "; ".join(todo[:6]))
        out = set(quarantined)
        for name in sorted(self.diverged):
            if name not in out:
                raise Violation(
                    "determinism",
                    f"{name} diverged and never quarantined itself: {self.diverged[name]}",
                )
        digests: dict[int, tuple[str, str]] = {}
        live = sorted(s.sub_id for s in self.model.live())
        for name, applied, sm in replicas:
            self.checks += 1
            held = [s.sub_id for s in sm.subs.sorted()]
            if applied >= self.commit_index and held != live:
                raise Violation(
                    "lifecycle",
                    f"{name} holds subscriptions {held}; the live ones are {live} (an ended "
                    "subscription must free its slot, a live one keep it)",
                )
            if sm.subs.outbox_size():
                raise Violation(
                    "bounded", f"{name} still holds {sm.subs.outbox_size()} rows after every ack"
                )
            digest = sm.digest()
            other = digests.setdefault(applied, (name, digest))
            if other[1] != digest:
                raise Violation(
                    "determinism", f"{name} and {other[0]} differ at raft index {applied}"
                )
