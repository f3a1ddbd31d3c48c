"""The simulator is deterministic by construction: one seeded `random.Random`, a
simulated clock, no threads, sockets or wall clock (only the CLI reads a monotonic
clock, for --time-budget)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
