"""Benchmark: consumer group throughput with 1, 2 and 4 member processes, and how
long a durable subscription takes to resume after its consumer process is killed.

    .venv/bin/python tests/bench/bench_groups.py [--backlog 2000] [--buckets 4]
        [--members 1,2,4] [--work-ms 1.0] [--handler sleep|spin] [--runs 1]

One cluster (3 nodes, fsync on, `--buckets` buckets). Consumer groups: for each
member count a fresh group of one query is made (one member joins and leaves: the
group's durable subscriptions exist, detached), `--backlog` single-key writes commit,
then the member processes (each its own `Client`) join, and once the buckets are dealt
(3 s) are released together; each handles an event by sleeping `--work-ms` per change
(an I/O-bound handler; `--handler spin` burns the CPU instead) and the figure is the
backlog's changes over the time from the release to the last change processed by any
member. Kafka's expectation is that this grows with the members while each has work
and a core to run on. (The backlog reaches the members' buffers while they settle, so
the figure is the group's pace of handling, not of delivery: `--work-ms` must be > 0.)
Durable resume: a consumer process subscribes by name, processes a first batch and is
killed with kill -9; a backlog commits; a new process subscribes by the name: the time
its `subscribe` takes (every bucket's stream attached after the server's acknowledged
position), to its first backlog event and to the whole backlog.

Also run by `tests/bench/side_by_side.py --groups`. Not a test: figures are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_writes import machine

from sevendb.cluster.ops.local import cluster_down, cluster_up, local_tls, local_token
from sevendb.sdk import Client, set_op

HERE = Path(__file__).resolve()
SETTLE_S = 3.0
"""From the last member's join to the release: beats enough to deal the buckets."""


def _client(data: Path) -> Client:
    from sevendb.cluster.ops.local import local_spec

    spec = local_spec(data)
    return Client(
        [n.grpc_address for n in spec.nodes], token=local_token(data), tls=local_tls(data)
    )


def member(args: argparse.Namespace) -> None:
    """A member process: join, handle from when `--go` exists until idle, report."""
    with _client(Path(args.data)) as client:
        sub = client.subscribe(args.query, group=args.group, session_timeout_s=5)
        print("joined", flush=True)
        while not Path(args.go).exists():
            time.sleep(0.001)
        changes, last = 0, time.time()
        while (event := sub.poll(args.idle_s)) is not None:
            for _ in event.changes:
                if args.handler == "spin":
                    until = time.perf_counter() + args.work_ms / 1000
                    while time.perf_counter() < until:
                        pass
                else:
                    time.sleep(args.work_ms / 1000)
                changes += 1
            last = time.time()
        sub.close()
    print(json.dumps({"changes": changes, "last": last}), flush=True)


def consumer(args: argparse.Namespace) -> None:
    """A durable consumer process: subscribe by name, say when subscribed and each
    change handled (the resume run prints its timings)."""
    started = time.perf_counter()
    with _client(Path(args.data)) as client:
        sub = client.subscribe(args.query, durable=args.durable)
        subscribed = time.perf_counter() - started
        print(json.dumps({"subscribed_ms": subscribed * 1000}), flush=True)
        seen, first = 0, 0.0
        while seen < args.want and (event := sub.poll(30)) is not None:
            seen += len(event.changes)
            first = first or time.perf_counter() - started
            if args.trickle:
                print(json.dumps({"seen": seen}), flush=True)
        total = time.perf_counter() - started
        print(json.dumps({"first_ms": first * 1000, "all_ms": total * 1000, "seen": seen}))
        sub.close()


def _spawn(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(HERE), *argv], stdout=subprocess.PIPE, text=True)


def _write(client: Client, prefix: str, count: int) -> None:
    futures = [client.write_async([set_op(f"{prefix}{i:06d}", b"x")]) for i in range(count)]
    for f in futures:
        f.result()


