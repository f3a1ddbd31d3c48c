"""Benchmark: how long a durable subscription takes to resume in a fresh client (a
consumer restarted with no cursor file), and a subscription from the earliest
retained change against one from the latest.

    .venv/bin/python tests/bench/bench_durable.py [--runs 5] [--backlog 200] [--buckets 2]

One durable cluster (3 nodes, fsync on). Each run: a consumer subscribes by name,
processes a first batch of writes and detaches; `--backlog` writes commit while it is
away; then a new `Client` subscribes by the name and processes the backlog. Prints,
per run and as medians: the resume (a new client's `subscribe(durable=...)` until it
returns: every bucket's stream attached after the server's acknowledged position), the
first backlog event, and the whole backlog. Then `start="earliest"` over the whole
retained history against `start="latest"`. Not a test: figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench_writes import machine

from sevendb.cluster.ops.local import cluster_down, cluster_up, local_tls, local_token
from sevendb.sdk import TLS, Client, Subscription


def drain(sub: Subscription, want: int, started: float) -> tuple[float, float]:
    """(seconds to the first event, seconds to the `want`-th), from `started`."""
    first, seen = 0.0, 0
    while seen < want:
        event = sub.poll(30.0)
        if event is None:
            raise SystemExit(f"only {seen} of {want} events within 30 s")
        seen += len(event.changes)
        first = first or time.perf_counter() - started
    return first, time.perf_counter() - started


def one_run(
    endpoints: list[str], token: str, tls: TLS | None, run: int, backlog: int
) -> list[float]:
    name, prefix = f"bench{run}", f"d{run}/"
    with Client(endpoints, token=token, tls=tls) as writer:
        with Client(endpoints, token=token, tls=tls) as first:
            sub = first.subscribe(f"prefix:{prefix}", durable=name)
            for i in range(20):
                writer.put(f"{prefix}a{i:04d}", b"x")
            drain(sub, 20, time.perf_counter())
            sub.close()  # a durable subscription is detached, not ended
        for i in range(backlog):
            writer.put(f"{prefix}b{i:05d}", b"x")
        started = time.perf_counter()
        with Client(endpoints, token=token, tls=tls) as fresh:
            sub = fresh.subscribe(f"prefix:{prefix}", durable=name)
            resumed = time.perf_counter() - started
            first_s, all_s = drain(sub, backlog, started)
            sub.unsubscribe()
    return [resumed * 1000, first_s * 1000, all_s * 1000]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backlog", type=int, default=200)
    parser.add_argument("--buckets", type=int, default=2)
    args = parser.parse_args()
    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="sevendb-durable-") as tmp:
        data = Path(tmp) / "data"
        spec = cluster_up(data, nodes=3, buckets=args.buckets, replicas=3).spec
        try:
            token, tls = local_token(data), local_tls(data)
            endpoints = [n.grpc_address for n in spec.nodes]
            rows = []
            for run in range(args.runs):
                row = one_run(endpoints, token, tls, run, args.backlog)
                rows.append(row)
                print(
                    f"run {run}: resumed in {row[0]:.1f} ms, first backlog event at "
                    f"{row[1]:.1f} ms, all {args.backlog} at {row[2]:.1f} ms",
                    flush=True,
                )
            med = [statistics.median(r[i] for r in rows) for i in range(3)]
            print(
                f"median of {args.runs}: resume {med[0]:.1f} ms, first event {med[1]:.1f} ms, "
                f"backlog of {args.backlog} {med[2]:.1f} ms ({args.buckets} buckets)"
            )
            with Client(endpoints, token=token, tls=tls) as client:
                retained = sum(1 for _ in client.history("all"))
                for start in ("latest", "earliest"):
                    t0 = time.perf_counter()
                    sub = client.subscribe("all", start=start)
                    made = (time.perf_counter() - t0) * 1000
                    got = drain(sub, retained, t0)[1] * 1000 if start == "earliest" else 0.0
                    sub.close()
                    tail = f", {retained} retained changes delivered in {got:.1f} ms"
                    print(f"start={start}: subscribed in {made:.1f} ms" + (tail if got else ""))
        finally:
            cluster_down(data)


if __name__ == "__main__":
    main()
