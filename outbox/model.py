"""Values the bucket state machine hands out: changes, rows, results, effects.

All frozen: callers (notifier, gRPC, archive, simulator) may keep them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import NamedTuple

from .emitseq import EmitSeq, EpochId
from .entries import OpKind, TxnOutcome
from .errors import Rejection
from .groups import GroupResult
from .query import Query


class Change(NamedTuple):
    """One key's change inside a delta; `version` is the key's version after it
    (for DEL: the version that was deleted). A named tuple: an SDK builds one per
    delivered change."""

    key: str
    op: OpKind
    value: bytes
    version: int

    def pack(self) -> list[object]:
        return [self.key, int(self.op), self.value, self.version]


@dataclass(frozen=True, slots=True)
class TxnTag:
    """The transaction a delta's changes belong to (docs/transactions.md): made at its
    COMMIT marker (`committed`), or as one of its writes applied (a read_uncommitted
    delivery, the transaction then undecided). The archive records it (docs/spark.md)."""

    txn_id: str
    epoch: int
    number: int
    committed: bool

    def pack(self) -> list[object]:
        return [self.txn_id, self.epoch, self.number, self.committed]


@dataclass(frozen=True, slots=True)
class Delta:
    """What one committed source entry changed for one subscription."""

    changes: tuple[Change, ...]
    commit_time_ms: int
    size_bytes: int = field(default=-1, compare=False, repr=False)
    """Its keys' and values' bytes, when its maker counted them (-1: not counted).
    Not part of its value: the state machine counts them as it builds a delta, while
    they are in cache, for the notifier's byte window (`delta_bytes`)."""
    txn: TxnTag | None = None
    """The transaction whose changes these are (None: a plain write's)."""

    def pack(self) -> list[object]:
        if self.txn is None:  # two items, as before transactions
            return [[c.pack() for c in self.changes], self.commit_time_ms]
        return [[c.pack() for c in self.changes], self.commit_time_ms, self.txn.pack()]


def delta_bytes(changes: Sequence[tuple[str, object, bytes, int]]) -> int:
    """The keys' and values' bytes of `changes` (`Delta.size_bytes`)."""
    size = 0
    for change in changes:
        size += len(change[0]) + len(change[2])  # key, value (by index: faster)
    return size


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """`(sub_id, emit_seq, prev_emit_seq, delta)`: one emission, chained per subscription."""

    sub_id: str
    emit_seq: EmitSeq
    prev_emit_seq: EmitSeq
    delta: Delta

    def pack(self) -> list[object]:
        return [self.sub_id, self.emit_seq.pack(), self.prev_emit_seq.pack(), self.delta.pack()]


@dataclass(frozen=True, slots=True)
class KeyRecord:
    value: bytes
    version: int
    mod_index: int


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    version: int
    mod_index: int


@dataclass(frozen=True, slots=True)
class SyncPage:
    """A page of current state ordered by (mod_index, key), after an exclusive cursor."""

    items: tuple[KeyValue, ...]
    has_more: bool
    next_since_index: int
    next_since_key: str
    applied_index: int


class RetainedChange(NamedTuple):
    """One committed source entry's changes, as the retained history keeps them
    (docs/core.md, "Retained history")."""

    emit_seq: EmitSeq
    commit_time_ms: int
    changes: tuple[Change, ...]
    size_bytes: int
    """Its keys' and values' bytes (`delta_bytes`)."""


@dataclass(frozen=True, slots=True)
class HistoryPage:
    """A page of the retained history matching a query, after an exclusive position.

    `next_after` is where the next page starts (the last event's position, or the
    page's end when nothing matched); `more` says whether there is a next page;
    `retained_after` is the oldest position the history reaches back to."""

    events: tuple[RetainedChange, ...]
    more: bool
    next_after: EmitSeq
    retained_after: EmitSeq


# ---- results: what the proposer of an entry is told -------------------------------


@dataclass(frozen=True, slots=True)
class WriteResult:
    commit: EmitSeq
    versions: tuple[tuple[str, int], ...] = ()
    duplicate: bool = False
    error: Rejection | None = None


@dataclass(frozen=True, slots=True)
class WriteBatchResult:
    """One result per write of a WRITE_BATCH, in order."""

    results: tuple[WriteResult, ...]


@dataclass(frozen=True, slots=True)
class InitProducerResult:
    producer_id: int
    epoch: int = 0
    error: Rejection | None = None


@dataclass(frozen=True, slots=True)
class SubscribeResult:
    sub_id: str
    """The subscription's id: for a durable name already in use, the id it was made
    with (not the one the SUBSCRIBE carried)."""
    start: EmitSeq | None = None
    plan_hash: int = 0
    existing: bool = False
    error: Rejection | None = None
    acked: EmitSeq | None = None
    """Where its stream resumes: everything up to here was acknowledged and purged
    (`start` for a new subscription)."""


@dataclass(frozen=True, slots=True)
class SubscribeBatchResult:
    """One result per SUBSCRIBE of a SUBSCRIBE_BATCH, in order."""

    results: tuple[SubscribeResult, ...]


@dataclass(frozen=True, slots=True)
class UnsubscribeResult:
    sub_id: str
    error: Rejection | None = None


@dataclass(frozen=True, slots=True)
class OutboxWriteResult:
    rows: int = 0
    already: bool = False
    error: Rejection | None = None


