"""Benchmark: when do send->application latency spikes happen, and how often?

    .venv/bin/python tests/bench/bench_stall.py [--seconds 20] [--rate 500] [--runs 1]
                                                 [--spike-ms 30] [--preload 1:10,32:10,64:10]
                                                 [--keep DIR]

The smallest probe of side_by_side.py's workload 2: a fresh local cluster (3 node
processes, 1 bucket, plaintext like the side-by-side run), first the closed-loop
writes of its workload 1 (`--preload`), then one prefix subscription in a separate
process (emission_subscriber.py) and an open-loop writer at `--rate` writes/s through
the SDK for `--seconds`. Each write is joined with its event on (bucket,
commit index); every time is the host's wall clock (`time.time_ns`).

Prints per run: write (send->ack) and send->application p50/p99/max, then the spike
episodes: runs of events whose send->application exceeds `--spike-ms`, each with its
start (seconds since the load began), length, worst latency and the gap since the
previous episode, and on the same clock the nodes' log lines about snapshots and
archive segments, so what a stall lines up with shows.
`--keep DIR` copies the nodes' logs there. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench_emission import Subscribers, delivery_latencies
from bench_writes import machine, pct, write_load

from sevendb.cluster.ops.local import cluster_down, cluster_up, local_token


def episodes(
    load: dict[str, Any], result: dict[str, Any], t0_ns: int, spike_ms: float
) -> list[dict[str, float]]:
    """Runs of writes (in send order) whose event came more than `spike_ms` after the
    send; two spikes less than 100 ms apart are one episode."""
    received = {(b, i): ns for b, i, ns in result["trace"]}
    rows = sorted(
        (sent, (got - sent) / 1e6, (acked - sent) / 1e6)
        for b, i, sent, acked in load["acks"]
        if (got := received.get((b, i))) is not None
    )
    out: list[dict[str, float]] = []
    for sent, lat, write in rows:
        if lat <= spike_ms:
            continue
        at = (sent - t0_ns) / 1e9
        if out and at - out[-1]["end_s"] < 0.1:
            e = out[-1]
            e["end_s"] = at
            e["worst_ms"] = max(e["worst_ms"], lat)
            e["worst_write_ms"] = max(e["worst_write_ms"], write)
            e["events"] += 1
            continue
        out.append(
            {"start_s": at, "end_s": at, "worst_ms": lat, "worst_write_ms": write, "events": 1}
        )
    return out


_NOTED = re.compile(r"snapshot at log index|archive: (published|compacted|deleted)")


def node_events(data: Path, t0_ns: int) -> list[tuple[float, str, str]]:
    """(seconds since `t0_ns`, node, message) of the nodes' log lines about snapshots
    and archive segments: the periodic work a spike may line up with."""
    out = []
    for log in sorted((data / "nodes").glob("*/node.log")):
        for line in log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError):
                record = json.loads(line)
                if _NOTED.search(record["message"]):
                    when = datetime.fromisoformat(record["time"].replace("Z", "+00:00"))
                    at = when.timestamp() - t0_ns / 1e9
                    out.append((at, log.parent.name, record["message"][:110]))
    return sorted(out)


_WRITTEN = re.compile(r"snapshot at log index \d+ written \(\d+ bytes in ([0-9.]+) s\)")


def snapshot_windows(marks: list[tuple[float, str, str]]) -> list[tuple[float, float]]:
    """(start, end) seconds of each snapshot the nodes logged: end is the log line's
    time, start that minus the duration it states."""
    out = []
    for at, _, what in marks:
        m = _WRITTEN.search(what)
        if m:
            out.append((at - float(m.group(1)), at))
    return out


def most_at_once(windows: list[tuple[float, float]]) -> int:
    """The most snapshot windows open at one time."""
    edges = sorted([(a, 1) for a, _ in windows] + [(b, -1) for _, b in windows])
    most = open_now = 0
    for _, step in edges:
        open_now += step
        most = max(most, open_now)
    return most


def split_by_windows(
    load: dict[str, Any], result: dict[str, Any], t0_ns: int, windows: list[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """send->application ms (sorted) of the writes sent while a snapshot was being
    written, and of the others."""
    received = {(b, i): ns for b, i, ns in result["trace"]}
    inside: list[float] = []
    outside: list[float] = []
    for b, i, sent, _ in load["acks"]:
        got = received.get((b, i))
        if got is None:
            continue
        at = (sent - t0_ns) / 1e9
        hit = any(a <= at <= z for a, z in windows)
        (inside if hit else outside).append((got - sent) / 1e6)
    return sorted(inside), sorted(outside)


def one_run(args: argparse.Namespace, run: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="sevendb-bench-stall-") as tmp:
        data = Path(tmp) / "data"
        spec = cluster_up(data, nodes=3, buckets=1, replicas=3, insecure=True).spec
        token = local_token(data)
        try:
            for inflight, seconds in args.preload:  # what side_by_side's workload 1 leaves
                pre = write_load(spec, token, f"w{inflight}/", seconds, inflight=inflight, tls=None)
                print(f"  preload: {pre['writes']} writes, {inflight} in flight", flush=True)
            sub = Subscribers(spec, token, "prefix:l/", 1, None)
            t0_ns = time.time_ns()
            load = write_load(spec, token, "l/", args.seconds, rate=args.rate, tls=None)
            sub.wait_count(load["writes"], 60)
            result = sub.finish()
        finally:
            cluster_down(data)
            marks = node_events(data, t0_ns)
            if args.keep:
                for log in (data / "nodes").glob("*/node.log"):
                    dest = Path(args.keep) / f"run{run}-{log.parent.name}.log"
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(log, dest)
    _, send_to_app = delivery_latencies(load, result)
    eps = episodes(load, result, t0_ns, args.spike_ms)
    print(
        f"run {run + 1}: {load['writes_per_s']:.0f} writes/s, {len(send_to_app)}/"
        f"{load['writes']} events; write p50 {load['p50_ms']:.2f} p99 {load['p99_ms']:.2f} ms; "
        f"send->app p50 {pct(send_to_app, 50):.2f} p99 {pct(send_to_app, 99):.2f} "
        f"max {send_to_app[-1] if send_to_app else float('nan'):.1f} ms; "
        f"{len(eps)} episodes over {args.spike_ms:.0f} ms; the load began at "
        f"{t0_ns / 1e9:.3f} (epoch s)",
        flush=True,
    )
    for at, node, what in marks:
        if -1 <= at <= args.seconds + 1:
            print(f"  node {node} at {at:7.3f} s: {what}", flush=True)
    windows = snapshot_windows(marks)
    inside, outside = split_by_windows(load, result, t0_ns, windows)
    print(
        f"  writes sent while a node wrote a snapshot: {len(inside)}, send->app p99 "
        f"{pct(inside, 99):.1f} max {max(inside, default=float('nan')):.1f} ms; the others: "
        f"{len(outside)}, p99 {pct(outside, 99):.1f} max {max(outside, default=float('nan')):.1f}"
        f" ms; at most {most_at_once(windows)} node(s) writing one at once",
        flush=True,
    )
    previous = None
    for e in eps:
        gap = "" if previous is None else f", {e['start_s'] - previous:.2f} s after the previous"
        previous = e["start_s"]
        print(
            f"  at {e['start_s']:7.3f} s: {e['events']:.0f} events over "
            f"{1000 * (e['end_s'] - e['start_s']):.0f} ms, worst {e['worst_ms']:.0f} ms "
            f"(its write {e['worst_write_ms']:.0f} ms){gap}",
            flush=True,
        )
    return {
        "p50_ms": pct(send_to_app, 50),
        "p99_ms": pct(send_to_app, 99),
        "write_p99_ms": load["p99_ms"],
        "episodes": float(len(eps)),
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--rate", type=float, default=500)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--spike-ms", type=float, default=30)
    p.add_argument(
        "--preload",
        default="1:10,32:10,64:10",
        help="closed-loop write phases (in flight:seconds, comma-separated; '' for none) "
        "before the subscriber starts: by default those of side_by_side.py's workload 1, "
        "which runs before its latency workload on the same cluster",
    )
    p.add_argument(
        "--snapshot-every",
        type=float,
        help="seconds: the nodes' raft.compaction_min_time_s (SEVENDB_RAFT_COMPACTION_MIN_"
        "TIME_S), so that every node snapshots its (preloaded) state that often, whatever "
        "the log's length, and snapshots land inside the measured load on any host",
    )
    p.add_argument("--keep", help="copy the nodes' logs into this directory")
    args = p.parse_args()
    args.preload = [
        (int(a), float(b)) for a, b in (x.split(":") for x in args.preload.split(",") if x)
    ]
    if args.snapshot_every:  # the nodes inherit the environment
        os.environ["SEVENDB_RAFT_COMPACTION_MIN_TIME_S"] = str(args.snapshot_every)
    print(f"machine: {machine()}", flush=True)
    runs = [one_run(args, r) for r in range(args.runs)]
    for key in ("p50_ms", "p99_ms", "write_p99_ms", "episodes"):
        values = [r[key] for r in runs]
        print(
            f"{key}: median {statistics.median(values):.2f} "
            f"(range {min(values):.2f}-{max(values):.2f}) over {len(runs)} runs",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
