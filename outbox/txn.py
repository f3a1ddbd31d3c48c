"""Transactions in the deterministic core (docs/transactions.md): the coordinator's
transaction log of each transactional id hashed to this bucket, and the pending
writes of transactions this bucket takes part in.

`BucketStateMachine` delegates TXN and TXN_WRITE entries here; like the rest of the
core this is pure: time arrives in the entries, nothing here does I/O. A bucket is
the coordinator of the transactional ids that hash to it and a participant of every
transaction that writes to it; the same object keeps both halves, and both are in the
bucket's snapshot and digest (`pack` / `unpack`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final, Protocol

from . import limits
from .emitseq import EmitSeq
from .entries import (
    Ack,
    ExpectKind,
    Isolation,
    Op,
    OpKind,
    Txn,
    TxnAction,
    TxnOutcome,
    TxnWrite,
)
from .errors import ErrorCode, Rejection
from .model import AckOutcome, AckStatus, OutboxRow, TxnResult, TxnWriteResult


class TxnPhase(IntEnum):
    ONGOING = 0
    PREPARE_COMMIT = 1
    PREPARE_ABORT = 2


_ACK_ERRORS: Final = {
    AckStatus.REGRESSIVE: ErrorCode.REGRESSIVE_ACK,
    AckStatus.DUPLICATE: ErrorCode.DUPLICATE_ACK,
    AckStatus.FUTURE: ErrorCode.FUTURE_ACK,
    AckStatus.NOT_OWNER: ErrorCode.NOT_OWNER,
    AckStatus.SUBSCRIPTION_NOT_FOUND: ErrorCode.SUBSCRIPTION_NOT_FOUND,
    AckStatus.STALE: ErrorCode.STALE_SUBSCRIPTION,
}
AckCheck = Callable[[str, str, EmitSeq], AckOutcome]
"""`BucketStateMachine.check_ack`: would an ack be accepted now?"""

COUNTED: Final = ("started", "committed", "aborted", "timed_out", "fenced")
_COUNT_OF: Final = {
    TxnOutcome.COMMIT: "committed",
    TxnOutcome.ABORT: "aborted",
    TxnOutcome.ABORT_TIMED_OUT: "timed_out",
    TxnOutcome.ABORT_FENCED: "fenced",
}

_ABORTS: Final = frozenset({TxnOutcome.ABORT, TxnOutcome.ABORT_TIMED_OUT, TxnOutcome.ABORT_FENCED})


@dataclass(slots=True)
class TxnRecord:
    """One transaction not yet complete, at its coordinator."""

    number: int
    epoch: int
    phase: TxnPhase
    buckets: tuple[int, ...]
    started_ms: int
    outcome: TxnOutcome = TxnOutcome.NONE
    """Decided (PREPARE_*): COMMIT, or the kind of abort."""

    def pack(self) -> list[object]:
        return [
            self.number,
            self.epoch,
            int(self.phase),
            list(self.buckets),
            self.started_ms,
            int(self.outcome),
        ]


@dataclass(slots=True)
class TxnIdState:
    """A transactional id at its coordinator: owner, epoch, timeout, transactions."""

    owner: str
    epoch: int
    timeout_ms: int
    last_number: int = 0
    txns: dict[int, TxnRecord] = field(default_factory=dict)
    """Open or decided and not complete, by number."""
    last_decided: tuple[int, TxnOutcome] = (0, TxnOutcome.NONE)
    """The newest decided transaction's number and outcome (a retried END's answer)."""

    @property
    def open(self) -> TxnRecord | None:
        for txn in self.txns.values():
            if txn.phase is TxnPhase.ONGOING:
                return txn
        return None


@dataclass(slots=True)
class PendingTxn:
    """A transaction's writes kept in a participant bucket until its marker."""

    epoch: int
    owner: str
    ops: list[Op] = field(default_factory=list)
    value_bytes: int = 0
    writes: int = 0
    """The sequence of the last TXN_WRITE taken (a retried one is not taken twice)."""
    acks: dict[str, Ack] = field(default_factory=dict)
    """Subscription acks to apply with the commit: sub_id -> the furthest one."""


