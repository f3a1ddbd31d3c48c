"""The workload of a run's fault phase: writes and write batches (with preconditions)
through random replicas, epoch bumps, new subscriptions, unsubscriptions and reused
sub_ids, and `mallory`, a principal who acks and reconnects to others' subscriptions.

Every choice comes from the simulation's one random generator, in a fixed order.
"""

from __future__ import annotations

import random
from concurrent.futures import Future
from typing import TYPE_CHECKING, Final

from sevendb.notifier.core import AttachStatus
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    NOT_EXISTS,
    Entry,
    EpochCreate,
    Expected,
    Op,
    OpKind,
    Start,
    StartKind,
    Write,
    WriteBatch,
)
from sevendb.outbox.query import Query
from sevendb.outbox.replica import ApplyOutcome

from .client import Client, State
from .network import AckReq, AttachReply, Events, Message, ReconnectReq

if TYPE_CHECKING:
    from .world import Simulation

QUERIES: Final = ("all", "prefix:a/", "prefix:b", "key:c", "key:a/1", "prefix:")
MALLORY: Final = "mallory"


class Workload:
    """What the clients of a run ask for (see the module docstring)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.writes_left = sim.config.writes
        self.ended_subs: list[tuple[Client, str, Query]] = []
        self._starts = random.Random(f"sevendb-sim-starts/{sim.config.seed}")
        """Where new subscriptions start: drawn apart from the run's generator, so that
        every other choice of a seed stayed as it was when starts came."""

    def step(self) -> None:
        """One tick of the fault phase's workload."""
        cfg = self.sim.config
        rng = self.sim.rng
        ticks_left = max(1, (cfg.fault_ms - self.sim.now_ms) // cfg.tick_ms)
        if self.writes_left and rng.random() < min(1.0, 1.5 * self.writes_left / ticks_left):
            self._write()
        if cfg.enabled("epoch_bump") and rng.random() < 0.002 * cfg.fault_rate:
            self.epoch_bump()
        if cfg.enabled("new_subs") and rng.random() < 0.004:
            client = rng.choice(list(self.sim.clients.values()))
            client.generation += 1
            client.subscribe(
                f"s{client.name[1:]}.n{client.generation}",
                Query.parse(rng.choice(QUERIES)),
                begin=self._start(),
            )
            self.sim.stats["new_subs"] += 1
        if cfg.enabled("unsubscribe") and rng.random() < (0.01 if cfg.reuse_sub_ids else 0.002):
            client = rng.choice(list(self.sim.clients.values()))
            streaming = [s for s in client.subs if s.state is State.STREAMING]
            if streaming:
                sub = rng.choice(streaming)
                client.unsubscribe(sub)
                self.ended_subs.append((client, sub.sub_id, sub.query))
                self.sim.stats["unsubscribes"] += 1
        if cfg.reuse_sub_ids and self.ended_subs and rng.random() < 0.3:
            client, sub_id, query = self.ended_subs[0]
            if not self.sim.checker.model_has_live(sub_id):
                self.ended_subs.pop(0)
                client.subscribe(sub_id, query)
                self.sim.stats["reused_sub_ids"] += 1

    def _start(self) -> Start:
        """Latest, earliest, after a committed change set, or from a time."""
        kinds = (StartKind.LATEST, StartKind.EARLIEST, StartKind.AFTER, StartKind.TIME)
        kind = self._starts.choice(kinds)
        self.sim.stats[f"start_{kind.name.lower()}"] += 1
        model = self.sim.checker.model
        if kind is StartKind.AFTER:
            seen = [emit for emit, _, _ in model.history] or [model.history_after]
            return Start(kind, self._starts.choice(seen))
        if kind is StartKind.TIME:
            return Start(kind, time_ms=self._starts.randint(0, self.sim.now_ms))
        return Start(kind)

    def _write(self) -> None:
        rng = self.sim.rng
        via = self.sim.raft.members[rng.choice(self.sim.replica_names)]
        entry: Entry = self._one_write()
        if rng.random() < 0.2:
            entry = WriteBatch(tuple(self._one_write() for _ in range(rng.randint(2, 3))))
        future = self.sim.propose(via, entry)
        if future is not None:
            self.sim.stats["writes"] += 1
            self.writes_left -= 1  # a refused write is retried later
            future.add_done_callback(self._write_done)

    def _write_done(self, future: Future[ApplyOutcome]) -> None:
        """The client hears back: its write committed (acknowledged) or not (unknown)."""
        if future.exception() is None:
            self.sim.stats["writes_acked"] += 1
            self.sim.checker.on_write_acked(future.result().commit_index)

    def _one_write(self) -> Write:
        rng = self.sim.rng
        ops = []
        for key in rng.sample(self.sim.config.keys, rng.randint(1, 2)):
            expected = Expected()
            roll = rng.random()
            if roll < 0.08:
                expected = NOT_EXISTS
            elif roll < 0.16:
                expected = Expected.exact(rng.randint(1, 3))
            if rng.random() < 0.15:
                ops.append(Op(OpKind.DEL, key, b"", expected))
            else:
                ops.append(Op(OpKind.SET, key, rng.randbytes(2), expected))
        return Write(tuple(ops), None, self.sim.now_ms + rng.randint(0, 3))

    def epoch_bump(self) -> None:
        for r in self.sim.raft.leaders():
            if r.active(self.sim.now_ms):
                entry = EpochCreate(r.sm.epoch.epoch_counter + 1, self.sim.now_ms)
                if self.sim.propose(r, entry) is not None:
                    self.sim.faults["epoch_bump"] += 1
                    self.sim.trace("epoch?", r.name, entry.epoch_counter)
                return

    def mallory_step(self) -> None:
        """Mallory acks, or reconnects to, someone else's subscription."""
        sim = self.sim
        model = sim.checker.model
        subs = sorted(model.subs)
        if not subs:
            return
        sub_id = sim.rng.choice(subs)
        target = sim.rng.choice(sim.replica_names)
        up_to = EmitSeq(sim.bucket_uuid, model.epoch, sim.checker.commit_index)
        sim.faults["malicious"] += 1
        if sim.rng.random() < 0.5:
            sim.net.send(sim.now_ms, MALLORY, target, AckReq(sub_id, MALLORY, up_to))
        else:
            sub = model.subs[sub_id]
            after = sim.rng.choice((sub.start, sub.head, sub.acked))
            req = ReconnectReq(sub_id, MALLORY, MALLORY, sim.new_conn(), after)
            sim.net.send(sim.now_ms, MALLORY, target, req)

    def mallory_receive(self, message: Message) -> None:
        sim = self.sim
        body = message.body
        if isinstance(body, AttachReply):
            nowhere = EmitSeq(sim.bucket_uuid, 0, 0)
            sim.checker.on_attach(MALLORY, body.sub_id, nowhere, body.attach, False)
            if body.attach.status is AttachStatus.ATTACHED:
                sim.stats["mallory_attached"] += 1
        elif isinstance(body, Events):
            for row in body.rows:
                sim.checker.on_receive(MALLORY, body.sub_id, row)
