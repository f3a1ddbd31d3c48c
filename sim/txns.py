"""Transactions in the simulation (docs/transactions.md, docs/sim.md): transactional
producers that run transactions through random replicas under the run's faults, and
the driver the node adapter runs in production (`cluster/server/txns.py`): the
coordinator's leader writes the markers of every decided transaction, then its
COMPLETE, and aborts open ones past their timeout.

The bucket is both the coordinator of the simulated transactional ids and the one
participant of their transactions. Every choice comes from a generator of its own
(seeded from the run's seed), so that runs without transactions draw as before.
"""

from __future__ import annotations

import random
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from sevendb.outbox.entries import (
    Entry,
    Expected,
    Op,
    OpKind,
    Txn,
    TxnAction,
    TxnOutcome,
    TxnWrite,
)
from sevendb.outbox.model import TxnResult, TxnWriteResult
from sevendb.outbox.replica import ApplyOutcome

from .txn_model import tag

if TYPE_CHECKING:
    from .raft import Member
    from .world import Simulation

PRINCIPAL: Final = "producer"
BUCKET_NUMBER: Final = 0
"""The simulated bucket's number, as a transaction's participant list names it."""
CALL_TIMEOUT_MS: Final = 1_000
"""A proposal not answered this long is given up (and proposed again): as a node's
proposal times out (its outcome unknown)."""
RETRYABLE: Final = frozenset({"CONCURRENT_TRANSACTIONS", "TOO_MANY_TRANSACTIONS"})
"""Refusals a producer waits out (the timeout or the driver ends the cause)."""


@dataclass(slots=True)
class _Call:
    entry: Entry
    future: Future[ApplyOutcome] | None
    at_ms: int


class TxnProducer:
    """One transactional id's producer: transactions one after another, each a script
    of entries (begin, join, writes, decision) proposed one at a time and retried until
    answered (every step is idempotent). It sometimes abandons a transaction (the
    timeout aborts it) or restarts as a new instance (INIT: fencing its own open one)."""

    def __init__(self, sim: Simulation, txn_id: str, rng: random.Random) -> None:
        self.sim = sim
        self.txn_id = txn_id
        self.rng = rng
        self.epoch: int | None = None
        self.last_number = 0
        self.script: list[Entry] = []
        self.call: _Call | None = None
        self.started = 0

    def _init(self) -> Txn:
        timeout = self.sim.config.txn_timeout_ms
        return Txn(
            TxnAction.INIT,
            self.txn_id,
            principal=PRINCIPAL,
            now_ms=self.sim.now_ms,
            timeout_ms=timeout,
        )

    def _next_script(self) -> list[Entry]:
        """The entries of the next transaction (its number: the last one's + 1)."""
        assert self.epoch is not None
        rng, now, epoch = self.rng, self.sim.now_ms, self.epoch
        number = self.last_number + 1
        script: list[Entry] = [
            Txn(
                TxnAction.ADD,
                self.txn_id,
                epoch,
                number,
                (BUCKET_NUMBER,),
                principal=PRINCIPAL,
                now_ms=now,
            ),
            Txn(TxnAction.JOIN, self.txn_id, epoch, number, principal=PRINCIPAL, now_ms=now),
        ]
        for seq in range(1, rng.randint(1, 3) + 1):
            ops = []
            for key in rng.sample(self.sim.config.keys, rng.randint(1, 2)):
                if rng.random() < 0.1:
                    ops.append(Op(OpKind.DEL, key))
                else:
                    expected = Expected.exact(1) if rng.random() < 0.05 else Expected()
                    ops.append(Op(OpKind.SET, key, tag(self.txn_id, number, seq), expected))
            script.append(TxnWrite(self.txn_id, epoch, number, tuple(ops), PRINCIPAL, now, seq))
        roll = rng.random()
        if roll < 0.08:
            return script  # abandoned: its timeout aborts it
        outcome = TxnOutcome.COMMIT if roll < 0.8 else TxnOutcome.ABORT
        end = Txn(
            TxnAction.END,
            self.txn_id,
            epoch,
            number,
            outcome=outcome,
            principal=PRINCIPAL,
            now_ms=now,
        )
        if roll < 0.13:  # a new instance fences this one, whose commit then comes late
            return [*script, self._init(), end]
        return [*script, end]

    def step(self) -> None:
        sim = self.sim
        if self.call is not None:
            future = self.call.future
            waited = sim.now_ms - self.call.at_ms
            if future is not None and not future.done() and waited < CALL_TIMEOUT_MS:
                return
            if future is not None and not future.done():
                future = None  # timed out: its outcome is unknown
            self._answered(self.call, future)
            return
        if self.epoch is None:
            self.script = [self._init()]
        elif not self.script:
            if self.started >= sim.config.txns:
                return
            self.started += 1
            sim.stats["txn_started"] += 1
            self.script = self._next_script()
        self._propose(self.script[0])

    def _propose(self, entry: Entry) -> None:
        via = self.sim.raft.members[self.rng.choice(self.sim.replica_names)]
        self.call = _Call(entry, self.sim.propose(via, entry), self.sim.now_ms)

    def _answered(self, call: _Call, future: Future[ApplyOutcome] | None) -> None:
        """The answer to the step in flight: go on, retry it, or give the
        transaction up."""
        self.call = None
        if future is None or future.exception() is not None:
            return  # not proposed, or the outcome is unknown: propose it again
        applied = future.result().applied
        assert applied is not None
        result = applied.result
        assert isinstance(result, TxnResult | TxnWriteResult)
        code = None if result.error is None else str(result.error.code)
        entry = call.entry
        if code is None:
            self.script.pop(0)
            if isinstance(entry, Txn) and entry.action is TxnAction.INIT:
                assert isinstance(result, TxnResult)
                self.epoch, self.last_number = result.epoch, result.number
                self.sim.stats["txn_inits"] += 1
            elif isinstance(entry, Txn) and entry.action is TxnAction.END:
                self.last_number = entry.number
                self.sim.stats[f"txn_{entry.outcome.name.lower()}"] += 1
            if not self.script and isinstance(entry, TxnWrite):
                self.last_number = entry.number  # abandoned after its last write
            return
        self.sim.stats[f"txn_refused_{code.lower()}"] += 1
        if code in RETRYABLE:
            return
        if code == "PRECONDITION_FAILED" and isinstance(entry, TxnWrite):
            self._skip_write(entry)
            return
        if code == "PRODUCER_FENCED":
            self.epoch = None
        number = getattr(entry, "number", 0)
        self.last_number = max(self.last_number, number)
        self.script = []  # the transaction is over (timed out, fenced, decided)

    def _skip_write(self, entry: TxnWrite) -> None:
        """A write refused for its precondition: the next ones take its sequence."""
        self.script.pop(0)
        self.script = [
            TxnWrite(e.txn_id, e.epoch, e.number, e.ops, e.principal, e.now_ms, e.sequence - 1)
            if isinstance(e, TxnWrite)
            else e
            for e in self.script
        ]


