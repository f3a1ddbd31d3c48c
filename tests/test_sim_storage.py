"""Storage faults in the simulator (docs/sim.md): a replica that restarts having lost
log entries it acknowledged (a corrupt record mid-log, a lost tail, a lost snapshot)
neither votes nor stands nor counts towards a commit until the leader has repaired
it; a group that cannot prove it holds every committed entry refuses with DATA_LOSS
instead of serving a shorter history. The checker's durability invariant ("no
acknowledged write lost") watches every election.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_sim_broken import DAMAGED_VOTER

from sevendb.outbox.entries import Expected, Op, OpKind, Write, encode_entry
from sevendb.outbox.replica import ApplyOutcome
from sevendb.sim.config import Bugs, Scripted, SimConfig
from sevendb.sim.raft import Damage, Member, RaftGroup, Role
from sevendb.sim.world import Report, Simulation

ALL = ("r0", "r1", "r2")


def nothing(member: Member, index: int, data: bytes, outcome: ApplyOutcome | None) -> None:
    """An apply hook that keeps nothing."""


def everyone(a: str, b: str) -> bool:
    return True


def write(i: int) -> bytes:
    return encode_entry(Write((Op(OpKind.SET, f"k/{i}", b"v", Expected()),), None, i))


def replicate_all(group: RaftGroup, leader: Member, to: tuple[str, ...]) -> None:
    """Replicate until every member in `to` holds the leader's log durably; commit."""
    for _ in range(40):
        for name in to:
            group.replicate(leader, group.members[name], 0, nothing)
            group.members[name].flush()
        leader.flush()
        group.advance_commit(leader)
        leader.apply_committed(nothing)
    assert all(group.members[n].durable == leader.last_index for n in to)


def two_of_three_acknowledged(*, damaged_votes: bool = False, compact: bool = True) -> RaftGroup:
    """r0 leads; r2 stops after the first entries; r0 and r1 acknowledge 20 more
    writes (committed); r1 compacts its log into a snapshot; r0 and r1 stop."""
    group = RaftGroup("b", ALL, random.Random(7), damaged_votes=damaged_votes)
    r0, r1, r2 = (group.members[n] for n in ALL)
    assert group.campaign(r0, 0, everyone)
    replicate_all(group, r0, ("r1", "r2"))
    r2.crash()
    for i in range(20):
        r0.append(write(i))
    replicate_all(group, r0, ("r1",))
    assert r0.commit == r0.last_index == 21
    r1.apply_committed(nothing)
    assert not compact or r1.compact(0, 1_000) is not None
    r0.crash()
    r1.crash()
    return group


# ---- the Raft model ---------------------------------------------------------------------


@pytest.mark.parametrize("damaged_votes", [False, True])
def test_a_replica_that_lost_its_snapshot_does_not_vote_for_a_shorter_log(
    damaged_votes: bool,
) -> None:
    group = two_of_three_acknowledged(damaged_votes=damaged_votes)
    r1, r2 = group.members["r1"], group.members["r2"]
    found = r1.restart(0, random.Random(1), nothing, Damage.LOST_SNAPSHOT)
    assert "the state is gone" in found
    assert r1.damaged and r1.last_index == 0 and r1.repair_through == 21
    assert not group.campaign(r1, 0, everyone)  # it does not stand either
    r2.restart(0, random.Random(2), nothing)
    assert not r2.damaged and r2.last_index == 1
    # r2 lacks 20 committed entries; r1's empty log cannot tell it, so only the rule
    # keeps r1's vote from electing it. The broken variant elects it.
    assert group.campaign(r2, 0, everyone) is damaged_votes
    if not damaged_votes:
        assert group.data_loss() == ""  # r0 is down, not damaged: wait for it


@pytest.mark.parametrize("damage", [Damage.CORRUPT_RECORD, Damage.LOST_TAIL])
def test_a_log_that_lost_acknowledged_records_is_damage_and_a_leader_repairs_it(
    damage: Damage,
) -> None:
    group = two_of_three_acknowledged(compact=False)
    r0, r1 = group.members["r0"], group.members["r1"]
    found = r1.restart(0, random.Random(3), nothing, damage)
    assert found and r1.damaged and r1.last_index < 21 == r1.repair_through
    r0.restart(0, random.Random(4), nothing)
    r2 = group.members["r2"]
    r2.restart(0, random.Random(6), nothing)
    assert group.campaign(r0, 0, everyone)  # with r2's vote (r1 gives none)
    assert r0.role is Role.LEADER
    replicate_all(group, r0, ("r1", "r2"))
    assert not r1.damaged and group.repairs == 1
    assert [r1.entry_at(i) for i in range(1, 22)] == [r0.entry_at(i) for i in range(1, 22)]


def test_a_lost_snapshot_with_the_whole_log_left_and_a_torn_tail_are_no_damage() -> None:
    group = two_of_three_acknowledged(compact=False)
    r1 = group.members["r1"]
    digest = r1.sm.digest()
    # A snapshot at 21 that left the log before it in place (the safety point held
    # compaction back).
    r1.snap_index, r1.snap_term, r1.snap_data = 21, r1.last_term, r1.sm.snapshot()
    r1.entries.append(r1.entries[-1])  # appended, never flushed: lost in the crash
    assert r1.last_index == 22 and r1.durable == 21
    r1.crash()
    assert r1.last_index == 21  # the torn tail: never acknowledged, nothing lost
    found = r1.restart(0, random.Random(5), nothing, Damage.LOST_SNAPSHOT)
    assert "the log from index 1 rebuilds the state" in found
    assert not r1.damaged and r1.applied == 21 and r1.sm.digest() == digest


