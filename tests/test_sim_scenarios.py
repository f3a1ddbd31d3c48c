"""The named validation scenarios of docs/sim.md, run in the simulator.

Each scenario pins part of a simulation (scripted faults, no random ones unless
named) and relies on the checker for the invariants; the asserts here add what
the scenario itself promises. Every scenario runs in both emission modes
(docs/emission.md): the checker's visibility rule follows the mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, cast

import pytest

from sevendb.outbox.entries import OutboxWrite, Write, WriteBatch, decode_entry
from sevendb.outbox.query import Plan, Query, plan_query
from sevendb.sim.checker import AppStream
from sevendb.sim.config import Scripted, SimConfig
from sevendb.sim.replay import emission_trace
from sevendb.sim.world import BUCKET, Report, Simulation

MODES = ("derived", "literal")


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """The emission mode a scenario runs in."""
    return cast(str, request.param)


def run(seed: int, **overrides: Any) -> tuple[Simulation, Report]:
    """A scenario: three replicas, two clients, no faults but the ones it names."""
    values: dict[str, Any] = {
        "replicas": 3,
        "clients": 2,
        "subs_per_client": 1,
        "writes": 60,
        "fault_ms": 2_000,
        "faults": (),
        "fault_rate": 1.0,
        "reorder_buffer_max": 4,
        "window_events": 8,
        "resend_after_ms": 400,
        "durable": False,
    }
    values.update(overrides)
    sim = Simulation(SimConfig.from_seed(seed, **values), keep_trace=True)
    report = sim.run()
    assert report.ok, report.describe()
    return sim, report


def apps(sim: Simulation) -> list[AppStream]:
    return list(sim.checker.apps.values())


def trace(sim: Simulation, kind: str) -> list[tuple[object, ...]]:
    return [e for e in sim.full_trace or [] if e[1] == kind]


def times(sim: Simulation, kind: str) -> list[int]:
    return [int(str(e[0])) for e in trace(sim, kind)]


def emits(app: AppStream) -> list[tuple[str, int, int]]:
    """The emit_seqs an application processed, as (bucket_uuid, epoch, commit_index)."""
    return [cast(tuple[str, int, int], key[1]) for key in app.processed]


# ---- DET-01 ---------------------------------------------------------------------------


def test_det_01_one_log_two_schedules_identical_emission_traces(mode: str) -> None:
    sim, _ = run(
        100,
        faults=("replica_crash", "holder_crash", "drop", "duplicate", "reorder", "epoch_bump"),
        fault_rate=2.0,
        writes=80,
        emission=mode,
    )
    log = [(i, data) for i, (_, data) in enumerate(sim.checker.committed) if i and data]
    first = emission_trace(log, 1, bucket_uuid=BUCKET)
    second = emission_trace(log, 2, bucket_uuid=BUCKET, replicas=5)
    assert first.crashes and second.restores  # the schedules really differ
    assert first.data == second.data
    assert first.state_digest == second.state_digest
    print(
        f"\nDET-01: {len(log)} entries, emission trace {len(first.data)} bytes, "
        f"xxh64 {first.digest}, state digest {first.state_digest}"
    )
    # What each application processed is a prefix of what the log emits for it: the
    # rows its OUTBOX_WRITEs checkpointed (literal), or the rows computed (derived).
    emitted: dict[str, list[object]] = {}
    import msgpack

    sendable = "pending" if mode == "derived" else "outboxed"
    for index in sorted(first.per_index):
        for kind, *rest in msgpack.unpackb(first.per_index[index], raw=False):
            if kind == sendable:
                for row in rest[0]:
                    emitted.setdefault(row[0], []).append(row[1])
    for app in apps(sim):
        got = [list(seq) for seq in emits(app)]
        assert got == emitted.get(app.sub_id, [])[: len(got)]


def test_det_01_a_seed_replays_exactly(mode: str) -> None:
    config = SimConfig.from_seed(4242, emission=mode)
    first = Simulation(config).run()
    second = Simulation(SimConfig.from_seed(4242, emission=mode)).run()
    assert first.trace_digest == second.trace_digest
    assert first.stats == second.stats


def test_det_01_runs_do_not_depend_on_pythonhashseed(mode: str) -> None:
    script = (
        "from sevendb.sim.world import run_seed\n"
        f"r = run_seed(77, emission={mode!r})\n"
        "print(r.trace_digest, r.stats['checks'])\n"
    )
    outs = set()
    for hashseed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        outs.add(done.stdout.strip())
    assert len(outs) == 1, outs


# ---- FTO -------------------------------------------------------------------------------


def test_fto_01_killing_the_active_notifier_fails_over_without_gaps(mode: str) -> None:
    sim, report = run(
        11,
        scripted=(Scripted(700, "crash_holder"), Scripted(1_500, "crash_holder")),
        fault_ms=2_200,
        emission=mode,
    )
    assert report.faults.get("holder_crash", 0) == 2
    assert report.stats.get("client_gaps", 0) == 0  # the SDK never saw a hole in a stream
    holders = {e[2] for e in trace(sim, "notifier-up")}
    assert len(holders) >= 2, holders  # someone else took over
    crash_ms = times(sim, "crash")
    for app in apps(sim):
        assert app.processed, app.sub_id
    # Events were sent both before the first kill and after the last one.
    assert any(t < crash_ms[0] for t in times(sim, "send"))
    assert any(t > crash_ms[-1] for t in times(sim, "send"))


def test_fto_02_crash_after_the_rows_are_durable_before_send_is_resent_and_deduped(
    mode: str,
) -> None:
    sim, _ = run(
        12,
        scripted=(Scripted(600, "crash_holder_after_outbox"),),
        fault_ms=1_500,
        faults=("duplicate",),
        emission=mode,
    )
    (crash,) = trace(sim, "crash-after-outbox")
    _, _, dead, index = crash
    assert isinstance(index, int)
    entry = decode_entry(sim.checker.committed[index][1])
    # The entry applied at `index` made these rows sendable: their OUTBOX_WRITE
    # (literal), or their source entry itself (derived). The holder died in that very
    # apply, before sending any of them.
    if mode == "literal":
        assert isinstance(entry, OutboxWrite)
        after, through = entry.from_index, entry.through_index
    else:
        assert isinstance(entry, Write | WriteBatch)
        after, through = index - 1, index
    moved = [
        (sub_id, emit)
        for sub_id, rows in sim.checker.model.sendable.items()
        for emit in rows
        if after < emit.commit_index <= through
    ]
    assert moved
    receipts = sim.checker.receipts
    processed = {(a.sub_id, k[1]) for a in apps(sim) for k in a.processed}
    for sub_id, emit in moved:
        assert receipts[(sub_id, emit, str(dead))] == 0
        by_others = sum(n for (s, e, r), n in receipts.items() if (s, e) == (sub_id, emit))
        assert by_others >= 1, (sub_id, emit)  # resent by the next holder
        assert (sub_id, (BUCKET, emit.epoch_counter, emit.commit_index)) in processed
    for app in apps(sim):
        keys = [k[1] for k in app.processed]
        assert len(keys) == len(set(keys))  # processed exactly once each (dedupe)


# ---- REC -------------------------------------------------------------------------------


def test_rec_01_normal_reconnect_continues_the_stream(mode: str) -> None:
    sim, report = run(
        21,
        scripted=(Scripted(500, "crash_clients"), Scripted(1_200, "crash_clients")),
        fault_ms=2_000,
        emission=mode,
    )
    assert report.faults.get("crash_clients", 0) >= 2
    attached: dict[str, int] = {}
    for e in trace(sim, "attached"):
        attached[str(e[3])] = attached.get(str(e[3]), 0) + 1
    assert all(n >= 2 for n in attached.values()), attached  # each sub reconnected
    assert report.stats.get("stale_resubscribes", 0) == 0
    for app in apps(sim):
        assert app.active and app.processed  # one continuous stream per subscription


def test_rec_02_reconnect_after_purge_and_compaction_is_stale_and_resubscribes(
    mode: str,
) -> None:
    sim, report = run(
        22,
        scripted=(Scripted(500, "stall_clients"),),
        fault_ms=6_000,
        writes=120,
        faults=("compaction",),
        emission=mode,
    )
    assert report.stats.get("compactions", 0) > 0
    assert report.stats.get("stale_resubscribes", 0) >= 1
    refused = [e for e in trace(sim, "refused") if e[4] == "STALE_SEQUENCE"]
    assert refused
    # The stale stream ended; the resubscribed one delivered everything after it.
    ended = [a for a in apps(sim) if not a.active]
    fresh = [a for a in apps(sim) if "~" in a.sub_id]
    assert ended and fresh and all(a.processed for a in fresh)


def test_durable_clients_that_keep_nothing_resume_by_name_after_the_servers_ack(
    mode: str,
) -> None:
    """Clients whose subscriptions are durable keep no position across a crash: each
    restart subscribes by name, the server's acknowledged position is where the stream
    resumes, and the checker holds it to that (a position past what the application
    processed is a gap; what it processed after the ack comes again)."""
    sim, report = run(
        23,
        scripted=(
            Scripted(400, "crash_clients", 100),
            Scripted(900, "crash_client", 150, 1),
            Scripted(1_400, "crash_clients", 100),
        ),
        durable=True,
        subs_per_client=2,
        emission=mode,
    )
    assert report.stats["durable_resumes"] >= 4
    assert report.stats.get("stale_resubscribes", 0) == 0
    for app in apps(sim):  # one stream per name: resumed, never made anew
        assert app.active and "~" not in app.sub_id and app.processed
    assert len(apps(sim)) == 4


def test_a_durable_resume_attaches_after_an_ack_applied_since_its_subscribe() -> None:
    """Seed 10004 (literal): a restarted client's SUBSCRIBE by name answered acked=10,
    then the old stream's last acks were purged before it attached: attaching after
    the answer's position was STALE_SEQUENCE. The holder now reads the position as it
    attaches (`BucketNotifier.resume`), as the node's Subscribe does."""
    config = SimConfig.from_seed(10004, emission="literal")
    assert config.durable
    report = Simulation(config).run()
    assert report.ok, report.describe()
    assert report.stats["durable_resumes"] >= 2


