"""tests/bench/side_by_side.py's `floor` system: the stack's parts joined
(`composed_node.py`, three processes), measured with the same workers and workloads
as the systems it is the floor of, and gone when the run ends.

Not a benchmark: the loads last a second, and only that figures exist is asserted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("bench") / "side_by_side.py"


def _composed_nodes() -> list[str]:
    found = subprocess.run(["pgrep", "-f", "composed_node.py"], capture_output=True, text=True)
    return found.stdout.split()


def test_floor_column_with_the_write_and_latency_workloads(tmp_path: Path) -> None:
    before = _composed_nodes()
    args = ["--runs", "1", "--no-doc", "--only", "floor", "--workloads", "1,2", "--seconds", "1"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| figure | the stack's parts joined |" in done.stdout, done.stdout
    found = re.search(r"raw results and client/server logs: (\S+)", done.stderr)
    assert found is not None, done.stderr[-3000:]
    results = json.loads((Path(found.group(1)) / "results.json").read_text())
    (run,) = results["runs"]["floor"]
    assert run["errors"] == {}, run["errors"]
    figures = run["figures"]
    for n in (1, 32, 64):
        assert figures[f"w1.{n}.writes_per_s"] > 0, figures
    assert figures["w2.writes_per_s"] > 0 and figures["w2.missing"] == 0, figures
    assert _composed_nodes() == before  # the three nodes went with the run
