"""The README demo runs and shows the lifecycle it claims to."""

from __future__ import annotations

from sevendb.cluster.cli import main


def test_demo_shows_dedupe_ack_reconnect_and_equal_digests(capsys: object) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
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
