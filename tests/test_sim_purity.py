"""The simulator is deterministic by construction: one seeded `random.Random`, a
simulated clock, no threads, sockets or wall clock (only the CLI reads a monotonic
clock, for --time-budget), also in the production notifier host it drives."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from sevendb.notifier import host
from sevendb.sim.config import SimConfig
from sevendb.sim.world import Simulation

SIM = Path(__file__).resolve().parent.parent / "sim"
BANNED = {
    "socket",
    "threading",
    "asyncio",
    "time",
    "os",
    "uuid",
    "secrets",
    "datetime",
    "subprocess",
    "multiprocessing",
    "selectors",
    "signal",
    "grpc",
    "pysyncobj",
}
CLOCK_ALLOWED = {"cli.py": {"time"}}


def imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(SIM.glob("*.py")), ids=lambda p: p.name)
def test_sim_module_is_deterministic_by_construction(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    assert not (imports(tree) & BANNED) - CLOCK_ALLOWED.get(path.name, set())
    # `random` only as the seeded class, never the module-level (global) generator.
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "random":
            assert [a.name for a in node.names] == ["Random"], path
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "random"
        ):
            assert node.attr == "Random", f"{path.name}: random.{node.attr}"


def test_the_simulator_runs_the_production_host_without_a_thread_or_the_wall_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every node of a run is the production `BucketNotifier`, its passes run from the
    simulation's steps on the simulated clock: starting a thread or reading the
    host's wall clock fails the run."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the simulation started a thread or read the wall clock")

    class NoClock:
        time_ns = staticmethod(refuse)

    with monkeypatch.context() as patch:
        patch.setattr(threading.Thread, "start", refuse)
        patch.setattr(host, "time", NoClock)
        sim = Simulation(SimConfig.from_seed(3, faults=("rendezvous", "holder_crash")))
        report = sim.run()
    assert report.ok, report.describe()
    assert report.stats["processed"] > 0
    assert all(type(node.host) is host.BucketNotifier for node in sim.nodes.values())