@dataclass(frozen=True, slots=True)
class DueMarkers:
    """A decided transaction whose markers a coordinator's leader must write."""

    txn_id: str
    epoch: int
    number: int
    outcome: TxnOutcome
    buckets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TxnInfo:
    """One transaction not complete, as `sevendb txn list` shows it."""

    txn_id: str
    owner: str
    epoch: int
    number: int
    phase: TxnPhase
    outcome: TxnOutcome
    buckets: tuple[int, ...]
    started_ms: int
    timeout_ms: int


class _Reader(Protocol):
    @property
    def isolation(self) -> Isolation: ...


def uncommitted_readers(rows: Iterable[OutboxRow], subs: Mapping[str, _Reader]) -> frozenset[str]:
    """The sub_ids of `rows` whose subscriptions read uncommitted (`RowsPurged`)."""
    found = set()
    for row in rows:
        sub = subs.get(row.sub_id)
        if sub is not None and sub.isolation is Isolation.READ_UNCOMMITTED:
            found.add(row.sub_id)
    return frozenset(found)


def _reject(code: ErrorCode, message: str) -> Rejection:
    return Rejection(code, message)


def _ended_error(txn_id: str, number: int, outcome: TxnOutcome) -> Rejection:
    if outcome is TxnOutcome.ABORT_TIMED_OUT:
        return _reject(
            ErrorCode.TRANSACTION_TIMED_OUT,
            f"transaction {number} of {txn_id!r} timed out and was aborted; begin a new one",
        )
    if outcome is TxnOutcome.ABORT_FENCED:
        return _reject(
            ErrorCode.PRODUCER_FENCED,
            f"transaction {number} of {txn_id!r} was aborted: a newer instance initialised",
        )
    return _reject(
        ErrorCode.INVALID_TXN_STATE,
        f"transaction {number} of {txn_id!r} is already decided ({outcome.name})",
    )


