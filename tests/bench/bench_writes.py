"""Benchmark: durable sevendb writes vs raw pysyncobj, same load, one run.

    .venv/bin/python tests/bench/bench_writes.py [--seconds 10] [--inflight 1,32]

Prints committed writes/s and p50/p99 latency for sevendb (3 nodes, fsync on,
1 and 4 buckets, through gRPC from a client routing to each bucket's leader)
next to a bare pysyncobj replicated counter (3 processes, its default in-memory
journal: nothing fsynced) driven in-process at the same concurrency, and the
ratio. Not a test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from sevendb.cluster.local import cluster_down, cluster_up, local_token, node_status
from sevendb.cluster.topology import bucket_of
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_raw(inflight: int, seconds: float, tuned: bool) -> dict[str, float]:
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    procs = []
    for me in addrs:
        cmd = [
            sys.executable,
            str(HERE / "raw_pysyncobj_node.py"),
            "--me",
            me,
            "--partners",
            ",".join(a for a in addrs if a != me),
            "--inflight",
            str(inflight),
            "--seconds",
            str(seconds),
        ]
        if tuned:
            cmd.append("--tuned")
        # stderr to a file: pysyncobj may log thousands of lines, which would fill a
        # pipe nobody reads until the end and stall the node.
        err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
        )
        procs.append((proc, err))
    result: dict[str, float] = {}
    for proc, _ in procs:
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline() or "{}")
        if "ops_per_s" in line:
            result = line
    truncations = 0
    for proc, err in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
        err.seek(0)
        truncations += err.read().count("truncating already-applied log entries")
        err.close()
    # Stock pysyncobj's rewinding nextIndex hazard (docs/raft.md), counted per run.
    result["critical_truncations"] = truncations
    return result


async def drive_sevendb(
    leaders: dict[int, str], buckets: int, inflight: int, seconds: float, token: str
) -> dict[str, float]:
    md = (("authorization", f"Bearer {token}"),)
    channels = {a: grpc.aio.insecure_channel(a) for a in set(leaders.values())}
    stubs = {a: pb_grpc.SevenDBStub(c) for a, c in channels.items()}  # type: ignore[no-untyped-call]
    latencies: list[float] = []
    errors = 0
    value = b"x" * 100
    end = time.monotonic() + seconds

    async def worker(w: int) -> None:
        nonlocal errors
        rng = random.Random(w)
        while time.monotonic() < end:
            key = f"k{rng.randrange(1 << 30)}"
            stub = stubs[leaders[bucket_of(key, buckets)]]
            t = time.monotonic()
            try:
                await stub.Write(
                    pb.WriteRequest(ops=[pb.Op(key=key, value=value)]), timeout=10, metadata=md
                )
                latencies.append(time.monotonic() - t)
            except grpc.aio.AioRpcError:
                errors += 1

    t0 = time.monotonic()
    await asyncio.gather(*(worker(w) for w in range(inflight)))
    elapsed = time.monotonic() - t0
    for c in channels.values():
        await c.close()
    latencies.sort()
    n = len(latencies)
    return {
        "ops": n,
        "ops_per_s": n / elapsed,
        "errors": errors,
        "p50_ms": 1000 * latencies[n // 2] if n else 0.0,
        "p99_ms": 1000 * latencies[min(n - 1, int(n * 0.99))] if n else 0.0,
    }


def run_sevendb(buckets: int, inflights: list[int], seconds: float) -> dict[int, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="sevendb-bench-") as tmp:
        data = Path(tmp) / "data"
        spec = cluster_up(data, nodes=3, buckets=buckets, replicas=3).spec
        try:
            leaders: dict[int, str] = {}
            for node in spec.nodes:
                status = node_status(node.grpc_address)
                assert status is not None
                for r in status.replicas:
                    if r.is_leader:
                        leaders[r.bucket] = node.grpc_address
            assert len(leaders) == buckets, leaders
            out = {}
            for inflight in inflights:
                before = fsyncs(spec)
                result = asyncio.run(
                    drive_sevendb(leaders, buckets, inflight, seconds, local_token(data))
                )
                result["fsyncs_per_write"] = (fsyncs(spec) - before) / max(1, result["ops"])
                out[inflight] = result
            return out
        finally:
            cluster_down(data)


def fsyncs(spec: object) -> int:
    total = 0
    for node in spec.nodes:  # type: ignore[attr-defined]
        status = node_status(node.grpc_address)
        if status is not None:
            total += sum(r.fsyncs for r in status.replicas)
    return total


def machine() -> str:
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {os.cpu_count()} cores, {cpu}, Python {platform.python_version()}"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--inflight", default="1,32")
    p.add_argument("--buckets", default="1,4")
    args = p.parse_args()
    inflights = [int(x) for x in args.inflight.split(",")]
    print(f"machine: {machine()}", flush=True)
    rows = []
    raw: dict[int, dict[str, float]] = {}
    for inflight in inflights:
        for tuned in (False, True):
            print(
                f"raw pysyncobj, {inflight} in flight, {'tuned' if tuned else 'default'} sends ...",
                file=sys.stderr,
                flush=True,
            )
            r = run_raw(inflight, args.seconds, tuned)
            rows.append(
                (
                    f"raw pysyncobj counter ({'tuned' if tuned else 'default'} sends, no fsync)",
                    inflight,
                    r,
                )
            )
            if tuned:
                raw[inflight] = r
    for buckets in [int(x) for x in args.buckets.split(",")]:
        print(f"sevendb, {buckets} bucket(s) ...", file=sys.stderr, flush=True)
        for inflight, r in run_sevendb(buckets, inflights, args.seconds).items():
            base = raw.get(inflight, {}).get("ops_per_s", 0.0)
            r["ratio_vs_raw_tuned"] = r["ops_per_s"] / base if base else 0.0
            rows.append((f"sevendb durable, {buckets} bucket(s), 3 nodes", inflight, r))
    print(
        "\n| system | in flight | writes/s | p50 ms | p99 ms | ratio vs raw (tuned) | "
        "fsyncs/write |\n|---|---|---|---|---|---|---|"
    )
    for name, inflight, r in rows:
        ratio = f"{r['ratio_vs_raw_tuned']:.2f}" if "ratio_vs_raw_tuned" in r else ""
        fs = f"{r['fsyncs_per_write']:.2f}" if "fsyncs_per_write" in r else ""
        print(
            f"| {name} | {inflight} | {r.get('ops_per_s', 0):,.0f} | "
            f"{r.get('p50_ms', 0):.2f} | {r.get('p99_ms', 0):.2f} | {ratio} | {fs} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
