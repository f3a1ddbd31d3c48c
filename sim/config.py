"""What one simulation run does: sizes, the fault plan, broken variants.

Everything here is plain data. `SimConfig.from_seed(seed)` derives a run from the
seed alone — swarm testing: each seed picks which fault kinds are enabled, and
from those a *fault plan*, a list of timed `Scripted` events the run executes
(plus the network's loss/duplication/jitter levels). Keyword overrides pin parts
of it for the named scenarios; a failing plan can be shrunk event by event.
"""

from __future__ import annotations

import dataclasses
import random
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from sevendb.notifier.core import EmissionMode
from sevendb.outbox.query import Planner

FAULT_KINDS: Final = (
    "replica_crash",  # a random replica dies (loses its unflushed tail), restarts later
    "holder_crash",  # the notifier lease holder dies
    "pause",  # a replica stops for a while, then resumes believing what it believed
    "partition",  # replicas (and maybe clients) split in two; healed later
    "drop",  # the client network loses messages
    "duplicate",  # ... delivers some twice
    "reorder",  # ... with jitter, so messages overtake each other
    "delay",  # ... with latency spikes
    "client_crash",  # a client process dies and restarts with its persisted cursors
    "client_stall",  # a client stays down past the stall window (STALE_SEQUENCE)
    "slow_flush",  # replicas fsync rarely: crashes lose longer tails
    "compaction",  # replicas snapshot and truncate their logs often
    "epoch_bump",  # EPOCH_CREATE under load (migration)
    "rendezvous",  # the lease follows rendezvous hashing instead of the leader
    "malicious",  # a principal acks and reconnects to others' subscriptions
    "unsubscribe",  # clients end subscriptions
    "new_subs",  # clients subscribe while the workload runs
    "storage",  # a replica restarts with a corrupt or lost log record or a lost snapshot
)

SCRIPTED_ACTIONS: Final = (
    "crash_replica",  # a replica (pick) dies for `arg` ms
    "crash_follower",  # a replica that is not the Raft leader (pick) dies for `arg` ms
    "crash_leader",  # the Raft leader dies for `arg` ms (600 if 0)
    "corrupt_log",  # a replica (pick) dies for `arg` ms; at restart a record of its
    # acknowledged log fails its checksum
    "lose_log_tail",  # ... at restart its last acknowledged records are gone
    "lose_snapshot",  # ... at restart its snapshot is gone
    "crash_holder",  # the current lease holder dies for `arg` ms (400 if 0)
    "crash_holder_after_outbox",  # arm: the holder dies right after its next OUTBOX_WRITE
    "pause_replica",  # a replica (pick) stops for `arg` ms
    "pause_leader",  # the Raft leader stops for `arg` ms (600 if 0)
    "partition",  # nodes split by the bits of `pick` for `arg` ms
    "partition_replicas",  # replicas split by the bits of `pick` (clients reach all)
    "partition_holder",  # the lease holder is cut off from everyone for `arg` ms
    "isolate_holder_raft",  # the holder is cut off from the other replicas, not from
    # the clients, for `arg` ms (1500 if 0): it stays leader in its own eyes
    "heal",  # heal every partition
    "crash_client",  # a client (pick) dies for `arg` ms
    "crash_clients",  # every client dies for `arg` ms (200 if 0)
    "stall_clients",  # every client dies past the stall window
    "epoch_bump",  # propose EPOCH_CREATE(current + 1)
    "mallory",  # a principal acks or reconnects to someone else's subscription
)


