"""Benchmark: how long a durable write takes to be acknowledged at a given rate, with
and without a subscriber receiving every write.

    .venv/bin/python tests/bench/bench_write_rates.py [--rates 1,50,200,500]
        [--seconds 6] [--runs 3]

For each run, a fresh 3-node, 1-bucket cluster (side_by_side.py's `SevendbCluster`:
plaintext, fsync on). Each rate writes open loop (one write every 1/rate s) for
`--seconds` through side_by_side.py's sevendb writer process (`AsyncClient`), first
with no subscriber, then with one of its subscriber processes holding a
subscription of every write (acknowledging as the SDK does). Prints the
acknowledgement's p50 / p90 / p99 in ms and the CPU the three nodes used per second
of load. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_writes import machine
from peers.clusters import SevendbCluster
from peers.common import Worker, cpu_seconds, pct
from peers.workloads import close_all

Row = tuple[float, float, float, float]
"""ack p50, p90, p99 (ms) and the nodes' CPU cores."""


def _run(rates: list[float], seconds: float, run: int) -> list[tuple[str, float, Row]]:
    root = Path(tempfile.mkdtemp(prefix="bench-rates-"))
    cluster = SevendbCluster(root, buckets=1)
    out = []
    try:
        cluster.start()
        writer = Worker("sevendb", "writer", cluster.conf(), root / "writer.log")
        time.sleep(3)  # the fresh cluster's leadership hand-over
        seq = 0
        for subscribed in (False, True):
            for rate in rates:
                prefix = f"r{int(rate)}s{int(subscribed)}"
                subs = []
                if subscribed:
                    spec = {"kind": "prefix", "prefix": prefix, "count": 1, "tag": prefix}
                    conf = {**cluster.conf(), "spec": spec}
                    subs.append(Worker("sevendb", "subscriber", conf, root / f"{prefix}.log"))
                cpu0 = sum(cpu_seconds(p) for p in cluster.pids())
                command = {"op": "load", "prefix": prefix, "rate": rate, "seconds": seconds}
                answer = writer.call({**command, "seq0": seq, "trace": True}, seconds + 120)
                cpu = (sum(cpu_seconds(p) for p in cluster.pids()) - cpu0) / seconds
                seq = int(answer["seq_end"])
                close_all(subs)
                acks = sorted((acked - sent) / 1e6 for _, sent, acked in answer["trace"])
                row = (pct(acks, 50), pct(acks, 90), pct(acks, 99), cpu)
                out.append(("1 subscriber" if subscribed else "none", rate, row))
        writer.close({"op": "quit"}, 30)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rates", default="1,50,200,500", help="writes per second, comma-separated")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    print(f"# {machine()}; {args.seconds:g} s per rate, {args.runs} run(s), fresh cluster each")
    print("| subscriber | writes/s | ack p50 ms | p90 ms | p99 ms | node CPU cores |")
    print("|---|---|---|---|---|---|")
    results: dict[tuple[str, float], list[Row]] = {}
    for run in range(args.runs):
        for who, rate, row in _run(rates, args.seconds, run):
            results.setdefault((who, rate), []).append(row)
            cells = " | ".join(f"{v:.2f}" for v in row)
            print(f"| {who} | {rate:g} | {cells} | (run {run + 1})", flush=True)
    print("\nMedians over the runs (range):")
    for (who, rate), rows in results.items():
        cells = " | ".join(
            f"{statistics.median(column):.2f} ({min(column):.2f}-{max(column):.2f})"
            for column in zip(*rows, strict=True)
        )
        print(f"| {who} | {rate:g} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
