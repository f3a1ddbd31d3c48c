"""Benchmark: how long a bucket's Raft group takes to replace a stopped leader.

    .venv/bin/python tests/bench/bench_failover.py [--trials 6] [--idle 5]

Each trial starts three replicas of one bucket in this process (real pysyncobj on
127.0.0.1, fsync on, production `RaftTuning`). It commits a write and lets the group
idle for `--idle` seconds, longer than `connection_timeout_s`, so the links between
followers have read nothing. Then it stops the leader and times how long until the
other two agree on a new, ready leader. It also prints how many terms that took:
1 means the first election won. Not a test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_writes import machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_replica import Cluster, num, write

from sevendb.cluster.raft.replica import RaftTuning


def trial(idle_s: float) -> tuple[float, int]:
    with tempfile.TemporaryDirectory(prefix="sevendb-bench-failover-") as tmp:
        cluster = Cluster(Path(tmp), n=3, tuning=RaftTuning()).start_all()
        try:
            leader = cluster.leader(20)
            assert leader.propose(write("x")).error is None
            time.sleep(idle_s)  # the condition measured: a quiet group
            term = num(leader, "term")
            t0 = time.monotonic()
            cluster.stop(cluster.index_of(leader))
            new = cluster.leader(30)
            return time.monotonic() - t0, num(new, "term") - term
        finally:
            cluster.close()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--idle", type=float, default=5.0)
    args = p.parse_args()
    print(f"machine: {machine()}", flush=True)
    results = []
    for n in range(args.trials):
        seconds, terms = trial(args.idle)
        results.append((seconds, terms))
        print(f"  trial {n + 1}: new leader after {seconds:.2f} s, {terms} term(s)", flush=True)
    times = [s for s, _ in results]
    print(
        f"failover: median {statistics.median(times):.2f} s, "
        f"min {min(times):.2f}, max {max(times):.2f}; "
        f"first election won in {sum(1 for _, t in results if t == 1)}/{len(results)} trials"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
