"""One simulation run: a bucket's Raft group, notifiers, network, clients, workload
and faults, all driven by one `random.Random(seed)` and a simulated clock.

    report = Simulation(SimConfig.from_seed(42)).run()

The run has two phases. During `fault_ms` the workload writes, subscribes, acks,
reconnects and bumps epochs while the enabled faults fire. Then faults stop,
partitions heal, crashed processes restart, and the run continues until
everything committed has been delivered and purged (the checker's liveness
condition) or `quiet_ms_max` passes. The checker watches every step.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Final

import xxhash

from sevendb.notifier.core import AttachStatus
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    NOT_EXISTS,
    Entry,
    EntryType,
    EpochCreate,
    Expected,
    Op,
    OpKind,
    Write,
    WriteBatch,
    encode_entry,
)
from sevendb.outbox.model import Applied
from sevendb.outbox.query import Query

from .checker import Checker, Violation
from .client import Client, State
from .config import Scripted, SimConfig
from .network import AckReq, AttachReply, Events, Faults, Message, Network, ReconnectReq
from .node import NotifierHost
from .raft import RaftGroup, RaftSafetyError, Replica, Role

BUCKET: Final = "bucket-sim"
TRACE_TAIL: Final = 40
QUERIES: Final = ("all", "prefix:a/", "prefix:b", "key:c", "key:a/1", "prefix:")
MALLORY: Final = "mallory"


@dataclass(slots=True)
class Report:
    seed: int
    ok: bool
    violation: str = ""
    invariant: str = ""
    trace_tail: list[str] = field(default_factory=list)
    trace_digest: str = ""
    stats: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    end_ms: int = 0
    replay: str = ""

    def describe(self) -> str:
        lines = [f"seed {self.seed}: " + ("ok" if self.ok else f"VIOLATION {self.violation}")]
        if not self.ok:
            lines.append("last steps:")
            lines.extend("  " + line for line in self.trace_tail)
            lines.append(f"replay: {self.replay}")
        return "\n".join(lines)


class Simulation:
    def __init__(self, config: SimConfig, *, keep_trace: bool = False) -> None:
        self.config = config
        self.full_trace: list[tuple[object, ...]] | None = [] if keep_trace else None
        self.rng = random.Random(config.seed)
        self.now_ms = 0
        self.replica_names = config.replica_names()
        self.net = Network(self.rng)
        self.checker = Checker(BUCKET, tolerate_divergence=bool(config.planners))
        self.raft = RaftGroup(BUCKET, self.replica_names, self.rng, dict(config.planners))
        self.hosts = {name: NotifierHost(self, r) for name, r in self.raft.replicas.items()}
        self.clients: dict[str, Client] = {}
        self.stats: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self._tail: deque[tuple[object, ...]] = deque(maxlen=TRACE_TAIL)
        self._hash = xxhash.xxh64()
        self._conn = 0
        self._restarts: list[tuple[int, str]] = []
        self._heal_at = -1
        self._scripted = sorted(config.scripted)
        self._writes_left = config.writes
        self._ended_subs: list[tuple[Client, str, Query]] = []
        self.in_fault_phase = True
        for i in range(config.clients):
            client = Client(self, f"c{i}", f"p{i}")
            for j in range(config.subs_per_client):
                client.subscribe(f"s{i}.{j}", Query.parse(self.rng.choice(QUERIES)))
            self.clients[client.name] = client
        malicious = any(e.action == "mallory" for e in config.scripted)
        self.mallory = Client(self, "mallory", MALLORY) if malicious else None

    # ---- services for replicas and clients -------------------------------------

    def trace(self, kind: str, *args: object) -> None:
        event = (self.now_ms, kind, *args)
        self._tail.append(event)
        if self.full_trace is not None:
            self.full_trace.append(event)
        self._hash.update(repr(event).encode())

    def new_conn(self) -> int:
        self._conn += 1
        return self._conn

    def reachable(self, a: str, b: str) -> bool:
        """Between replicas (Raft traffic)."""
        return self.net.reachable_raft(a, b)

    def propose(self, via: Replica, entry: Entry) -> int | None:
        index = self.raft.propose(via, encode_entry(entry), self.reachable, self.now_ms)
        if index is not None:
            self.stats["proposals"] += 1
        return index

    def crash_replica(
        self, replica: Replica, *, kind: str = "replica_crash", down_ms: int | None = None
    ) -> None:
        if not replica.alive:
            return
        replica.crash()
        self.hosts[replica.name].reset()
        if down_ms is None:
            down_ms = self.rng.randint(50, 600)
        self._restarts.append((self.now_ms + down_ms, replica.name))
        self.faults[kind] += 1
        self.trace("crash", replica.name, replica.last_index, replica.durable)

    def holder(self) -> Replica | None:
        """The replica that currently emits (its own applied state says so)."""
        best = None
        for r in self.raft.replicas.values():
            if (
                r.usable
                and r.sm.lease_holder == r.name
                and (best is None or r.sm.lease_index > best.sm.lease_index)
            ):
                best = r
        return best

    # ---- the apply hook ----------------------------------------------------------

    def on_apply(self, replica: Replica, index: int, data: bytes, applied: Applied | None) -> None:
        self.checker.on_apply(replica.name, index, data, applied)
        if index % self.config.digest_every == 0 or not data:
            self.checker.on_digest(replica.name, index, replica.sm.digest())
        if applied is not None:
            self.hosts[replica.name].on_applied(index, applied, self.now_ms)

    # ---- the run -----------------------------------------------------------------

    def run(self) -> Report:
        violation: Violation | None = None
        try:
            self._run()
        except Violation as exc:
            violation = exc
        except RaftSafetyError as exc:
            violation = Violation("raft-safety", str(exc))
        report = Report(
            self.config.seed,
            violation is None,
            trace_tail=[self._fmt(e) for e in self._tail],
            trace_digest=self._hash.hexdigest(),
            stats=dict(sorted(self.stats.items())),
            faults=dict(sorted(self.faults.items())),
            end_ms=self.now_ms,
            replay=self.config.replay_command(),
        )
        report.stats.update(
            checks=self.checker.checks,
            received=self.checker.received,
            processed=self.checker.processed,
            duplicates_dropped=self.checker.duplicates_dropped,
            committed=self.checker.commit_index,
            elections=self.raft.elections,
            truncations=self.raft.truncations,
            snapshot_installs=self.raft.snapshot_installs,
            net_dropped=self.net.stats.dropped,
            net_duplicated=self.net.stats.duplicated,
        )
        if violation is not None:
            report.violation = str(violation)
            report.invariant = violation.invariant
        return report

    def format_trace(self) -> list[str]:
        return [self._fmt(e) for e in (self.full_trace or [])]

    @staticmethod
    def _fmt(event: tuple[object, ...]) -> str:
        now, kind, *args = event
        return f"{now:>6}ms {kind} " + " ".join(str(a) for a in args)

    def _run(self) -> None:
        cfg = self.config
        self._start_faults()
        while self.now_ms < cfg.fault_ms:
            self._step()
            self._workload()
        self._stop_faults()
        deadline = cfg.fault_ms + cfg.quiet_ms_max
        while self.now_ms < deadline:
            for _ in range(20):
                self._step()
            if self._quiescent():
                self.checker.final(
                    [(r.name, r.applied, r.sm) for r in self.raft.replicas.values() if r.usable],
                    [r.name for r in self.raft.replicas.values() if r.quarantined],
                )
                self.trace("quiescent")
                return
        raise Violation(
            "liveness",
            f"not quiescent {cfg.quiet_ms_max} ms after faults stopped: "
            + "; ".join(self._blockers()[:6]),
        )

    def _blockers(self) -> list[str]:
        out = self.checker.pending_work()
        holder = self.holder()
        out.append(f"holder {holder.name if holder else None}")
        out.extend(
            f"{r.name} {'quarantined' if r.quarantined else ''} applied {r.applied}/{r.commit}"
            for r in self.raft.replicas.values()
        )
        return out

    def _quiescent(self) -> bool:
        if self.checker.pending_work():
            return False
        commit = self.checker.commit_index
        for r in self.raft.replicas.values():
            if r.usable and r.applied < commit:
                return False
        return any(r.role is Role.LEADER for r in self.raft.replicas.values() if r.usable)

    def _step(self) -> None:
        """One tick: restarts, Raft, notifiers, network, clients."""
        self.now_ms += self.config.tick_ms
        now = self.now_ms
        self._scripted_step()
        self._restart_due()
        if self._heal_at >= 0 and now >= self._heal_at:
            self.net.heal()
            self._heal_at = -1
            self.trace("heal")
        self._raft_step()
        for name in self.replica_names:
            replica = self.raft.replicas[name]
            if replica.active(now):
                self.hosts[name].tick(now)
        for message in self.net.due(now):
            self._deliver(message)
        for client in self.clients.values():
            if client.alive:
                client.tick(now)

    def _raft_step(self) -> None:
        now = self.now_ms
        flush_p = 0.1 if self.config.enabled("slow_flush") and self.in_fault_phase else 0.6
        compact_p = 0.05 if self.config.enabled("compaction") else 0.002
        replicas = [self.raft.replicas[n] for n in self.replica_names]
        for r in replicas:
            if not r.active(now):
                continue
            timed_out = now - r.last_heard_ms >= r.election_timeout_ms
            if (
                r.role is not Role.LEADER
                and timed_out
                and self.raft.campaign(r, now, self.reachable)
            ):
                self.trace("leader", r.name, r.term, r.last_index)
            if self.rng.random() < flush_p:
                r.flush()
            if self.rng.random() < compact_p and r.last_index - r.base > 6:
                base = r.compact(now, self.config.stall_window_ms)
                if base is not None:
                    self.checker.on_compact(r.name, base, r.sm, now, self.config.stall_window_ms)
                    self.stats["compactions"] += 1
        for leader in replicas:
            if not leader.active(now) or leader.role is not Role.LEADER:
                continue
            for follower in replicas:
                if follower is leader or not follower.active(now):
                    continue
                if not self.reachable(leader.name, follower.name) or self.rng.random() < 0.4:
                    continue
                installs = self.raft.snapshot_installs
                self.raft.replicate(leader, follower, now, self.on_apply)
                if self.raft.snapshot_installs != installs:
                    self.trace("install-snapshot", leader.name, follower.name, follower.snap_index)
                if follower.quarantined:
                    self._quarantined(follower)
                if leader.role is not Role.LEADER:
                    break
            if leader.role is not Role.LEADER:
                continue
            before = leader.commit
            self.raft.advance_commit(leader)
            for index in range(self.checker.commit_index + 1, leader.commit + 1):
                entry = leader.entry(index)
                self.checker.on_commit(index, entry.term, entry.data)
            if leader.commit > before:
                kinds = [_kind(leader.entry(i).data) for i in range(before + 1, leader.commit + 1)]
                self.trace("commit", leader.name, leader.commit, ",".join(kinds))
            leader.apply_committed(self.on_apply)
            if leader.quarantined:
                self._quarantined(leader)

    def _quarantined(self, replica: Replica) -> None:
        if self.stats[f"quarantined:{replica.name}"] == 0:
            self.stats[f"quarantined:{replica.name}"] = 1
            self.trace("quarantine", replica.name, replica.quarantine_reason[:60])
        self.hosts[replica.name].reset()

    def _deliver(self, message: Message) -> None:
        dst = message.dst
        if dst in self.raft.replicas:
            replica = self.raft.replicas[dst]
            if replica.active(self.now_ms):
                self.hosts[dst].on_message(message, self.now_ms)
            return
        client = self.clients.get(dst)
        if client is None and self.mallory is not None and dst == self.mallory.name:
            self._mallory_receive(message)
            return
        if client is not None and client.alive:
            client.on_message(message, self.now_ms)

    def _restart_due(self) -> None:
        due = [(t, n) for t, n in self._restarts if t <= self.now_ms]
        if not due:
            return
        self._restarts = [(t, n) for t, n in self._restarts if t > self.now_ms]
        for _, name in due:
            if name in self.raft.replicas:
                replica = self.raft.replicas[name]
                if replica.alive:
                    continue
                replica.restart(self.now_ms, self.rng, self.on_apply)
                self.checker.on_digest(name, replica.applied, replica.sm.digest())
                self.trace("restart", name, replica.applied)
                if replica.quarantined:
                    self._quarantined(replica)
            else:
                client = self.clients[name]
                if not client.alive:
                    client.restart()
                    self.trace("client-restart", name)

    # ---- workload ----------------------------------------------------------------

    def _workload(self) -> None:
        cfg = self.config
        rng = self.rng
        ticks_left = max(1, (cfg.fault_ms - self.now_ms) // cfg.tick_ms)
        if self._writes_left and rng.random() < min(1.0, 1.5 * self._writes_left / ticks_left):
            self._write()
        if cfg.enabled("epoch_bump") and rng.random() < 0.002 * cfg.fault_rate:
            self._epoch_bump()
        if cfg.enabled("new_subs") and rng.random() < 0.004:
            client = rng.choice(list(self.clients.values()))
            client.generation += 1
            client.subscribe(
                f"s{client.name[1:]}.n{client.generation}", Query.parse(rng.choice(QUERIES))
            )
            self.stats["new_subs"] += 1
        if cfg.enabled("unsubscribe") and rng.random() < (0.01 if cfg.reuse_sub_ids else 0.002):
            client = rng.choice(list(self.clients.values()))
            streaming = [s for s in client.subs if s.state is State.STREAMING]
            if streaming:
                sub = rng.choice(streaming)
                client.unsubscribe(sub)
                self._ended_subs.append((client, sub.sub_id, sub.query))
                self.stats["unsubscribes"] += 1
        if cfg.reuse_sub_ids and self._ended_subs and rng.random() < 0.3:
            client, sub_id, query = self._ended_subs[0]
            if not self.checker.model_has_live(sub_id):
                self._ended_subs.pop(0)
                client.subscribe(sub_id, query)
                self.stats["reused_sub_ids"] += 1

    def _write(self) -> None:
        rng = self.rng
        via = self.raft.replicas[rng.choice(self.replica_names)]
        entry: Entry = self._one_write()
        if rng.random() < 0.2:
            entry = WriteBatch(tuple(self._one_write() for _ in range(rng.randint(2, 3))))
        if self.propose(via, entry) is not None:
            self.stats["writes"] += 1
            self._writes_left -= 1  # a refused write is retried later

    def _one_write(self) -> Write:
        rng = self.rng
        ops = []
        for key in rng.sample(self.config.keys, rng.randint(1, 2)):
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
        return Write(tuple(ops), None, self.now_ms + rng.randint(0, 3))

    def _epoch_bump(self) -> None:
        for r in self.raft.leaders():
            if r.active(self.now_ms):
                entry = EpochCreate(r.sm.epoch.epoch_counter + 1, self.now_ms)
                if self.propose(r, entry) is not None:
                    self.faults["epoch_bump"] += 1
                    self.trace("epoch?", r.name, entry.epoch_counter)
                return

    def _mallory_step(self) -> None:
        assert self.mallory is not None
        subs = sorted(self.checker.model.subs)
        if not subs:
            return
        sub_id = self.rng.choice(subs)
        target = self.rng.choice(self.replica_names)
        up_to = EmitSeq(BUCKET, self.checker.model.epoch, self.checker.commit_index)
        self.faults["malicious"] += 1
        if self.rng.random() < 0.5:
            self.net.send(self.now_ms, MALLORY, target, AckReq(sub_id, MALLORY, up_to))
        else:
            sub = self.checker.model.subs[sub_id]
            after = self.rng.choice((sub.start, sub.head, sub.acked))
            req = ReconnectReq(self.new_conn(), MALLORY, sub_id, MALLORY, after)
            self.net.send(self.now_ms, MALLORY, target, req)

    def _mallory_receive(self, message: Message) -> None:
        body = message.body
        if isinstance(body, AttachReply):
            self.checker.on_attach(MALLORY, body.sub_id, EmitSeq(BUCKET, 0, 0), body.attach, False)
            if body.attach.status is AttachStatus.ATTACHED:
                self.stats["mallory_attached"] += 1
        elif isinstance(body, Events):
            for row in body.rows:
                self.checker.on_receive(MALLORY, body.sub_id, row)

    # ---- faults ------------------------------------------------------------------

    def _start_faults(self) -> None:
        n = self.config.net
        self.net.faults = Faults(n.drop, n.duplicate, n.jitter_ms, n.spike, n.spike_ms)

    def _stop_faults(self) -> None:
        self.in_fault_phase = False
        self.net.faults = Faults()
        self.net.heal()
        self._heal_at = -1
        for r in self.raft.replicas.values():
            r.paused_until_ms = 0
        self._restarts = [(min(t, self.now_ms), n) for t, n in self._restarts]
        for client in self.clients.values():
            if not client.alive:
                self._restarts.append((self.now_ms, client.name))
        self.trace("faults-stop")

    def _crash_client(self, client: Client, down_ms: int, kind: str) -> None:
        if not client.alive:
            return
        client.crash(self.now_ms + down_ms)
        self._restarts.append((self.now_ms + down_ms, client.name))
        self.faults[kind] += 1
        self.trace("client-crash", client.name, down_ms)

    def _scripted_step(self) -> None:
        """Execute the fault plan's events that are due (only during the fault phase)."""
        while self._scripted and self._scripted[0].at_ms <= self.now_ms:
            event = self._scripted.pop(0)
            if self.in_fault_phase:
                self._execute(event)

    def _execute(self, event: Scripted) -> None:
        action, arg, pick = event.action, event.arg, event.pick
        now = self.now_ms
        replicas = [self.raft.replicas[n] for n in self.replica_names]
        usable = [r for r in replicas if r.usable]
        clients = list(self.clients.values())
        holder = self.holder()
        self.trace("fault", str(event))
        if action == "crash_replica" and usable:
            self.crash_replica(usable[pick % len(usable)], down_ms=arg)
        elif action == "crash_holder" and holder is not None:
            self.crash_replica(holder, kind="holder_crash", down_ms=arg or 400)
        elif action == "crash_holder_after_outbox" and holder is not None:
            self.hosts[holder.name].crash_after_outbox = True
        elif action == "pause_replica" and usable:
            target = usable[pick % len(usable)]
            target.paused_until_ms = now + arg
            self.faults["pause"] += 1
        elif action == "pause_leader":
            for r in self.raft.leaders():
                r.paused_until_ms = now + (arg or 600)
                self.faults["pause"] += 1
        elif action in ("partition", "partition_replicas"):
            replicas_only = action == "partition_replicas"
            names = [*self.replica_names, *([] if replicas_only else self.clients)]
            sides = {n: (pick >> i) & 1 for i, n in enumerate(names)}
            self.net.partition(sides, replicas_only=replicas_only)
            self._heal_at = max(self._heal_at, now + arg)
            self.faults["partition"] += 1
        elif action == "partition_holder" and holder is not None:
            self.net.partition({holder.name: 1})
            self._heal_at = max(self._heal_at, now + (arg or 800))
            self.faults["partition"] += 1
        elif action == "isolate_holder_raft" and holder is not None:
            self.net.partition({holder.name: 1}, replicas_only=True)
            self._heal_at = max(self._heal_at, now + (arg or 1_500))
            self.faults["partition"] += 1
        elif action == "heal":
            self.net.heal()
            self._heal_at = -1
        elif action == "crash_client" and clients:
            kind = "client_stall" if arg > self.config.stall_window_ms else "client_crash"
            self._crash_client(clients[pick % len(clients)], arg, kind)
        elif action in ("crash_clients", "stall_clients"):
            down = self.config.stall_window_ms + 1_000 if action == "stall_clients" else arg or 200
            for client in clients:
                self._crash_client(client, down, action)
        elif action == "epoch_bump":
            self._epoch_bump()
        elif action == "mallory" and self.mallory is not None:
            self._mallory_step()


def _kind(data: bytes) -> str:
    """The entry type of an encoded entry, for the trace (no-ops are "noop")."""
    if len(data) < 3:
        return "noop"
    try:
        return EntryType(data[2]).name
    except ValueError:
        return "?"


def run_seed(seed: int, **overrides: object) -> Report:
    """Run one seed (swarm configuration, optionally pinned) and return its report."""
    return Simulation(SimConfig.from_seed(seed, **overrides)).run()
