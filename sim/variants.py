"""Deliberately broken notifier cores (`Bugs`), to prove the checker bites.

They subclass the production `NotifierCore` and change one decision each; the
production host builds them through its `new_core` factory when the simulation's
configuration asks, never by editing production code. (The other variants live
where they break something: `SimReplica(fenced=False)`, `SpeculativeReplica`,
`RaftGroup(damaged_votes=True)`, the client's `sdk_skips_dedupe`.)
"""

from __future__ import annotations

from sevendb.notifier.core import Attach, AttachStatus, NotifierConfig, NotifierCore
from sevendb.notifier.host import CoreFactory
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import Entry, OutboxPurge, OutboxWrite, TxnWrite
from sevendb.outbox.model import Applied, Change, OutboxRow, ReconnectStatus, RowsPending
from sevendb.outbox.state import BucketStateMachine, rows_digest

from .config import Bugs


class PurgeBeforeAck(NotifierCore):
    """Treats "sent" as "acknowledged": queues an ack for every batch it sends."""

    def next_batches(
        self, sm: BucketStateMachine, max_events: int, now_ms: int, *, full: bool = True
    ) -> list[tuple[str, tuple[OutboxRow, ...]]]:
        batches = super().next_batches(sm, max_events, now_ms, full=full)
        for sub_id, rows in batches:
            sub = sm.subs.get(sub_id)
            if sub is not None:
                self._queue_ack(sm, sub_id, sub.principal, rows[-1].emit_seq)
        return batches


class Unfenced(NotifierCore):
    """Emits whenever its host believes it leads; judges reconnects from whatever it
    applied so far (no lease check, no "client is ahead of me" check)."""

    def holds_lease(self, sm: BucketStateMachine) -> bool:
        return True

    def attach(
        self, sm: BucketStateMachine, sub_id: str, principal: str, after: EmitSeq, now_ms: int
    ) -> Attach:
        decision = sm.decide_reconnect(sub_id, principal, after)
        if decision.status is not ReconnectStatus.OK:
            return Attach(AttachStatus.REFUSED, decision, message=decision.message)
        return self._register(sm, sub_id, principal, after, now_ms, decision)


class ForgetsTail(NotifierCore):
    """Outboxes only rows computed after it took the lease: what its predecessor left
    un-outboxed is never proposed (so the range never lines up again)."""

    def __init__(self, me: str, config: NotifierConfig | None, taken_at: int) -> None:
        super().__init__(me, config)
        self._taken_at = taken_at

    def outbox_entry(
        self, sm: BucketStateMachine, lease_index: int, now_ms: int
    ) -> OutboxWrite | None:
        after = self.outbox_after(sm, now_ms)
        if not self.holds_lease(sm) or after is None:
            return None
        start = max(self._taken_at, sm.outboxed_through, after)
        through = sm.applied_index
        rows = sm.pending.rows(through, after=start)
        if not rows or through <= start:
            return None
        count, digest = rows_digest(rows)
        return OutboxWrite(lease_index, start, through, count, digest, now_ms)


class SecondsWindow(NotifierCore):
    """Proposes its OUTBOX_PURGEs with the stall window in seconds (1,500 ms becomes
    1 ms): every replica checks each expiry against the window the entry names, so
    subscriptions that acknowledged a moment ago are expired, their rows dropped."""

    def purge_entry(
        self,
        sm: BucketStateMachine,
        lease_index: int,
        now_ms: int,
        stall_window_ms: int,
        *,
        expire: bool = True,
    ) -> OutboxPurge | None:
        window = max(1, stall_window_ms // 1000)
        return super().purge_entry(sm, lease_index, now_ms, window, expire=expire)


class SkipsPredecessorRows(NotifierCore):
    """Takes every row computed before it took the lease as sent by its predecessor:
    it never sends one of them, whatever position a stream attaches at."""

    def __init__(self, me: str, config: NotifierConfig | None, taken_at: int) -> None:
        super().__init__(me, config)
        self._taken_at = taken_at

    def _rows_after(
        self, sm: BucketStateMachine, sub_id: str, position: EmitSeq, through: int | None
    ) -> tuple[OutboxRow, ...]:
        rows = super()._rows_after(sm, sub_id, position, through)
        return tuple(row for row in rows if row.emit_seq.commit_index > self._taken_at)


class EagerTxnStateMachine(BucketStateMachine):
    """`Bugs.deliver_before_marker`: a transactional write's changes become rows of every
    subscription it matches as the write applies, as if it were a plain write."""

    def apply_entry(self, commit_index: int, entry: Entry) -> Applied:
        applied = super().apply_entry(commit_index, entry)
        if not isinstance(entry, TxnWrite) or getattr(applied.result, "error", None):
            return applied
        changes = tuple(Change(op.key, op.kind, op.value, 0) for op in entry.ops)
        rows = self.subs.rows_for(self.emit_seq(commit_index), changes, entry.now_ms)
        if not rows:
            return applied
        self.pending.add(commit_index, rows)
        return Applied(applied.commit_index, applied.result, (*applied.effects, RowsPending(rows)))


def core_factory(bugs: Bugs) -> CoreFactory:
    """What a replica's host builds when it takes the lease: the production core unless
    a bug is injected."""
    if bugs.purge_before_ack:
        return lambda me, config, sm: PurgeBeforeAck(me, config)
    if bugs.lease_without_fencing:
        return lambda me, config, sm: Unfenced(me, config)
    if bugs.forget_unoutboxed_tail:
        return lambda me, config, sm: ForgetsTail(me, config, sm.applied_index)
    if bugs.expiry_window_in_seconds:
        return lambda me, config, sm: SecondsWindow(me, config)
    if bugs.skip_predecessor_rows:
        return lambda me, config, sm: SkipsPredecessorRows(me, config, sm.applied_index)
    return lambda me, config, sm: NotifierCore(me, config)
