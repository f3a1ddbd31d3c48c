"""The bucket state machine: pure, deterministic, no I/O, no clock, no randomness.

`apply(commit_index, entry_bytes)` is the only way state changes. Time and ids
arrive inside entries (put there by the proposing adapter), so every replica and
every replay computes byte-identical state (`digest()`), rows and results. That
includes lifecycles: a subscription or producer idle past its window is deleted by
an entry that names it, judged against the time that entry carries
(docs/core.md, lifecycles).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgpack
import xxhash

from . import limits
from .emitseq import EmitSeq, EpochId
from .entries import (
    Entry,
    EpochCreate,
    HistoryTrim,
    InitProducer,
    Isolation,
    Lease,
    OutboxPurge,
    OutboxWrite,
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
    PlanMismatch,
    Rejection,
    SnapshotError,
)
from .groups import GroupBeat, GroupTable
from .history import History
from .lifecycle import idle
from .model import (
    AckStatus,
    Applied,
    Change,
    CloseReason,
    Delta,
    Effect,
    EpochChanged,
    EpochResult,
    KeyRecord,
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
from .pending import PendingRows, rows_digest
from .producers import Producer, ProducerTable
from .query import Plan, Planner, Query, plan_query
from .store import KeyStore
from .subscriptions import Subscription, SubscriptionTable
from .txn import TxnState, uncommitted_readers

__all__ = ["BucketStateMachine", "Subscription", "rows_digest"]

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


def _check_order(commit_index: int, applied: int) -> None:
    if isinstance(commit_index, bool) or not isinstance(commit_index, int):
        raise ApplyOrderError(f"commit_index must be an int, got {commit_index!r}")
    if commit_index <= applied:
        raise ApplyOrderError(f"commit_index {commit_index} not after applied index {applied}")


def _refused(commit: EmitSeq, error: Rejection) -> tuple[WriteResult, list[Change]]:
    return WriteResult(commit, error=error), []


def _stale_lease(proposed: int, in_force: int, holder: str) -> Rejection | None:
    """Why an entry proposed under lease `proposed` may not apply, if it may not."""
    if in_force == 0 or proposed != in_force:
        return Rejection(
            ErrorCode.STALE_LEASE,
            f"proposed under lease {proposed}; the lease in force is "
            f"{in_force} ({holder or 'none'})",
        )
    return None


class BucketStateMachine:
    """One bucket's replicated state: its positions (epoch, lease, applied index) and
    its parts - keys (`store`), producers, subscriptions (`subs`), rows waiting for a
    checkpoint (`pending`), retained history, consumer groups and transactions - which
    only entries applied here change."""

    def __init__(
        self, bucket_uuid: str, *, planner: Planner = plan_query, epoch_counter: int = 1
    ) -> None:
        self._bucket_uuid = bucket_uuid
        self._planner = planner
        self._epoch_counter = epoch_counter
        self._applied_index = 0
        self._lease_holder = ""
        self._lease_index = 0
        self.store = KeyStore()
        """The keys (outbox/store.py)."""
        self.producers = ProducerTable()
        """The idempotent producers (outbox/producers.py)."""
        self.subs = SubscriptionTable(bucket_uuid)
        """The live subscriptions and their outboxes (outbox/subscriptions.py)."""
        self.pending = PendingRows()
        """Rows computed and not yet checkpointed by an OUTBOX_WRITE (outbox/pending.py)."""
        self.history = History(EmitSeq(bucket_uuid, epoch_counter, 0))
        """The retained history (outbox/history.py; docs/core.md, "Retained history")."""
        self.groups = GroupTable()
        """The consumer groups' members and owners here (outbox/groups.py)."""
        self.txns = TxnState()
        """Transactions coordinated here and pending writes of those writing here
        (outbox/txn.py; read-only outside: change them only through entries)."""

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
        return self.pending.through

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
        _check_order(commit_index, self._applied_index)
        return self.apply_entry(commit_index, decode_entry(data))

    def apply_entry(self, commit_index: int, entry: Entry) -> Applied:
        _check_order(commit_index, self._applied_index)
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
            result = self.history.trim(min(entry.through_index, commit_index))
        elif isinstance(entry, GroupBeat):
            result = self.groups.apply(entry)
        elif isinstance(entry, Txn):
            result = self._apply_txn(commit_index, entry, effects)
        elif isinstance(entry, TxnWrite):
            result = self.txns.write(entry, self.store.version_of, self.subs.check_ack)
            if self.subs.uncommitted and result.error is None:
                self._emit_uncommitted(commit_index, entry, effects)
        else:
            assert isinstance(entry, InitProducer)
            result = self.producers.init(entry)
        self._applied_index = commit_index
        return Applied(commit_index, result, tuple(effects))

    # ---- WRITE -----------------------------------------------------------------

    def _apply_write(self, commit: EmitSeq, entry: Write) -> tuple[WriteResult, list[Change]]:
        """Apply one write committed at `commit`; returns its result and the changes it
        made (none if refused)."""
        producer: Producer | None = None
        if entry.producer is not None:
            admitted = self.producers.admit(entry, self._bucket_uuid)
            if isinstance(admitted, Rejection):
                return _refused(commit, admitted)
            if isinstance(admitted, WriteResult):  # a retry: its first result again
                return admitted, []
            producer = admitted
        refusal = self.store.check(entry.ops)
        changes: list[Change] = []
        if refusal is not None:  # (a producer's refused sequence is answered so again)
            result = WriteResult(commit, error=refusal)
        else:
            changes, versions = self.store.apply(commit.commit_index, entry.ops)
            result = WriteResult(commit, tuple(versions))
        if producer is not None and entry.producer is not None:
            producer.last_seq = entry.producer.sequence
            producer.results.add(result)
            producer.results.forget_before(entry.producer.answered_below, producer.last_seq)
            producer.last_active_ms = max(producer.last_active_ms, entry.now_ms)
        return result, changes

    def _emit_uncommitted(self, index: int, entry: TxnWrite, effects: list[Effect]) -> None:
        """Rows of a transactional write for the subscriptions reading uncommitted (and
        for no one else, nor for the retained history: it is not committed). Its
        changes carry version 0: the versions are set at the COMMIT marker."""
        changes = tuple(Change(op.key, op.kind, op.value, 0) for op in entry.ops)
        tag = TxnTag(entry.txn_id, entry.epoch, entry.number, committed=False)
        rows = self.subs.rows_for(
            self.emit_seq(index), changes, entry.now_ms, Isolation.READ_UNCOMMITTED, tag
        )
        if rows:
            self.pending.add(index, rows)
            effects.append(RowsPending(rows))

    def _apply_txn(self, index: int, entry: Txn, effects: list[Effect]) -> TxnResult:
        """A TXN entry (outbox/txn.py); a COMMIT marker applies the transaction's
        pending writes here, as one change set at the marker's position."""
        if entry.coordinator_side:
            return self.txns.apply(entry)
        if entry.action is TxnAction.JOIN:
            return self.txns.join(entry)
        if entry.action is TxnAction.PREPARE:
            return self.txns.prepare(entry)
        result, ops, acks = self.txns.mark(entry)
        if ops:
            changes = self.store.apply(index, ops)[0]
            commit = self.emit_seq(index)
            tag = TxnTag(entry.txn_id, entry.epoch, entry.number, committed=True)
            self._emit_rows(commit, changes, entry.now_ms, effects, Isolation.READ_COMMITTED, tag)
        purged: list[OutboxRow] = []
        for ack in acks:  # consumed input commits with the output (if still ahead)
            outcome = self.subs.check_ack(ack.sub_id, ack.principal, ack.up_to)
            if outcome.status is AckStatus.ACCEPTED:
                purged.extend(self.subs.purge(ack, entry.now_ms))
        if purged:
            readers = frozenset[str]()
            if self.subs.uncommitted:
                readers = uncommitted_readers(purged, self.subs.by_id())
            effects.insert(0, RowsPurged(tuple(purged), entry.now_ms, readers))
        return result

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
            self.history.record(RetainedChange(commit, now_ms, made, delta_bytes(made)))
        rows = self.subs.rows_for(commit, made, now_ms, only, txn)
        if rows:
            self.pending.add(commit.commit_index, rows)
            effects.append(RowsPending(rows))

    # ---- subscriptions ---------------------------------------------------------

    def _apply_subscribe(
        self, index: int, entry: Subscribe, effects: list[Effect], plan: Plan | None = None
    ) -> SubscribeResult:
        """`plan`: the entry's query planned already (by a SUBSCRIBE_BATCH's check)."""
        named = self.subs.durable_id(entry.principal, entry.durable) if entry.durable else None
        existing = self.subs.get(named or entry.sub_id)
        if existing is not None:
            return _existing_subscription(existing, entry)
        plan = self._planner(entry.query) if plan is None else plan
        if plan.plan_hash != entry.plan_hash:
            raise PlanMismatch(
                f"SUBSCRIBE {entry.sub_id} at {index}: plan_hash {entry.plan_hash:#x} committed, "
                f"this replica planned {plan.plan_hash:#x}"
            )
        if len(self.subs) >= limits.SUBSCRIPTIONS_PER_BUCKET_MAX:
            return SubscribeResult(
                entry.sub_id,
                error=Rejection(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"bucket already has {limits.SUBSCRIPTIONS_PER_BUCKET_MAX} subscriptions",
                ),
            )
        start = self.history.start(entry.start, self.emit_seq(index), self._applied_index)
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
        self.subs.add(sub)
        if start.commit_index < index:
            # Starting in the past: a row for each retained change set after its start
            # that its query matches, as if it had been subscribed then, pending a
            # checkpoint as rows computed at this SUBSCRIBE's index.
            rows = tuple(
                sub.take_row(
                    kept.emit_seq, Delta(kept.changes, kept.commit_time_ms, kept.size_bytes)
                )
                for kept in self.history.since(start, plan.matches)
            )
            if rows:
                self.pending.add(index, rows)
                effects.append(RowsPending(rows))
        return SubscribeResult(entry.sub_id, start, plan.plan_hash, acked=start)

    def _apply_subscribe_batch(
        self, index: int, entry: SubscribeBatch, effects: list[Effect]
    ) -> SubscribeBatchResult:
        """Each SUBSCRIBE in order, as if each were an entry of its own at `index`. Every
        new subscription's plan is checked first: a divergence raises `PlanMismatch`
        before anything changed (the replica quarantines itself)."""
        seen: set[str] = set()
        plans: dict[Query, Plan] = {}
        for subscribe in entry.subscribes:
            if self.subs.get(subscribe.sub_id) is None and subscribe.sub_id not in seen:
                plan = plans.get(subscribe.query) or self._planner(subscribe.query)
                plans[subscribe.query] = plan
                if plan.plan_hash != subscribe.plan_hash:
                    raise PlanMismatch(
                        f"SUBSCRIBE_BATCH at {index}, {subscribe.sub_id}: plan_hash "
                        f"{subscribe.plan_hash:#x} committed, this replica planned "
                        f"{plan.plan_hash:#x}"
                    )
            seen.add(subscribe.sub_id)
        return SubscribeBatchResult(
            tuple(
                self._apply_subscribe(index, subscribe, effects, plans.get(subscribe.query))
                for subscribe in entry.subscribes
            )
        )

    def _apply_unsubscribe(self, entry: Unsubscribe, effects: list[Effect]) -> UnsubscribeResult:
        sub = self.subs.get(entry.sub_id)
        if sub is None:
            return UnsubscribeResult(
                entry.sub_id,
                Rejection(ErrorCode.SUBSCRIPTION_NOT_FOUND, f"no subscription {entry.sub_id}"),
            )
        if sub.principal != entry.principal:
            return UnsubscribeResult(
                entry.sub_id,
                Rejection(
                    ErrorCode.NOT_OWNER, f"subscription {entry.sub_id} belongs to another principal"
                ),
            )
        # Its rows not yet checkpointed stay in the pending batches (digests already
        # proposed cover them); it is no longer there to send them to.
        self.subs.remove(sub)
        effects.append(SubscriptionClosed(entry.sub_id, CloseReason.UNSUBSCRIBED))
        return UnsubscribeResult(entry.sub_id)

    # ---- outbox ----------------------------------------------------------------

    def propose_outbox_write(
        self, lease_index: int, now_ms: int, after: int = 0
    ) -> OutboxWrite | None:
        """The OUTBOX_WRITE a lease holder should propose now, or None if nothing waits:
        the count and digest of every row computed since the last one.

        `after` pipelines: the through index of the holder's newest OUTBOX_WRITE still
        in flight. The entry then covers only the rows after it, and applies only if
        that one committed first (its range starts where that one ends; otherwise it
        is rejected with STALE_RANGE and changes nothing)."""
        return self.pending.propose(lease_index, self._applied_index, now_ms, after)

    def _apply_outbox_write(
        self, index: int, entry: OutboxWrite, effects: list[Effect]
    ) -> OutboxWriteResult:
        error = _stale_lease(entry.lease_index, self._lease_index, self._lease_holder)
        if error is not None:
            return OutboxWriteResult(error=error)
        done = self.pending.checkpoint(index, entry, self.subs)
        if done is None:
            return OutboxWriteResult(already=True)
        if isinstance(done, Rejection):
            return OutboxWriteResult(error=done)
        if done:
            effects.append(RowsOutboxed(done))
        return OutboxWriteResult(rows=len(done))

    def _apply_purge(self, entry: OutboxPurge, effects: list[Effect]) -> PurgeResult:
        error = _stale_lease(entry.lease_index, self._lease_index, self._lease_holder)
        if error is not None:
            return PurgeResult(error=error)
        outcomes = []
        purged: list[OutboxRow] = []
        for ack in entry.acks:
            outcome = self.subs.check_ack(ack.sub_id, ack.principal, ack.up_to)
            outcomes.append(outcome)
            if outcome.status is AckStatus.ACCEPTED:
                purged.extend(self.subs.purge(ack, entry.now_ms))
        readers = frozenset[str]()  # taken before expiries below remove a subscription
        if self.subs.uncommitted:
            readers = uncommitted_readers(purged, self.subs.by_id())
        now = entry.now_ms
        for sub_id in entry.touch:
            sub = self.subs.get(sub_id)
            # Only acks keep alive one with rows (any computed for it, checkpointed or not).
            if sub is not None and not sub.rows:
                sub.last_active_ms = max(sub.last_active_ms, now)
        expired = []
        # Only the named subscriptions are checked: scanning them all on every purge
        # cost each replica O(subscriptions) 50 times a second.
        for sub_id in entry.expire:
            sub = self.subs.get(sub_id)
            if sub is not None and idle(sub, now, entry.stall_window_ms):
                self.subs.remove(sub, expired=True)  # gone: a repeated sub_id is skipped
                expired.append(sub_id)
                effects.append(SubscriptionClosed(sub_id, CloseReason.STALLED))
        forgotten = self.producers.expire(entry.expire_producers, now, entry.producer_idle_ms)
        if purged:
            effects.insert(0, RowsPurged(tuple(purged), now, readers))
        return PurgeResult(
            tuple(outcomes), tuple(expired), len(purged), expired_producers=forgotten
        )

    # ---- epochs ----------------------------------------------------------------

    def _apply_epoch(self, entry: EpochCreate, effects: list[Effect]) -> EpochResult:
        if entry.epoch_counter != self._epoch_counter + 1:
            return EpochResult(
                self.epoch,
                Rejection(
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
        return self.store.get(key)

    def __len__(self) -> int:
        return len(self.store)

    def sync_page(self, since_index: int = 0, since_key: str = "", limit: int = 0) -> SyncPage:
        """Current state ordered by (mod_index, key), strictly after the cursor.

        `limit` is clamped to [1, SYNC_LIMIT_MAX]; 0 means SYNC_LIMIT_DEFAULT.
        """
        return self.store.sync_page(since_index, since_key, limit, self._applied_index)

    def decide_reconnect(
        self, sub_id: str, principal: str, last_processed: EmitSeq
    ) -> ReconnectDecision:
        """OK / STALE_SEQUENCE / INVALID_SEQUENCE / SUBSCRIPTION_NOT_FOUND
        (docs/contract.md, reconnect)."""
        sub = self.subs.get(sub_id)
        epoch, nxt = self.epoch, self._applied_index + 1
        owner = self.subs.owner(sub_id)
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
        refusal = _off_stream(sub, last_processed, self._bucket_uuid, self._applied_index)
        if refusal is not None:
            status, message = refusal
            return ReconnectDecision(status, epoch, nxt, message=message)
        resume = self.subs.outbox_rows(sub_id, last_processed)
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
            for sub in self.subs.by_id().values()
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
        here. Sorting and packing are left to `make`, which packs item by item rather
        than in one `packb` (of ~40 MB: the GIL held ~60 ms, the tick thread's
        heartbeats with it); the bytes are exactly those of one `packb` of the whole
        list. Sorting the keys is still one call: 3 ms for 300k keys written in order,
        ~85 ms for 300k random ones."""
        head = [
            SNAPSHOT_FORMAT_VERSION,
            self._bucket_uuid,
            self._epoch_counter,
            self._applied_index,
            self.pending.through,
            self._lease_holder,
            self._lease_index,
        ]
        parts: list[Callable[[], Any]] = [
            self.store.copy().pack_items,
            self.producers.pack().__iter__,
            self.subs.pack_later(),
            _later(PendingRows.pack_item, self.pending.pack_later()),
        ]
        tail: list[Any] = [self.subs.pack_expired()]
        history = self.history.copy()
        groups = self.groups.pack()
        txns = self.txns.pack() if self.txns else None  # absent: as before transactions

        def make() -> bytes:
            packer = msgpack.Packer(use_bin_type=True, autoreset=False)
            fields = [*tail, history.pack_kept(), history.pack_reach()]
            if txns is not None or groups:  # a 15th field with groups or transactions
                fields.append(groups)
            if txns is not None:  # a 16th with transactions
                fields.append(txns)
            packer.pack_array_header(len(head) + len(parts) + len(fields))
            for item in head:
                packer.pack(item)
            for part in [*(part() for part in parts), *fields]:
                _pack_field(packer, part)
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
            return _restored(raw, planner)
        except PlanMismatch:
            raise
        except Exception as exc:
            raise SnapshotError(f"snapshot content is invalid: {exc}") from None


def _restored(raw: list[Any], planner: Planner) -> BucketStateMachine:
    version = raw[0]
    if len(raw) != {1: 11, 2: 12}.get(version, 14) and not (
        version == 3 and ((len(raw) == 15 and raw[14]) or len(raw) == 16)
    ):
        raise ValueError(f"{len(raw)} fields")
    _, uuid, epoch, applied, outboxed, holder, lease_index, kv, producers, subs = raw[:10]
    sm = BucketStateMachine(uuid, planner=planner, epoch_counter=epoch)
    sm._applied_index = applied
    sm._lease_holder, sm._lease_index = holder, lease_index
    sm.store = KeyStore.unpack(kv)
    if version == 1:
        producers, subs, expired = _from_version_1(producers, subs)
    else:
        expired = raw[11]
    if version < 3:  # no durable names, no history before format 3
        subs = [[*sub, "", sub[5][2]] for sub in subs]  # born at its start
        latest = max([0, *(p[4] for p in producers), *(sub[8] for sub in subs)])
        sm.history = History(sm.emit_seq(applied), latest)
    else:
        sm.history = History.unpack(raw[12], raw[13])
        if len(raw) >= 15:
            sm.groups = GroupTable.unpack(raw[14])
        if len(raw) == 16:  # transactions (outbox/txn.py), absent when none
            sm.txns = TxnState.unpack(raw[15])
            if not sm.txns:
                raise ValueError("an empty transaction state is not canonical")
    sm.producers = ProducerTable.unpack(producers)
    sm.subs.unpack(subs, expired, planner)
    sm.pending = PendingRows.unpack(raw[10], outboxed)
    if version == 1:
        _adopt_pending_rows(sm.subs, sm.pending)
    return sm


def _off_stream(
    sub: Subscription, last: EmitSeq, bucket_uuid: str, applied: int
) -> tuple[ReconnectStatus, str] | None:
    """Why a stream cannot resume after `last`, if it cannot."""
    if last.bucket_uuid != bucket_uuid or last < sub.start:
        return ReconnectStatus.INVALID_SEQUENCE, f"{last} is not in this stream"
    if last.commit_index > applied:
        # Beyond everything applied here. Judged only on current state (the
        # notifier answers BEHIND until its replica has caught up with the log).
        return (
            ReconnectStatus.INVALID_SEQUENCE,
            f"{last} is beyond anything committed (applied through {applied})",
        )
    if last > sub.head:
        return (
            ReconnectStatus.INVALID_SEQUENCE,
            f"{last} is ahead of the stream head {sub.head}; reset",
        )
    if last < sub.acked:
        return (
            ReconnectStatus.STALE_SEQUENCE,
            f"{last} is older than retained history (acknowledged through {sub.acked}); "
            "resubscribe",
        )
    if last not in (sub.acked, sub.start) and all(row.emit_seq != last for row in sub.rows):
        return ReconnectStatus.INVALID_SEQUENCE, f"{last} was never emitted to {sub.sub_id}"
    return None


def _existing_subscription(existing: Subscription, entry: Subscribe) -> SubscribeResult:
    """A SUBSCRIBE naming a live subscription: its answer again if it asks for the same
    one, or why it cannot be had."""
    if existing.principal != entry.principal:
        return SubscribeResult(
            entry.sub_id,
            error=Rejection(
                ErrorCode.NOT_OWNER, f"subscription {entry.sub_id} belongs to another principal"
            ),
        )
    if existing.durable != entry.durable:
        return SubscribeResult(
            entry.sub_id,
            error=Rejection(
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
            error=Rejection(
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


def _later(pack: Callable[..., Any], items: list[Any]) -> Callable[[], Any]:
    """`items`, each packed by `pack`, when called."""
    return lambda: (pack(*item) for item in items)


def _pack_field(packer: msgpack.Packer, part: Any) -> None:
    """A snapshot field: an iterator is packed as an array item by item (its length
    known only once drained, so it is listed first), anything else in one call."""
    if isinstance(part, (list, tuple, dict)) or not hasattr(part, "__next__"):
        packer.pack(part)
        return
    items = list(part)
    packer.pack_array_header(len(items))
    for item in items:
        packer.pack(item)


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


def _adopt_pending_rows(subs: SubscriptionTable, pending: PendingRows) -> None:
    """A format-1 state kept rows not yet checkpointed only in the pending batches:
    each joins its live subscription (one newer than the row never: it is a new
    incarnation of the sub_id), as the apply of the row's source entry does now."""
    for batch in pending:
        for row in batch.rows:
            sub = subs.get(row.sub_id)
            if sub is not None and row.emit_seq > sub.start:
                sub.rows.append(row)
