"""The consumer group simulation (sim/groups.py): members join, leave, die and pause
over seeded runs of the production state machine, and the checker holds one owner
per bucket, fenced acks, each bucket's order, no redelivery after an ack and nothing
lost; each broken variant is caught."""

from __future__ import annotations

import pytest

from sevendb.sim.groups import GroupSimConfig, main, run_seed

SEEDS = 150
CAUGHT_WITHIN = 30


def test_every_seed_keeps_the_group_invariants() -> None:
    reports = [run_seed(seed) for seed in range(SEEDS)]
    failed = [r.line() for r in reports if r.violation is not None]
    assert failed == []
    # The runs did what they are for: members died, paused and moved buckets.
    assert sum(r.deaths for r in reports) > SEEDS / 2
    assert sum(r.pauses for r in reports) > SEEDS / 2
    assert sum(r.rebalances for r in reports) > 5 * SEEDS
    assert sum(r.rows for r in reports) > 50 * SEEDS


def test_a_seed_replays_exactly() -> None:
    assert run_seed(11).line() == run_seed(11).line()
    assert GroupSimConfig.from_seed(11) == GroupSimConfig.from_seed(11)


@pytest.mark.parametrize(
    ("bug", "invariant"), [("deposed_ack", "fenced acks"), ("two_owners", "one owner")]
)
def test_each_broken_variant_is_caught(bug: str, invariant: str) -> None:
    caught = [run_seed(seed, bug) for seed in range(CAUGHT_WITHIN)]
    assert any(r.violation is not None and r.violation.invariant == invariant for r in caught)


def test_a_deposed_ack_let_through_loses_changes_or_breaks_order() -> None:
    """Without the direct check on acks, its effects are caught: a deposed member's
    late ack moves the group past rows the new owner never got."""
    found = {
        r.violation.invariant
        for r in (run_seed(seed, "deposed_ack", check_acks=False) for seed in range(100))
        if r.violation is not None
    }
    assert found & {"nothing lost", "order", "once"}


def test_the_command_line_runs_a_swarm(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "5"]) == 0
    assert main(["--seeds", "5", "--bug", "two_owners"]) == 1
    assert "VIOLATION one owner" in capsys.readouterr().out
