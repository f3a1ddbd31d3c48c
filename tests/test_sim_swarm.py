"""The swarm: many seeds, each with its own fault mix, all checked."""

from __future__ import annotations

import shlex

import pytest

from sevendb.sim.cli import config_from_argv, main, shrink, swarm
from sevendb.sim.config import STORAGE_ACTIONS, Bugs, Scripted, SimConfig
from sevendb.sim.planners import sneaky_planner
from sevendb.sim.world import Simulation

SWARM_SEEDS = 500


@pytest.mark.slow
def test_a_swarm_of_seeds_is_clean() -> None:
    result = swarm(0, SWARM_SEEDS)
    print(
        f"\n{result.seeds} seeds, {result.seeds_per_s:.1f} seeds/s, "
        f"{sum(result.faults.values())} faults injected, {result.checks} events checked"
    )
    assert result.seeds == SWARM_SEEDS
    assert not result.failures, "\n\n".join(r.describe() for r in result.failures[:3])
    # The swarm really exercises the faults it claims to, in both emission modes.
    assert sorted(result.modes) == ["derived", "literal"]
    for mode, faults in result.modes.items():
        assert faults["seeds"] > SWARM_SEEDS // 3, mode
        for kind in (
            "replica_crash",
            "holder_crash",
            "partition",
            "client_crash",
            "client_stall",
            "pause",
            "epoch_bump",
            "malicious",
        ):
            assert faults[kind] > 0, (mode, kind)
        assert all(faults[kind] > 0 for kind in STORAGE_ACTIONS), (mode, faults)
    assert result.processed > 10 * SWARM_SEEDS


@pytest.mark.parametrize("mode", ["derived", "literal"])
def test_a_small_swarm_is_clean(mode: str) -> None:
    result = swarm(10_000, 25, overrides={"emission": mode})
    assert not result.failures, "\n\n".join(r.describe() for r in result.failures[:3])
    assert result.modes[mode]["seeds"] == 25


def test_the_cli_runs_a_seed_and_a_budgeted_swarm(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "seed 5: ok" in out and "trace digest" in out
    assert main(["--seeds", "3", "--time-budget", "30"]) == 0
    out = capsys.readouterr().out
    assert "3 seeds in" in out and "seeds/s" in out and "events checked" in out


def test_the_cli_reports_a_violation_with_its_replay_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    found = swarm(0, 30, overrides={"bugs": Bugs(sdk_skips_dedupe=True)}, stop_on_failure=True)
    assert found.failures
    seed = str(found.failures[0].seed)
    assert main(["--seed", seed, "--bug", "sdk_skips_dedupe"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION effective-once" in out
    assert "last steps:" in out
    assert f"replay: python -m sevendb.sim --seed {seed} --bug sdk_skips_dedupe" in out


def test_the_time_budget_stops_the_swarm() -> None:
    ticks = iter(range(100))
    result = swarm(0, 1_000, time_budget_s=2.5, clock=lambda: float(next(ticks)))
    assert result.seeds == 2


def test_a_replay_command_parses_back_to_the_same_configuration() -> None:
    config = SimConfig.from_seed(
        7,
        faults=("drop", "pause"),
        writes=33,
        reuse_sub_ids=True,
        scripted=(Scripted(100, "crash_holder"), Scripted(250, "partition", 300, 5)),
        planners={"r1": sneaky_planner},
        bugs=Bugs(purge_before_ack=True),
    )
    argv = shlex.split(config.replay_command())[3:]
    assert argv[:2] == ["--seed", "7"]
    assert config_from_argv(argv) == config
    plain = SimConfig.from_seed(8)
    assert plain.replay_command() == "python -m sevendb.sim --seed 8"
    assert config_from_argv(["--seed", "8"]) == plain


def test_shrinking_keeps_the_violation_with_fewer_fault_events() -> None:
    config = SimConfig.from_seed(5, bugs=Bugs(sdk_skips_dedupe=True))
    report = Simulation(config).run()
    assert not report.ok
    small, smaller = shrink(config, report.invariant)
    assert len(small.scripted) < len(config.scripted)
    assert not smaller.ok and smaller.invariant == report.invariant
    assert Simulation(small).run().violation == smaller.violation
