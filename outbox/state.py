"""The bucket state machine: pure, deterministic, no I/O, no clock, no randomness.

`apply(commit_index, entry_bytes)` is the only way state changes. Time and ids
arrive inside entries (put there by the proposing adapter), so every replica and
every replay computes byte-identical state (`digest()`), rows and results. That
includes lifecycles: a subscription or producer idle past its window is deleted by
an entry that names it, judged against the time that entry carries
(docs/core.md, lifecycles).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

import msgpack
import xxhash

from . import limits
from .emitseq import EmitSeq, EpochId
from .entries import (
    Ack,
    Entry,
    EpochCreate,
    ExpectKind,
    HistoryTrim,
    InitProducer,
    Isolation,
    Lease,
    Op,
    OpKind,
    OutboxPurge,
    OutboxWrite,
    Start,
    StartKind,
    Subscribe,
    SubscribeBatch,
    Txn,
    TxnAction,
    TxnWrite,
    Unsubscribe,
    Write,
    WriteBatch,
    decode_entry,
)
from .errors import (
    ApplyOrderError,
    ErrorCode,
    InvalidArgument,
    PlanMismatch,
    Rejection,
    SnapshotError,
    StaleSequence,
)
from .groups import GroupBeat, GroupTable
from .lifecycle import idle
from .model import (
    AckOutcome,
    AckStatus,
    Applied,
    Change,
    CloseReason,
    Delta,
    Effect,
    EpochChanged,
    EpochResult,
    HistoryPage,
    HistoryTrimResult,
    InitProducerResult,
    KeyRecord,
    KeyValue,
    LeaseChanged,
    LeaseResult,
    OutboxRow,
    OutboxWriteResult,
    PurgeResult,
    ReconnectDecision,
    ReconnectStatus,
    Result,
    RetainedChange,
    RowsOutboxed,
    RowsPending,
    RowsPurged,
    SubscribeBatchResult,
    SubscribeResult,
    SubscriptionClosed,
    SyncPage,
    TxnResult,
    TxnTag,
    UnsubscribeResult,
    WriteBatchResult,
    WriteResult,
    delta_bytes,
)
from .producer_results import ProducerResults
from .query import Plan, Planner, Query, QueryIndex, QueryKind, plan_query
from .txn import TxnState, uncommitted_readers

SNAPSHOT_FORMAT_VERSION: Final = 3
"""3: each subscription carries its durable name ("" for none) and the index of its
SUBSCRIBE last, and the retained
history follows the expired subscriptions (its change sets, then the position and
commit time it reaches back to). 2: producers
carry when they were last active, subscriptions no longer carry a stale flag (the
expired subscriptions remembered follow the pending rows), and a subscription's rows
include those computed and not yet checkpointed (1 kept them only in the pending
batches). Versions 1 and 2 are still read (`restore`).
A producer's owner is a sixth field of its item, absent when it has none: a state
without owners snapshots as before. Likewise the consumer groups (`GroupTable.pack`)
are a fifteenth field of format 3, absent when the bucket has none, and the
transaction state (outbox/txn.py) a sixteenth, absent when the bucket has none (then
the fifteenth is there, empty if the bucket has no group)."""


@dataclass(slots=True)
class Subscription:
    """A replicated query, its stream position and its outbox rows (emit_seq order)."""

    sub_id: str
    principal: str
    query: Query
    plan: Plan
    start: EmitSeq
    head: EmitSeq
    """emit_seq of the last row computed for it (or `start`): the next row's prev."""
    acked: EmitSeq
    """Everything up to here was acknowledged and purged."""
    last_active_ms: int
    """Log time of its SUBSCRIBE, its last accepted ack or its last keep-alive."""
    rows: deque[OutboxRow] = field(default_factory=deque)
    """Its outbox: every row computed for it and not yet acknowledged, in emit_seq
    order. A row joins when its source entry applies (it is a function of the
    committed log, as durable as that entry); the bucket's `outboxed_through` says
    which ones an OUTBOX_WRITE has checkpointed (docs/emission.md: which rows a
    holder may send depends on its emission mode)."""
    durable: str = ""
    """Its durable name ("" for none): its principal resumes it by this name."""
    born: int = 0
    """Log index of the SUBSCRIBE that made it (its start's, unless it started in the
    past): rows computed before it were an earlier incarnation's of its sub_id."""
    isolation: Isolation = Isolation.READ_COMMITTED
    """What it receives of transactions (docs/transactions.md)."""

    @property
    def last_row(self) -> EmitSeq:
        """The newest row kept for it, or the acknowledged point if none is."""
        return self.rows[-1].emit_seq if self.rows else self.acked

    @property
    def ack_lag(self) -> int:
        """How many commit indexes the acks trail the stream head."""
        return self.head.commit_index - self.acked.commit_index


@dataclass(slots=True)
class _Producer:
    epoch: int
    last_active_ms: int
    """Log time of its INIT_PRODUCER or of its last write taken (or answered as a
    duplicate)."""
    last_seq: int = -1
    results: ProducerResults = field(default_factory=ProducerResults)
    """The results of its last sequences, `last_seq` last (a producer's sequences
    apply only in order, so these are consecutive)."""
    owner: str = ""
    """The principal whose INIT_PRODUCER made it (empty: made by an older build)."""


@dataclass(frozen=True, slots=True)
class _PendingBatch:
    """The rows of one source entry not yet checkpointed by an OUTBOX_WRITE (the same
    row objects the subscriptions keep: an OUTBOX_WRITE's digest covers them even
    after an ack, an unsubscribe or an expiry removed them from a subscription)."""

    commit_index: int
    rows: tuple[OutboxRow, ...]


def _reject(code: ErrorCode, message: str) -> Rejection:
    return Rejection(code, message)


def _not_owner(producer_id: int, principal: str) -> Rejection:
    return _reject(
        ErrorCode.PERMISSION_DENIED,
        f"producer {producer_id} belongs to another principal: {principal or 'this caller'} "
        "lacks ownership of it (init a producer id of your own)",
    )


def _refused(commit: EmitSeq, *, error: Rejection) -> tuple[WriteResult, list[Change]]:
    return WriteResult(commit, error=error), []


def rows_digest(rows: Iterator[OutboxRow] | tuple[OutboxRow, ...]) -> tuple[int, int]:
    """(row count, xxh64 over the canonical encoding of `rows`), as OUTBOX_WRITE carries."""
    hasher = xxhash.xxh64()
    count = 0
    # The rows of one source entry share its EmitSeq and usually its Delta: each is
    # encoded once (the object is kept with its encoding, so its id is not reused).
    encoded: dict[int, tuple[object, bytes]] = {}

    def encode(part: EmitSeq | Delta) -> bytes:
        hit = encoded.get(id(part))
        if hit is None or hit[0] is not part:
            hit = encoded[id(part)] = (part, msgpack.packb(part.pack(), use_bin_type=True))
        return hit[1]

    for row in rows:
        # Exactly the bytes of packb(row.pack()): a 4-array header, then its items.
        hasher.update(_ROW_HEADER)
        hasher.update(msgpack.packb(row.sub_id, use_bin_type=True))
        hasher.update(encode(row.emit_seq))
        hasher.update(encode(row.prev_emit_seq))
        hasher.update(encode(row.delta))
        count += 1
    return count, hasher.intdigest()


_DIGESTS_KEPT: Final = 16
"""Ranges a replica remembers the digest of (`_digests`): more than a holder pipelines."""

_ROW_HEADER: Final = b"\x94"
"""msgpack's header of a 4-element array (an `OutboxRow.pack()`)."""


_Record = tuple[bytes, int, int]
"""A key's value, version and mod_index. A tuple of atomic values is untracked by
the garbage collector, and so is a dict holding only such tuples: a full collection
skips the bucket's data. With a `KeyRecord` object per key it walked them all (33 ms
for 300k keys on an idle core; full collections of up to 195 ms measured in a loaded
node)."""


