"""A bucket's live subscriptions: each one's query, stream position and outbox rows,
the index of their queries, and the rows a committed change set makes for them.
Pure: part of the state machine's state (outbox/state.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from . import limits
from .emitseq import EmitSeq
from .entries import Ack, Isolation, OpKind
from .errors import PlanMismatch
from .model import AckOutcome, AckStatus, Change, Delta, OutboxRow, TxnTag, delta_bytes
from .query import Plan, Planner, Query, QueryIndex, QueryKind


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

    def take_row(self, commit: EmitSeq, delta: Delta) -> OutboxRow:
        """A row for the change set committed at `commit` joins its outbox."""
        row = OutboxRow(self.sub_id, commit, self.head, delta)
        self.rows.append(row)
        self.head = commit
        return row


class SubscriptionTable:
    """The live subscriptions of a bucket by sub_id, with what is derived from them
    (never in snapshots): the query index, each principal's count, the durable names
    and how many read uncommitted; and the expired ones remembered."""

    __slots__ = (
        "_bucket_uuid",
        "_durable",
        "_expired",
        "_owned",
        "_queries",
        "_subs",
        "uncommitted",
    )

    def __init__(self, bucket_uuid: str) -> None:
        self._bucket_uuid = bucket_uuid
        self._subs: dict[str, Subscription] = {}
        self._expired: dict[str, str] = {}
        """Expired subscriptions remembered, oldest first: sub_id -> owner (so their
        Reconnect is STALE_SEQUENCE); at most EXPIRED_REMEMBERED_MAX."""
        self._owned: dict[str, int] = {}
        """principal -> how many subscriptions it has here."""
        self._durable: dict[tuple[str, str], str] = {}
        """(principal, durable name) -> sub_id of the live subscription of that name."""
        self._queries = QueryIndex()
        """The live subscriptions by what their queries match."""
        self.uncommitted = 0
        """How many subscriptions read uncommitted."""

    # ---- lookups -------------------------------------------------------------------

    def get(self, sub_id: str) -> Subscription | None:
        return self._subs.get(sub_id)

    def __len__(self) -> int:
        return len(self._subs)

    def sorted(self) -> list[Subscription]:
        """Every live subscription in sub_id order."""
        return [self._subs[sub_id] for sub_id in sorted(self._subs)]

    def by_id(self) -> Mapping[str, Subscription]:
        """Every live subscription by sub_id, read-only, in no particular order (a
        view, not a copy: for scans that need no order, outbox/lifecycle.py)."""
        return MappingProxyType(self._subs)

    def count(self, principal: str | None = None) -> int:
        """Live subscriptions here (of `principal`, if given)."""
        if principal is None:
            return len(self._subs)
        return self._owned.get(principal, 0)

    def durable_id(self, principal: str, name: str) -> str | None:
        """The live subscription `principal` named `name`, if any."""
        return self._durable.get((principal, name))

    def owner(self, sub_id: str) -> str | None:
        """The principal of a live or remembered expired subscription."""
        sub = self._subs.get(sub_id)
        return sub.principal if sub is not None else self._expired.get(sub_id)

    # ---- changes -------------------------------------------------------------------

    def add(self, sub: Subscription) -> None:
        """A new subscription (a new incarnation, if its sub_id had expired)."""
        self._expired.pop(sub.sub_id, None)
        self._subs[sub.sub_id] = sub
        self._queries.add(sub.sub_id, sub.plan)
        self._owned[sub.principal] = self._owned.get(sub.principal, 0) + 1
        self.uncommitted += sub.isolation is Isolation.READ_UNCOMMITTED
        if sub.durable:
            self._durable[sub.principal, sub.durable] = sub.sub_id

    def remove(self, sub: Subscription, *, expired: bool = False) -> None:
        """Delete a subscription: its rows go with it, checkpointed or not (no holder
        sends one again, in either emission mode), and its slot is free. Those not yet
        checkpointed stay in the pending batches only for the OUTBOX_WRITE's digest,
        which covers them, and are dropped when it applies. An `expired` one is
        remembered (bounded), so that its Reconnect is STALE_SEQUENCE."""
        self._queries.remove(sub.sub_id, sub.plan)
        del self._subs[sub.sub_id]
        self.uncommitted -= sub.isolation is Isolation.READ_UNCOMMITTED
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

    def purge(self, ack: Ack, now_ms: int) -> list[OutboxRow]:
        """An accepted cumulative ack: the rows it covers leave the outbox."""
        sub = self._subs[ack.sub_id]
        removed = []
        while sub.rows and sub.rows[0].emit_seq <= ack.up_to:
            removed.append(sub.rows.popleft())
        sub.acked = ack.up_to
        sub.last_active_ms = now_ms
        return removed

    # ---- rows ----------------------------------------------------------------------

    def rows_for(
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
        subs = self._subs
        hit_sets = [self._queries.matching(change.key) for change in changes]
        if only is not None and self.uncommitted:
            hit_sets = [{s for s in hits if subs[s].isolation is only} for hits in hit_sets]
        first = hit_sets[0]
        if all(hits == first for hits in hit_sets):
            # The common case (one change, or every change matching the same
            # subscriptions): each matching subscription gets one delta of them all.
            if not first:
                return ()
            delta = Delta(changes, now_ms, delta_bytes(changes), txn)
            return tuple(subs[sub_id].take_row(commit, delta) for sub_id in sorted(first))
        return self._rows_split(commit, changes, hit_sets, now_ms, txn)

    def _rows_split(
        self,
        commit: EmitSeq,
        changes: tuple[Change, ...],
        hit_sets: list[set[str]],
        now_ms: int,
        txn: TxnTag | None,
    ) -> tuple[OutboxRow, ...]:
        """`rows_for` when changes match different subscriptions: each gets a delta of
        the changes it matches (subscriptions matching the same changes share one)."""
        matched: dict[str, list[int]] = {}
        for i, hits in enumerate(hit_sets):
            for sub_id in hits:
                matched.setdefault(sub_id, []).append(i)
        deltas: dict[tuple[int, ...], Delta] = {}
        rows = []
        for sub_id in sorted(matched):
            picked = tuple(matched[sub_id])
            delta = deltas.get(picked)
            if delta is None:
                mine = tuple(changes[i] for i in picked)
                delta = deltas[picked] = Delta(mine, now_ms, delta_bytes(mine), txn)
            rows.append(self._subs[sub_id].take_row(commit, delta))
        return tuple(rows)

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

    def check_ack(self, sub_id: str, principal: str, up_to: EmitSeq) -> AckOutcome:
        """Would this cumulative ack be accepted now? (The notifier asks before proposing.)"""
        sub = self._subs.get(sub_id)
        owner = self.owner(sub_id)
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

    # ---- snapshots -----------------------------------------------------------------

    def pack_later(self) -> Callable[[], Iterator[list[Any]]]:
        """Each subscription as a snapshot item (sub_id order), packed when the
        returned function is called; only references are taken now (a subscription's
        rows are one tuple copy; rows are immutable)."""
        taken = [
            (s, s.start, s.head, s.acked, s.last_active_ms, tuple(s.rows)) for s in self.sorted()
        ]

        def items() -> Iterator[list[Any]]:
            for sub, start, head, acked, active, rows in taken:
                yield [
                    sub.sub_id,
                    sub.principal,
                    int(sub.query.kind),
                    sub.query.arg,
                    sub.plan.plan_hash,
                    start.pack(),
                    head.pack(),
                    acked.pack(),
                    active,
                    [row.pack() for row in rows],
                    sub.durable,
                    sub.born,
                    # a thirteenth item only for a non-default isolation level
                    *(
                        (int(sub.isolation),)
                        if sub.isolation is not Isolation.READ_COMMITTED
                        else ()
                    ),
                ]

        return items

    def pack_expired(self) -> list[list[str]]:
        return [[sub_id, owner] for sub_id, owner in self._expired.items()]

    def unpack(self, items: list[Any], expired: list[Any], planner: Planner) -> None:
        """Fill an empty table from snapshot items (`pack_later`'s, or format 2's with a
        durable name and birth index added). Raises PlanMismatch if a query plans
        differently here."""
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
        ) in items:
            query = Query(QueryKind(kind), arg)
            plan = planner(query)
            if plan.plan_hash != plan_hash:
                raise PlanMismatch(
                    f"restored subscription {sub_id}: plan_hash "
                    f"{plan_hash:#x}, this replica planned {plan.plan_hash:#x}"
                )
            self.add(
                Subscription(
                    sub_id,
                    principal,
                    query,
                    plan,
                    EmitSeq(*start),
                    EmitSeq(*head),
                    EmitSeq(*acked),
                    active,
                    deque(unpack_row(r) for r in rows),
                    name,
                    born,
                    _isolation(isolation),
                )
            )
        self._expired = {sub_id: owner for sub_id, owner in expired}


def _isolation(rest: list[Any]) -> Isolation:
    """A snapshot's subscription isolation: a thirteenth item, absent for the default."""
    if not rest:
        return Isolation.READ_COMMITTED
    (level,) = rest
    if level != Isolation.READ_UNCOMMITTED or isinstance(level, bool):
        raise ValueError(f"subscription isolation {level!r}")
    return Isolation(level)


def unpack_row(raw: Any) -> OutboxRow:
    """An outbox row from its snapshot item (`OutboxRow.pack()`)."""
    sub_id, emit, prev, (changes, commit_time, *txn) = raw
    made = tuple(Change(k, OpKind(op), v, ver) for k, op, v, ver in changes)
    tag = TxnTag(*txn[0]) if txn else None  # a third item: a transaction's (outbox/txn.py)
    return OutboxRow(sub_id, EmitSeq(*emit), EmitSeq(*prev), Delta(made, commit_time, txn=tag))
