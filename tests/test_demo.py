"""The README demo runs and shows what it claims to."""

from __future__ import annotations

from pathlib import Path

import pytest

from sevendb.cluster.ops.cli import main
from sevendb.cluster.ops.demo import run_core_demo


def test_core_demo_shows_dedupe_ack_reconnect_and_equal_digests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_core_demo() == 0
    out = capsys.readouterr().out
    assert "duplicate=True" in out
    assert "dropped by the client" in out
    assert "PRECONDITION_FAILED" in out
    assert "ACCEPTED, 2 rows purged" in out
    assert "NOT_OWNER" in out
    for status in ("OK", "STALE_SEQUENCE", "INVALID_SEQUENCE", "SUBSCRIPTION_NOT_FOUND"):
        assert status in out
    digests = [
        line.split()[-1] for line in out.splitlines() if "digest" in line and "replica" in line
    ]
    assert len(digests) == 2 and digests[0] == digests[1]


@pytest.mark.slow
def test_full_demo_streams_through_crashes_and_a_migration_then_audits_with_spark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--data", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "kill -9" in out
    assert "the stream continued" in out and "none missing" in out
    assert "resumed after its cursor" in out and "nothing missing" in out
    assert "[subscriber pid" in out and "orders/44 SET 'new'" in out
    assert "every replica of every bucket has the same applied index and state digest" in out
    assert "kept printing: nothing missing" in out and "from epoch 1 to epoch 2" in out
    # Part 2: Spark over the archive the demo's acks drained.
    assert "gaps 0, duplicates 0, out of order 0" in out and "audit: OK" in out
    assert "bucket / epoch / subscription" in out and "epoch 2" in out
    assert '"key": "orders/1", "value": "paid", "version": 2' in out
    assert "cluster stopped" in out
    assert not list((tmp_path / "demo" / "nodes").glob("*/node.pid"))