class AckStatus(StrEnum):
    """Per-acknowledgement outcome (mirrors `AckResult.Status` on the wire)."""

    ACCEPTED = "ACCEPTED"
    REGRESSIVE = "REGRESSIVE"
    DUPLICATE = "DUPLICATE"
    FUTURE = "FUTURE"
    NOT_OWNER = "NOT_OWNER"
    SUBSCRIPTION_NOT_FOUND = "SUBSCRIPTION_NOT_FOUND"
    STALE = "STALE"


@dataclass(frozen=True, slots=True)
class AckOutcome:
    sub_id: str
    status: AckStatus
    message: str = ""


@dataclass(frozen=True, slots=True)
class PurgeResult:
    acks: tuple[AckOutcome, ...] = ()
    expired: tuple[str, ...] = ()
    """Subscriptions expired and deleted (in the entry's order)."""
    purged_rows: int = 0
    error: Rejection | None = None
    expired_producers: tuple[int, ...] = ()
    """Producers forgotten (in the entry's order)."""


@dataclass(frozen=True, slots=True)
class EpochResult:
    epoch: EpochId
    error: Rejection | None = None


@dataclass(frozen=True, slots=True)
class LeaseResult:
    holder: str
    lease_index: int
    error: Rejection | None = None


@dataclass(frozen=True, slots=True)
class HistoryTrimResult:
    dropped: int
    """Entries of history dropped."""
    retained_after: EmitSeq
    """The oldest position the history now reaches back to."""


@dataclass(frozen=True, slots=True)
class TxnResult:
    """The answer to a TXN entry (`error` set when refused: nothing changed)."""

    txn_id: str
    epoch: int = 0
    number: int = 0
    outcome: TxnOutcome = TxnOutcome.NONE
    buckets: tuple[int, ...] = ()
    """ADD: the buckets newly added (to be joined); END/RESOLVE/EXPIRE/INIT: the
    participants of the transaction decided (whose markers are due)."""
    error: Rejection | None = None


@dataclass(frozen=True, slots=True)
class TxnWriteResult:
    txn_id: str
    number: int
    error: Rejection | None = None


Result = (
    WriteResult
    | WriteBatchResult
    | InitProducerResult
    | SubscribeResult
    | SubscribeBatchResult
    | UnsubscribeResult
    | OutboxWriteResult
    | PurgeResult
    | EpochResult
    | LeaseResult
    | HistoryTrimResult
    | GroupResult
    | TxnResult
    | TxnWriteResult
)


# ---- effects: what adapters must do after an entry applied ------------------------


@dataclass(frozen=True, slots=True)
class RowsPending:
    """Rows computed from a source entry, waiting for an OUTBOX_WRITE (never send yet)."""

    rows: tuple[OutboxRow, ...]


@dataclass(frozen=True, slots=True)
class RowsOutboxed:
    """Rows now durable in the outbox: the lease holder may send them."""

    rows: tuple[OutboxRow, ...]


@dataclass(frozen=True, slots=True)
class RowsPurged:
    """Acknowledged rows removed from the outbox: the archive writer records them."""

    rows: tuple[OutboxRow, ...]
    ack_time_ms: int
    read_uncommitted: frozenset[str] = frozenset()
    """The sub_ids among `rows` whose subscriptions read uncommitted (the archive
    records each row's isolation level)."""


class CloseReason(StrEnum):
    UNSUBSCRIBED = "UNSUBSCRIBED"
    """Deleted by an UNSUBSCRIBE (its owner's, or an administrator's on its behalf)."""
    STALLED = "STALLED"
    """Expired and deleted: idle past the stall window."""


@dataclass(frozen=True, slots=True)
class SubscriptionClosed:
    sub_id: str
    reason: CloseReason


@dataclass(frozen=True, slots=True)
class LeaseChanged:
    holder: str
    lease_index: int


@dataclass(frozen=True, slots=True)
class EpochChanged:
    epoch: EpochId


Effect = RowsPending | RowsOutboxed | RowsPurged | SubscriptionClosed | LeaseChanged | EpochChanged


@dataclass(frozen=True, slots=True)
class Applied:
    """The outcome of applying one entry: the proposer's result and the effects."""

    commit_index: int
    result: Result
    effects: tuple[Effect, ...] = ()


class ReconnectStatus(IntEnum):
    """Mirrors `ReconnectAck.Status` (docs/contract.md §5.2)."""

    OK = 0
    STALE_SEQUENCE = 1
    INVALID_SEQUENCE = 2
    SUBSCRIPTION_NOT_FOUND = 3


@dataclass(frozen=True, slots=True)
class ReconnectDecision:
    status: ReconnectStatus
    current_epoch: EpochId
    next_commit_index: int
    resume: tuple[OutboxRow, ...] = ()
    message: str = ""
    not_owner: bool = False


@dataclass(frozen=True, slots=True)
class SubscriptionInfo:
    """What an operator sees of one subscription (`sevendb subscriptions show`)."""

    sub_id: str
    principal: str
    query: Query
    start: EmitSeq
    head: EmitSeq
    """The last event computed for it (or its start)."""
    acked: EmitSeq
    """Everything up to here was acknowledged and purged."""
    last_active_ms: int
    """When it last acknowledged something, subscribed or was kept alive (log time)."""
    rows: int
    """Outboxed rows held for it, not yet acknowledged."""
    row_bytes: int
    """Keys and values of those rows."""
    pending_rows: int
    """Rows computed for it, not yet acknowledged, that no OUTBOX_WRITE has checkpointed
    yet (in the derived emission mode they may already have been sent)."""

    @property
    def lag(self) -> int:
        """Commit indexes between its acknowledged point and its head."""
        return self.head.commit_index - self.acked.commit_index