def test_a_lagging_holder_does_not_take_a_past_start_for_an_unknown_subscription() -> None:
    """Seed 78 (rendezvous): a subscription starting in the past (at 8, its SUBSCRIBE
    at 56) reconnected to a holder that had not applied the SUBSCRIBE: its position was
    below what that holder applied, so it answered SUBSCRIPTION_NOT_FOUND (the SDK would
    have subscribed afresh: a gap). The core now answers BEHIND for a subscription it
    does not hold; only a current replica (after the node's read barrier) says
    not-found."""
    report = Simulation(SimConfig.from_seed(78)).run()
    assert report.ok, report.describe()
    assert report.stats["start_time"] == 1


def test_the_checker_refuses_a_durable_resume_past_what_was_processed() -> None:
    from sevendb.outbox.emitseq import EmitSeq
    from sevendb.sim.checker import Violation

    sim, _ = run(24, durable=True, writes=20)
    app = next(a for a in apps(sim) if a.processed)
    last = EmitSeq(*cast(tuple[str, int, int], app.processed[-1][1]))
    beyond = EmitSeq(last.bucket_uuid, last.epoch_counter, last.commit_index + 1)
    with pytest.raises(Violation, match="gap"):
        sim.checker.on_durable_resume(app.principal, app.sub_id, app.start, beyond)
    first = EmitSeq(*cast(tuple[str, int, int], app.processed[0][1]))
    processed = len(app.processed)
    again = sim.checker.on_durable_resume(app.principal, app.sub_id, app.start, first)
    assert again == processed - 1 and emits(app) == [app.processed[0][1]]
    assert app.last == first


