"""Durable named subscriptions against real processes (docs/emission.md, "Durable
names"): a consumer process killed with kill -9 and a fresh process with no cursor
file resume the principal's subscription by its name, with no gap and, deduplicated
by emit_seq, no duplicate; one live consumer per name; names are per principal."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import LocalCluster, wait_for
from test_emission import Collector, Writer, committed

from sevendb.sdk import SubscriptionBroken

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path / "data", buckets=2)
    try:
        yield c
    finally:
        c.stop()


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_killed_consumer_is_resumed_by_name_from_another_process_with_no_file(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    out1, out2 = tmp_path / "run1.jsonl", tmp_path / "run2.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "sevendb.cluster.ops.cli",
        "subscribe",
        "prefix:k/",
        "--data",
        str(cluster.data_dir),
        "--durable",
        "billing",
    ]
    with cluster.client() as client:
        writer = Writer(client, "k/")
        with open(out1, "w") as f:
            first = subprocess.Popen(cmd, stdout=f, stderr=subprocess.PIPE, cwd=work, text=True)
        assert first.stderr is not None
        assert "subscribed" in first.stderr.readline()  # every bucket's stream is up
        writer.write(60, pause_s=0.002)
        wait_for(lambda: out1.read_text().count("\n") >= 25, 30, "some events printed")
        os.kill(first.pid, signal.SIGKILL)  # mid-stream: no final ack, no unsubscribe
        first.wait()
        writer.write(30)
        assert list(work.iterdir()) == []  # no cursor file anywhere: the server has it
        with open(out2, "w") as f:
            second = subprocess.Popen(
                [*cmd, "--idle-exit", "3"], stdout=f, stderr=subprocess.PIPE, cwd=work
            )
        _, err = second.communicate(timeout=90)
        assert second.returncode == 0, err
        truth = committed(client, writer.attempted)
    run1, run2 = _lines(out1), _lines(out2)
    assert run1 and run2
    for run in (run1, run2):  # each run on its own: no duplicate, an unbroken chain
        for bucket in (0, 1):
            mine = [r for r in run if r["bucket"] == bucket]
            assert all(b["prev_emit_seq"] == a["emit_seq"] for a, b in itertools.pairwise(mine))
    for bucket in (0, 1):
        seen = [r["emit_seq"] for r in run1 if r["bucket"] == bucket]
        resumed = [r for r in run2 if r["bucket"] == bucket]
        if seen and resumed:
            # The second run continues run 1's chain (no gap) from a position run 1
            # reached: the last it acknowledged, so it repeats at most what run 1
            # processed after its last ack.
            assert resumed[0]["prev_emit_seq"] in seen
            assert len(seen) - 1 - seen.index(resumed[0]["prev_emit_seq"]) <= 256
    # Deduplicated by emit_seq (what the SDK's cursor does within a process), the two
    # runs hold every committed write exactly once.
    merged = {(r["key"], tuple(r["emit_seq"])) for r in run1 + run2}
    assert sorted(k for k, _ in merged) == sorted(truth)
    assert {k: s[2] for k, s in merged} == truth


def test_one_live_consumer_per_name_and_names_are_per_principal(cluster: LocalCluster) -> None:
    cluster.grant_all("bob")
    with (
        cluster.client() as one,
        cluster.client() as two,
        cluster.client(principal="bob") as bob,
    ):
        first = one.subscribe("prefix:d/", durable="billing")
        ids = first.sub_ids
        with pytest.raises(SubscriptionBroken, match="live consumer"):
            two.subscribe("prefix:d/", durable="billing")
        # Bob's "billing" is another subscription, of his own.
        bobs = Collector(bob.subscribe("prefix:d/", durable="billing"))
        assert set(bobs.sub.sub_ids.values()).isdisjoint(ids.values())
        collector = Collector(first)
        one.put("d/1", b"1")
        collector.wait_keys({"d/1"})
        collector.stop()  # close: a durable subscription is kept (detached)
        one.put("d/2", b"2")
        one.put("d/3", b"3")
        # Another client of the principal resumes it: the same subscriptions, after
        # what the first acknowledged, with what was written meanwhile.
        again = Collector(two.subscribe("prefix:d/", durable="billing"))
        assert again.sub.sub_ids == ids
        again.wait_keys({"d/2", "d/3"})
        assert "d/1" not in again.keys()  # noqa: SIM118 (Collector.keys)
        again.stop(close=False)
        again.sub.unsubscribe()  # ends it: the name is free
        fresh = two.subscribe("prefix:d/", durable="billing")
        assert set(fresh.sub_ids.values()).isdisjoint(ids.values())
        fresh.unsubscribe()
        bobs.wait_keys({"d/1", "d/2", "d/3"})
        bobs.stop()
