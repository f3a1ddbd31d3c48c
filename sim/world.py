"""One simulation run: a bucket's Raft group, its nodes (each running the production
notifier host), network, clients, workload and faults, all driven by one
`random.Random(seed)` and a simulated clock.

    report = Simulation(SimConfig.from_seed(42)).run()

The run has two phases. During `fault_ms` the workload writes, subscribes, acks,
reconnects and bumps epochs while the enabled faults fire. Then faults stop,
partitions heal, crashed processes restart, and the run continues until
everything committed has been delivered and purged (the checker's liveness
condition) or `quiet_ms_max` passes; a group that refuses with DATA_LOSS (storage
faults on too many replicas) ends the run there instead. The checker watches every step.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Final

import xxhash

from sevendb.outbox.entries import Entry, EntryType, encode_entry
from sevendb.outbox.model import RowsOutboxed, RowsPending
from sevendb.outbox.query import Query
from sevendb.outbox.replica import ApplyOutcome, ReplicaUnavailable
from sevendb.outbox.state import BucketStateMachine

from .checker import Checker, Violation
from .client import Client
from .config import NetFaults, SimConfig
from .faults import FaultPlan
from .network import Message, Network
from .node import SimNode
from .raft import Damage, Member, RaftGroup, RaftSafetyError, Role
from .txns import TxnDriver, TxnProducer
from .variants import EagerTxnStateMachine
from .workload import MALLORY, QUERIES, Workload

BUCKET: Final = "bucket-sim"
TRACE_TAIL: Final = 40


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
    refused: str = ""
    """Why the bucket refused to go on (DATA_LOSS), if it did: a correct end."""

    def describe(self) -> str:
        verdict = "ok" + (f" (refused: {self.refused})" if self.refused else "")
        lines = [f"seed {self.seed}: " + (verdict if self.ok else f"VIOLATION {self.violation}")]
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
        self.checker = Checker(
            BUCKET,
            tolerate_divergence=bool(config.planners),
            stall_window_ms=config.stall_window_ms,
            emission=config.emission,
        )
        self.raft = RaftGroup(
            BUCKET,
            self.replica_names,
            self.rng,
            dict(config.planners),
            damaged_votes=config.bugs.damaged_replica_votes,
            sm_class=EagerTxnStateMachine
            if config.bugs.deliver_before_marker
            else BucketStateMachine,
        )
        self.nodes = {name: SimNode(self, m) for name, m in self.raft.members.items()}
        self.refused = ""
        """The group's DATA_LOSS verdict, once it gave one."""
        self._applied_run: dict[str, None] = {}
        """Members that applied entries in this step (their tick's after_applies is due)."""
        self.clients: dict[str, Client] = {}
        self.stats: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self._tail: deque[tuple[object, ...]] = deque(maxlen=TRACE_TAIL)
        self._hash = xxhash.xxh64()
        self._conn = 0
        self._restarts: list[tuple[int, str, Damage | None]] = []
        self.plan = FaultPlan(self, config.scripted)
        self.workload = Workload(self)
        self.in_fault_phase = True
        for i in range(config.clients):
            client = Client(self, f"c{i}", f"p{i}")
            for j in range(config.subs_per_client):
                durable = f"d{j}" if config.durable else ""
                client.subscribe(f"s{i}.{j}", Query.parse(self.rng.choice(QUERIES)), durable)
            self.clients[client.name] = client
        malicious = any(e.action == "mallory" for e in config.scripted)
        self.bucket_uuid = BUCKET
        self.mallory = Client(self, "mallory", MALLORY) if malicious else None
        txn_rng = random.Random(f"sevendb-sim-txns/{config.seed}")
        self.txn_producers = (
            [TxnProducer(self, f"tx{i}", txn_rng) for i in range(config.txn_producers)]
            if config.txns
            else []
        )
        self.txn_driver = TxnDriver(self, txn_rng) if config.txns else None

    # ---- services for replicas and clients -------------------------------------

    def trace(self, kind: str, *args: object) -> None:
        event = (self.now_ms, kind, *args)
        self._tail.append(event)
        if self.full_trace is not None:
            self.full_trace.append(event)
        self._hash.update(repr(event).encode())

    def clock_ms(self) -> int:
        return self.now_ms

    def schedule_restart(self, at_ms: int, name: str, damage: Damage | None = None) -> None:
        """Replica or client `name` (down) starts again at `at_ms`."""
        self._restarts.append((at_ms, name, damage))

    def new_conn(self) -> int:
        self._conn += 1
        return self._conn

    def reachable(self, a: str, b: str) -> bool:
        """Between replicas (Raft traffic)."""
        return self.net.reachable_raft(a, b)

    def on_propose(self, via: str, index: int, data: bytes) -> None:
        """A leader took a proposal made through `via` (any node's replica)."""
        self.stats["proposals"] += 1
        self.trace("propose", via, _kind(data), index)

    def propose(self, via: Member, entry: Entry) -> Future[ApplyOutcome] | None:
        """Propose `entry` through `via`'s replica, as a client of that node would."""
        try:
            return self.nodes[via.name].replica.submit(encode_entry(entry))
        except ReplicaUnavailable as exc:
            if exc.reason == "DATA_LOSS":
                self.stats["data_loss_refusals"] += 1
            return None

    def crash_replica(
        self,
        member: Member,
        *,
        kind: str = "replica_crash",
        down_ms: int | None = None,
        damage: Damage | None = None,
    ) -> None:
        """`member`'s node dies; it restarts after `down_ms`, finding `damage`."""
        if not member.alive:
            return
        member.crash()
        self.nodes[member.name].crash()
        if down_ms is None:
            down_ms = self.rng.randint(50, 600)
        self.schedule_restart(self.now_ms + down_ms, member.name, damage)
        self.faults[kind] += 1
        self.trace("crash", member.name, member.last_index, member.durable)

    def holder(self) -> Member | None:
        """The member that currently emits (its own applied state says so)."""
        best = None
        for r in self.raft.members.values():
            if (
                r.usable
                and r.sm.lease_holder == r.name
                and (best is None or r.sm.lease_index > best.sm.lease_index)
            ):
                best = r
        return best

    # ---- the apply hook ----------------------------------------------------------

    def on_apply(
        self, member: Member, index: int, data: bytes, outcome: ApplyOutcome | None
    ) -> None:
        applied = None if outcome is None else outcome.applied
        self.checker.on_apply(member.name, index, data, applied)
        if index % self.config.digest_every == 0 or not data:
            self.checker.on_digest(member.name, index, member.sm.digest())
        node = self.nodes[member.name]
        node.on_apply(index, outcome)
        self._applied_run[member.name] = None
        # FTO-02's moment: the holder dies in the apply that made rows sendable (their
        # OUTBOX_WRITE, or in the derived mode their source entry), before sending.
        sendable = RowsPending if self.config.emission == "derived" else RowsOutboxed
        if (
            node.crash_after_outbox
            and node.host.emitting
            and applied is not None
            and any(isinstance(e, sendable) for e in applied.effects)
        ):
            node.crash_after_outbox = False
            self.trace("crash-after-outbox", member.name, index)
            self.crash_replica(member, kind="crash_after_outbox")

    def _after_applies(self) -> None:
        """Each member's tick ends its run of applies with the host's fast path."""
        run, self._applied_run = self._applied_run, {}
        for name in run:
            if self.raft.members[name].alive:
                self.nodes[name].host.after_applies()

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
            net_dropped=self.net.stats["dropped"],
            net_duplicated=self.net.stats["duplicated"],
        )
        report.stats.update(repairs=self.raft.repairs)
        report.refused = self.refused
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
        self.net.faults = cfg.net
        while self.now_ms < cfg.fault_ms:
            self._step()
            self.workload.step()
            for producer in self.txn_producers:
                producer.step()
        self._stop_faults()
        deadline = cfg.fault_ms + cfg.quiet_ms_max
        while self.now_ms < deadline:
            for _ in range(20):
                self._step()
            if self.refused:
                self.trace("refused", self.refused)
                return  # no leader can be elected again: an operator decides
            if self._quiescent():
                self.checker.final(
                    [(r.name, r.applied, r.sm) for r in self.raft.members.values() if r.usable],
                    [r.name for r in self.raft.members.values() if r.quarantined],
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
            f"{r.name} {'quarantined' if r.quarantined else ''}"
            f"{'damaged' if r.damaged else ''} applied {r.applied}/{r.commit}"
            for r in self.raft.members.values()
        )
        return out

    def _quiescent(self) -> bool:
        if self.checker.pending_work():
            return False
        commit = self.checker.commit_index
        for r in self.raft.members.values():
            if r.usable and (r.applied < commit or r.damaged):
                return False
        return any(r.role is Role.LEADER for r in self.raft.members.values() if r.usable)

    def _step(self) -> None:
        """One tick: restarts, Raft, notifiers, network, clients."""
        self.now_ms += self.config.tick_ms
        now = self.now_ms
        self.plan.step()
        self._restart_due()
        self._raft_step()
        self._after_applies()
        if not self.refused and (lost := self.raft.data_loss()):
            self.refused = lost
            self.stats["data_loss"] = 1
            self.trace("data-loss", lost)
        for name in self.replica_names:
            if self.raft.members[name].active(now):
                self.nodes[name].tick(now)
        for message in self.net.due(now):
            self._deliver(message)
        for name in self.replica_names:
            if self.raft.members[name].active(now):
                self.nodes[name].flush_subscribes()
        for client in self.clients.values():
            if client.alive:
                client.tick(now)
        if self.txn_driver is not None:
            self.txn_driver.step()

    def _raft_step(self) -> None:
        now = self.now_ms
        members = [self.raft.members[n] for n in self.replica_names]
        for member in members:
            if member.active(now):
                self._raft_local(member)
        for leader in members:
            if leader.active(now) and leader.role is Role.LEADER:
                self._raft_lead(leader, members)

    def _raft_local(self, r: Member) -> None:
        """What a member does on its own: time out and campaign, fsync, compact."""
        now = self.now_ms
        flush_p = 0.1 if self.config.enabled("slow_flush") and self.in_fault_phase else 0.6
        compact_p = 0.05 if self.config.enabled("compaction") else 0.002
        timed_out = now - r.last_heard_ms >= r.election_timeout_ms
        if r.role is not Role.LEADER and timed_out and self.raft.campaign(r, now, self.reachable):
            self.trace("leader", r.name, r.term, r.last_index)
            self.checker.on_leader(r.name, r.term, r.base, r.entry_at)
        if self.rng.random() < flush_p:
            r.flush()
        if self.rng.random() < compact_p and r.last_index - r.base > 6:
            base = r.compact(now, self.config.stall_window_ms)
            if base is not None:
                self.checker.on_compact(r.name, base, r.sm, now, self.config.stall_window_ms)
                self.stats["compactions"] += 1

    def _raft_lead(self, leader: Member, members: list[Member]) -> None:
        """A leader's round: AppendEntries to the followers it reaches, commit, apply."""
        now = self.now_ms
        for follower in members:
            if follower is leader or not follower.active(now):
                continue
            if not self.reachable(leader.name, follower.name) or self.rng.random() < 0.4:
                continue
            installs, repairs = self.raft.snapshot_installs, self.raft.repairs
            self.raft.replicate(leader, follower, now, self.on_apply)
            if self.raft.snapshot_installs != installs:
                self.trace("install-snapshot", leader.name, follower.name, follower.snap_index)
            if self.raft.repairs != repairs:
                self.trace("repaired", follower.name, follower.durable, leader.name)
            if follower.quarantined:
                self._quarantined(follower)
            if leader.role is not Role.LEADER:
                return
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

    def _quarantined(self, member: Member) -> None:
        """Traced once; its host sees it at its next pass and closes its streams."""
        if self.stats[f"quarantined:{member.name}"] == 0:
            self.stats[f"quarantined:{member.name}"] = 1
            self.trace("quarantine", member.name, member.quarantine_reason[:60])

    def _deliver(self, message: Message) -> None:
        dst = message.dst
        if dst in self.raft.members:
            if self.raft.members[dst].active(self.now_ms):
                self.nodes[dst].on_message(message)
            return
        client = self.clients.get(dst)
        if client is None and self.mallory is not None and dst == self.mallory.name:
            self.workload.mallory_receive(message)
            return
        if client is not None and client.alive:
            client.on_message(message, self.now_ms)

    def _restart_due(self) -> None:
        due = [(t, n, d) for t, n, d in self._restarts if t <= self.now_ms]
        if not due:
            return
        self._restarts = [(t, n, d) for t, n, d in self._restarts if t > self.now_ms]
        for _, name, damage in due:
            if name in self.raft.members:
                self._restart_member(self.raft.members[name], damage)
            else:
                client = self.clients[name]
                if not client.alive:
                    client.restart()
                    self.trace("client-restart", name)
        self._after_applies()

    def _restart_member(self, member: Member, damage: Damage | None) -> None:
        """A new node process on `member`'s storage (damaged first, if so planned)."""
        if member.alive:
            return
        name = member.name
        self.nodes[name] = SimNode(self, member)
        found = member.restart(self.now_ms, self.rng, self.on_apply, damage)
        if damage is not None:
            self.trace("storage-fault", name, damage.value, found or "nothing to damage")
        if member.damaged:
            self.stats["damaged_restarts"] += 1
            self.trace("damaged", name, member.last_index, member.repair_through)
        self.checker.on_digest(name, member.applied, member.sm.digest())
        self.trace("restart", name, member.applied)
        if member.quarantined:
            self._quarantined(member)

    # ---- workload ----------------------------------------------------------------

    # ---- faults ------------------------------------------------------------------

    def _stop_faults(self) -> None:
        self.in_fault_phase = False
        self.net.faults = NetFaults()
        self.plan.heal()
        for r in self.raft.members.values():
            r.paused_until_ms = 0
        self._restarts = [(min(t, self.now_ms), n, d) for t, n, d in self._restarts]
        for client in self.clients.values():
            if not client.alive:
                self._restarts.append((self.now_ms, client.name, None))
        self.trace("faults-stop")


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
