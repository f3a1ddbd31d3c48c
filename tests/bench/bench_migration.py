"""Benchmark: migrating a bucket that holds 100,000 keys, under a write load.

    .venv/bin/python tests/bench/bench_migration.py [--keys 100000] [--rate 200]

One local cluster (3 nodes, 1 bucket, fsync on): the bucket is filled with `--keys`
100-byte values, a fourth node is added, and `sevendb bucket migrate` moves the
bucket onto it (its leader leaves) while a writer commits `--rate` writes/s. Prints
how long the migration took (first step to EPOCH_CREATE) and the write latency
(p50/p99/max) before and during it. Not a test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from bench_writes import machine, pct

from sevendb.cluster.ops.local import (
    add_node,
    cluster_down,
    cluster_up,
    local_admin,
    local_spec,
    local_tls,
    local_token,
    node_status,
)
from sevendb.cluster.ops.migrate import migrate_bucket
from sevendb.sdk import Client, set_op

VALUE = b"x" * 100


def fill(client: Client, keys: int) -> float:
    """Write `keys` keys with up to 512 in flight; returns seconds taken."""
    slots = threading.Semaphore(512)
    t0 = time.monotonic()
    futures: list[Future[Any]] = []
    for i in range(keys):
        slots.acquire()
        f = client.write_async([set_op(f"fill/{i:07d}", VALUE)])
        f.add_done_callback(lambda _f: slots.release())
        futures.append(f)
        if i and i % 20_000 == 0:
            print(f"  filled {i:,} keys", file=sys.stderr, flush=True)
    for f in futures:
        f.result()
    return time.monotonic() - t0


class PacedWriter:
    """Open-loop writes at `rate`/s, recording (start time, latency) of each."""

    def __init__(self, client: Client, rate: float) -> None:
        self.client = client
        self.rate = rate
        self.samples: list[tuple[float, float]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        i = 0
        while not self._stop.is_set():
            pause = t0 + i / self.rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            start = time.monotonic()

            def done(f: Future[Any], start: float = start) -> None:
                if f.exception() is None:
                    self.samples.append((start, time.monotonic() - start))
                else:
                    self.errors += 1

            self.client.write_async([set_op(f"live/{i:07d}", VALUE)]).add_done_callback(done)
            i += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        time.sleep(1.0)  # let the last writes answer

    def window(self, start: float, end: float) -> dict[str, float]:
        lat = sorted(1000 * d for s, d in self.samples if start <= s <= end)
        return {
            "writes": len(lat),
            "p50_ms": pct(lat, 50),
            "p99_ms": pct(lat, 99),
            "max_ms": lat[-1] if lat else float("nan"),
        }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--rate", type=float, default=200)
    args = p.parse_args()
    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="sevendb-bench-mig-") as tmp:
        data = Path(tmp) / "data"
        cluster_up(data, nodes=3, buckets=1, replicas=3)
        try:
            with Client(
                [n.grpc_address for n in local_spec(data).nodes],
                token=local_token(data),
                tls=local_tls(data),
            ) as client:
                filled_s = fill(client, args.keys)
                print(f"filled {args.keys:,} keys in {filled_s:.1f} s", flush=True)
                new = add_node(data).node_id
                spec = local_spec(data)
                leader = next(
                    n.node_id
                    for n in spec.nodes
                    if any(
                        r.is_leader
                        for r in (node_status(n.grpc_address, local_tls(data)) or _empty()).replicas
                    )
                )
                target = (new, *[n for n in spec.buckets[0].nodes if n != leader][:2])
                writer = PacedWriter(client, args.rate)
                time.sleep(5)  # a baseline before the migration
                m0 = time.monotonic()
                summary = migrate_bucket(
                    local_admin(data),
                    0,
                    target,
                    progress=lambda line: print(
                        f"  [{time.monotonic() - m0:6.2f} s] {line}", file=sys.stderr, flush=True
                    ),
                )
                m1 = time.monotonic()
                time.sleep(3)
                writer.stop()
                record = client.get("fill/0000000")
                assert record is not None and record.value == VALUE
            result = {
                "keys": args.keys,
                "migration_s": round(m1 - m0, 2),
                "steps": summary.steps,
                "epoch": summary.epoch,
                "write_rate": args.rate,
                "writes_before": writer.window(m0 - 5, m0),
                "writes_during": writer.window(m0, m1),
                "write_errors": writer.errors,
                "slowest_writes_during": [
                    {"sent_at_s": round(start - m0, 2), "ms": round(1000 * d, 1)}
                    for start, d in sorted(
                        (x for x in writer.samples if m0 <= x[0] <= m1), key=lambda x: -x[1]
                    )[:5]
                ],
            }
            print(json.dumps(result, indent=1), flush=True)
        finally:
            cluster_down(data)
    return 0


def _empty() -> Any:
    from sevendb.proto import sevendb_pb2 as pb

    return pb.StatusResponse()


if __name__ == "__main__":
    sys.exit(main())