@dataclass(frozen=True, slots=True)
class Bugs:
    """Deliberately broken variants, to prove the checker bites (never on by default)."""

    sdk_skips_dedupe: bool = False
    """The client hands every event to the application (no StreamCursor)."""
    purge_before_ack: bool = False
    """The notifier queues an ack for every row as soon as it sends it."""
    lease_without_fencing: bool = False
    """A holder emits while it believes it leads (no check-quorum) and judges
    reconnects from its own applied state, without the lease or the client's
    position as a fence."""
    forget_unoutboxed_tail: bool = False
    """A new holder outboxes only what was computed after it took the lease."""
    damaged_replica_votes: bool = False
    """A replica that lost acknowledged log entries votes before it is repaired."""
    expiry_window_in_seconds: bool = False
    """The holder proposes expiries with the stall window read as seconds where it is
    milliseconds: live subscriptions are expired and their rows dropped."""
    send_before_commit: bool = False
    """The holder computes rows from its log ahead of commit and sends them (its
    replica's reads include entries appended and not yet committed)."""
    skip_predecessor_rows: bool = False
    """A new holder takes every row computed before it took the lease as sent by its
    predecessor: a stream attaching behind them starts after them."""
    deliver_before_marker: bool = False
    """The bucket computes a transactional write's rows for every subscription as the
    write applies, read_committed ones included (not at its COMMIT marker)."""
    complete_without_marker: bool = False
    """The transaction driver completes a committed transaction without writing its
    COMMIT marker: its writes are never applied."""

    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name))


BUG_NAMES: Final = tuple(f.name for f in dataclasses.fields(Bugs))


@dataclass(frozen=True, slots=True, order=True)
class Scripted:
    """One timed event of the fault plan. `pick` chooses the target (an index
    modulo the candidates, or a bitmask for partitions); `arg` is a duration."""

    at_ms: int
    action: str
    arg: int = 0
    pick: int = 0

    def __post_init__(self) -> None:
        if self.action not in SCRIPTED_ACTIONS:
            raise ValueError(f"unknown scripted action {self.action!r}")

    def __str__(self) -> str:
        text = f"{self.at_ms}:{self.action}"
        if self.arg or self.pick:
            text += f":{self.arg}"
        if self.pick:
            text += f":{self.pick}"
        return text

    @classmethod
    def parse(cls, text: str) -> Scripted:
        """`MS:ACTION[:ARG[:PICK]]`, as `--script` takes it."""
        parts = text.split(":")
        if not 2 <= len(parts) <= 4:
            raise ValueError(f"a scripted event is MS:ACTION[:ARG[:PICK]], not {text!r}")
        numbers = [int(p) for p in parts[2:]] + [0, 0]
        return cls(int(parts[0]), parts[1], numbers[0], numbers[1])


@dataclass(frozen=True, slots=True)
class NetFaults:
    """What the client network does to messages (all off: a healthy network)."""

    drop: float = 0.0
    """The chance a message is lost."""
    duplicate: float = 0.0
    """The chance a message arrives twice."""
    jitter_ms: int = 0
    """Extra delay up to this, drawn per message: messages overtake each other."""
    spike: float = 0.0
    """The chance of a latency spike of up to `spike_ms`."""
    spike_ms: int = 0


_EARLY_KINDS: Final = FAULT_KINDS[: FAULT_KINDS.index("storage")]

EMISSION_MODES: Final = tuple(mode.value for mode in EmissionMode)
"""("derived", "literal"): the notifier's emission modes, by value."""

STALL_WINDOW_MS: Final = 1_500
"""The simulated stall window (the production default is 24 h)."""

# Plan rates, events per simulated second at fault_rate 1.
_RATES: Final = {
    "replica_crash": 0.8,
    "holder_crash": 0.6,
    "pause": 0.6,
    "partition": 0.4,
    "client_crash": 0.6,
    "client_stall": 0.16,
    "epoch_bump": 0.4,
    "malicious": 4.0,
    "storage": 0.5,
}
STORAGE_ACTIONS: Final = ("corrupt_log", "lose_log_tail", "lose_snapshot")


