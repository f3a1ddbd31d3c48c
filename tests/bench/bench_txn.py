"""Benchmark: transactions across 1, 2 and 4 buckets (docs/transactions.md).

    .venv/bin/python tests/bench/bench_txn.py [--seconds 10] [--producers 1,4]

A local cluster (3 nodes, 4 buckets, fsync on, TLS) on this host. Each of
`--producers` threads (its own transactional id, its own Client) runs transactions
back to back: one key written in each of 1, 2 or 4 buckets, then commit. Prints
transactions/s, the latency of a whole transaction (first write to commit answered)
and of its commit alone (p50/p99), for each bucket count and producer count. Not a
test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_writes import machine, pct

from sevendb.cluster.ops.local import cluster_down, cluster_up, local_tls, local_token
from sevendb.outbox.keys import bucket_of
from sevendb.sdk import TLS, Client

BUCKETS = 4
VALUE = b"x" * 100


def keys_for(prefix: str, buckets: int) -> list[str]:
    """One key in each of the first `buckets` buckets."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < buckets:
        key = f"{prefix}{i}"
        bucket = bucket_of(key, BUCKETS)
        if bucket < buckets and bucket not in found:
            found[bucket] = key
        i += 1
    return [found[b] for b in sorted(found)]


def producer(
    endpoints: list[str],
    token: str,
    tls: TLS | None,
    txn_id: str,
    keys: list[str],
    seconds: float,
    out: list[tuple[float, float]],
) -> None:
    with Client(endpoints, token=token, tls=tls) as client:
        with client.transaction(txn_id) as warm:  # INIT, and the channels
            warm.put(keys[0], VALUE)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            txn = client.transaction(txn_id)
            for key in keys:
                txn.put(key, VALUE)
            committing = time.perf_counter()
            txn.commit()
            done = time.perf_counter()
            out.append((done - started, done - committing))


def run(
    endpoints: list[str], token: str, tls: TLS | None, buckets: int, producers: int, seconds: float
) -> dict[str, Any]:
    results: list[list[tuple[float, float]]] = [[] for _ in range(producers)]
    threads = [
        threading.Thread(
            target=producer,
            args=(
                endpoints,
                token,
                tls,
                f"bench-{buckets}-{producers}-{i}",
                keys_for(f"b{buckets}/p{producers}/{i}/", buckets),
                seconds,
                results[i],
            ),
        )
        for i in range(producers)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    whole = sorted(w for r in results for w, _ in r)
    commit = sorted(c for r in results for _, c in r)
    return {
        "txns": len(whole),
        "txns_per_s": len(whole) / elapsed,
        "txn_p50_ms": pct(whole, 50) * 1000,
        "txn_p99_ms": pct(whole, 99) * 1000,
        "commit_p50_ms": pct(commit, 50) * 1000,
        "commit_p99_ms": pct(commit, 99) * 1000,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--producers", default="1,4", help="producer threads, comma separated")
    args = p.parse_args()
    producer_counts = [int(x) for x in args.producers.split(",")]
    print(f"machine: {machine()}")
    print(f"3 nodes, {BUCKETS} buckets, fsync on, TLS; {args.seconds:g} s per row")
    print(
        f"{'buckets/txn':>11} {'producers':>9} {'txns':>6} {'txns/s':>8} "
        f"{'txn p50':>8} {'txn p99':>8} {'commit p50':>10} {'commit p99':>10}"
    )
    with tempfile.TemporaryDirectory(prefix="sevendb-bench-txn-") as tmp:
        data = Path(tmp) / "data"
        spec = cluster_up(data, nodes=3, buckets=BUCKETS, replicas=3).spec
        try:
            endpoints = [n.grpc_address for n in spec.nodes]
            token, tls = local_token(data), local_tls(data)
            for buckets in (1, 2, 4):
                for producers in producer_counts:
                    r = run(endpoints, token, tls, buckets, producers, args.seconds)
                    print(
                        f"{buckets:>11} {producers:>9} {r['txns']:>6} {r['txns_per_s']:>8.1f} "
                        f"{r['txn_p50_ms']:>6.1f}ms {r['txn_p99_ms']:>6.1f}ms "
                        f"{r['commit_p50_ms']:>8.1f}ms {r['commit_p99_ms']:>8.1f}ms",
                        flush=True,
                    )
        finally:
            cluster_down(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
