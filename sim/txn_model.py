"""The checker's model of transactions, written from docs/transactions.md rather than
from `outbox/txn.py`: what each TXN and TXN_WRITE entry must answer (its refusal code,
or none) and, at a COMMIT marker, which writes become visible. It also keeps what the
two transaction invariants need: which transactions were decided which way and which
were marked (`atomicity`), and which values belong to which transaction
(`read-committed`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from sevendb.outbox.entries import ExpectKind, OpKind, Txn, TxnAction, TxnOutcome, TxnWrite

PENDING_MAX: Final = 5
"""Transactions of one id not complete (docs/transactions.md, "Limits")."""
TAG: Final = b"t:"
"""Values the simulated transactional clients write start with this (plain writes
carry two random bytes): `tag_of` reads the transaction back from a value."""


def tag(txn_id: str, number: int, seq: int) -> bytes:
    return TAG + f"{txn_id}:{number}:{seq}".encode()


def tag_of(value: bytes) -> tuple[str, int] | None:
    """(txn_id, number) of a transactional value, None for a plain one."""
    if len(value) <= 2 or not value.startswith(TAG):
        return None
    txn_id, number, _ = value[2:].decode().split(":")
    return txn_id, int(number)


@dataclass(slots=True)
class MTxn:
    number: int
    epoch: int
    buckets: tuple[int, ...]
    started_ms: int
    outcome: TxnOutcome = TxnOutcome.NONE
    """NONE while open; the decision once prepared."""


@dataclass(slots=True)
class MId:
    owner: str
    epoch: int
    timeout_ms: int
    last_number: int = 0
    txns: dict[int, MTxn] = field(default_factory=dict)
    last_decided: tuple[int, TxnOutcome] = (0, TxnOutcome.NONE)

    def open(self) -> MTxn | None:
        return next((t for t in self.txns.values() if t.outcome is TxnOutcome.NONE), None)


@dataclass(slots=True)
class MPending:
    epoch: int
    owner: str
    ops: list[tuple[int, str, bytes]] = field(default_factory=list)
    writes: int = 0


Ops = list[tuple[int, str, bytes]]


class TxnModel:
    """Both halves, as the contract states them (see the module docstring)."""

    def __init__(self) -> None:
        self.ids: dict[str, MId] = {}
        self.pending: dict[tuple[str, int], MPending] = {}
        self.ended: dict[str, tuple[int, TxnOutcome]] = {}
        self.decided: dict[tuple[str, int], TxnOutcome] = {}
        """Every decision ever taken, by transaction."""
        self.marked: set[tuple[str, int]] = set()
        self.completed: set[tuple[str, int]] = set()
        self.committed_at: dict[tuple[str, int], int] = {}
        """Log index of the COMMIT marker of each transaction that had writes here."""

    # ---- coordinator ---------------------------------------------------------------

    def coordinator(self, entry: Txn) -> str | None:
        if entry.action is TxnAction.INIT:
            return self._init(entry)
        state = self.ids.get(entry.txn_id)
        if state is None:
            return "INVALID_TXN_ID"
        if entry.action is TxnAction.EXPIRE:
            txn = state.open()
            if txn is not None and entry.now_ms - txn.started_ms > state.timeout_ms:
                self._decide(entry.txn_id, state, txn, TxnOutcome.ABORT_TIMED_OUT)
            return None
        if entry.action is TxnAction.COMPLETE:
            txn = state.txns.get(entry.number)
            if txn is not None and txn.outcome is not TxnOutcome.NONE:
                del state.txns[entry.number]
                self.completed.add((entry.txn_id, entry.number))
            return None
        if entry.action is not TxnAction.RESOLVE:
            if state.owner and entry.principal != state.owner:
                return "PERMISSION_DENIED"
            if entry.epoch != state.epoch:
                return "PRODUCER_FENCED" if entry.epoch < state.epoch else "INVALID_PRODUCER_EPOCH"
        if entry.action is TxnAction.ADD:
            return self._add(entry, state)
        return self._end(entry, state)

    def _init(self, entry: Txn) -> str | None:
        state = self.ids.get(entry.txn_id)
        if state is None:
            self.ids[entry.txn_id] = MId(entry.principal, 0, entry.timeout_ms)
            return None
        if state.owner and entry.principal != state.owner:
            return "PERMISSION_DENIED"
        state.epoch += 1
        state.timeout_ms = entry.timeout_ms
        txn = state.open()
        if txn is not None:
            self._decide(entry.txn_id, state, txn, TxnOutcome.ABORT_FENCED)
        return None

    def _add(self, entry: Txn, state: MId) -> str | None:
        txn = state.txns.get(entry.number)
        if txn is None and entry.number == state.last_number + 1:
            if state.open() is not None:
                return "CONCURRENT_TRANSACTIONS"
            if len(state.txns) >= PENDING_MAX:
                return "TOO_MANY_TRANSACTIONS"
            state.last_number += 1
            txn = state.txns[entry.number] = MTxn(entry.number, state.epoch, (), entry.now_ms)
        elif txn is None or txn.outcome is not TxnOutcome.NONE:
            return self._gone(entry, state)
        txn.buckets = tuple(sorted({*txn.buckets, *entry.buckets}))
        return None

    def _gone(self, entry: Txn, state: MId) -> str:
        txn = state.txns.get(entry.number)
        outcome = txn.outcome if txn is not None else None
        if outcome is None and entry.number == state.last_decided[0]:
            outcome = state.last_decided[1]
        return _ended_code(outcome)

    def _end(self, entry: Txn, state: MId) -> str | None:
        txn = state.txns.get(entry.number)
        want = TxnOutcome(entry.outcome)
        if txn is not None and txn.outcome is TxnOutcome.NONE:
            self._decide(entry.txn_id, state, txn, want)
            return None
        decided = txn.outcome if txn is not None else None
        if decided is None and entry.number == state.last_decided[0]:
            decided = state.last_decided[1]
        aborts = (TxnOutcome.ABORT, TxnOutcome.ABORT_TIMED_OUT, TxnOutcome.ABORT_FENCED)
        if decided is want or (want is TxnOutcome.ABORT and decided in aborts):
            return None
        return self._gone(entry, state)

    def _decide(self, txn_id: str, state: MId, txn: MTxn, outcome: TxnOutcome) -> None:
        txn.outcome = outcome
        self.decided[txn_id, txn.number] = outcome
        if txn.number > state.last_decided[0]:
            state.last_decided = (txn.number, outcome)

    def due(self) -> list[tuple[str, int]]:
        """Decided transactions not complete (their markers may be outstanding)."""
        return sorted(
            (txn_id, number)
            for txn_id, state in self.ids.items()
            for number, txn in state.txns.items()
            if txn.outcome is not TxnOutcome.NONE
        )

    # ---- participant --------------------------------------------------------------

    def join(self, entry: Txn) -> str | None:
        if (entry.txn_id, entry.number) in self.pending:
            return None
        ended = self.ended.get(entry.txn_id)
        if ended is not None and ended[0] >= entry.number:
            return _ended_code(ended[1])
        self.pending[entry.txn_id, entry.number] = MPending(entry.epoch, entry.principal)
        return None

    def write(self, entry: TxnWrite, versions: dict[str, int]) -> str | None:
        pending = self.pending.get((entry.txn_id, entry.number))
        if pending is None:
            ended = self.ended.get(entry.txn_id)
            if ended is not None and ended[0] >= entry.number:
                return _ended_code(ended[1])
            return "BUCKET_NOT_IN_TXN"
        if pending.owner and entry.principal != pending.owner:
            return "PERMISSION_DENIED"
        if entry.epoch != pending.epoch:
            return "PRODUCER_FENCED" if entry.epoch < pending.epoch else "INVALID_PRODUCER_EPOCH"
        for op in entry.ops:
            version = versions.get(op.key)
            exp = op.expected
            if not (
                exp.kind is ExpectKind.ANY
                or (exp.kind is ExpectKind.NOT_EXISTS and version is None)
                or (exp.kind is ExpectKind.EXACT and version == exp.version)
            ):
                return "PRECONDITION_FAILED"
        if entry.sequence <= pending.writes:
            return None
        if entry.sequence != pending.writes + 1:
            return "OUT_OF_ORDER_SEQUENCE"
        pending.writes = entry.sequence
        pending.ops.extend((int(op.kind), op.key, op.value) for op in entry.ops)
        return None

    def mark(self, index: int, entry: Txn) -> Ops:
        """A marker: the ops that become visible at it (a COMMIT of pending writes)."""
        key = (entry.txn_id, entry.number)
        self.marked.add(key)
        pending = self.pending.pop(key, None)
        ended = self.ended.pop(entry.txn_id, None)
        if ended is None or ended[0] < entry.number:
            ended = (entry.number, TxnOutcome(entry.outcome))
        self.ended[entry.txn_id] = ended
        if pending is None or entry.outcome is not TxnOutcome.COMMIT:
            return []
        if pending.ops:
            self.committed_at[key] = index
        return pending.ops


def _ended_code(outcome: TxnOutcome | None) -> str:
    if outcome is TxnOutcome.ABORT_TIMED_OUT:
        return "TRANSACTION_TIMED_OUT"
    if outcome is TxnOutcome.ABORT_FENCED:
        return "PRODUCER_FENCED"
    return "INVALID_TXN_STATE"


def op_changes(ops: Ops, versions: dict[str, int]) -> list[tuple[str, int, bytes, int]]:
    """Apply committed ops to `versions`: the changes they make."""
    changes = []
    for kind, key, value in ops:
        version = versions.get(key)
        if kind == int(OpKind.SET):
            new = 1 if version is None else version + 1
            versions[key] = new
            changes.append((key, kind, value, new))
        elif version is not None:
            del versions[key]
            changes.append((key, kind, b"", version))
    return changes


__all__ = ["TAG", "TxnModel", "op_changes", "tag", "tag_of"]