class TxnState:
    """Both halves of a bucket's transactions (see the module docstring)."""

    def __init__(self) -> None:
        self.ids: dict[str, TxnIdState] = {}
        self.pending: dict[tuple[str, int], PendingTxn] = {}
        self.ended: dict[str, tuple[int, TxnOutcome]] = {}
        """Participant: txn_id -> the newest transaction marked here (number, outcome)."""
        self.counts: dict[str, int] = dict.fromkeys(COUNTED, 0)
        """Coordinator: transactions begun, and decided by kind, ever (the metrics)."""

    def __bool__(self) -> bool:
        return bool(self.ids or self.pending or self.ended)

    # ---- coordinator -------------------------------------------------------------

    def apply(self, entry: Txn) -> TxnResult:
        """A coordinator-side TXN entry (INIT, ADD, END, COMPLETE, EXPIRE, RESOLVE)."""
        if entry.action is TxnAction.INIT:
            return self._init(entry)
        state = self.ids.get(entry.txn_id)
        if state is None:
            return TxnResult(
                entry.txn_id,
                error=_reject(
                    ErrorCode.INVALID_TXN_ID,
                    f"transactional id {entry.txn_id!r} is not initialised at its coordinator",
                ),
            )
        if entry.action is TxnAction.EXPIRE:
            return self._expire(entry, state)
        if entry.action is TxnAction.COMPLETE:
            done = state.txns.get(entry.number)
            if done is not None and done.phase is not TxnPhase.ONGOING:
                del state.txns[entry.number]
            return TxnResult(entry.txn_id, state.epoch, entry.number)
        if entry.action is TxnAction.RESOLVE:
            return self._decide(entry, state, TxnOutcome(entry.outcome))
        refused = self._check_caller(entry, state)
        if refused is not None:
            return TxnResult(entry.txn_id, state.epoch, entry.number, error=refused)
        if entry.action is TxnAction.ADD:
            return self._add(entry, state)
        return self._decide(entry, state, TxnOutcome(entry.outcome))

    def _init(self, entry: Txn) -> TxnResult:
        state = self.ids.get(entry.txn_id)
        if state is None:
            if len(self.ids) >= limits.TXN_IDS_PER_BUCKET_MAX:
                return TxnResult(
                    entry.txn_id,
                    error=_reject(
                        ErrorCode.LIMIT_EXCEEDED,
                        f"bucket already coordinates {limits.TXN_IDS_PER_BUCKET_MAX} "
                        "transactional ids",
                    ),
                )
            self.ids[entry.txn_id] = TxnIdState(entry.principal, 0, entry.timeout_ms)
            return TxnResult(entry.txn_id, 0)  # number 0: the first transaction is 1
        if state.owner and entry.principal != state.owner:
            return TxnResult(
                entry.txn_id,
                state.epoch,
                error=_reject(
                    ErrorCode.PERMISSION_DENIED,
                    f"transactional id {entry.txn_id!r} belongs to another principal: "
                    f"{entry.principal or 'this caller'} lacks ownership of it",
                ),
            )
        if state.epoch >= 2**32 - 1:
            return TxnResult(
                entry.txn_id,
                state.epoch,
                error=_reject(ErrorCode.LIMIT_EXCEEDED, "the transactional id's epochs ran out"),
            )
        fenced = state.open
        state.epoch += 1
        state.timeout_ms = entry.timeout_ms
        state.owner = state.owner or entry.principal
        if fenced is None:
            return TxnResult(entry.txn_id, state.epoch, state.last_number)
        self._prepare(state, fenced, TxnOutcome.ABORT_FENCED)
        return TxnResult(
            entry.txn_id, state.epoch, fenced.number, TxnOutcome.ABORT_FENCED, fenced.buckets
        )

    @staticmethod
    def _check_caller(entry: Txn, state: TxnIdState) -> Rejection | None:
        if state.owner and entry.principal != state.owner:
            return _reject(
                ErrorCode.PERMISSION_DENIED,
                f"transactional id {entry.txn_id!r} belongs to another principal: "
                f"{entry.principal or 'this caller'} lacks ownership of it",
            )
        if entry.epoch < state.epoch:
            return _reject(
                ErrorCode.PRODUCER_FENCED,
                f"transactional id {entry.txn_id!r} epoch {entry.epoch} is fenced by epoch "
                f"{state.epoch}",
            )
        if entry.epoch > state.epoch:
            return _reject(
                ErrorCode.INVALID_PRODUCER_EPOCH,
                f"transactional id {entry.txn_id!r} epoch {entry.epoch} was never granted "
                f"(current {state.epoch})",
            )
        return None

    def _add(self, entry: Txn, state: TxnIdState) -> TxnResult:
        found = state.txns.get(entry.number)
        if found is None and entry.number == state.last_number + 1:
            current = state.open
            if current is not None:
                return TxnResult(
                    entry.txn_id,
                    state.epoch,
                    current.number,
                    error=_reject(
                        ErrorCode.CONCURRENT_TRANSACTIONS,
                        f"transaction {current.number} of {entry.txn_id!r} is open: commit or "
                        "abort it first",
                    ),
                )
            if len(state.txns) >= limits.TXN_PENDING_PER_PRODUCER_MAX:
                return TxnResult(
                    entry.txn_id,
                    state.epoch,
                    error=_reject(
                        ErrorCode.TOO_MANY_TRANSACTIONS,
                        f"{entry.txn_id!r} has {len(state.txns)} transactions not complete; "
                        f"the limit is {limits.TXN_PENDING_PER_PRODUCER_MAX}",
                    ),
                )
            state.last_number += 1
            self.counts["started"] += 1
            txn = TxnRecord(state.last_number, state.epoch, TxnPhase.ONGOING, (), entry.now_ms)
            state.txns[txn.number] = txn
        else:
            if found is None or found.phase is not TxnPhase.ONGOING:
                return TxnResult(
                    entry.txn_id, state.epoch, entry.number, error=self._gone(entry, state)
                )
            txn = found
        added = tuple(b for b in entry.buckets if b not in txn.buckets)
        if len(txn.buckets) + len(added) > limits.TXN_BUCKETS_MAX:
            return TxnResult(
                entry.txn_id,
                state.epoch,
                txn.number,
                error=_reject(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"a transaction spans at most {limits.TXN_BUCKETS_MAX} buckets",
                ),
            )
        txn.buckets = tuple(sorted((*txn.buckets, *added)))
        return TxnResult(entry.txn_id, state.epoch, txn.number, buckets=added)

    @staticmethod
    def _gone(entry: Txn, state: TxnIdState) -> Rejection:
        """Why transaction `entry.number` is not open."""
        found = state.txns.get(entry.number)
        number, outcome = state.last_decided
        if found is not None:
            return _ended_error(entry.txn_id, entry.number, found.outcome)
        if entry.number == number:
            return _ended_error(entry.txn_id, number, outcome)
        if entry.number > state.last_number:
            return _reject(
                ErrorCode.INVALID_TXN_STATE,
                f"transaction {entry.number} of {entry.txn_id!r} was never begun",
            )
        return _reject(
            ErrorCode.INVALID_TXN_STATE,
            f"transaction {entry.number} of {entry.txn_id!r} is complete",
        )

    def _decide(self, entry: Txn, state: TxnIdState, outcome: TxnOutcome) -> TxnResult:
        """END or RESOLVE: decide transaction `entry.number` (a retry of the same
        decision answers as the first did)."""
        txn = state.txns.get(entry.number)
        if txn is not None and txn.phase is TxnPhase.ONGOING:
            self._prepare(state, txn, outcome)
            return TxnResult(entry.txn_id, state.epoch, txn.number, outcome, txn.buckets)
        decided = txn.outcome if txn is not None else None
        if decided is None and entry.number == state.last_decided[0]:
            decided = state.last_decided[1]
        if decided is outcome or (decided in _ABORTS and outcome is TxnOutcome.ABORT):
            buckets = txn.buckets if txn is not None else ()
            return TxnResult(entry.txn_id, state.epoch, entry.number, decided, buckets)
        return TxnResult(entry.txn_id, state.epoch, entry.number, error=self._gone(entry, state))

    def _prepare(self, state: TxnIdState, txn: TxnRecord, outcome: TxnOutcome) -> None:
        self.counts[_COUNT_OF[outcome]] += 1
        commit = outcome is TxnOutcome.COMMIT
        txn.phase = TxnPhase.PREPARE_COMMIT if commit else TxnPhase.PREPARE_ABORT
        txn.outcome = outcome
        if txn.number > state.last_decided[0]:
            state.last_decided = (txn.number, outcome)

    def _expire(self, entry: Txn, state: TxnIdState) -> TxnResult:
        txn = state.open
        if txn is None or entry.now_ms - txn.started_ms <= state.timeout_ms:
            return TxnResult(entry.txn_id, state.epoch)  # nothing timed out at that time
        self._prepare(state, txn, TxnOutcome.ABORT_TIMED_OUT)
        return TxnResult(
            entry.txn_id, state.epoch, txn.number, TxnOutcome.ABORT_TIMED_OUT, txn.buckets
        )

    def due(self) -> Iterator[DueMarkers]:
        """Decided transactions whose markers are due, in id and number order."""
        for txn_id in sorted(self.ids):
            state = self.ids[txn_id]
            for number in sorted(state.txns):
                txn = state.txns[number]
                if txn.phase is not TxnPhase.ONGOING:
                    yield DueMarkers(txn_id, txn.epoch, number, txn.outcome, txn.buckets)

    def timed_out(self, now_ms: int) -> list[str]:
        """Transactional ids whose open transaction is older than its timeout at `now_ms`."""
        out = []
        for txn_id in sorted(self.ids):
            state = self.ids[txn_id]
            txn = state.open
            if txn is not None and now_ms - txn.started_ms > state.timeout_ms:
                out.append(txn_id)
        return out

    def transactions(self) -> list[TxnInfo]:
        """Every transaction not complete that this bucket coordinates."""
        return [
            TxnInfo(
                txn_id,
                state.owner,
                txn.epoch,
                txn.number,
                txn.phase,
                txn.outcome,
                txn.buckets,
                txn.started_ms,
                state.timeout_ms,
            )
            for txn_id, state in sorted(self.ids.items())
            for _, txn in sorted(state.txns.items())
        ]

    # ---- participant -------------------------------------------------------------

    def join(self, entry: Txn) -> TxnResult:
        key = (entry.txn_id, entry.number)
        pending = self.pending.get(key)
        if pending is not None:
            return TxnResult(entry.txn_id, pending.epoch, entry.number)
        ended = self.ended.get(entry.txn_id)
        if ended is not None and ended[0] >= entry.number:
            return TxnResult(
                entry.txn_id,
                entry.epoch,
                entry.number,
                error=_ended_error(entry.txn_id, entry.number, ended[1]),
            )
        self.pending[key] = PendingTxn(entry.epoch, entry.principal)
        return TxnResult(entry.txn_id, entry.epoch, entry.number)

    def prepare(self, entry: Txn) -> TxnResult:
        """PREPARE, before a COMMIT is decided: refused (INVALID_TXN_STATE) unless this
        bucket holds exactly `entry.writes` writes of the transaction, so that the
        COMMIT marker, once decided, finds here what the producer wrote. A transaction
        already ended here passes (the coordinator answers for it); nothing changes."""
        ended = self.ended.get(entry.txn_id)
        if ended is not None and ended[0] >= entry.number:
            return TxnResult(entry.txn_id, entry.epoch, entry.number)
        pending = self.pending.get((entry.txn_id, entry.number))
        held = 0 if pending is None else pending.writes
        if held == entry.writes:
            return TxnResult(entry.txn_id, entry.epoch, entry.number)
        joined = "joined it" if pending is not None else "never joined it"
        return TxnResult(
            entry.txn_id,
            entry.epoch,
            entry.number,
            error=_reject(
                ErrorCode.INVALID_TXN_STATE,
                f"transaction {entry.number} of {entry.txn_id!r} cannot commit: a participant "
                f"bucket holds {held} of the {entry.writes} writes sent to it ({joined})",
            ),
        )

    def write(
        self, entry: TxnWrite, version_of: Callable[[str], int | None], check_ack: AckCheck
    ) -> TxnWriteResult:
        """Keep `entry`'s ops and acks pending (checked now against the committed
        versions `version_of` gives, None for an absent key, and the acks against the
        subscriptions as `check_ack` judges them: each must be one that would be
        accepted, beyond any the transaction holds already)."""
        pending = self.pending.get((entry.txn_id, entry.number))
        refused = self._write_refusal(entry, pending, version_of)
        if refused is None and pending is not None and entry.sequence > pending.writes:
            refused = self._ack_refusal(entry, pending, check_ack)
        if refused is not None:
            return TxnWriteResult(entry.txn_id, entry.number, refused)
        assert pending is not None
        if entry.sequence <= pending.writes:
            return TxnWriteResult(entry.txn_id, entry.number)  # a retry: taken before
        if entry.sequence != pending.writes + 1:
            return TxnWriteResult(
                entry.txn_id,
                entry.number,
                _reject(
                    ErrorCode.OUT_OF_ORDER_SEQUENCE,
                    f"transactional write {entry.sequence} skips ahead; expected "
                    f"{pending.writes + 1}",
                ),
            )
        pending.writes = entry.sequence
        pending.ops.extend(entry.ops)
        for ack in entry.acks:
            pending.acks[ack.sub_id] = ack
        pending.value_bytes += sum(len(op.value) for op in entry.ops)
        return TxnWriteResult(entry.txn_id, entry.number)

    def _write_refusal(
        self,
        entry: TxnWrite,
        pending: PendingTxn | None,
        version_of: Callable[[str], int | None],
    ) -> Rejection | None:
        if pending is None:
            ended = self.ended.get(entry.txn_id)
            if ended is not None and ended[0] >= entry.number:
                return _ended_error(entry.txn_id, entry.number, ended[1])
            return _reject(
                ErrorCode.BUCKET_NOT_IN_TXN,
                f"this bucket was not added to transaction {entry.number} of {entry.txn_id!r}",
            )
        if pending.owner and entry.principal != pending.owner:
            return _reject(
                ErrorCode.PERMISSION_DENIED,
                f"transactional id {entry.txn_id!r} belongs to another principal: "
                f"{entry.principal or 'this caller'} lacks ownership of it",
            )
        if entry.epoch != pending.epoch:
            code = (
                ErrorCode.PRODUCER_FENCED
                if entry.epoch < pending.epoch
                else (ErrorCode.INVALID_PRODUCER_EPOCH)
            )
            return _reject(
                code,
                f"transaction {entry.number} of {entry.txn_id!r} belongs to epoch "
                f"{pending.epoch}, not {entry.epoch}",
            )
        if len(pending.ops) + len(entry.ops) > limits.TXN_OPS_PER_BUCKET_MAX or (
            pending.value_bytes + sum(len(op.value) for op in entry.ops)
            > limits.TXN_BYTES_PER_BUCKET_MAX
        ):
            return _reject(
                ErrorCode.LIMIT_EXCEEDED,
                f"a transaction keeps at most {limits.TXN_OPS_PER_BUCKET_MAX} ops and "
                f"{limits.TXN_BYTES_PER_BUCKET_MAX} value bytes pending in one bucket",
            )
        for op in entry.ops:
            expected = op.expected
            if expected.kind is ExpectKind.ANY:
                continue
            version = version_of(op.key)
            if expected.kind is ExpectKind.NOT_EXISTS and version is None:
                continue
            if expected.kind is ExpectKind.EXACT and version == expected.version:
                continue
            actual = "absent" if version is None else f"at version {version}"
            return _reject(
                ErrorCode.PRECONDITION_FAILED,
                f"key {op.key!r} expected {expected} but is {actual}",
            )
        return None

    @staticmethod
    def _ack_refusal(entry: TxnWrite, pending: PendingTxn, check_ack: AckCheck) -> Rejection | None:
        for ack in entry.acks:
            if ack.principal != entry.principal:
                return _reject(ErrorCode.NOT_OWNER, f"ack of {ack.sub_id} by another principal")
            held = pending.acks.get(ack.sub_id)
            if held is not None and ack.up_to <= held.up_to:
                return _reject(
                    ErrorCode.REGRESSIVE_ACK,
                    f"the transaction already acknowledges {ack.sub_id} through {held.up_to}",
                )
            outcome = check_ack(ack.sub_id, ack.principal, ack.up_to)
            if outcome.status is not AckStatus.ACCEPTED:
                return _reject(_ACK_ERRORS[outcome.status], outcome.message)
        return None

    def mark(self, entry: Txn) -> tuple[TxnResult, tuple[Op, ...], tuple[Ack, ...]]:
        """A marker: the pending ops and acks to apply now (COMMIT), or none (an
        abort, or a marker that was applied before: markers are idempotent)."""
        pending = self.pending.pop((entry.txn_id, entry.number), None)
        ended = self.ended.pop(entry.txn_id, None)  # re-inserted: newest last
        if ended is None or ended[0] < entry.number:
            ended = (entry.number, TxnOutcome(entry.outcome))
        self.ended[entry.txn_id] = ended
        while len(self.ended) > limits.TXN_ENDED_REMEMBERED_MAX:
            del self.ended[next(iter(self.ended))]
        result = TxnResult(entry.txn_id, entry.epoch, entry.number, TxnOutcome(entry.outcome))
        if pending is None or entry.outcome is not TxnOutcome.COMMIT:
            return result, (), ()
        return result, tuple(pending.ops), tuple(pending.acks[k] for k in sorted(pending.acks))

    def acks_pending_for(self, sub_id: str) -> list[tuple[str, int]]:
        """The transactions (id, number) holding an ack of subscription `sub_id` until
        their marker: its acknowledged position may still move when they end."""
        return [key for key, pending in sorted(self.pending.items()) if sub_id in pending.acks]

    def pending_ops(self) -> int:
        return sum(len(p.ops) for p in self.pending.values())

    def active(self) -> int:
        """Transactions coordinated here not complete (open, or decided)."""
        return sum(len(state.txns) for state in self.ids.values())

    # ---- snapshots -----------------------------------------------------------------

    def pack(self) -> list[object]:
        ids = [
            [
                txn_id,
                s.owner,
                s.epoch,
                s.timeout_ms,
                s.last_number,
                [t.pack() for _, t in sorted(s.txns.items())],
                [s.last_decided[0], int(s.last_decided[1])],
            ]
            for txn_id, s in sorted(self.ids.items())
        ]
        pending = [
            [
                txn_id,
                number,
                p.epoch,
                p.owner,
                [[int(op.kind), op.key, op.value] for op in p.ops],
                p.writes,
                [[a.sub_id, a.principal, a.up_to.pack()] for _, a in sorted(p.acks.items())],
            ]
            for (txn_id, number), p in sorted(self.pending.items())
        ]
        ended = [[txn_id, number, int(outcome)] for txn_id, (number, outcome) in self.ended.items()]
        return [ids, pending, ended, [self.counts[k] for k in COUNTED]]

    @classmethod
    def unpack(cls, raw: Any) -> TxnState:
        """The state `pack` made (raises on anything else; the caller reports it)."""
        ids, pending, ended, counts = raw
        state = cls()
        if len(counts) != len(COUNTED):
            raise ValueError(f"{len(counts)} transaction counts")
        state.counts = dict(zip(COUNTED, counts, strict=True))
        for txn_id, owner, epoch, timeout_ms, last_number, txns, (number, outcome) in ids:
            records = {}
            for t_number, t_epoch, phase, buckets, started, t_outcome in txns:
                records[t_number] = TxnRecord(
                    t_number,
                    t_epoch,
                    TxnPhase(phase),
                    tuple(buckets),
                    started,
                    TxnOutcome(t_outcome),
                )
            state.ids[txn_id] = TxnIdState(
                owner, epoch, timeout_ms, last_number, records, (number, TxnOutcome(outcome))
            )
        for txn_id, number, epoch, owner, ops, writes, acks in pending:
            made = PendingTxn(epoch, owner, writes=writes)
            for sub_id, who, up_to in acks:
                made.acks[sub_id] = Ack(sub_id, who, EmitSeq(*up_to))
            for kind, key, value in ops:
                made.ops.append(Op(OpKind(kind), key, value))
                made.value_bytes += len(value)
            state.pending[txn_id, number] = made
        for txn_id, number, outcome in ended:
            state.ended[txn_id] = (number, TxnOutcome(outcome))
        return state


__all__ = [
    "COUNTED",
    "DueMarkers",
    "PendingTxn",
    "TxnIdState",
    "TxnInfo",
    "TxnPhase",
    "TxnRecord",
    "TxnState",
    "uncommitted_readers",
]
