"""Consumer group members as real processes (`sevendb subscribe --group`), killed
with kill -9 at random while a writer writes: every committed change is processed
by some member, none is lost and, deduplicated by emit_seq, none twice, and each
bucket's order is kept (docs/sdk.md, "Consumer groups")."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import LocalCluster, wait_for
from test_emission import Writer, committed

pytestmark = pytest.mark.slow

BUCKETS = 4


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path / "data", buckets=BUCKETS)
    try:
        yield c
    finally:
        c.stop()


class Members:
    """Member processes of one group, each printing to a file of its own."""

    def __init__(self, cluster: LocalCluster, out: Path) -> None:
        self.cmd = [
            sys.executable,
            "-m",
            "sevendb.cluster.ops.cli",
            "subscribe",
            "prefix:kg/",
            "--data",
            str(cluster.data_dir),
            "--group",
            "kg",
            "--session-timeout",
            "1.5",
        ]
        self.out = out
        self.live: list[subprocess.Popen[str]] = []
        self.files: list[Path] = []
        self.errors: dict[int, Path] = {}  # each member's stderr, by pid

    def start(self) -> None:
        path = self.out / f"member{len(self.files)}.jsonl"
        self.files.append(path)
        err = path.with_suffix(".err")  # a file, not a pipe nobody reads: never fills
        with open(path, "w") as f, open(err, "w") as e:
            proc = subprocess.Popen(self.cmd, stdout=f, stderr=e, text=True)
        wait_for(lambda: "joined group" in err.read_text() or proc.poll() is not None, 60, "a join")
        assert "joined group" in err.read_text(), err.read_text()
        self.live.append(proc)
        self.errors[proc.pid] = err

    def kill9(self, rng: random.Random) -> None:
        proc = self.live.pop(rng.randrange(len(self.live)))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for proc in self.live:
            proc.send_signal(signal.SIGINT)  # a clean leave
        for proc in self.live:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"a member did not leave within 60 s: {self.errors[proc.pid].read_text()}"
                ) from None
        self.live = []

    def runs(self) -> list[list[dict[str, Any]]]:
        return [
            [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
            for path in self.files
        ]


def test_members_killed_at_random_lose_nothing_and_keep_each_buckets_order(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    rng = random.Random(int(os.environ.get("SEVENDB_TEST_SEED", "34")))
    members = Members(cluster, tmp_path)
    try:
        for _ in range(3):
            members.start()
        with cluster.client() as client:
            writer = Writer(client, "kg/")
            for _ in range(5):
                writer.write(40, pause_s=0.005)
                members.kill9(rng)  # mid-stream: no final ack, no leave
                members.start()
            writer.write(40)
            truth = committed(client, writer.attempted)

            def seen() -> set[str]:
                return {r["key"] for run in members.runs() for r in run}

            wait_for(lambda: seen() >= set(truth), 90, "every change processed")
        members.stop()
    finally:
        for proc in members.live:
            proc.kill()
            proc.wait()
    runs = members.runs()
    delivered = [tuple(r["emit_seq"]) for run in runs for r in run]
    merged = {(r["key"], tuple(r["emit_seq"])) for run in runs for r in run}
    # Every committed change, at the position it committed at, and nothing else.
    assert sorted(k for k, _ in merged) == sorted(truth)
    assert {k: s[2] for k, s in merged} == truth
    # Each bucket's order: within a member's run a bucket's events follow their chain
    # (prev_emit_seq is the previous event's); where a member (re)starts a bucket, it
    # continues from a position some member processed, or the start: no gap.
    positions = {tuple(r["emit_seq"]) for run in runs for r in run}
    for run in runs:
        last: dict[int, tuple[Any, ...]] = {}
        for r in run:
            prev, here = tuple(r["prev_emit_seq"]), tuple(r["emit_seq"])
            before = last.get(r["bucket"])
            if before is not None and prev == before:
                assert here > before
            else:
                assert prev in positions or prev[2] <= min(
                    s[2] for s in positions if s[0] == here[0]
                ), f"bucket {r['bucket']}: a gap before {here}"
            last[r["bucket"]] = here
    again = len(delivered) - len(set(delivered))
    print(f"{len(truth)} changes, {len(delivered)} deliveries, {again} again after a kill")
    assert again <= 5 * 256  # redelivered only what a killed member held unacked
