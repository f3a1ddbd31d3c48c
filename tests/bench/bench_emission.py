"""Benchmark: emission throughput and commit->application latency on 3 nodes.

    .venv/bin/python tests/bench/bench_emission.py [--seconds 10] [--subs 1,100,1000]

In one run, on one local cluster (3 node processes, fsync on, 100-byte values):

1. durable write throughput: closed-loop writers, 64 in flight, no subscriber;
2. for each subscription count N: N SDK subscriptions on the written prefix in a
   separate subscriber process (each event processed, its cursor persisted and
   acknowledged by the SDK), closed-loop writers for the same time: events
   delivered+acked per second, and the ratio to (1) for N=1;
3. commit->application latency with 1 subscription at a fixed 500 writes/s:
   write acknowledged -> event received by the application (joined on the commit
   index; same host clock), and write sent -> event received.

Not a test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_writes import machine, pct, write_load

from sevendb.cluster.common.topology import ClusterSpec
from sevendb.cluster.ops.local import cluster_down, cluster_up, local_tls, local_token, node_status
from sevendb.sdk import TLS

HERE = Path(__file__).resolve().parent


class Subscribers:
    def __init__(
        self, spec: ClusterSpec, token: str, query: str, subs: int, ca: Path | None
    ) -> None:
        """`ca`: the cluster's CA file (None: plaintext)."""
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "emission_subscriber.py"),
                "--endpoints",
                ",".join(n.grpc_address for n in spec.nodes),
                "--token",
                token,
                "--query",
                query,
                "--subs",
                str(subs),
                *(["--insecure"] if ca is None else ["--ca", str(ca)]),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().strip()
        assert ready == "READY", ready

    def count(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def wait_count(self, expected: int, timeout_s: float) -> float:
        """Seconds until the subscriber has `expected` events (or the timeout)."""
        t0 = time.monotonic()
        while self.count() < expected and time.monotonic() - t0 < timeout_s:
            time.sleep(0.05)
        return time.monotonic() - t0

    def finish(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        result: dict[str, Any] = json.loads(self.proc.stdout.readline())
        self.proc.wait(60)
        return result


def delivery_latencies(
    load: dict[str, Any], result: dict[str, Any]
) -> tuple[list[float], list[float]]:
    """(write acknowledged -> event in the application, write sent -> event in the
    application), ms, sorted: the writes of `load` joined on (bucket, commit index)
    with the subscriber's trace."""
    received = {(b, i): ns for b, i, ns in result["trace"]}
    commit_to_app, send_to_app = [], []
    for bucket, index, sent, acked in load["acks"]:
        got = received.get((bucket, index))
        if got is not None:
            commit_to_app.append((got - acked) / 1e6)
            send_to_app.append((got - sent) / 1e6)
    return sorted(commit_to_app), sorted(send_to_app)


def outbox_rows(spec: ClusterSpec, tls: TLS | None) -> int:
    total = 0
    for node in spec.nodes:
        status = node_status(node.grpc_address, tls)
        if status is not None:
            total += sum(r.outbox_rows for r in status.replicas if r.emitting)
    return total


def run(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    rows: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="sevendb-bench-emit-") as tmp:
        data = Path(tmp) / "data"
        spec = cluster_up(
            data, nodes=3, buckets=args.buckets, replicas=3, insecure=args.insecure
        ).spec
        token = local_token(data)
        tls = local_tls(data)
        ca = None if tls is None else data / "ca.pem"
        try:
            base = write_load(spec, token, "w/", args.seconds, tls=tls)
            rows.append(("durable writes, no subscriber (64 in flight)", base))
            print(f"  writes: {base['writes_per_s']:,.0f}/s", file=sys.stderr, flush=True)
            for n in args.subs:
                prefix = f"e{n}/"
                sub = Subscribers(spec, token, f"prefix:{prefix}", n, ca)
                load = write_load(
                    spec, token, prefix, args.seconds, inflight=args.inflight, tls=tls
                )
                expected = load["writes"] * n
                drained_s = sub.wait_count(expected, 120)
                t0 = time.monotonic()
                while outbox_rows(spec, tls) and time.monotonic() - t0 < 30:
                    time.sleep(0.05)  # every event acknowledged and purged
                result = sub.finish()
                delivered = sum(result["counts"])
                span_s = max(1e-9, (result["last_ns"] - result["first_ns"]) / 1e9)
                row = {
                    "subs": n,
                    "writes_per_s": load["writes_per_s"],
                    "events": delivered,
                    "expected_events": expected,
                    "events_per_s": delivered / span_s,
                    "drain_after_load_s": drained_s,
                    "outbox_left": outbox_rows(spec, tls),
                    "ratio_vs_writes": (delivered / span_s) / base["writes_per_s"],
                }
                rows.append((f"{n} subscription(s) on one prefix", row))
                print(
                    f"  {n} subs: {row['events_per_s']:,.0f} events/s "
                    f"({delivered}/{expected} delivered)",
                    file=sys.stderr,
                    flush=True,
                )
            # latency at a fixed rate
            sub = Subscribers(spec, token, "prefix:l/", 1, ca)
            load = write_load(spec, token, "l/", args.seconds, rate=args.rate, tls=tls)
            sub.wait_count(load["writes"], 60)
            commit_to_app, e2e = delivery_latencies(load, sub.finish())
            rows.append(
                (
                    f"1 subscription, writes at {args.rate:.0f}/s",
                    {
                        "writes_per_s": load["writes_per_s"],
                        "events": len(commit_to_app),
                        "expected_events": load["writes"],
                        "commit_to_app_p50_ms": pct(commit_to_app, 50),
                        "commit_to_app_p99_ms": pct(commit_to_app, 99),
                        "send_to_app_p50_ms": pct(e2e, 50),
                        "send_to_app_p99_ms": pct(e2e, 99),
                        "write_p50_ms": load["p50_ms"],
                        "write_p99_ms": load["p99_ms"],
                    },
                )
            )
        finally:
            cluster_down(data)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--subs", default="1,100,1000")
    p.add_argument(
        "--buckets",
        type=int,
        default=1,
        help="1 (default): one Raft group, like etcd's; on a 2-core host more groups "
        "add per-entry work without adding cores (docs/performance.md)",
    )
    p.add_argument("--inflight", type=int, default=64)
    p.add_argument("--rate", type=float, default=500)
    p.add_argument(
        "--insecure", action="store_true", help="the client port plaintext (default TLS)"
    )
    args = p.parse_args()
    args.subs = [int(x) for x in args.subs.split(",")]
    print(f"machine: {machine()}", flush=True)
    for name, row in run(args):
        shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}
        shown.pop("acks", None)
        print(f"{name}: {json.dumps(shown)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
