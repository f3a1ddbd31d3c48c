"""Benchmark: subscription set-up, and whose CPU it takes.

    .venv/bin/python tests/bench/bench_subscribe_setup.py [--subs 2000] [--threads 64]
                                                         [--runs 1]

Each run starts a fresh local cluster (3 node processes, fsync on, 2 buckets) and
makes `--subs` one-key subscriptions from this one process with `Client.subscribe`
on `--threads` threads (as side_by_side.py's workload 4 does from each of its
subscriber processes), then prints: subscriptions set up per second, the nodes' and
this process's CPU per subscription (the nodes' by thread name too), and how many
log entries made them (the distinct commit indexes the new subscriptions start at:
one per SUBSCRIBE when nothing is batched). Not a test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from peers.common import cpu_seconds, thread_cpu

from sevendb.cluster.ops.local import (
    cluster_down,
    cluster_up,
    local_tls,
    local_token,
    running_pid,
)
from sevendb.sdk import Client


def one_run(subs: int, threads: int) -> dict[str, Any]:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sevendb-bench-subsetup-") as tmp:
        data = Path(tmp) / "data"
        spec = cluster_up(data, nodes=3, buckets=2, replicas=3).spec
        pids = [pid for n in spec.nodes if (pid := running_pid(data, n.node_id))]
        client = Client(
            [n.grpc_address for n in spec.nodes], token=local_token(data), tls=local_tls(data)
        )
        try:
            client.subscribe("key:warm/0").close()  # the layout, the sessions
            server0 = sum(cpu_seconds(p) for p in pids)
            threads0 = thread_cpu(pids)
            client0 = time.process_time()
            t0 = time.monotonic()
            with ThreadPoolExecutor(max_workers=threads) as pool:
                made = list(pool.map(lambda i: client.subscribe(f"key:s/{i}"), range(subs)))
            wall = time.monotonic() - t0
            server = sum(cpu_seconds(p) for p in pids) - server0
            by_thread = {k: v - threads0.get(k, 0.0) for k, v in thread_cpu(pids).items()}
            own = time.process_time() - client0
            starts = _starts(made)  # before anything is delivered: nothing is written
            for sub in made:
                sub.close()
        finally:
            client.close()
            cluster_down(data)
    return {
        "load": load,
        "subs_per_s": subs / wall,
        "server_cpu_ms_per_sub": server * 1000 / subs,
        "client_cpu_ms_per_sub": own * 1000 / subs,
        "entries": len(starts),
        "threads_us_per_sub": {
            k: v * 1e6 / subs for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1])
        },
    }


def _starts(made: list[Any]) -> set[tuple[int, int]]:
    """(bucket, commit index) of where each subscription's stream starts (its SubAck's
    start_emit_seq, as its cursor first released it): one per entry that made them."""
    return {
        (bucket, stream.cursor.released.commit_index)
        for sub in made
        for bucket, stream in sub._streams.streams.items()
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--subs", type=int, default=2000)
    p.add_argument("--threads", type=int, default=64)
    p.add_argument("--runs", type=int, default=1)
    a = p.parse_args()
    rows = []
    for run in range(a.runs):
        row = one_run(a.subs, a.threads)
        rows.append(row)
        print(
            f"run {run + 1}: load {row['load']:.1f}, {row['subs_per_s']:,.0f} set up/s, "
            f"CPU per subscription: nodes {row['server_cpu_ms_per_sub']:.2f} ms, "
            f"this process {row['client_cpu_ms_per_sub']:.2f} ms; "
            f"{row['entries']} log entries for {a.subs} subscriptions",
            flush=True,
        )
        by_thread = ", ".join(
            f"{k} {v:.0f} µs" for k, v in row["threads_us_per_sub"].items() if v >= 5
        )
        print(f"  nodes' CPU per subscription by thread name: {by_thread}", flush=True)
    if len(rows) > 1:
        rates = [r["subs_per_s"] for r in rows]
        print(
            f"median {statistics.median(rates):,.0f} set up/s ({min(rates):,.0f}-{max(rates):,.0f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