def plan_faults(
    rng: random.Random,
    faults: tuple[str, ...],
    fault_ms: int,
    fault_rate: float,
    stall_window_ms: int,
) -> tuple[Scripted, ...]:
    """The timed fault events of a run: a Poisson process per enabled kind."""
    events: list[Scripted] = []
    for kind, per_s in _RATES.items():
        if kind not in faults:
            continue
        rate_per_ms = per_s * fault_rate / 1000
        at = rng.expovariate(rate_per_ms)
        while at < fault_ms:
            pick = rng.randrange(1 << 16)
            if kind == "replica_crash":
                events.append(Scripted(int(at), "crash_replica", rng.randint(50, 600), pick))
            elif kind == "holder_crash":
                events.append(Scripted(int(at), "crash_holder", rng.randint(50, 600)))
            elif kind == "pause":
                events.append(Scripted(int(at), "pause_replica", rng.randint(150, 900), pick))
            elif kind == "partition":
                action = "partition_replicas" if rng.random() < 0.5 else "partition"
                events.append(Scripted(int(at), action, rng.randint(100, 900), pick))
            elif kind == "client_crash":
                events.append(Scripted(int(at), "crash_client", rng.randint(20, 400), pick))
            elif kind == "client_stall":
                down = stall_window_ms + rng.randint(300, 1_200)
                events.append(Scripted(int(at), "crash_client", down, pick))
            elif kind == "epoch_bump":
                events.append(Scripted(int(at), "epoch_bump"))
            elif kind == "storage":
                action = rng.choice(STORAGE_ACTIONS)
                events.append(Scripted(int(at), action, rng.randint(50, 600), pick))
            else:
                events.append(Scripted(int(at), "mallory", 0, pick))
            at += rng.expovariate(rate_per_ms)
    return tuple(sorted(events))


def plan_network(rng: random.Random, faults: tuple[str, ...]) -> NetFaults:
    return NetFaults(
        drop=rng.uniform(0.03, 0.15) if "drop" in faults else 0.0,
        duplicate=rng.uniform(0.03, 0.15) if "duplicate" in faults else 0.0,
        jitter_ms=rng.randint(5, 60) if "reorder" in faults else 0,
        spike=rng.uniform(0.01, 0.05) if "delay" in faults else 0.0,
        spike_ms=rng.randint(100, 600) if "delay" in faults else 0,
    )


