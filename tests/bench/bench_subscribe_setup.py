"""Benchmark: subscription set-up, and whose CPU it takes.

    .venv/bin/python tests/bench/bench_subscribe_setup.py [--subs 2000] [--threads 64]
                                                         [--client async|thread] [--runs 1]

Each run starts a fresh local cluster (3 node processes, fsync on, 2 buckets) and
makes `--subs` one-key subscriptions from this one process, `--threads` at a time:
with `AsyncClient.subscribe` on one loop (`--client async`, the default, as
side_by_side.py's workload 4 does from each of its subscriber processes), or with
`Client.subscribe` on that many threads (`--client thread`). It prints:
subscriptions set up per second, the nodes' and this process's CPU per subscription
(the nodes' by thread name too), and how many log entries made them (the distinct
commit indexes the new subscriptions start at: one per SUBSCRIBE when nothing is
batched). Not a test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
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
from sevendb.sdk import AsyncClient, Client

Snapshot = tuple[float, dict[str, float], float, float]
"""The nodes' CPU, theirs by thread name, this process's CPU, and the time."""


def _snapshot(pids: list[int]) -> Snapshot:
    return (
        sum(cpu_seconds(p) for p in pids),
        thread_cpu(pids),
        time.process_time(),
        time.monotonic(),
    )


def one_run(subs: int, at_once: int, threaded: bool) -> dict[str, Any]:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sevendb-bench-subsetup-") as tmp:
        data = Path(tmp) / "data"
        spec = cluster_up(data, nodes=3, buckets=2, replicas=3).spec
        pids = [pid for n in spec.nodes if (pid := running_pid(data, n.node_id))]
        endpoints = [n.grpc_address for n in spec.nodes]
        try:
            measure = _threaded if threaded else _async
            before, after, starts = measure(endpoints, data, pids, subs, at_once)
        finally:
            cluster_down(data)
    server, client, wall = after[0] - before[0], after[2] - before[2], after[3] - before[3]
    by_thread = {k: v - before[1].get(k, 0.0) for k, v in after[1].items()}
    return {
        "load": load,
        "subs_per_s": subs / wall,
        "server_cpu_ms_per_sub": server * 1000 / subs,
        "client_cpu_ms_per_sub": client * 1000 / subs,
        "entries": len(starts),
        "threads_us_per_sub": {
            k: v * 1e6 / subs for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1])
        },
    }


Measured = tuple[Snapshot, Snapshot, set[tuple[int, int]]]


def _threaded(
    endpoints: list[str], data: Path, pids: list[int], subs: int, at_once: int
) -> Measured:
    """`Client.subscribe` on `at_once` threads."""
    with Client(endpoints, token=local_token(data), tls=local_tls(data)) as client:
        client.subscribe("key:warm/0").close()  # the layout, the sessions
        before = _snapshot(pids)
        with ThreadPoolExecutor(max_workers=at_once) as pool:
            made = list(pool.map(lambda i: client.subscribe(f"key:s/{i}"), range(subs)))
        after = _snapshot(pids)
        starts = _starts(made)  # before anything is delivered: nothing is written
        for sub in made:
            sub.close()
    return before, after, starts


def _async(endpoints: list[str], data: Path, pids: list[int], subs: int, at_once: int) -> Measured:
    """`AsyncClient.subscribe` on one loop, `at_once` at a time."""

    async def run() -> Measured:
        async with AsyncClient(endpoints, token=local_token(data), tls=local_tls(data)) as client:
            await (await client.subscribe("key:warm/0")).aclose()
            gate = asyncio.Semaphore(at_once)

            async def one(i: int) -> Any:
                async with gate:
                    return await client.subscribe(f"key:s/{i}")

            before = _snapshot(pids)
            made = await asyncio.gather(*(one(i) for i in range(subs)))
            after = _snapshot(pids)
            starts = _starts(made)
            for sub in made:
                await sub.aclose()
        return before, after, starts

    return asyncio.run(run())


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
    p.add_argument("--threads", type=int, default=64, help="subscriptions made at a time")
    p.add_argument("--client", choices=("async", "thread"), default="async")
    p.add_argument("--runs", type=int, default=1)
    a = p.parse_args()
    rows = []
    for run in range(a.runs):
        row = one_run(a.subs, a.threads, a.client == "thread")
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
