"""tests/bench/side_by_side.py's `sevendb-netns` system: sevendb's three nodes on three
network-namespace hosts, measured in the same run as the loopback cluster and shown
beside it; the lab and the nodes go when the run ends, and when it is interrupted.

Not a benchmark: the loads last a second, and only that figures exist is asserted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_harness import wait_for
from netns import leftovers

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("bench") / "side_by_side.py"
LABEL = "sevendb, 3 netns hosts"


def _harness(args: list[str], stderr: Path) -> subprocess.Popen[str]:
    with stderr.open("w") as err:
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), "--runs", "1", "--no-doc", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
        )


def _node_pids(stderr: str) -> list[int]:
    pids = [int(p) for p in re.findall(r"sevendb-netns: node n\d \(pid (\d+)\)", stderr)]
    assert len(pids) == 3, stderr
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_torn_down(harness_pid: int, node_pids: list[int]) -> None:
    tag = f"b{harness_pid % 100_000}"
    assert leftovers(tag) == []
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True)
    assert f"sdb{tag}br" not in rules.stdout
    assert [p for p in node_pids if _alive(p)] == []


def test_netns_column_beside_loopback(tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    proc = _harness(["--only", "sevendb", "--netns", "--workloads", "1,2", "--seconds", "1"], err)
    out, _ = proc.communicate(timeout=600)
    log = err.read_text()
    assert proc.returncode == 0, log[-3000:]
    assert f"| figure | sevendb | {LABEL} | {LABEL} / sevendb |" in out, out
    found = re.search(r"raw results and client/server logs: (\S+)", log)
    assert found is not None, log[-3000:]
    results = json.loads((Path(found.group(1)) / "results.json").read_text())
    for system in ("sevendb", "sevendb-netns"):
        (run,) = results["runs"][system]
        assert run["errors"] == {}, (system, run["errors"])
        figures = run["figures"]
        for n in (1, 32, 64):
            assert figures[f"w1.{n}.writes_per_s"] > 0, (system, figures)
        assert figures["w1.64.server_cores"] > 0, (system, figures)  # the nodes' pids
        assert figures["w2.writes_per_s"] > 0 and figures["w2.missing"] == 0, (system, figures)
    _assert_torn_down(proc.pid, _node_pids(log))


def test_interrupted_run_tears_the_lab_down(tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    proc = _harness(["--only", "sevendb-netns", "--workloads", "1", "--seconds", "600"], err)
    try:
        wait_for(
            lambda: "3 nodes up" in err.read_text() or proc.poll() is not None,
            300,
            "the netns cluster to be up",
            0.2,
        )
        assert proc.poll() is None, err.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = err.read_text()
    assert proc.returncode == 130, log[-3000:]
    assert "SIGINT: stopping" in log
    _assert_torn_down(proc.pid, _node_pids(log))
