"""Benchmark: the cost of TLS on the client port, TLS and plaintext side by side.

    .venv/bin/python tests/bench/bench_tls.py [--rounds 3] [--seconds 8] [--rate 300]

Each round runs both, in alternating order (a shared machine's load drifts), each on
a fresh local cluster (3 node processes, fsync on, 2 buckets, 100-byte values),
`cluster up` with TLS (its own CA) or `--insecure`:

1. write throughput: closed-loop writers, 64 in flight (bench_writes.write_load);
2. delivery latency: one subscription in a separate process (bench_emission's
   subscriber), writes at a fixed rate: write acknowledged -> event in the
   application, and write sent -> event in the application.

Prints every run, then the median of each figure per mode and the ratio TLS /
plaintext; the 1-minute load average before each run. Not a test: figures are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_emission import Subscribers, delivery_latencies
from bench_writes import machine, pct, write_load

from sevendb.cluster.ops.local import cluster_down, cluster_up, local_tls, local_token

FIGURES = (
    ("writes_per_s", "writes/s (64 in flight)"),
    ("write_p50_ms", "write p50 ms"),
    ("write_p99_ms", "write p99 ms"),
    ("commit_to_app_p50_ms", "ack -> app p50 ms"),
    ("commit_to_app_p99_ms", "ack -> app p99 ms"),
    ("send_to_app_p50_ms", "send -> app p50 ms"),
    ("send_to_app_p99_ms", "send -> app p99 ms"),
)


def one_run(*, insecure: bool, seconds: float, rate: float, buckets: int) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sevendb-bench-tls-") as tmp:
        data = Path(tmp) / "data"
        spec = cluster_up(data, nodes=3, buckets=buckets, replicas=3, insecure=insecure).spec
        token, tls = local_token(data), local_tls(data)
        ca = None if tls is None else data / "ca.pem"
        try:
            closed = write_load(spec, token, "w/", seconds, inflight=64, tls=tls)
            sub = Subscribers(spec, token, "prefix:l/", 1, ca)
            paced = write_load(spec, token, "l/", seconds, rate=rate, tls=tls)
            sub.wait_count(paced["writes"], 60)
            result = sub.finish()
        finally:
            cluster_down(data)
    commit_to_app, send_to_app = delivery_latencies(paced, result)
    return {
        "load": load_before,
        "writes_per_s": closed["writes_per_s"],
        "write_p50_ms": closed["p50_ms"],
        "write_p99_ms": closed["p99_ms"],
        "errors": closed["errors"] + paced["errors"],
        "delivered": f"{len(commit_to_app)}/{paced['writes']}",
        "commit_to_app_p50_ms": pct(commit_to_app, 50),
        "commit_to_app_p99_ms": pct(commit_to_app, 99),
        "send_to_app_p50_ms": pct(send_to_app, 50),
        "send_to_app_p99_ms": pct(send_to_app, 99),
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8)
    p.add_argument("--rate", type=float, default=300, help="writes/s of the latency run")
    p.add_argument("--buckets", type=int, default=2)
    args = p.parse_args()
    print(f"machine: {machine()}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"TLS": [], "plaintext": []}
    print(
        "\n| round | mode | load avg | " + " | ".join(t for _, t in FIGURES) + " | delivered |"
        "\n|---|---|---|" + "---|" * len(FIGURES) + "---|"
    )
    for r in range(args.rounds):
        order = ("TLS", "plaintext") if r % 2 == 0 else ("plaintext", "TLS")
        for mode in order:
            print(f"round {r + 1}: {mode} ...", file=sys.stderr, flush=True)
            run = one_run(
                insecure=mode == "plaintext",
                seconds=args.seconds,
                rate=args.rate,
                buckets=args.buckets,
            )
            runs[mode].append(run)
            cells = " | ".join(f"{run[k]:,.1f}" for k, _ in FIGURES)
            print(f"| {r + 1} | {mode} | {run['load']:.2f} | {cells} | {run['delivered']} |")
    print("\n| median of the rounds | TLS | plaintext | TLS / plaintext |\n|---|---|---|---|")
    for key, title in FIGURES:
        tls = statistics.median(run[key] for run in runs["TLS"])
        plain = statistics.median(run[key] for run in runs["plaintext"])
        print(f"| {title} | {tls:,.1f} | {plain:,.1f} | {tls / plain:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