def test_subscriptions_starting_in_the_past_replay_the_retained_history(mode: str) -> None:
    """New subscriptions start earliest, after a committed position or from a time,
    while the holder trims the history to 8 change sets: the model replays the same
    rows the core does, and each application processes its stream, replayed part and
    live part, exactly once."""
    sim, report = run(
        50, writes=80, fault_ms=3_000, faults=("new_subs",), history_entries=8, emission=mode
    )
    assert report.stats["start_after"] + report.stats["start_earliest"] >= 2
    trims = [e for e in trace(sim, "commit") if "HISTORY_TRIM" in str(e)]
    assert trims
    from sevendb.outbox.entries import Subscribe, SubscribeBatch

    def in_the_past(app: AppStream) -> bool:
        """Its start is not its SUBSCRIBE's own position."""
        index = app.start.commit_index
        entry = decode_entry(sim.checker.committed[index][1]) if index else None
        return not isinstance(entry, Subscribe | SubscribeBatch)

    past = [a for a in apps(sim) if in_the_past(a) and a.processed]
    assert len(past) >= 2


# ---- MIG-01 ----------------------------------------------------------------------------


def test_mig_01_epoch_bump_under_load_keeps_emit_seq_monotonic(mode: str) -> None:
    sim, _ = run(
        31,
        scripted=tuple(Scripted(t, "epoch_bump") for t in (400, 800, 1_200)),
        fault_ms=1_800,
        writes=90,
        faults=("reorder", "duplicate"),
        emission=mode,
    )
    assert sim.checker.model.epoch >= 3
    crossed = 0
    for app in apps(sim):
        seqs = emits(app)
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        epochs = [s[1] for s in seqs]
        crossed += len(set(epochs)) > 1
        # commit_index keeps growing across epochs: (uuid, 1, 1000) -> (uuid, 2, 1001).
        indexes = [s[2] for s in seqs]
        assert indexes == sorted(indexes)
        # And each event chains from the one before it.
        for prev, key in zip(app.processed, app.processed[1:], strict=False):
            assert key[2] == prev[1]
    assert crossed  # some stream saw the rollover


# ---- PLN-01 ----------------------------------------------------------------------------


def broken_planner(query: Query) -> Plan:
    plan = plan_query(query)
    return Plan(plan.kind, plan.arg, plan.plan_hash ^ 0x5EED)


@pytest.mark.parametrize("broken", ["r0", "r2"])
def test_pln_01_a_diverging_replica_quarantines_itself_and_the_others_go_on(
    broken: str, mode: str
) -> None:
    sim, _ = run(41, planners={broken: broken_planner}, fault_ms=1_500, emission=mode)
    replica = sim.raft.members[broken]
    assert replica.quarantined
    assert "plan_hash" in replica.quarantine_reason
    healthy = [r for r in sim.raft.members.values() if r.name != broken]
    assert not any(r.quarantined for r in healthy)
    assert all(app.processed for app in apps(sim))
