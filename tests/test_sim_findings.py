"""What the simulator found in the core, pinned.

Each test states the *correct* behaviour. A finding that is fixed keeps its test
as a regression guard; one still open is marked `xfail(strict=True)`, so the day
it is fixed the XPASS fails the suite and the marker gets removed.
"""

from __future__ import annotations

import pytest
from helpers import Driver

from sevendb.outbox.lifecycle import stalled_subscriptions
from sevendb.sim.config import SimConfig
from sevendb.sim.planners import sneaky_planner
from sevendb.sim.world import Simulation, run_seed

REUSE = {
    "reuse_sub_ids": True,
    "faults": ("unsubscribe", "rendezvous", "holder_crash", "replica_crash", "pause"),
    "fault_rate": 2.0,
}


def test_a_resubscribed_sub_id_does_not_adopt_its_previous_incarnations_rows() -> None:
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    d.set("k")  # a row for the first incarnation, still pending
    d.unsubscribe("s")
    d.subscribe("s", "all")  # a new incarnation starts here
    d.outbox()
    sub = d.sm.subs.get("s")
    assert sub is not None
    # Finding 1 (fixed): the old row, emit_seq before sub.start, was attached; no
    # ack could ever cover it (acking sub.start is a DUPLICATE), so the outbox
    # never drained and the caught-up subscription was expired as stalled.
    assert list(sub.rows) == []
    assert stalled_subscriptions(d.sm, d.now_ms + 10**9, 1_000) == ()


def test_the_swarm_is_clean_when_sub_ids_are_reused() -> None:
    for seed in range(80):
        report = run_seed(seed, **REUSE)
        assert report.ok, report.describe()


@pytest.mark.xfail(
    strict=True,
    reason="OUTBOX_WRITE carries the proposer's digest and every replica that disagrees "
    "quarantines itself: a diverged lease holder takes the healthy majority down and "
    "streams its own rows",
)
@pytest.mark.parametrize("mode", ["derived", "literal"])
def test_a_diverged_lease_holder_is_contained(mode: str) -> None:
    report = run_seed(2, planners={"r0": sneaky_planner}, faults=(), emission=mode)
    assert report.ok, report.describe()


@pytest.mark.parametrize("mode", ["derived", "literal"])
def test_a_diverged_follower_quarantines_itself_at_the_next_outbox_write(mode: str) -> None:
    """The same broken planner on a replica that does not propose: contained (in the
    derived mode at the next checkpoint, which is also an OUTBOX_WRITE)."""
    for seed in range(40):
        config = SimConfig.from_seed(
            seed, planners={"r0": sneaky_planner}, faults=(), emission=mode
        )
        sim = Simulation(config)
        report = sim.run()
        r0 = sim.raft.members["r0"]
        if report.ok and r0.quarantined:
            assert "OUTBOX_WRITE" in r0.quarantine_reason
            assert not any(r.quarantined for r in sim.raft.members.values() if r is not r0)
            return
    pytest.fail("no seed had the diverged replica outside the lease")