def test_a_damaged_follower_does_not_count_towards_a_commit() -> None:
    group = RaftGroup("b", ALL, random.Random(9))
    r0, r1 = group.members["r0"], group.members["r1"]
    assert group.campaign(r0, 0, everyone)
    index = r0.append(write(1))
    r0.flush()
    r0.match["r1"] = index  # r1 acknowledged it ...
    r1.repair_through = index  # ... and has lost it since
    assert group.advance_commit(r0) == 0
    r1.repair_through = 0
    assert group.advance_commit(r0) == index


# ---- whole runs ------------------------------------------------------------------------


def run(seed: int, **overrides: Any) -> tuple[Simulation, Report]:
    sim = Simulation(SimConfig.from_seed(seed, **overrides), keep_trace=True)
    report = sim.run()
    assert report.ok, report.describe()
    return sim, report


def events(sim: Simulation, kind: str) -> list[tuple[object, ...]]:
    return [e for e in sim.full_trace or [] if e[1] == kind]


@pytest.mark.parametrize("action", ["corrupt_log", "lose_log_tail", "lose_snapshot"])
def test_one_damaged_replica_is_repaired_and_nothing_is_lost(action: str) -> None:
    repaired = 0
    for seed in range(6):
        sim, report = run(
            seed,
            replicas=3,
            faults=("compaction",),
            writes=80,
            fault_ms=2_000,
            scripted=(Scripted(1_000, action, 300, seed),),
        )
        assert not report.refused
        assert events(sim, "quiescent")  # converged: delivered, purged, digests agree
        for damaged in events(sim, "damaged"):
            assert any(e[2] == damaged[2] for e in events(sim, "repaired")), damaged
            repaired += 1
    assert repaired >= 3  # the damage took effect on most seeds (a log to damage)


def test_a_damaged_replica_does_not_vote_and_the_bucket_waits_for_the_acknowledged_entries() -> (
    None
):
    """The scenario that catches `damaged_replica_votes`, with the real rule: while the
    damaged replica and the stale one are the only ones up, nobody is elected; when
    the replica that holds the acknowledged entries returns, it leads and repairs."""
    caught = 0
    for seed in range(12):
        broken = Simulation(
            SimConfig.from_seed(seed, bugs=Bugs(damaged_replica_votes=True), **DAMAGED_VOTER)
        ).run()
        if broken.ok:
            continue
        caught += 1
        assert broken.invariant == "durability"
        sim, _ = run(seed, **DAMAGED_VOTER)
        (damaged,) = events(sim, "damaged")
        back = int(str(events(sim, "faults-stop")[0][0]))
        leaders = [e for e in events(sim, "leader") if int(str(e[0])) > int(str(damaged[0]))]
        assert leaders and all(int(str(e[0])) >= back for e in leaders)
        assert any(e[2] == damaged[2] for e in events(sim, "repaired"))
    assert caught >= 3


# Two replicas stop and restart damaged (a corrupt record, a lost tail); the third,
# which holds everything, stops before it could repair them and comes back later.
PLAN = ("800:corrupt_log:300", "805:lose_log_tail:300", "810:crash_replica:390")
MAJORITY_DAMAGED = {
    "faults": (),
    "replicas": 3,
    "fault_ms": 2_000,
    "scripted": tuple(Scripted.parse(event) for event in PLAN),
}


def test_a_majority_of_damaged_replicas_refuses_with_data_loss() -> None:
    refused = 0
    for seed in range(8):
        sim, report = run(seed, **MAJORITY_DAMAGED)
        if len(events(sim, "damaged")) < 2:
            continue  # a damage found nothing to damage (all under a snapshot)
        refused += 1
        damaged = sorted(str(e[2]) for e in events(sim, "damaged"))
        assert report.refused.startswith("DATA_LOSS")
        assert f"damaged: {', '.join(damaged)}" in report.refused
        assert report.stats["data_loss_refusals"] > 0  # the workload's writes
        (verdict,) = events(sim, "data-loss")
        assert not [e for e in events(sim, "leader") if int(str(e[0])) >= int(str(verdict[0]))]
        # The intact replica still holds every committed entry: nothing was served
        # from, or overwritten by, a shorter history.
        (intact,) = [m for m in sim.raft.members.values() if not m.damaged]
        committed = sim.checker.committed
        for index in range(intact.base + 1, len(committed)):
            assert intact.entry_at(index) == committed[index]
    assert refused >= 4


def test_the_swarm_is_clean_with_storage_faults() -> None:
    damaged = repairs = refused = 0
    for seed in range(40):
        config = SimConfig.from_seed(
            seed,
            faults=("storage", "replica_crash", "holder_crash", "compaction", "partition"),
            fault_rate=2.0,
        )
        report = Simulation(config).run()
        assert report.ok, report.describe()
        damaged += report.stats.get("damaged_restarts", 0)
        repairs += report.stats.get("repairs", 0)
        refused += bool(report.refused)
    assert damaged > 20 and repairs > 10, (damaged, repairs, refused)
