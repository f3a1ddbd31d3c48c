"""Benchmark: durable sevendb writes vs raw pysyncobj, same load, one run.

    .venv/bin/python tests/bench/bench_writes.py [--seconds 10] [--inflight 1,32,64,128,256]

Prints committed writes/s and p50/p99 latency for sevendb (3 nodes, fsync on,
1 and 4 buckets, through the SDK: concurrent writes share WriteMany requests)
next to bare pysyncobj replicated counters (3 processes, its default in-memory
journal: nothing fsynced; one counter per bucket, the in-flight writes split
between them) driven in-process at the same concurrency, and the ratio to the
raw run with as many counters as sevendb has buckets. The raw counters run stock
pysyncobj with sevendb's send tuning (the ratio's base), then once more with
sevendb's transport patches too (`--sevendb-transport`: the pickle protocol and
frames that are not deflated, which make every message cheaper), for a second
ratio. Last, each system's throughput: the most writes/s it made at any of the
in-flight levels run, and the ratios of those. Not a test: figures are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sevendb.cluster.common.topology import ClusterSpec
from sevendb.cluster.ops.local import cluster_down, cluster_up, local_tls, local_token, node_status
from sevendb.cluster.raft.replica import RaftTuning
from sevendb.sdk import TLS, Client, set_op

HERE = Path(__file__).resolve().parent
VALUE = b"x" * 100


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


def tuned_sends() -> dict[str, object]:
    """The send and timing settings BucketReplica gives pysyncobj (not its journal,
    fsyncs, group-commit draining or transport patches)."""
    t = RaftTuning()
    return {
        "appendEntriesUseBatch": False,
        "appendEntriesPeriod": t.heartbeat_s,
        "autoTickPeriod": t.tick_s,
        "raftMinTimeout": t.election_min_s,
        "raftMaxTimeout": t.election_max_s,
        "connectionRetryTime": t.connection_retry_s,
    }


def run_raw(
    inflight: int, seconds: float, tuned: bool, groups: int = 1, *, patched: bool = False
) -> dict[str, float]:
    ports = iter(free_ports(3 * groups))
    addrs = [[f"127.0.0.1:{next(ports)}" for _ in range(groups)] for _ in range(3)]
    procs = []
    for mine in addrs:
        others = [a for a in addrs if a is not mine]
        cmd = [
            sys.executable,
            str(HERE / "raw_pysyncobj_node.py"),
            "--me",
            ",".join(mine),
            "--partners",
            ";".join(",".join(o[g] for o in others) for g in range(groups)),
            "--inflight",
            str(inflight),
            "--seconds",
            str(seconds),
            "--conf",
            json.dumps(tuned_sends() if tuned else {}),
        ]
        if patched:
            cmd.append("--sevendb-transport")
        # stderr to a file: pysyncobj may log thousands of lines, which would fill a
        # pipe nobody reads until the end and stall the node.
        err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
        )
        procs.append((proc, err))
    ops_per_s = errors = cpu_s = 0.0
    latencies: list[float] = []
    for proc, _ in procs:
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline() or "{}")
        ops_per_s += line.get("ops_per_s", 0.0)
        errors += line.get("errors", 0)
        cpu_s += line.get("cpu_s", 0.0)
        latencies += line.get("latencies_ms", [])
    latencies.sort()
    result = {
        "ops_per_s": ops_per_s,
        "errors": errors,
        "p50_ms": pct(latencies, 50),
        "p99_ms": pct(latencies, 99),
        # the 3 processes' CPU per increment while the writes ran
        "cpu_us_per_op": 1e6 * cpu_s / len(latencies) if latencies else float("nan"),
    }
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


def write_load(
    spec: ClusterSpec,
    token: str,
    prefix: str,
    seconds: float,
    *,
    inflight: int = 64,
    rate: float = 0.0,
    tls: TLS | None,
) -> dict[str, Any]:
    """Through the SDK (concurrent writes share WriteMany calls): `inflight` writes
    kept in flight (closed loop: each answer starts the next write, from the SDK's
    callback, as an application reacting to its writes would), or one started
    every 1/`rate` s from this thread (open loop)."""
    acks: list[tuple[int, int, int, int]] = []  # (bucket, commit index, sent ns, acked ns)
    errors = [0]
    issued = [0]
    lock = threading.Lock()
    finished = threading.Condition(lock)
    with Client([n.grpc_address for n in spec.nodes], token=token, tls=tls) as client:
        client.layout()
        t0 = time.monotonic()
        end = t0 + seconds

        def claim() -> int:
            """The next write's number; with `lock` held, so that the wait below
            never sees every issued write answered while another is being issued."""
            issued[0] += 1
            return issued[0] - 1

        def issue(i: int) -> None:
            sent = time.time_ns()
            future = client.write_async([set_op(f"{prefix}{i:010d}", VALUE)])
            future.add_done_callback(lambda f: done(f, sent))

        def done(f: Future[Any], sent: int) -> None:
            now = time.time_ns()
            with lock:
                if f.exception() is None:
                    r = f.result()
                    acks.append((r.bucket, r.committed.commit_index, sent, now))
                else:
                    errors[0] += 1
                if rate or time.monotonic() >= end:
                    finished.notify_all()  # only now can the wait below be over
                    return
                i = claim()
            issue(i)

        for _ in range(0 if rate else inflight):
            with lock:
                i = claim()
            issue(i)
        while rate and time.monotonic() < end:
            pause = t0 + issued[0] / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            with lock:
                i = claim()
            issue(i)
        with finished:
            finished.wait_for(
                lambda: len(acks) + errors[0] >= issued[0] and time.monotonic() >= end,
                timeout=seconds + 30,
            )
        elapsed = time.monotonic() - t0
        stats = client._pipeline()
        calls, writes = stats.calls, stats.writes
    lat = sorted((a[3] - a[2]) / 1e6 for a in acks)
    return {
        "writes": len(acks),
        "writes_per_s": len(acks) / elapsed,
        "errors": errors[0],
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "writes_per_call": writes / max(1, calls),
        "acks": acks,
    }


def pct(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p / 100))]


def run_sevendb(
    buckets: int, inflights: list[int], seconds: float, *, insecure: bool = False
) -> dict[int, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="sevendb-bench-") as tmp:
        data = Path(tmp) / "data"
        spec = cluster_up(data, nodes=3, buckets=buckets, replicas=3, insecure=insecure).spec
        tls = local_tls(data)
        try:
            out = {}
            for inflight in inflights:
                before = fsyncs(spec, tls)
                result = write_load(
                    spec, local_token(data), f"w{inflight}/", seconds, inflight=inflight, tls=tls
                )
                result.pop("acks")
                result["ops_per_s"] = result["writes_per_s"]
                after = fsyncs(spec, tls)
                result["fsyncs_per_write"] = (after - before) / max(1, result["writes"])
                out[inflight] = result
            return out
        finally:
            cluster_down(data)


def fsyncs(spec: object, tls: TLS | None) -> int:
    total = 0
    for node in spec.nodes:  # type: ignore[attr-defined]
        status = node_status(node.grpc_address, tls)
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
    p.add_argument("--inflight", default="1,32,64,128,256")
    p.add_argument("--buckets", default="1,4")
    p.add_argument(
        "--insecure", action="store_true", help="sevendb's client port plaintext (default TLS)"
    )
    args = p.parse_args()
    inflights = [int(x) for x in args.inflight.split(",")]
    print(f"machine: {machine()}", flush=True)
    bucket_counts = [int(x) for x in args.buckets.split(",")]
    rows = []
    # (patched, groups, in flight) -> figures of the tuned raw runs
    raw: dict[tuple[bool, int, int], dict[str, float]] = {}
    for groups in bucket_counts:
        # pysyncobj's default sends (an append every 100 ms) only for context, once.
        variants = [(False, False), (True, False), (True, True)]
        for tuned, patched in variants if groups == bucket_counts[0] else variants[1:]:
            sends = "tuned" if tuned else "default"
            transport = "sevendb's transport patches" if patched else "stock"
            name = f"raw pysyncobj, {groups} counter(s) ({transport}, {sends} sends, no fsync)"
            for inflight in inflights:
                print(f"{name}, {inflight} in flight ...", file=sys.stderr, flush=True)
                r = run_raw(inflight, args.seconds, tuned, groups, patched=patched)
                rows.append((name, inflight, r))
                if tuned:
                    raw[patched, groups, inflight] = r
    sevendb: dict[int, dict[int, dict[str, Any]]] = {}
    for buckets in bucket_counts:
        print(f"sevendb, {buckets} bucket(s) ...", file=sys.stderr, flush=True)
        sevendb[buckets] = run_sevendb(buckets, inflights, args.seconds, insecure=args.insecure)
        for inflight, r in sevendb[buckets].items():
            for patched in (False, True):
                base = raw.get((patched, buckets, inflight), {}).get("ops_per_s", 0.0)
                r[f"ratio_{patched}"] = r["ops_per_s"] / base if base else 0.0
            rows.append((f"sevendb durable, {buckets} bucket(s), 3 nodes", inflight, r))
    print(
        "\n| system | in flight | writes/s | p50 ms | p99 ms | vs raw stock (tuned sends), "
        "as many counters | vs raw with sevendb's transport patches | fsyncs/write |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for name, inflight, r in rows:
        ratios = [f"{r[k]:.2f}" if k in r else "" for k in ("ratio_False", "ratio_True")]
        fs = f"{r['fsyncs_per_write']:.2f}" if "fsyncs_per_write" in r else ""
        print(
            f"| {name} | {inflight} | {r.get('ops_per_s', 0):,.0f} | "
            f"{r.get('p50_ms', 0):.2f} | {r.get('p99_ms', 0):.2f} | {ratios[0]} | "
            f"{ratios[1]} | {fs} |"
        )
    print(
        "\n| throughput: the most writes/s at any in-flight level | sevendb durable | "
        "raw stock (tuned sends), as many counters | ratio | raw with sevendb's "
        "transport patches | ratio |\n|---|---|---|---|---|---|"
    )
    for buckets in bucket_counts:
        best, at = peak(sevendb[buckets])
        cells = [f"{best['ops_per_s']:,.0f} at {at} (p99 {best['p99_ms']:.2f} ms)"]
        for patched in (False, True):
            raw_best, raw_at = peak({i: raw[patched, buckets, i] for i in inflights})
            cells.append(f"{raw_best['ops_per_s']:,.0f} at {raw_at}")
            cells.append(f"**{best['ops_per_s'] / raw_best['ops_per_s']:.2f}**")
        print(f"| {buckets} bucket(s) | " + " | ".join(cells) + " |")
    return 0


def peak(by_inflight: dict[int, dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """The figures of the in-flight level with the most writes/s, and that level."""
    at = max(by_inflight, key=lambda i: float(by_inflight[i].get("ops_per_s", 0.0)))
    return by_inflight[at], at


if __name__ == "__main__":
    sys.exit(main())
