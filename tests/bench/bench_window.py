"""Benchmark: one client's write throughput by the SDK's bound on unanswered
sequences per bucket (`WritePipeline(sequences_in_flight=...)`, default
`SEQUENCES_IN_FLIGHT_MAX`).

    .venv/bin/python tests/bench/bench_window.py [--seconds 8] [--runs 3]
        [--windows 0,128,1024] [--inflight 64,128,256] [--buckets 1]

One durable cluster (3 nodes, fsync on); the closed-loop load of bench_writes.py
(each answer starts the next write) at each in-flight level, under each window (0:
unbounded, as before the bound), the windows alternating in a rotated order run
after run, since the machine is shared and its load drifts. Prints the median (and
range) of writes/s and of p50/p99 latency per window and level, with the load
average seen at each run. Not a test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_writes import machine, write_load

from sevendb.cluster.ops.local import cluster_down, cluster_up, local_tls, local_token
from sevendb.sdk import writer

UNBOUNDED = 1 << 40


def with_window(window: int) -> None:
    """Every WritePipeline made from now on bounds a bucket's unanswered sequences
    to `window`."""
    init = _ORIGINAL_INIT

    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["sequences_in_flight"] = window or UNBOUNDED
        init(self, *args, **kwargs)

    writer.WritePipeline.__init__ = patched  # type: ignore[method-assign]


_ORIGINAL_INIT = writer.WritePipeline.__init__


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=8)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--windows", default="0,128,1024")
    p.add_argument("--inflight", default="64,128,256")
    p.add_argument("--buckets", type=int, default=1)
    args = p.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    inflights = [int(i) for i in args.inflight.split(",")]
    print(f"machine: {machine()}", flush=True)
    figures: dict[tuple[int, int], list[dict[str, Any]]] = {}
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="sevendb-window-") as tmp:
        data = Path(tmp) / "data"
        spec = cluster_up(data, nodes=3, buckets=args.buckets, replicas=3).spec
        try:
            token, tls = local_token(data), local_tls(data)
            for run in range(args.runs):
                order = windows[run % len(windows) :] + windows[: run % len(windows)]
                for window in order:
                    with_window(window)
                    for inflight in inflights:
                        load = os.getloadavg()[0]
                        loads.append(load)
                        prefix = f"r{run}w{window}i{inflight}/"
                        r = write_load(
                            spec, token, prefix, args.seconds, inflight=inflight, tls=tls
                        )
                        r.pop("acks")
                        r["load"] = load
                        figures.setdefault((window, inflight), []).append(r)
                        print(
                            f"run {run} window {window or 'unbounded'} in flight {inflight}: "
                            f"{r['writes_per_s']:,.0f} writes/s, p50 {r['p50_ms']:.1f} ms, "
                            f"p99 {r['p99_ms']:.1f} ms, {r['writes_per_call']:.0f} writes/call, "
                            f"{r['errors']} errors, load {load:.1f}",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            cluster_down(data)
    print(
        f"\n{args.runs} runs of {args.seconds:g} s each, {args.buckets} bucket(s); "
        f"1-minute load average {min(loads):.1f}-{max(loads):.1f} "
        f"(median {statistics.median(loads):.1f}) on {os.cpu_count()} cores"
    )
    print(
        "\n| window | in flight | writes/s, median (range) | p50 ms | p99 ms | writes/call |"
        "\n|---|---|---|---|---|---|"
    )
    for window in windows:
        for inflight in inflights:
            rs = figures[window, inflight]
            wps = [r["writes_per_s"] for r in rs]
            print(
                f"| {window or 'unbounded'} | {inflight} | {statistics.median(wps):,.0f} "
                f"({min(wps):,.0f}-{max(wps):,.0f}) | "
                f"{statistics.median(r['p50_ms'] for r in rs):.1f} | "
                f"{statistics.median(r['p99_ms'] for r in rs):.1f} | "
                f"{statistics.median(r['writes_per_call'] for r in rs):.0f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