class BucketStateMachine:
    """One bucket's replicated state: data, producers, subscriptions, outbox, epoch, lease."""

    def __init__(
        self, bucket_uuid: str, *, planner: Planner = plan_query, epoch_counter: int = 1
    ) -> None:
        self._bucket_uuid = bucket_uuid
        self._planner = planner
        self._epoch_counter = epoch_counter
        self._applied_index = 0
        self._outboxed_through = 0
        self._lease_holder = ""
        self._lease_index = 0
        self._data: dict[str, _Record] = {}
        self._producers: dict[int, _Producer] = {}
        self._subs: dict[str, Subscription] = {}
        self._expired: dict[str, str] = {}
        """Expired subscriptions remembered, oldest first: sub_id -> owner (so their
        Reconnect is STALE_SEQUENCE); at most EXPIRED_REMEMBERED_MAX."""
        self._owned: dict[str, int] = {}
        self._uncommitted = 0
        """How many subscriptions read uncommitted (derived; not in snapshots)."""
        """principal -> how many subscriptions it has here (derived; not in snapshots)."""
        self._durable: dict[tuple[str, str], str] = {}
        """(principal, durable name) -> sub_id of the live subscription of that name
        (derived from the subscriptions' names; snapshots carry the names)."""
        self._pending: deque[_PendingBatch] = deque()
        self._digests: dict[tuple[int, int], tuple[int, int]] = {}
        """(from, through) -> (count, digest) of the ranges this replica proposed, so
        that applying its own OUTBOX_WRITE does not compute the digest again: the rows
        of a range cannot change between the two (only an OUTBOX_WRITE removes pending
        rows, and one for another range makes this one STALE_RANGE or a no-op). Not
        state: never in a snapshot or a digest."""
        self._queries = QueryIndex()
        """The live subscriptions by what their queries match."""
        self._history: deque[RetainedChange] = deque()
        """The retained history: every change set committed after `_history_after`,
        oldest first (docs/core.md, "Retained history"). HISTORY_TRIM drops its head."""
        self._history_bytes = 0
        """Its keys' and values' bytes (derived)."""
        self._history_after = EmitSeq(bucket_uuid, epoch_counter, 0)
        """The oldest position it reaches back to: everything after it is retained."""
        self._history_after_ms = 0
        """Commit time of the newest change set dropped (0: none ever was)."""
        self.groups = GroupTable()
        """The consumer groups' members and owners here (outbox/groups.py)."""
        self._txns = TxnState()
        """Transactions coordinated here and pending writes of those writing here
        (outbox/txn.py)."""

    # ---- identity and positions ------------------------------------------------

    @property
    def bucket_uuid(self) -> str:
        return self._bucket_uuid

    @property
    def epoch(self) -> EpochId:
        return EpochId(self._bucket_uuid, self._epoch_counter)

    @property
    def applied_index(self) -> int:
        return self._applied_index

    @property
    def outboxed_through(self) -> int:
        """Every source entry at or below this index has had its rows outboxed."""
        return self._outboxed_through

    @property
    def lease_holder(self) -> str:
        return self._lease_holder

    @property
    def lease_index(self) -> int:
        """Commit index of the LEASE entry in force (0: none yet)."""
        return self._lease_index

    def emit_seq(self, commit_index: int) -> EmitSeq:
        return EmitSeq(self._bucket_uuid, self._epoch_counter, commit_index)

    # ---- apply -----------------------------------------------------------------

    def apply(self, commit_index: int, data: bytes) -> Applied:
        """Decode and apply one committed entry.

        Raises `EntryError` (malformed/unknown: nothing changed), `PlanMismatch`
        (this replica diverged: nothing changed, quarantine it) or
        `ApplyOrderError` (the caller broke the apply order).
        """
        self._check_order(commit_index)
        return self.apply_entry(commit_index, decode_entry(data))

    def apply_entry(self, commit_index: int, entry: Entry) -> Applied:
        self._check_order(commit_index)
        effects: list[Effect] = []
        result: Result
        if isinstance(entry, Write):
            commit = self.emit_seq(commit_index)
            result, changes = self._apply_write(commit, entry)
            self._emit_rows(commit, changes, entry.now_ms, effects)
        elif isinstance(entry, WriteBatch):
            commit = self.emit_seq(commit_index)
            results, changes = [], []
            for write in entry.writes:
                one, some = self._apply_write(commit, write)
                results.append(one)
                changes.extend(some)
            self._emit_rows(commit, changes, entry.writes[-1].now_ms, effects)
            result = WriteBatchResult(tuple(results))
        elif isinstance(entry, Subscribe):
            result = self._apply_subscribe(commit_index, entry, effects)
        elif isinstance(entry, SubscribeBatch):
            result = self._apply_subscribe_batch(commit_index, entry, effects)
        elif isinstance(entry, Unsubscribe):
            result = self._apply_unsubscribe(entry, effects)
        elif isinstance(entry, OutboxWrite):
            result = self._apply_outbox_write(commit_index, entry, effects)
        elif isinstance(entry, OutboxPurge):
            result = self._apply_purge(entry, effects)
        elif isinstance(entry, EpochCreate):
            result = self._apply_epoch(entry, effects)
        elif isinstance(entry, Lease):
            self._lease_holder, self._lease_index = entry.holder, commit_index
            effects.append(LeaseChanged(entry.holder, commit_index))
            result = LeaseResult(entry.holder, commit_index)
        elif isinstance(entry, HistoryTrim):
            result = self._apply_history_trim(commit_index, entry)
        elif isinstance(entry, GroupBeat):
            result = self.groups.apply(entry)
        elif isinstance(entry, Txn):
            result = self._apply_txn(commit_index, entry, effects)
        elif isinstance(entry, TxnWrite):
            result = self._txns.write(entry, self._version_of, self.check_ack)
            if self._uncommitted and result.error is None:
                self._emit_uncommitted(commit_index, entry, effects)
        else:
            result = self._apply_init_producer(entry)
        self._applied_index = commit_index
        return Applied(commit_index, result, tuple(effects))

    def _check_order(self, commit_index: int) -> None:
        if isinstance(commit_index, bool) or not isinstance(commit_index, int):
            raise ApplyOrderError(f"commit_index must be an int, got {commit_index!r}")
        if commit_index <= self._applied_index:
            raise ApplyOrderError(
                f"commit_index {commit_index} not after applied index {self._applied_index}"
            )

    # ---- WRITE -----------------------------------------------------------------

    def _apply_write(self, commit: EmitSeq, entry: Write) -> tuple[WriteResult, list[Change]]:
        """Apply one write committed at `commit`; returns its result and the changes it
        made (none if refused)."""
        producer = None
        if entry.producer is not None:
            ref = entry.producer
            producer = self._producers.get(ref.producer_id)
            if producer is None:
                return _refused(
                    commit,
                    error=_reject(
                        ErrorCode.UNKNOWN_PRODUCER,
                        f"producer {ref.producer_id} is not initialised in this bucket",
                    ),
                )
            if producer.owner and entry.principal != producer.owner:
                return _refused(commit, error=_not_owner(ref.producer_id, entry.principal))
            if ref.epoch < producer.epoch:
                return _refused(
                    commit,
                    error=_reject(
                        ErrorCode.PRODUCER_FENCED,
                        f"producer {ref.producer_id} epoch {ref.epoch} is fenced by epoch "
                        f"{producer.epoch}",
                    ),
                )
            if ref.epoch > producer.epoch:
                return _refused(
                    commit,
                    error=_reject(
                        ErrorCode.INVALID_PRODUCER_EPOCH,
                        f"producer {ref.producer_id} epoch {ref.epoch} was never granted "
                        f"(current {producer.epoch})",
                    ),
                )
            if ref.sequence <= producer.last_seq:
                back = producer.last_seq - ref.sequence
                original = producer.results.original(back, self._bucket_uuid, entry)
                if original is not None:
                    producer.last_active_ms = max(producer.last_active_ms, entry.now_ms)
                    return original, []
                return _refused(
                    commit,
                    error=_reject(
                        ErrorCode.DUPLICATE_SEQUENCE,
                        f"sequence {ref.sequence} was committed before and is older than the "
                        f"last {limits.PRODUCER_RESULTS_CACHED} results kept",
                    ),
                )
            if ref.sequence != producer.last_seq + 1:
                return _refused(
                    commit,
                    error=_reject(
                        ErrorCode.OUT_OF_ORDER_SEQUENCE,
                        f"sequence {ref.sequence} skips ahead; expected {producer.last_seq + 1}",
                    ),
                )
        result, changes = self._write_ops(commit, entry)
        if producer is not None and entry.producer is not None:
            producer.last_seq = entry.producer.sequence
            producer.results.add(result)
            producer.last_active_ms = max(producer.last_active_ms, entry.now_ms)
        return result, changes

    def _version_of(self, key: str) -> int | None:
        record = self._data.get(key)
        return None if record is None else record[1]

    def _emit_uncommitted(self, index: int, entry: TxnWrite, effects: list[Effect]) -> None:
        """Rows of a transactional write for the subscriptions reading uncommitted (and
        for no one else, nor for the retained history: it is not committed). Its
        changes carry version 0: the versions are set at the COMMIT marker."""
        changes = tuple(Change(op.key, op.kind, op.value, 0) for op in entry.ops)
        commit = self.emit_seq(index)
        tag = TxnTag(entry.txn_id, entry.epoch, entry.number, committed=False)
        rows = self._rows_for(commit, changes, entry.now_ms, Isolation.READ_UNCOMMITTED, tag)
        if rows:
            self._pending.append(_PendingBatch(index, rows))
            effects.append(RowsPending(rows))

    def _apply_txn(self, index: int, entry: Txn, effects: list[Effect]) -> TxnResult:
        """A TXN entry (outbox/txn.py); a COMMIT marker applies the transaction's
        pending writes here, as one change set at the marker's position."""
        if entry.coordinator_side:
            return self._txns.apply(entry)
        if entry.action is TxnAction.JOIN:
            return self._txns.join(entry)
        if entry.action is TxnAction.PREPARE:
            return self._txns.prepare(entry)
        result, ops, acks = self._txns.mark(entry)
        if ops:
            commit = self.emit_seq(index)
            changes = self._set_ops(index, ops)[0]
            tag = TxnTag(entry.txn_id, entry.epoch, entry.number, committed=True)
            self._emit_rows(commit, changes, entry.now_ms, effects, Isolation.READ_COMMITTED, tag)
        purged: list[OutboxRow] = []
        for ack in acks:  # consumed input commits with the output (if still ahead)
            if self.check_ack(ack.sub_id, ack.principal, ack.up_to).status is AckStatus.ACCEPTED:
                purged.extend(self._purge(ack, entry.now_ms))
        if purged:
            readers = uncommitted_readers(purged, self._subs) if self._uncommitted else frozenset()
            effects.insert(0, RowsPurged(tuple(purged), entry.now_ms, readers))
        return result

    @property
    def txns(self) -> TxnState:
        """The bucket's transactions (read-only: change them only through entries)."""
        return self._txns

    def _write_ops(self, commit: EmitSeq, entry: Write) -> tuple[WriteResult, list[Change]]:
        index = commit.commit_index
        for op in entry.ops:
            expected = op.expected
            if expected.kind is ExpectKind.ANY:
                continue
            current = self._data.get(op.key)
            if expected.kind is ExpectKind.NOT_EXISTS and current is None:
                continue
            version = 0 if current is None else current[1]
            if expected.kind is ExpectKind.EXACT and version == expected.version:
                continue  # (a version is >= 1; 0 means absent)
            actual = "absent" if current is None else f"at version {version}"
            return _refused(
                commit,
                error=_reject(
                    ErrorCode.PRECONDITION_FAILED,
                    f"key {op.key!r} expected {expected} but is {actual}",
                ),
            )
        changes, versions = self._set_ops(index, entry.ops)
        return WriteResult(commit, tuple(versions)), changes

    def _set_ops(
        self, index: int, ops: tuple[Op, ...]
    ) -> tuple[list[Change], list[tuple[str, int]]]:
        """Apply `ops` (preconditions already checked) at log index `index`: the
        changes made and each op's key and resulting version (0: deleted)."""
        changes: list[Change] = []
        versions: list[tuple[str, int]] = []
        for op in ops:
            current = self._data.get(op.key)
            if op.kind is OpKind.SET:
                version = 1 if current is None else current[1] + 1
                self._data[op.key] = (op.value, version, index)
                changes.append(Change(op.key, OpKind.SET, op.value, version))
                versions.append((op.key, version))
            else:
                versions.append((op.key, 0))
                if current is not None:
                    del self._data[op.key]
                    changes.append(Change(op.key, OpKind.DEL, b"", current[1]))
        return changes, versions

    def _emit_rows(
        self,
        commit: EmitSeq,
        changes: list[Change],
        now_ms: int,
        effects: list[Effect],
        only: Isolation | None = None,
        txn: TxnTag | None = None,
    ) -> None:
        made = tuple(changes)
        if made:
            size = delta_bytes(made)
            self._history.append(RetainedChange(commit, now_ms, made, size))
            self._history_bytes += size
        rows = self._rows_for(commit, made, now_ms, only, txn)
        if rows:
            self._pending.append(_PendingBatch(commit.commit_index, rows))
            effects.append(RowsPending(rows))

    def _rows_for(
        self,
        commit: EmitSeq,
        changes: tuple[Change, ...],
        now_ms: int,
        only: Isolation | None = None,
        txn: TxnTag | None = None,
    ) -> tuple[OutboxRow, ...]:
        """One row per live subscription that any change matches (of isolation level
        `only`, if given: a COMMIT marker's changes go to those reading committed, a
        transactional write's to those reading uncommitted), in sub_id order; each
        joins its subscription's outbox."""
        if not changes or not self._subs:
            return ()
        keep = None
        if only is not None and self._uncommitted:
            subs = self._subs

            def keep(sub_id: str) -> bool:
                return subs[sub_id].isolation is only

        if len(changes) == 1:  # the common case: every matching sub gets the one delta
            return self._rows_of_one(commit, changes, now_ms, keep, txn)
        return self._rows_matched(commit, changes, now_ms, keep, txn)

    def _rows_matched(
        self,
        commit: EmitSeq,
        changes: tuple[Change, ...],
        now_ms: int,
        keep: Callable[[str], bool] | None = None,
        txn: TxnTag | None = None,
    ) -> tuple[OutboxRow, ...]:
        matched: dict[str, list[int]] = {}
        for i, change in enumerate(changes):
            for sub_id in self._queries.matching(change.key):
                if keep is None or keep(sub_id):
                    matched.setdefault(sub_id, []).append(i)
        deltas: dict[tuple[int, ...], Delta] = {}
        rows = []
        for sub_id in sorted(matched):
            picked = tuple(matched[sub_id])
            delta = deltas.get(picked)
            if delta is None:
                mine = tuple(changes[i] for i in picked)
                delta = deltas[picked] = Delta(mine, now_ms, delta_bytes(mine), txn)
            sub = self._subs[sub_id]
            row = OutboxRow(sub_id, commit, sub.head, delta)
            rows.append(row)
            sub.rows.append(row)
            sub.head = commit
        return tuple(rows)

    def _rows_of_one(
        self,
        commit: EmitSeq,
        changes: tuple[Change, ...],
        now_ms: int,
        keep: Callable[[str], bool] | None = None,
        txn: TxnTag | None = None,
    ) -> tuple[OutboxRow, ...]:
        """`_rows_for` of a single change: the same rows, without the per-sub bookkeeping."""
        hits = self._queries.matching(changes[0].key)
        if keep is not None:
            hits = {sub_id for sub_id in hits if keep(sub_id)}
        if not hits:
            return ()
        delta = Delta(changes, now_ms, delta_bytes(changes), txn)
        subs = self._subs
        rows = []
        for sub_id in sorted(hits):
            sub = subs[sub_id]
            row = OutboxRow(sub_id, commit, sub.head, delta)
            rows.append(row)
            sub.rows.append(row)
            sub.head = commit
        return tuple(rows)

    # ---- producers -------------------------------------------------------------

    def _apply_init_producer(self, entry: InitProducer) -> InitProducerResult:
        producer = self._producers.get(entry.producer_id)
        if producer is not None and producer.owner and entry.principal != producer.owner:
            # Someone else's producer: re-initialising it would fence its owner.
            return InitProducerResult(
                entry.producer_id, producer.epoch, _not_owner(entry.producer_id, entry.principal)
            )
        if producer is None:
            if len(self._producers) >= limits.PRODUCERS_PER_BUCKET_MAX:
                return InitProducerResult(
                    entry.producer_id,
                    error=_reject(
                        ErrorCode.LIMIT_EXCEEDED,
                        f"bucket already tracks {limits.PRODUCERS_PER_BUCKET_MAX} producers",
                    ),
                )
            self._producers[entry.producer_id] = _Producer(0, entry.now_ms, owner=entry.principal)
            return InitProducerResult(entry.producer_id, 0)
        self._producers[entry.producer_id] = _Producer(
            producer.epoch + 1, entry.now_ms, owner=entry.principal
        )
        return InitProducerResult(entry.producer_id, producer.epoch + 1)

    def idle_producers(self, now_ms: int, idle_ms: int) -> tuple[int, ...]:
        """Producers that wrote nothing for longer than `idle_ms` (in id order): what
        an OUTBOX_PURGE may forget (`expire_producers`)."""
        return tuple(
            sorted(pid for pid, p in self._producers.items() if now_ms - p.last_active_ms > idle_ms)
        )

    def producer_count(self) -> int:
        return len(self._producers)

    # ---- subscriptions ---------------------------------------------------------

    def _apply_subscribe(
        self, index: int, entry: Subscribe, effects: list[Effect]
    ) -> SubscribeResult:
        named = self._durable.get((entry.principal, entry.durable)) if entry.durable else None
        existing = self._subs.get(named or entry.sub_id)
        if existing is not None:
            if existing.principal != entry.principal:
                return SubscribeResult(
                    entry.sub_id,
                    error=_reject(
                        ErrorCode.NOT_OWNER,
                        f"subscription {entry.sub_id} belongs to another principal",
                    ),
                )
            if existing.durable != entry.durable:
                return SubscribeResult(
                    entry.sub_id,
                    error=_reject(
                        ErrorCode.SUBSCRIPTION_EXISTS,
                        f"subscription {entry.sub_id} exists "
                        + (f"as durable {existing.durable!r}" if existing.durable else "unnamed")
                        + (f", not as durable {entry.durable!r}" if entry.durable else ""),
                    ),
                )
            if existing.query != entry.query or existing.isolation is not entry.isolation:
                what = f"durable {entry.durable!r}" if entry.durable else entry.sub_id
                return SubscribeResult(
                    entry.sub_id,
                    error=_reject(
                        ErrorCode.SUBSCRIPTION_EXISTS,
                        f"subscription {what} exists with query {existing.query} "
                        f"({existing.isolation.name.lower()})",
                    ),
                )
            return SubscribeResult(
                existing.sub_id,
                existing.start,
                existing.plan.plan_hash,
                existing=True,
                acked=existing.acked,
            )
        plan = self._planner(entry.query)
        if plan.plan_hash != entry.plan_hash:
            raise PlanMismatch(
                f"SUBSCRIBE {entry.sub_id} at {index}: plan_hash {entry.plan_hash:#x} committed, "
                f"this replica planned {plan.plan_hash:#x}"
            )
        if len(self._subs) >= limits.SUBSCRIPTIONS_PER_BUCKET_MAX:
            return SubscribeResult(
                entry.sub_id,
                error=_reject(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"bucket already has {limits.SUBSCRIPTIONS_PER_BUCKET_MAX} subscriptions",
                ),
            )
        start = self._start_at(index, entry.start)
        if isinstance(start, Rejection):
            return SubscribeResult(entry.sub_id, error=start)
        sub = Subscription(
            entry.sub_id,
            entry.principal,
            entry.query,
            plan,
            start,
            start,
            start,
            entry.now_ms,
            durable=entry.durable,
            born=index,
            isolation=entry.isolation,
        )
        self._expired.pop(entry.sub_id, None)  # a new incarnation of an expired sub_id
        self._add_sub(sub)
        if start.commit_index < index:
            self._replay(index, sub, effects)
        return SubscribeResult(entry.sub_id, start, plan.plan_hash, acked=start)

    def _start_at(self, index: int, start: Start) -> EmitSeq | Rejection:
        """Where a new subscription's stream starts (docs/core.md, "Start positions"),
        or why it cannot."""
        if start.kind is StartKind.LATEST:
            return self.emit_seq(index)
        if start.kind is StartKind.EARLIEST:
            return self._history_after
        if start.kind is StartKind.TIME:
            if self._history_after.commit_index and start.time_ms <= self._history_after_ms:
                return _reject(
                    ErrorCode.STALE_SEQUENCE,
                    f"changes from {start.time_ms} ms on are no longer retained (the history "
                    f"reaches back to {self._history_after}, committed at "
                    f"{self._history_after_ms} ms)",
                )
            before = self._history_after
            for kept in self._history:
                if kept.commit_time_ms >= start.time_ms:
                    break
                before = kept.emit_seq
            return before
        after = start.after
        assert after is not None
        if after.bucket_uuid != self._bucket_uuid or after >= self.emit_seq(index):
            return _reject(
                ErrorCode.INVALID_ARGUMENT,
                f"start position {after} is not one of this bucket's log "
                f"({self._bucket_uuid}, applied through {self._applied_index})",
            )
        if after < self._history_after:
            return _reject(
                ErrorCode.STALE_SEQUENCE,
                f"start position {after} is older than the retained history (it reaches "
                f"back to {self._history_after})",
            )
        return after

    def _replay(self, index: int, sub: Subscription, effects: list[Effect]) -> None:
        """A subscription starting in the past gets a row for each retained change set
        after its start that its query matches, as if it had been subscribed then. They
        are pending a checkpoint, as rows computed at `index` (the SUBSCRIBE's)."""
        rows = []
        matches = sub.plan.matches
        for kept in self._history:
            if kept.emit_seq <= sub.start:
                continue
            mine = tuple(c for c in kept.changes if matches(c.key))
            if mine:
                delta = Delta(mine, kept.commit_time_ms, delta_bytes(mine))
                row = OutboxRow(sub.sub_id, kept.emit_seq, sub.head, delta)
                rows.append(row)
                sub.rows.append(row)
                sub.head = kept.emit_seq
        if rows:
            self._pending.append(_PendingBatch(index, tuple(rows)))
            effects.append(RowsPending(tuple(rows)))

    def _apply_history_trim(self, index: int, entry: HistoryTrim) -> HistoryTrimResult:
        dropped = 0
        through = min(entry.through_index, index)
        while self._history and self._history[0].emit_seq.commit_index <= through:
            gone = self._history.popleft()
            self._history_bytes -= gone.size_bytes
            self._history_after, self._history_after_ms = gone.emit_seq, gone.commit_time_ms
            dropped += 1
        return HistoryTrimResult(dropped, self._history_after)

    @property
    def history_after(self) -> EmitSeq:
        """The oldest position the retained history reaches back to."""
        return self._history_after

    def history_size(self) -> tuple[int, int]:
        """(change sets, bytes) retained."""
        return len(self._history), self._history_bytes

    def retained(self) -> Sequence[RetainedChange]:
        """The retained history, oldest first (read-only: do not change it)."""
        return self._history

    def history_page(
        self, plan: Plan, after: EmitSeq | None, through: int | None, limit: int
    ) -> HistoryPage:
        """Up to `limit` (clamped as Sync's) retained change sets after `after` (None:
        the oldest retained) and at or below log index `through` (None: all), each
        with the changes `plan` matches. Raises `StaleSequence` for a position older
        than the history reaches, `InvalidArgument` for one not of this bucket."""
        limit = min(limit if limit > 0 else limits.SYNC_LIMIT_DEFAULT, limits.SYNC_LIMIT_MAX)
        start = self._history_after if after is None else after
        if start.bucket_uuid != self._bucket_uuid:
            raise InvalidArgument(f"{start} is not a position of bucket {self._bucket_uuid}")
        if start < self._history_after:
            raise StaleSequence(
                f"{start} is older than the retained history (it reaches back to "
                f"{self._history_after}); read the current state with Sync instead"
            )
        events: list[RetainedChange] = []
        last, more = start, False
        for kept in self._history:
            if kept.emit_seq <= start:
                continue
            if through is not None and kept.emit_seq.commit_index > through:
                break
            if len(events) == limit:
                more = True
                break
            last = kept.emit_seq
            mine = tuple(c for c in kept.changes if plan.matches(c.key))
            if mine:
                events.append(kept._replace(changes=mine, size_bytes=delta_bytes(mine)))
        return HistoryPage(tuple(events), more, last, self._history_after)

    def _add_sub(self, sub: Subscription) -> None:
        self._subs[sub.sub_id] = sub
        self._queries.add(sub.sub_id, sub.plan)
        self._owned[sub.principal] = self._owned.get(sub.principal, 0) + 1
        self._uncommitted += sub.isolation is Isolation.READ_UNCOMMITTED
        if sub.durable:
            self._durable[sub.principal, sub.durable] = sub.sub_id

    def durable_sub_id(self, principal: str, name: str) -> str | None:
        """The live subscription `principal` named `name`, if any."""
        return self._durable.get((principal, name))

    def _remove_sub(self, sub: Subscription, *, expired: bool = False) -> None:
        """Delete a subscription: its rows go with it, checkpointed or not (no holder
        sends one again, in either emission mode), and its slot is free. Those not yet
        checkpointed stay in the pending batches only for the OUTBOX_WRITE's digest,
        which covers them, and are dropped when it applies. An `expired` one is
        remembered (bounded), so that its Reconnect is STALE_SEQUENCE."""
        self._queries.remove(sub.sub_id, sub.plan)
        del self._subs[sub.sub_id]
        self._uncommitted -= sub.isolation is Isolation.READ_UNCOMMITTED
        if sub.durable:
            del self._durable[sub.principal, sub.durable]
        left = self._owned[sub.principal] - 1
        if left:
            self._owned[sub.principal] = left
        else:
            del self._owned[sub.principal]
        if expired:
            self._expired.pop(sub.sub_id, None)
            self._expired[sub.sub_id] = sub.principal
            while len(self._expired) > limits.EXPIRED_REMEMBERED_MAX:
                del self._expired[next(iter(self._expired))]

    def subscription_count(self, principal: str | None = None) -> int:
        """Live subscriptions here (of `principal`, if given)."""
        if principal is None:
            return len(self._subs)
        return self._owned.get(principal, 0)

    def _apply_subscribe_batch(
        self, index: int, entry: SubscribeBatch, effects: list[Effect]
    ) -> SubscribeBatchResult:
        """Each SUBSCRIBE in order, as if each were an entry of its own at `index`. Every
        new subscription's plan is checked first: a divergence raises `PlanMismatch`
        before anything changed (the replica quarantines itself)."""
        seen: set[str] = set()
        for subscribe in entry.subscribes:
            if subscribe.sub_id not in self._subs and subscribe.sub_id not in seen:
                plan = self._planner(subscribe.query)
                if plan.plan_hash != subscribe.plan_hash:
                    raise PlanMismatch(
                        f"SUBSCRIBE_BATCH at {index}, {subscribe.sub_id}: plan_hash "
                        f"{subscribe.plan_hash:#x} committed, this replica planned "
                        f"{plan.plan_hash:#x}"
                    )
            seen.add(subscribe.sub_id)
        return SubscribeBatchResult(
            tuple(
                self._apply_subscribe(index, subscribe, effects) for subscribe in entry.subscribes
            )
        )

    def _apply_unsubscribe(self, entry: Unsubscribe, effects: list[Effect]) -> UnsubscribeResult:
        sub = self._subs.get(entry.sub_id)
        if sub is None:
            return UnsubscribeResult(
                entry.sub_id,
                _reject(ErrorCode.SUBSCRIPTION_NOT_FOUND, f"no subscription {entry.sub_id}"),
            )
        if sub.principal != entry.principal:
            return UnsubscribeResult(
                entry.sub_id,
                _reject(
                    ErrorCode.NOT_OWNER, f"subscription {entry.sub_id} belongs to another principal"
                ),
            )
        # Its rows not yet checkpointed stay in the pending batches (digests already
        # proposed cover them); it is no longer there to send them to.
        self._remove_sub(sub)
        effects.append(SubscriptionClosed(entry.sub_id, CloseReason.UNSUBSCRIBED))
        return UnsubscribeResult(entry.sub_id)

    # ---- outbox ----------------------------------------------------------------

    def _lease_error(self, lease_index: int) -> Rejection | None:
        if self._lease_index == 0 or lease_index != self._lease_index:
            return _reject(
                ErrorCode.STALE_LEASE,
                f"proposed under lease {lease_index}; the lease in force is "
                f"{self._lease_index} ({self._lease_holder or 'none'})",
            )
        return None

    def pending_rows(
        self, through_index: int | None = None, after: int = 0
    ) -> tuple[OutboxRow, ...]:
        """Rows computed and not yet checkpointed by an OUTBOX_WRITE (acknowledged or
        not), optionally only those of source indexes in (after, through_index]."""
        return tuple(
            row
            for batch in self._pending
            if batch.commit_index > after
            and (through_index is None or batch.commit_index <= through_index)
            for row in batch.rows
        )

    def propose_outbox_write(
        self, lease_index: int, now_ms: int, after: int = 0
    ) -> OutboxWrite | None:
        """The OUTBOX_WRITE a lease holder should propose now, or None if nothing waits:
        the count and digest of every row computed since the last one.

        `after` pipelines: the through index of the holder's newest OUTBOX_WRITE still
        in flight. The entry then covers only the rows after it, and applies only if
        that one committed first (its range starts where that one ends; otherwise it
        is rejected with STALE_RANGE and changes nothing)."""
        start = max(after, self._outboxed_through)
        if not self._pending or self._pending[-1].commit_index <= start:
            return None
        count, digest = rows_digest(self.pending_rows(after=start))
        if len(self._digests) >= _DIGESTS_KEPT:
            self._digests.pop(next(iter(self._digests)))
        self._digests[(start, self._applied_index)] = (count, digest)
        return OutboxWrite(lease_index, start, self._applied_index, count, digest, now_ms)

    def _apply_outbox_write(
        self, index: int, entry: OutboxWrite, effects: list[Effect]
    ) -> OutboxWriteResult:
        error = self._lease_error(entry.lease_index)
        if error is not None:
            return OutboxWriteResult(error=error)
        if entry.through_index <= self._outboxed_through:
            return OutboxWriteResult(already=True)
        if entry.from_index != self._outboxed_through:
            return OutboxWriteResult(
                error=_reject(
                    ErrorCode.STALE_RANGE,
                    f"range starts after {entry.from_index}; outboxed through "
                    f"{self._outboxed_through}",
                )
            )
        if entry.through_index >= index:
            return OutboxWriteResult(
                error=_reject(
                    ErrorCode.INVALID_ARGUMENT,
                    f"range ends at {entry.through_index}, not before its own index {index}",
                )
            )
        moving = self.pending_rows(entry.through_index)
        known = self._digests.pop((entry.from_index, entry.through_index), None)
        count, digest = rows_digest(moving) if known is None else known
        if (count, digest) != (entry.row_count, entry.digest):
            raise PlanMismatch(
                f"OUTBOX_WRITE at {index} for ({entry.from_index}, {entry.through_index}]: "
                f"committed {entry.row_count} rows digest {entry.digest:#x}, this replica "
                f"computed {count} rows digest {digest:#x}"
            )
        live = []
        while self._pending and self._pending[0].commit_index <= entry.through_index:
            batch = self._pending.popleft()
            for row in batch.rows:
                sub = self._subs.get(row.sub_id)
                # A row computed before the subscription's SUBSCRIBE applied was an
                # earlier incarnation's of a reused sub_id (UNSUBSCRIBE, then SUBSCRIBE
                # again): it is not on this stream's chain.
                if sub is not None and batch.commit_index >= sub.born:
                    live.append(row)
        self._outboxed_through = entry.through_index
        if live:
            effects.append(RowsOutboxed(tuple(live)))
        return OutboxWriteResult(rows=len(live))

    def check_ack(self, sub_id: str, principal: str, up_to: EmitSeq) -> AckOutcome:
        """Would this cumulative ack be accepted now? (The notifier asks before proposing.)"""
        sub = self._subs.get(sub_id)
        owner = sub.principal if sub is not None else self._expired.get(sub_id)
        if owner is None:
            return AckOutcome(sub_id, AckStatus.SUBSCRIPTION_NOT_FOUND, f"no subscription {sub_id}")
        if owner != principal:
            return AckOutcome(
                sub_id, AckStatus.NOT_OWNER, f"subscription {sub_id} belongs to another principal"
            )
        if sub is None:
            return AckOutcome(
                sub_id,
                AckStatus.STALE,
                f"subscription {sub_id} expired (idle past the stall window); resubscribe",
            )
        if up_to.bucket_uuid != self._bucket_uuid:
            return AckOutcome(
                sub_id,
                AckStatus.FUTURE,
                f"ack names bucket {up_to.bucket_uuid}, not {self._bucket_uuid}",
            )
        if up_to < sub.acked:
            return AckOutcome(
                sub_id, AckStatus.REGRESSIVE, f"ack {up_to} is behind the acknowledged {sub.acked}"
            )
        if up_to == sub.acked:
            return AckOutcome(sub_id, AckStatus.DUPLICATE, f"{up_to} was already acknowledged")
        if up_to > sub.last_row:
            return AckOutcome(
                sub_id,
                AckStatus.FUTURE,
                f"ack {up_to} is beyond the last event computed {sub.last_row}",
            )
        return AckOutcome(sub_id, AckStatus.ACCEPTED)

    def _apply_purge(self, entry: OutboxPurge, effects: list[Effect]) -> PurgeResult:
        error = self._lease_error(entry.lease_index)
        if error is not None:
            return PurgeResult(error=error)
        outcomes = []
        purged: list[OutboxRow] = []
        for ack in entry.acks:
            outcome = self.check_ack(ack.sub_id, ack.principal, ack.up_to)
            outcomes.append(outcome)
            if outcome.status is AckStatus.ACCEPTED:
                purged.extend(self._purge(ack, entry.now_ms))
        readers = uncommitted_readers(purged, self._subs) if self._uncommitted else frozenset()
        now = entry.now_ms
        for sub_id in entry.touch:
            sub = self._subs.get(sub_id)
            # Only acks keep alive one with rows (any computed for it, checkpointed or not).
            if sub is not None and not sub.rows:
                sub.last_active_ms = max(sub.last_active_ms, now)
        expired = []
        # Only the named subscriptions are checked: scanning them all on every purge
        # cost each replica O(subscriptions) 50 times a second.
        for sub_id in entry.expire:
            sub = self._subs.get(sub_id)
            if sub is not None and idle(sub, now, entry.stall_window_ms):
                self._remove_sub(sub, expired=True)  # gone: a repeated sub_id is skipped
                expired.append(sub_id)
                effects.append(SubscriptionClosed(sub_id, CloseReason.STALLED))
        forgotten = []
        for pid in entry.expire_producers:
            producer = self._producers.get(pid)
            if producer is not None and now - producer.last_active_ms > entry.producer_idle_ms:
                del self._producers[pid]
                forgotten.append(pid)
        if purged:
            effects.insert(0, RowsPurged(tuple(purged), now, readers))
        return PurgeResult(
            tuple(outcomes), tuple(expired), len(purged), expired_producers=tuple(forgotten)
        )

    def _purge(self, ack: Ack, now_ms: int) -> list[OutboxRow]:
        sub = self._subs[ack.sub_id]
        removed = []
        while sub.rows and sub.rows[0].emit_seq <= ack.up_to:
            removed.append(sub.rows.popleft())
        sub.acked = ack.up_to
        sub.last_active_ms = now_ms
        return removed

    # ---- epochs ----------------------------------------------------------------

    def _apply_epoch(self, entry: EpochCreate, effects: list[Effect]) -> EpochResult:
        if entry.epoch_counter != self._epoch_counter + 1:
            return EpochResult(
                self.epoch,
                _reject(
                    ErrorCode.STALE_EPOCH,
                    f"EPOCH_CREATE {entry.epoch_counter}; the next epoch is "
                    f"{self._epoch_counter + 1}",
                ),
            )
        self._epoch_counter = entry.epoch_counter
        effects.append(EpochChanged(self.epoch))
        return EpochResult(self.epoch)

    # ---- reads -----------------------------------------------------------------

    def get(self, key: str) -> KeyRecord | None:
        record = self._data.get(key)
        return None if record is None else KeyRecord(*record)

    def __len__(self) -> int:
        return len(self._data)

    def key_range_later(
        self, start: str, end: str, prefix: str, after: str, limit: int
    ) -> Callable[[], tuple[tuple[KeyValue, ...], bool]]:
        """Up to `limit` keys in [`start`, `end`) (`end` "": no bound) starting with
        `prefix` and after `after`, in key order, and whether more follow: as the state
        is now, computed when the returned function is called (in another thread,
        while this one applies on: only the key dict is copied now, ~3 ms per 100k
        keys). The scan is O(keys): no index is kept in key order."""
        data = self._data.copy()

        def make() -> tuple[tuple[KeyValue, ...], bool]:
            wanted = [
                k
                for k in data
                if k.startswith(prefix) and k > after and k >= start and (not end or k < end)
            ]
            keys = heapq.nsmallest(limit + 1, wanted)
            return tuple(KeyValue(k, *data[k]) for k in keys[:limit]), len(keys) > limit

        return make

    def sync_page(self, since_index: int = 0, since_key: str = "", limit: int = 0) -> SyncPage:
        """Current state ordered by (mod_index, key), strictly after the cursor.

        `limit` is clamped to [1, SYNC_LIMIT_MAX]; 0 means SYNC_LIMIT_DEFAULT.
        """
        if limit <= 0:
            limit = limits.SYNC_LIMIT_DEFAULT
        limit = min(limit, limits.SYNC_LIMIT_MAX)
        cursor = (since_index, since_key)
        after = sorted((rec[2], key) for key, rec in self._data.items() if (rec[2], key) > cursor)
        page = after[:limit]
        items = tuple(KeyValue(key, *self._data[key][:2], index) for index, key in page)
        next_index, next_key = page[-1] if page else cursor
        return SyncPage(items, len(after) > limit, next_index, next_key, self._applied_index)

    def subscription(self, sub_id: str) -> Subscription | None:
        return self._subs.get(sub_id)

    def subscriptions(self) -> list[Subscription]:
        return [self._subs[sub_id] for sub_id in sorted(self._subs)]

    def subscriptions_by_id(self) -> Mapping[str, Subscription]:
        """Every live subscription by sub_id, read-only, in no particular order (a
        view, not a copy: for scans that need no order, outbox/lifecycle.py)."""
        return MappingProxyType(self._subs)

    def outbox_rows(
        self, sub_id: str, after: EmitSeq | None = None, through_index: int | None = None
    ) -> tuple[OutboxRow, ...]:
        """A subscription's rows after `after`, in emit_seq order; with
        `through_index`, only those whose source entry is at or below it (a holder in
        the literal emission mode passes `outboxed_through`)."""
        sub = self._subs.get(sub_id)
        if sub is None:
            return ()
        if after is None and through_index is None:
            return tuple(sub.rows)
        # From the newest backwards: a stream usually asks for the few rows after
        # what it sent last, so this costs what it returns (plus, with
        # `through_index`, the rows not checkpointed yet), not the whole outbox.
        newer = []
        for row in reversed(sub.rows):
            if after is not None and row.emit_seq <= after:
                break
            if through_index is None or row.emit_seq.commit_index <= through_index:
                newer.append(row)
        newer.reverse()
        return tuple(newer)

    def outbox_size(self) -> int:
        """Rows kept for any subscription (computed, not yet acknowledged)."""
        return sum(len(sub.rows) for sub in self._subs.values())

    def decide_reconnect(
        self, sub_id: str, principal: str, last_processed: EmitSeq
    ) -> ReconnectDecision:
        """Seed 000 §5.2: OK / STALE_SEQUENCE / INVALID_SEQUENCE / SUBSCRIPTION_NOT_FOUND."""
        sub = self._subs.get(sub_id)
        epoch, nxt = self.epoch, self._applied_index + 1
        owner = sub.principal if sub is not None else self._expired.get(sub_id)
        if owner != principal:
            return ReconnectDecision(
                ReconnectStatus.SUBSCRIPTION_NOT_FOUND,
                epoch,
                nxt,
                message=f"no subscription {sub_id} for this principal",
                not_owner=owner is not None,
            )
        if sub is None:
            return ReconnectDecision(
                ReconnectStatus.STALE_SEQUENCE,
                epoch,
                nxt,
                message="expired: idle past the stall window; resubscribe",
            )
        if last_processed.bucket_uuid != self._bucket_uuid or last_processed < sub.start:
            return ReconnectDecision(
                ReconnectStatus.INVALID_SEQUENCE,
                epoch,
                nxt,
                message=f"{last_processed} is not in this stream",
            )
        if last_processed.commit_index > self._applied_index:
            # Beyond everything applied here. Judged only on current state (the
            # notifier answers BEHIND until its replica has caught up with the log).
            return ReconnectDecision(
                ReconnectStatus.INVALID_SEQUENCE,
                epoch,
                nxt,
                message=f"{last_processed} is beyond anything committed "
                f"(applied through {self._applied_index})",
            )
        if last_processed > sub.head:
            return ReconnectDecision(
                ReconnectStatus.INVALID_SEQUENCE,
                epoch,
                nxt,
                message=f"{last_processed} is ahead of the stream head {sub.head}; reset",
            )
        if last_processed < sub.acked:
            return ReconnectDecision(
                ReconnectStatus.STALE_SEQUENCE,
                epoch,
                nxt,
                message=f"{last_processed} is older than retained history "
                f"(acknowledged through {sub.acked}); resubscribe",
            )
        on_chain = last_processed in (sub.acked, sub.start) or any(
            row.emit_seq == last_processed for row in sub.rows
        )
        if not on_chain:
            return ReconnectDecision(
                ReconnectStatus.INVALID_SEQUENCE,
                epoch,
                nxt,
                message=f"{last_processed} was never emitted to {sub_id}",
            )
        resume = self.outbox_rows(sub_id, last_processed)
        return ReconnectDecision(ReconnectStatus.OK, epoch, last_processed.commit_index + 1, resume)

    def safety_point(
        self,
        now_ms: int,
        stall_window_ms: int = limits.STALL_WINDOW_MS_DEFAULT,
        cold_replica_checkpoint: int | None = None,
        migration_hold_point: int | None = None,
    ) -> int:
        """The highest log index compaction may reach (docs/contract.md §8).

        min(oldest cold replica checkpoint, min active client ack, migration hold
        point), never past what this replica applied. Only a subscription with rows
        to acknowledge that acknowledged within the window holds it: one idle past
        the window holds nothing, even before the OUTBOX_PURGE that deletes it
        commits. A cold replica silent past its window holds nothing either (see
        `outbox.lifecycle.cold_replica_checkpoint`, which computes the argument).
        """
        bounds = [self._applied_index]
        if cold_replica_checkpoint is not None:
            bounds.append(cold_replica_checkpoint)
        if migration_hold_point is not None:
            bounds.append(migration_hold_point)
        bounds.extend(
            sub.acked.commit_index
            for sub in self._subs.values()
            if sub.rows and not idle(sub, now_ms, stall_window_ms)
        )
        return max(0, min(bounds))

    # ---- snapshots -------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Deterministic bytes of the whole state (sorted; no sets or hash order)."""
        return self.snapshot_later()()

    def snapshot_later(self) -> Callable[[], bytes]:
        """`snapshot()` of the state as it is now, made when the returned function is
        called: in another thread, while this one applies on. Only references are
        taken now (the key data is one dict copy, each producer's results one bytes
        copy; records, rows and sequences are immutable): ~10 ms for 300k keys and
        10,000 subscriptions, against ~75 ms when the subscriptions' rows were packed
        here. Sorting and packing are
        left to `make`, which packs item by item rather than in one `packb` (of ~40 MB:
        the GIL held ~60 ms, the tick thread's heartbeats with it); the bytes are
        exactly those of one `packb` of the whole list. Sorting the keys is still one
        call: 3 ms for 300k keys written in order, ~85 ms for 300k random ones."""
        records = self._data.copy()
        producers = [
            (pid, p.epoch, p.last_seq, p.results.packed(), p.last_active_ms)
            + ((p.owner,) if p.owner else ())
            for pid, p in sorted(self._producers.items())
        ]
        subs = [
            (
                s.sub_id,
                s.principal,
                s.query,
                s.plan.plan_hash,
                s.start,
                s.head,
                s.acked,
                s.last_active_ms,
                tuple(s.rows),
                s.durable,
                s.born,
                s.isolation,
            )
            for s in self.subscriptions()
        ]
        pending = [(b.commit_index, b.rows) for b in self._pending]
        expired = [[sub_id, owner] for sub_id, owner in self._expired.items()]
        history = tuple(self._history)
        reaches = [self._history_after.pack(), self._history_after_ms]
        groups = self.groups.pack()
        txns = self._txns.pack() if self._txns else None  # absent: as before transactions
        head = [
            SNAPSHOT_FORMAT_VERSION,
            self._bucket_uuid,
            self._epoch_counter,
            self._applied_index,
            self._outboxed_through,
            self._lease_holder,
            self._lease_index,
        ]

        def make() -> bytes:
            packer = msgpack.Packer(use_bin_type=True, autoreset=False)
            pack = packer.pack
            extra = 2 if txns is not None else 1 if groups else 0
            packer.pack_array_header(len(head) + 7 + extra)
            for item in head:
                pack(item)
            packer.pack_array_header(len(records))
            for key in sorted(records):
                pack((key, *records[key]))
            packer.pack_array_header(len(producers))
            for producer in producers:
                pack(producer)
            packer.pack_array_header(len(subs))
            for sub in subs:
                (
                    sub_id,
                    who,
                    query,
                    plan_hash,
                    start,
                    head_,
                    acked,
                    active,
                    rows,
                    name,
                    born,
                    iso,
                ) = sub
                pack(
                    [
                        sub_id,
                        who,
                        int(query.kind),
                        query.arg,
                        plan_hash,
                        start.pack(),
                        head_.pack(),
                        acked.pack(),
                        active,
                        [row.pack() for row in rows],
                        name,
                        born,
                        # a thirteenth item only for a non-default isolation level
                        *((int(iso),) if iso is not Isolation.READ_COMMITTED else ()),
                    ]
                )
            packer.pack_array_header(len(pending))
            for commit_index, batch in pending:
                pack([commit_index, [row.pack() for row in batch]])
            pack(expired)
            packer.pack_array_header(len(history))
            for kept in history:
                pack(
                    [
                        kept.emit_seq.pack(),
                        kept.commit_time_ms,
                        [change.pack() for change in kept.changes],
                    ]
                )
            pack(reaches)
            if extra:  # a 15th field with consumer groups or transactions (else as before)
                pack(groups)
            if txns is not None:  # a 16th with transactions
                pack(txns)
            return packer.bytes()

        return make

    def digest(self) -> str:
        """xxh64 of the snapshot bytes: equal on every replica that applied the same log."""
        return xxhash.xxh64_hexdigest(self.snapshot())

    @classmethod
    def restore(cls, data: bytes, *, planner: Planner = plan_query) -> BucketStateMachine:
        """The state `snapshot()` made (format 3, or 2 or 1: see SNAPSHOT_FORMAT_VERSION)."""
        try:
            raw = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
            version = raw[0]
        except Exception as exc:
            raise SnapshotError(f"snapshot is not readable: {exc}") from None
        if version not in (1, 2, SNAPSHOT_FORMAT_VERSION) or isinstance(version, bool):
            raise SnapshotError(
                f"snapshot format {version!r}; this build reads 1 to {SNAPSHOT_FORMAT_VERSION}"
            )
        try:
            if len(raw) != {1: 11, 2: 12}.get(version, 14) and not (
                version == 3 and ((len(raw) == 15 and raw[14]) or len(raw) == 16)
            ):
                raise ValueError(f"{len(raw)} fields")
            _, uuid, epoch, applied, outboxed, holder, lease_index, kv, producers, subs = raw[:10]
            pending = raw[10]
            sm = cls(uuid, planner=planner, epoch_counter=epoch)
            sm._applied_index, sm._outboxed_through = applied, outboxed
            sm._lease_holder, sm._lease_index = holder, lease_index
            sm._data = {k: (v, ver, mod) for k, v, ver, mod in kv}
            if version == 1:
                producers, subs, expired = _from_version_1(producers, subs)
            else:
                expired = raw[11]
            if version < 3:  # no durable names, no history before format 3
                subs = [[*sub, "", sub[5][2]] for sub in subs]  # born at its start
                sm._history_after = sm.emit_seq(applied)
                sm._history_after_ms = max(
                    [0, *(p[4] for p in producers), *(sub[8] for sub in subs)]
                )
            else:
                for emit, when, changes in raw[12]:
                    made = tuple(Change(k, OpKind(op), v, ver) for k, op, v, ver in changes)
                    size = delta_bytes(made)
                    sm._history.append(RetainedChange(EmitSeq(*emit), when, made, size))
                    sm._history_bytes += size
                after, sm._history_after_ms = raw[13]
                sm._history_after = EmitSeq(*after)
                if len(raw) >= 15:
                    sm.groups = GroupTable.unpack(raw[14])
                if len(raw) == 16:  # transactions (outbox/txn.py), absent when none
                    sm._txns = TxnState.unpack(raw[15])
                    if not sm._txns:
                        raise ValueError("an empty transaction state is not canonical")
            for pid, p_epoch, last_seq, results, p_active, *owner in producers:
                producer = _Producer(p_epoch, p_active, last_seq, owner=_owner(owner))
                producer.results = ProducerResults.restore(results, last_seq)
                sm._producers[pid] = producer
            for (
                sub_id,
                principal,
                kind,
                arg,
                plan_hash,
                start,
                head,
                acked,
                active,
                rows,
                name,
                born,
                *isolation,
            ) in subs:
                query = Query(QueryKind(kind), arg)
                plan = planner(query)
                if plan.plan_hash != plan_hash:
                    raise PlanMismatch(
                        f"restored subscription {sub_id}: plan_hash "
                        f"{plan_hash:#x}, this replica planned {plan.plan_hash:#x}"
                    )
                sm._add_sub(
                    Subscription(
                        sub_id,
                        principal,
                        query,
                        plan,
                        EmitSeq(*start),
                        EmitSeq(*head),
                        EmitSeq(*acked),
                        active,
                        deque(_unpack_row(r) for r in rows),
                        name,
                        born,
                        _isolation(isolation),
                    )
                )
            sm._expired = {sub_id: owner for sub_id, owner in expired}
            sm._pending = deque(
                _PendingBatch(index, tuple(_unpack_row(r) for r in rows)) for index, rows in pending
            )
            if version == 1:
                _adopt_pending_rows(sm._subs, sm._pending)
        except PlanMismatch:
            raise
        except Exception as exc:
            raise SnapshotError(f"snapshot content is invalid: {exc}") from None
        return sm


