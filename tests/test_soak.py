"""The soak run of issue 27 in CI: five minutes of steady writes with churn
(tests/bench/soak.py): memory, disk, outbox rows, subscriptions and producers stay
flat after warm-up, no acknowledged write is lost, and the auditor's subscription
sees no gap or duplicate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "bench"))

from soak import SERIES_SLACK, report, soak, verdict


def test_the_verdict_judges_peaks_against_peaks() -> None:
    """A saw-tooth (a log between compactions) is flat; a climb is not."""
    saw = [{name: float(100 + (i % 6) * 50) for name in SERIES_SLACK} for i in range(60)]
    assert all(v["flat"] for v in verdict(saw).values())
    climb = [{name: float(1_000 + i * 100) for name in SERIES_SLACK} for i in range(60)]
    assert not any(v["flat"] for v in verdict(climb).values())


@pytest.mark.slow
def test_five_minutes_of_churn_leave_everything_flat(tmp_path: Path) -> None:
    result = soak(5.0, 100.0, tmp_path / "data")
    report(result)
    assert not result["acknowledged_writes_missing"], result["acknowledged_writes_missing"]
    assert not result["audit_problems"], result["audit_problems"]
    growing = {k: v for k, v in result["series"].items() if not v["flat"]}
    assert not growing, growing
    assert result["churn"].get("vanished subscribers", 0) > 0