def group_run(
    data: Path, members: int, backlog: int, work_ms: float, run: int, handler: str
) -> float:
    group, prefix = f"g{members}r{run}", f"g{members}r{run}/"
    query = f"prefix:{prefix}"
    with _client(data) as client:
        client.subscribe(query, group=group).close()  # the group's subscriptions exist
        _write(client, prefix, backlog)
    go = data.parent / f"go-{group}"
    common = ["member", "--data", str(data), "--query", query, "--group", group, "--go", str(go)]
    procs = [
        _spawn(*common, "--work-ms", str(work_ms), "--handler", handler) for _ in range(members)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "joined"
    time.sleep(SETTLE_S)  # the buckets dealt over every member
    released = time.time()
    go.touch()
    reports = [json.loads(p.communicate(timeout=600)[0].splitlines()[-1]) for p in procs]
    # (events delivered before the release wait in the members' buffers: the figure
    # is the group's steady pace of handling, not its rebalance)
    done = sum(r["changes"] for r in reports)
    if done < backlog:
        raise SystemExit(f"{members} members processed {done} of {backlog} changes")
    return backlog / (max(r["last"] for r in reports) - released)


def resume_run(data: Path, backlog: int, run: int) -> dict[str, float]:
    name, prefix = f"resume{run}", f"r{run}/"
    query = f"prefix:{prefix}"
    common = ["consumer", "--data", str(data), "--query", query, "--durable", name]
    first = _spawn(*common, "--want", "1000000", "--trickle")
    assert first.stdout is not None
    json.loads(first.stdout.readline())  # subscribed
    with _client(data) as client:
        _write(client, prefix, 50)
        while json.loads(first.stdout.readline())["seen"] < 25:
            pass
        os.kill(first.pid, signal.SIGKILL)  # mid-stream: no final ack
        first.wait()
        _write(client, prefix, backlog)
    again = _spawn(*common, "--want", str(backlog))
    out = [json.loads(line) for line in again.communicate(timeout=300)[0].splitlines()]
    figures = {**out[0], **out[-1]}
    return {k: figures[k] for k in ("subscribed_ms", "first_ms", "all_ms")}


def bench(
    backlog: int,
    buckets: int,
    counts: list[int],
    work_ms: float,
    runs: int,
    handler: str = "sleep",
) -> None:
    print(f"machine: {machine()}", flush=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="sevendb-groups-") as tmp:
        data = Path(tmp) / "data"
        cluster_up(data, nodes=3, buckets=buckets, replicas=3)
        try:
            rates: dict[int, list[float]] = {n: [] for n in counts}
            for run in range(runs):
                for n in counts:
                    rates[n].append(group_run(data, n, backlog, work_ms, run, handler))
                    print(f"run {run}: {n} member(s): {rates[n][-1]:,.0f} changes/s", flush=True)
            base = statistics.median(rates[counts[0]])
            for n in counts:
                med = statistics.median(rates[n])
                print(
                    f"group of {n}: {med:,.0f} changes/s (x{med / base:.2f} of {counts[0]}), "
                    f"backlog {backlog}, {buckets} buckets, handler: {handler} "
                    f"{work_ms:g} ms/change"
                )
            resumes = [resume_run(data, backlog, run) for run in range(runs)]
            mid = {k: statistics.median(r[k] for r in resumes) for k in resumes[0]}
            print(
                f"durable resume after kill -9 (new process, median of {runs}): subscribe "
                f"{mid['subscribed_ms']:.0f} ms, first backlog change {mid['first_ms']:.0f} ms, "
                f"all {backlog} {mid['all_ms']:.0f} ms (from the new process's client start)"
            )
        finally:
            cluster_down(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode")
    m = sub.add_parser("member")
    c = sub.add_parser("consumer")
    for p in (m, c):
        p.add_argument("--data", required=True)
        p.add_argument("--query", required=True)
    m.add_argument("--group", required=True)
    m.add_argument("--go", required=True)
    m.add_argument("--work-ms", type=float, default=1.0)
    m.add_argument("--handler", choices=("sleep", "spin"), default="sleep")
    m.add_argument("--idle-s", type=float, default=3.0)
    c.add_argument("--durable", required=True)
    c.add_argument("--want", type=int, required=True)
    c.add_argument("--trickle", action="store_true")
    parser.add_argument("--backlog", type=int, default=2000)
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--members", default="1,2,4")
    parser.add_argument("--work-ms", type=float, default=1.0)
    parser.add_argument("--handler", choices=("sleep", "spin"), default="sleep")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    if args.mode == "member":
        member(args)
    elif args.mode == "consumer":
        consumer(args)
    else:
        counts = [int(n) for n in args.members.split(",")]
        if args.work_ms <= 0:
            parser.error("--work-ms must be > 0 (see the docstring)")
        bench(args.backlog, args.buckets, counts, args.work_ms, args.runs, args.handler)


if __name__ == "__main__":
    main()