def _isolation(rest: list[Any]) -> Isolation:
    """A snapshot's subscription isolation: a thirteenth item, absent for the default."""
    if not rest:
        return Isolation.READ_COMMITTED
    (level,) = rest
    if level != Isolation.READ_UNCOMMITTED or isinstance(level, bool):
        raise ValueError(f"subscription isolation {level!r}")
    return Isolation(level)


def _owner(rest: list[Any]) -> str:
    """A snapshot's producer owner: a sixth field, absent for an unowned producer."""
    if not rest:
        return ""
    (owner,) = rest
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"producer owner {owner!r}")
    return owner


def _from_version_1(
    producers: list[Any], subs: list[Any]
) -> tuple[list[Any], list[Any], list[Any]]:
    """Producers, live subscriptions and expired ones of a format 1 snapshot, in format
    2's shapes. Format 1 kept no time per producer: each is taken as last active at the
    latest time the snapshot holds (a subscription's activity or a row's commit
    time), so none is forgotten before it had `producer_idle_ms` to write again. Its
    stale subscriptions are the expired ones."""
    latest = 0
    live, expired = [], []
    for sub_id, principal, kind, arg, plan_hash, start, head, acked, active, stale, rows in subs:
        latest = max([latest, active, *(row[3][1] for row in rows)])
        if stale:
            expired.append([sub_id, principal])
        else:
            live.append([sub_id, principal, kind, arg, plan_hash, start, head, acked, active, rows])
    return [[*p, latest] for p in producers], live, expired


def _adopt_pending_rows(subs: dict[str, Subscription], pending: deque[_PendingBatch]) -> None:
    """A format-1 state kept rows not yet checkpointed only in the pending batches:
    each joins its live subscription (one newer than the row never: it is a new
    incarnation of the sub_id), as the apply of the row's source entry does now."""
    for batch in pending:
        for row in batch.rows:
            sub = subs.get(row.sub_id)
            if sub is not None and row.emit_seq > sub.start:
                sub.rows.append(row)


def _unpack_row(raw: Any) -> OutboxRow:
    sub_id, emit, prev, (changes, commit_time, *txn) = raw
    made = tuple(Change(k, OpKind(op), v, ver) for k, op, v, ver in changes)
    tag = TxnTag(*txn[0]) if txn else None  # a third item: a transaction's (outbox/txn.py)
    return OutboxRow(sub_id, EmitSeq(*emit), EmitSeq(*prev), Delta(made, commit_time, txn=tag))