@dataclass(frozen=True, slots=True)
class SimConfig:
    seed: int
    replicas: int = 3
    clients: int = 2
    subs_per_client: int = 1
    writes: int = 40
    """Writes the workload proposes during the fault phase."""
    keys: tuple[str, ...] = ("a/1", "a/2", "b/1", "c")
    fault_ms: int = 2_000
    """Simulated time with faults and workload; then faults stop and everything heals."""
    quiet_ms_max: int = 12_000
    """After the fault phase, everything committed must be delivered and purged by then."""
    tick_ms: int = 5
    stall_window_ms: int = STALL_WINDOW_MS
    faults: tuple[str, ...] = ()
    """Enabled fault kinds: the plan's source, and switches (slow_flush, compaction,
    rendezvous, unsubscribe, new_subs) the run consults directly."""
    fault_rate: float = 1.0
    scripted: tuple[Scripted, ...] = ()
    """The fault plan (from_seed derives it from `faults` unless given)."""
    net: NetFaults = field(default_factory=NetFaults)
    bugs: Bugs = field(default_factory=Bugs)
    planners: Mapping[str, Planner] = field(default_factory=dict)
    """Replica name -> planner (PLN-01 passes a broken one)."""
    reuse_sub_ids: bool = False
    """Resubscribe with the sub_id of an ended subscription (found a core bug, now fixed;
    the swarm turns it on for ~30% of seeds)."""
    reorder_buffer_max: int = 4
    window_events: int = 8
    resend_after_ms: int = 400
    digest_every: int = 4
    """Replicas compare state digests at every raft index divisible by this."""
    emission: str = "derived"
    """The notifier hosts' emission mode (`EmissionMode`: "derived" or "literal");
    the swarm runs each with half the seeds."""
    history_entries: int = 10_000
    """The notifiers' `history_entries` bound of the retained history (the swarm draws 4,
    16 or 10,000, so that HISTORY_TRIMs happen under new subscriptions starting in the
    past)."""
    txns: int = 0
    """Transactions each of `txn_producers` runs in the fault phase (0: none; the
    bucket then sees no transaction entry, and a seed runs as it always did)."""
    txn_producers: int = 2
    txn_timeout_ms: int = 300
    """The simulated transactional ids' timeout: short, so that timeouts race commits."""
    durable: bool = False
    """The clients' first subscriptions are durable (named) and keep nothing across a
    crash: a restarted client resumes each by its name, from the server's position
    (the swarm turns it on for ~40% of seeds)."""

    def __post_init__(self) -> None:
        if self.emission not in EMISSION_MODES:
            raise ValueError(f"emission must be one of {', '.join(EMISSION_MODES)}")

    @classmethod
    def from_seed(cls, seed: int, **overrides: Any) -> SimConfig:
        """Swarm: the seed picks sizes, the enabled fault kinds and the fault plan."""
        rng = random.Random(f"sevendb-sim-config/{seed}")
        values: dict[str, Any] = {
            "seed": seed,
            "replicas": rng.choice((3, 3, 3, 5)),
            "clients": rng.randint(1, 3),
            "subs_per_client": rng.randint(1, 2),
            "writes": rng.randint(25, 100),
            "fault_ms": rng.randint(1_000, 3_000),
            "faults": tuple(kind for kind in _EARLY_KINDS if rng.random() < 0.45),
            "fault_rate": rng.choice((0.5, 1.0, 2.0)),
            "reorder_buffer_max": rng.choice((1, 2, 4, 64)),
            "window_events": rng.choice((1, 3, 8, 64)),
            "resend_after_ms": rng.choice((150, 400, 1_000)),
            "reuse_sub_ids": rng.random() < 0.3,
        }
        # Drawn last, so that adding them left every other draw of a seed as it was.
        if rng.random() < 0.45:
            values["faults"] += ("storage",)
        values["emission"] = "literal" if rng.random() < 0.5 else "derived"
        values["durable"] = rng.random() < 0.4
        values["history_entries"] = rng.choice((4, 16, 10_000))
        values.update({k: v for k, v in overrides.items() if k not in ("scripted", "net")})
        plan_rng = random.Random(f"sevendb-sim-plan/{seed}")
        values["net"] = plan_network(plan_rng, values["faults"])
        values["scripted"] = plan_faults(
            plan_rng,
            values["faults"],
            values["fault_ms"],
            values["fault_rate"],
            values.get("stall_window_ms", STALL_WINDOW_MS),
        )
        values.update({k: v for k, v in overrides.items() if k in ("scripted", "net")})
        return cls(**values)

    def replica_names(self) -> tuple[str, ...]:
        return tuple(f"r{i}" for i in range(self.replicas))

    def enabled(self, kind: str) -> bool:
        return kind in self.faults

    def replay_command(self) -> str:
        """The command line that reruns exactly this configuration."""
        from .planners import planner_name

        overrides = {name: getattr(self, name) for name in CLI_FIELDS}
        base = SimConfig.from_seed(self.seed, **overrides)
        parts = [f"python -m sevendb.sim --seed {self.seed}"]
        default = SimConfig.from_seed(self.seed)
        for name in CLI_FIELDS:
            value = getattr(self, name)
            if value != getattr(default, name):
                text = ",".join(value) if name == "faults" else repr(value)
                parts.append(f"--set {shlex.quote(f'{name}={text}')}")
        if self.scripted != base.scripted:
            if not self.scripted:
                parts.append("--script none")
            parts.extend(f"--script {event}" for event in self.scripted)
        if self.net != base.net:
            parts.append("(network fault levels pinned in code)")
        parts.extend(
            f"--planner {replica}={planner_name(planner)}"
            for replica, planner in sorted(self.planners.items())
        )
        parts.extend(f"--bug {name}" for name in self.bugs.names())
        return " ".join(parts)


CLI_FIELDS: Final = (
    "replicas",
    "clients",
    "subs_per_client",
    "writes",
    "fault_ms",
    "quiet_ms_max",
    "stall_window_ms",
    "faults",
    "fault_rate",
    "reuse_sub_ids",
    "reorder_buffer_max",
    "window_events",
    "resend_after_ms",
    "emission",
    "durable",
    "history_entries",
    "txns",
    "txn_producers",
    "txn_timeout_ms",
)
"""SimConfig fields `--set NAME=VALUE` may pin (VALUE is a Python literal)."""
