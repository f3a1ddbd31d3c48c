"""Exactly-once consume-transform-produce on real processes (issue 29, docs/
transactions.md): a transformer (tests/txn_transformer.py) is killed with SIGKILL at
random points and restarted; every input ends up in the output exactly once (each
output key written once: version 1)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import STARTED, LocalCluster, wait_for

pytestmark = pytest.mark.slow

INPUTS = 60
HERE = Path(__file__).parent


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path / "data", buckets=2)
    STARTED.append(Path(c.data_dir))
    try:
        c.wait_settled()
        yield c
    finally:
        c.stop()


def _start(cluster: LocalCluster, jitter_s: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "txn_transformer.py"), str(cluster.data_dir), str(jitter_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_killed_transformer_reflects_every_input_exactly_once(cluster: LocalCluster) -> None:
    rng = random.Random(29)
    with cluster.client() as client:
        proc = _start(cluster, 0.02)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "subscribed"
            for i in range(INPUTS):
                client.put(f"in/{i:03d}", str(i).encode())
                if i % 12 == 11:  # kill it at a random point, and start another
                    time.sleep(rng.uniform(0.05, 0.6))
                    proc.kill()
                    proc.wait(timeout=30)
                    proc = _start(cluster, 0.02)
                    assert proc.stdout is not None
                    assert proc.stdout.readline().strip() == "subscribed", proc.stderr

            def outputs() -> int:
                return sum(1 for i in range(INPUTS) if client.get(f"out/in/{i:03d}") is not None)

            wait_for(lambda: outputs() == INPUTS, 120, "every input transformed")
        finally:
            proc.kill()
            proc.wait(timeout=30)
        for i in range(INPUTS):
            record = client.get(f"out/in/{i:03d}")
            assert record is not None
            assert record.value == f"T({i})".encode()
            assert record.version == 1, f"out/in/{i:03d} written {record.version} times"
