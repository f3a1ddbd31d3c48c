"""Benchmark: where one durable write's time goes, stage by stage, in every process.

    .venv/bin/python tests/bench/bench_write_path.py [--seconds 5] [--functions F,...]

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
probe adds ~1 µs per call, so the total runs a little slower than unprobed. Not a
test: nothing is asserted.
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
    "sevendb.sdk.writer:WritePipeline._kick",
    "sevendb.sdk.writer:WritePipeline._answered",
    "sevendb.sdk.writer:WritePipeline._settle",
)
Record = tuple[int, int, str, str]
"""start ns, end ns, function, label."""


async def _write_one_at_a_time(conf: dict[str, object], seconds: float) -> list[tuple[int, int]]:
    from sevendb.sdk import AsyncClient, set_op

    endpoints = conf["endpoints"]
    assert isinstance(endpoints, list)
    client = AsyncClient(endpoints, token=str(conf["token"]), tls=None)
    try:
        await client.layout()
        for i in range(200):  # warm-up: connections, the producer, caches
            await client.write([set_op(f"warm/{i}", value_of(i))])
        windows = []
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            sent = time.monotonic_ns()
            await client.write([set_op(f"w/{i}", value_of(i))])
            windows.append((sent, time.monotonic_ns()))
            i += 1
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
    args = p.parse_args()
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
    print(f"# {machine()}; one write at a time for {args.seconds:g} s{with_sub}", flush=True)
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
        windows = asyncio.run(_write_one_at_a_time(cluster.conf(), args.seconds))
        time.sleep(1.0)  # the nodes' probes write every half second
        stage_probe._flush(str(probe_dir))
        by_pid = _read(probe_dir)
    finally:
        close_all(subscribers)
        cluster.stop()
    latencies = sorted((acked - sent) / 1e6 for sent, acked in windows)
    print(
        f"{len(windows)} writes: p50 {statistics.median(latencies):.3f} ms, "
        f"p90 {latencies[int(len(latencies) * 0.9)]:.3f} ms"
    )
    leader = max(by_pid, key=lambda pid: sum(r[2] == "Writes._parse" for r in by_pid[pid]))
    roles = {os.getpid(): "client (this process)", leader: "leader"}
    print("\nstart µs after the send, median duration µs, function, label, n-th call")
    for pid in sorted(by_pid, key=lambda pid: (pid != os.getpid(), pid != leader, pid)):
        print(f"\n{roles.get(pid, 'follower')} (pid {pid})")
        print("\n".join(_timeline(by_pid[pid], windows)))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
