"""Benchmark: where one durable write's time goes, stage by stage, in every process.

    .venv/bin/python tests/bench/bench_write_path.py [--seconds 5] [--functions F,...]
                                                      [--subscriber] [--together N]

A fresh 3-node, 1-bucket cluster (side_by_side.py's `SevendbCluster`: plaintext,
fsync on); this process writes one write at a time through `AsyncClient` for
`--seconds` (with `--subscriber`, while side_by_side.py's subscriber process holds a
subscription of every write). The stage probe (`stage_probe/sitecustomize.py`, loaded into the node
processes through PYTHONPATH and into this one directly) records each call of the
functions below with one host-wide clock. For each process (the client, the leader,
each follower) and each call made while a write was in flight (the n-th call of a
function within that write's window is its own row), it prints the median start
after the write was sent and the median duration, in µs, for calls present in most
writes. Gaps between rows are waits: for a thread, the GIL, a socket or a disk. The
probe adds ~1 µs per call, so the total runs a little slower than unprobed.

With `--together N` the client sends N writes at once (`asyncio.gather`), waits for
all N, and sends the next N: the cycle that side_by_side.py's 64-in-flight load
settles into, since its writes are answered together and come back together
(docs/performance.md, "fifteenth session"). A function called many times per
cycle (once per write) is one row then: the median first start, the median span
from its first start to its last end, its median calls per cycle and its median
time summed over them. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_writes import machine
from peers.clusters import SevendbCluster
from peers.common import Worker, value_of
from peers.workloads import close_all

HERE = Path(__file__).resolve().parent
PROBE_FILE = HERE / "stage_probe" / "sitecustomize.py"
# By its path: `import sitecustomize` may give the interpreter's own.
_spec = importlib.util.spec_from_file_location("stage_probe", PROBE_FILE)
assert _spec is not None and _spec.loader is not None
stage_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stage_probe)

NODE_FUNCTIONS = (
    "sevendb.cluster.server.writes:Writes._parse",
    "sevendb.cluster.server.batcher:EntryBatcher._propose",
    "sevendb.cluster.raft.replica:BucketReplica.submit",
    "sevendb.cluster.raft.loop:RaftLoop._dispatch",
    "sevendb.cluster.raft.node:RaftNode.tick",
    "sevendb.cluster.raft.node:RaftNode._checkCommandsToApply",
    "sevendb.cluster.raft.journal:DurableJournal.add",
    "sevendb.cluster.raft.node:RaftNode._SyncObj__sendAppendEntries",
    "pysyncobj.tcp_connection:TcpConnection.send",
    "pysyncobj.tcp_connection:TcpConnection._TcpConnection__processParseMessage",
    "sevendb.cluster.raft.journal:DurableJournal.sync",
    "sevendb.cluster.raft.replica:BucketReplica._apply",
    "sevendb.cluster.raft.replica:BucketReplica._after_applies",
    "sevendb.cluster.server.batcher:EntryBatcher._applied",
    "sevendb.cluster.server.writes:Writes._answers",
)
CLIENT_FUNCTIONS = (
    "sevendb.sdk.writer:WritePipeline.submit",
    "sevendb.sdk.writer:WritePipeline._admit",
    "sevendb.sdk.writer:WritePipeline._drain",
    "sevendb.sdk.writer:WritePipeline._kick",
    "sevendb.sdk.writer:WritePipeline._answered",
    "sevendb.sdk.writer:WritePipeline._settle",
)
Record = tuple[int, int, str, str]
"""start ns, end ns, function, label."""


async def _write_cycles(
    conf: dict[str, object], seconds: float, together: int
) -> list[tuple[int, int]]:
    """`together` writes at once, again and again for `seconds`: each cycle's window
    (sent, last answered) on `time.monotonic_ns`."""
    from sevendb.sdk import AsyncClient, set_op

    endpoints = conf["endpoints"]
    assert isinstance(endpoints, list)
    client = AsyncClient(endpoints, token=str(conf["token"]), tls=None)

    async def cycle(prefix: str, first: int) -> None:
        await asyncio.gather(
            *(
                client.write([set_op(f"{prefix}/{i}", value_of(i))])
                for i in range(first, first + together)
            )
        )

    try:
        await client.layout()
        for i in range(0, 200 * together, together):  # warm-up: connections, the producer
            await cycle("warm", i)
        windows = []
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            sent = time.monotonic_ns()
            await cycle("w", i)
            windows.append((sent, time.monotonic_ns()))
            i += together
        return windows
    finally:
        await client.close()


def _read(directory: Path) -> dict[int, list[Record]]:
    out: dict[int, list[Record]] = {}
    for path in directory.glob("*.tsv"):
        records = []
        for line in path.read_text().splitlines():
            name, label, started, ended, _thread = line.split("\t")
            records.append((int(started), int(ended), name, label))
        records.sort()
        out[int(path.stem)] = records
    return out


def _cycle_timeline(records: list[Record], windows: list[tuple[int, int]]) -> list[str]:
    """One line per (function, label) present in most cycles: median first start
    after the send, span to its last end, calls, and time summed over the calls."""
    starts = [r[0] for r in records]
    stats: dict[tuple[str, str], list[tuple[float, float, int, float]]] = collections.defaultdict(
        list
    )
    for sent, acked in windows:
        seen: dict[tuple[str, str], list[int]] = {}
        for started, ended, name, label in records[bisect.bisect_left(starts, sent) :]:
            if started > acked:
                break
            first, last, calls, busy = seen.setdefault((name, label), [started, ended, 0, 0])
            seen[(name, label)] = [first, max(last, ended), calls + 1, busy + ended - started]
        for key, (first, last, calls, busy) in seen.items():
            stats[key].append(((first - sent) / 1e3, (last - first) / 1e3, calls, busy / 1e3))
    rows = []
    for (name, label), values in stats.items():
        if len(values) < len(windows) / 2:
            continue
        at, span, calls, busy = (statistics.median(column) for column in zip(*values, strict=True))
        rows.append(
            (at, f"  +{at:7.0f}  {span:6.0f}  {calls:4.0f}  {busy:6.0f}  {name} {label}".rstrip())
        )
    return [line for _, line in sorted(rows)]


def _timeline(records: list[Record], windows: list[tuple[int, int]]) -> list[str]:
    """One line per (function, label, n-th call in the window) present in most writes."""
    starts = [r[0] for r in records]
    calls: dict[tuple[str, str, int], list[tuple[float, float]]] = collections.defaultdict(list)
    for sent, acked in windows:
        seen: collections.Counter[tuple[str, str]] = collections.Counter()
        for started, ended, name, label in records[bisect.bisect_left(starts, sent) :]:
            if started > acked:
                break
            seen[(name, label)] += 1
            key = (name, label, seen[(name, label)])
            calls[key].append(((started - sent) / 1e3, (ended - started) / 1e3))
    rows = []
    for (name, label, nth), values in calls.items():
        if len(values) < len(windows) / 2:
            continue
        at = statistics.median(v[0] for v in values)
        took = statistics.median(v[1] for v in values)
        rows.append((at, f"  +{at:7.0f}  {took:6.0f}  {name} {label} #{nth}".rstrip()))
    return [line for _, line in sorted(rows)]


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument(
        "--functions", default="", help="more node functions to probe (module:Class.method,...)"
    )
    p.add_argument(
        "--subscriber",
        action="store_true",
        help="one subscription of every write, in side_by_side.py's subscriber process",
    )
    p.add_argument(
        "--together",
        type=int,
        default=1,
        help="writes sent at once, each cycle waiting for all of them (default 1)",
    )
    args = p.parse_args()
    if args.together < 1:
        p.error(f"--together must be at least 1, not {args.together}")
    node_functions = [*NODE_FUNCTIONS, *filter(None, args.functions.split(","))]
    root = Path(tempfile.mkdtemp(prefix="bench-write-path-"))
    probe_dir = root / "probe"
    probe_dir.mkdir()
    os.environ[stage_probe.DIR_ENV] = str(probe_dir)
    os.environ[stage_probe.FUNCTIONS_ENV] = ",".join(node_functions)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(PROBE_FILE.parent), os.environ.get("PYTHONPATH")])
    )
    with_sub = ", one subscriber" if args.subscriber else ""
    at_once = "one write" if args.together == 1 else f"{args.together} writes"
    print(f"# {machine()}; {at_once} at a time for {args.seconds:g} s{with_sub}", flush=True)
    cluster = SevendbCluster(root, buckets=1)
    subscribers: list[Worker] = []
    try:
        cluster.start()
        time.sleep(3)  # a fresh cluster hands leadership over in its first seconds
        if args.subscriber:
            spec = {"kind": "prefix", "prefix": "w", "count": 1, "tag": "w"}
            conf = {**cluster.conf(), "spec": spec}
            subscribers.append(Worker("sevendb", "subscriber", conf, root / "subscriber.log"))
        import sevendb.sdk.writer  # noqa: F401 - loaded, so that the probe can wrap it

        stage_probe.start(str(probe_dir), list(CLIENT_FUNCTIONS))
        windows = asyncio.run(_write_cycles(cluster.conf(), args.seconds, args.together))
        time.sleep(1.0)  # the nodes' probes write every half second
        stage_probe._flush(str(probe_dir))
        by_pid = _read(probe_dir)
    finally:
        close_all(subscribers)
        cluster.stop()
    latencies = sorted((acked - sent) / 1e6 for sent, acked in windows)
    span = (windows[-1][1] - windows[0][0]) / 1e9
    what = "writes" if args.together == 1 else f"cycles of {args.together}"
    print(
        f"{len(windows)} {what}: p50 {statistics.median(latencies):.3f} ms, "
        f"p90 {latencies[int(len(latencies) * 0.9)]:.3f} ms; "
        f"{len(windows) * args.together / span:,.0f} writes/s"
    )
    leader = max(by_pid, key=lambda pid: sum(r[2] == "Writes._parse" for r in by_pid[pid]))
    roles = {os.getpid(): "client (this process)", leader: "leader"}
    if args.together == 1:
        print("\nstart µs after the send, median duration µs, function, label, n-th call")
        timeline = _timeline
    else:
        print(
            "\nmedians per cycle: first start µs after the send, µs from first start to "
            "last end, calls, µs summed over the calls; function, label"
        )
        timeline = _cycle_timeline
    for pid in sorted(by_pid, key=lambda pid: (pid != os.getpid(), pid != leader, pid)):
        print(f"\n{roles.get(pid, 'follower')} (pid {pid})")
        print("\n".join(timeline(by_pid[pid], windows)))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