class TxnDriver:
    """The coordinator's leader finishing what was decided (the production driver's
    job): markers, then COMPLETE; and EXPIRE for open transactions past their timeout.
    What it knows (which markers it saw applied) is its node's memory: a new leader
    starts without it and writes markers again (they are idempotent). With
    `Bugs.complete_without_marker` it completes committed transactions without their
    marker."""

    def __init__(self, sim: Simulation, rng: random.Random) -> None:
        self.sim = sim
        self.rng = rng
        self.leader = ""
        self.marked: set[tuple[str, int]] = set()
        self.calls: dict[tuple[str, int, str], tuple[Future[ApplyOutcome] | None, int]] = {}

    def step(self) -> None:
        sim = self.sim
        leaders = [m for m in sim.raft.leaders() if m.active(sim.now_ms) and m.usable]
        if not leaders or self.rng.random() < 0.5:
            return
        leader = leaders[0]
        if leader.name != self.leader:
            self.leader, self.marked, self.calls = leader.name, set(), {}
        self._collect()
        now = sim.now_ms
        for txn_id in leader.sm.txns.timed_out(now):
            self._propose(leader, (txn_id, 0, "expire"), Txn(TxnAction.EXPIRE, txn_id, now_ms=now))
        due = list(leader.sm.txns.due())
        self.rng.shuffle(due)  # markers of several transactions in any order
        skip = sim.config.bugs.complete_without_marker
        for item in due:
            key = (item.txn_id, item.number)
            if key in self.marked or (skip and item.outcome is TxnOutcome.COMMIT):
                complete = Txn(TxnAction.COMPLETE, item.txn_id, item.epoch, item.number, now_ms=now)
                self._propose(leader, (*key, "complete"), complete)
                if self.rng.random() < 0.1:  # a marker again, after the fact
                    self._propose(
                        leader,
                        (*key, "again"),
                        self._marker(item.txn_id, item.epoch, item.number, item.outcome),
                    )
                continue
            self._propose(
                leader,
                (*key, "mark"),
                self._marker(item.txn_id, item.epoch, item.number, item.outcome),
            )

    def _marker(self, txn_id: str, epoch: int, number: int, outcome: TxnOutcome) -> Txn:
        return Txn(TxnAction.MARK, txn_id, epoch, number, outcome=outcome, now_ms=self.sim.now_ms)

    def _propose(self, leader: Member, key: tuple[str, int, str], entry: Txn) -> None:
        if key in self.calls:
            return  # in flight
        self.calls[key] = (self.sim.propose(leader, entry), self.sim.now_ms)
        self.sim.stats[f"txn_driver_{key[2]}"] += 1

    def _collect(self) -> None:
        """Learn which proposals were answered: an applied marker is marked; anything
        answered or lost may be proposed again."""
        for key, (future, at_ms) in list(self.calls.items()):
            waiting = future is not None and not future.done()
            if waiting and self.sim.now_ms - at_ms < CALL_TIMEOUT_MS:
                continue
            del self.calls[key]
            if (
                not waiting
                and future is not None
                and future.exception() is None
                and key[2] == "mark"
            ):
                self.marked.add((key[0], key[1]))


__all__ = ["TxnDriver", "TxnProducer"]
