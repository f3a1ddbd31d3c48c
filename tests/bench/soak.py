"""Soak: a local cluster under a steady write rate with churn, sampled until it is
clear whether everything that should be bounded is flat.

    python tests/bench/soak.py --minutes 60 [--rate 200] [--json OUT]

For `--minutes`, with 3 nodes and 4 buckets:

* one writer puts `--rate` writes/s over a fixed key space (the state cannot grow),
  each value a counter, and remembers the last value acknowledged per key;
* subscribers come and go: some close (unsubscribe), some are `kill -9`ed without
  closing (`sevendb subscribe` processes: the subscription is left to expire);
* short-lived clients write a few keys and close (their producers are left to
  expire);
* one slow subscriber acknowledges one event a second (its stream is cut off when
  it stops acknowledging for `slow_stream_ms`, and it resumes);
* halfway, a follower node is stopped and restarted;
* an auditor subscription with a cursor checks every event it gets is the next in
  its bucket's chain (no gap, no duplicate).

Lifecycles are shortened so that they turn over within the run: the stall window and
the producers' idle time are 20 s, a slow stream is cut after 10 s.

With `--dump-minutes M`, each node writes a memory dump every M minutes into
`<node dir>/memory/` (docs/operations.md, "Memory"), with `--trace-memory FRAMES`
its allocation sites too (tracing costs CPU and memory: its RSS is not the
untraced one); the dumps are copied to `--dumps DIR` at the end.

Every 5 s it samples each node's RSS, journal and snapshot bytes, and every bucket's
outbox rows, live subscriptions and producers (from `Status`). At the end it prints
each series' median after warm-up (the first third) and whether the highest value of
its last third stays within 10% (and a small absolute slack) of the highest of the
middle third (series that saw-tooth, like a log between compactions, are judged by
their peaks): flat or GROWING.
It also checks that every acknowledged write is there and that the auditor saw no
gap or duplicate. Exit status 0 only if all of that holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sevendb.cluster.ops.local import (
    cluster_down,
    cluster_up,
    local_spec,
    local_tls,
    local_token,
    node_status,
    running_pid,
    start_node,
    stop_nodes,
)
from sevendb.cluster.raft.records import HEADER_V2, read_log
from sevendb.sdk import TLS, Client, Event, SevenDBError, SubscribeOptions
from sevendb.sdk.subscription import AckMode

KEYS = 2000
SAMPLE_S = 5.0
LIFECYCLE_ENV = {
    "SEVENDB_RAFT_STALL_WINDOW_MS": "20000",
    "SEVENDB_NOTIFIER_PRODUCER_IDLE_MS": "20000",
    "SEVENDB_NOTIFIER_SLOW_STREAM_MS": "10000",
    "SEVENDB_NOTIFIER_ATTACH_GRACE_MS": "5000",
    "SEVENDB_RAFT_COMPACTION_MIN_ENTRIES": "2000",
    "SEVENDB_RAFT_COMPACTION_MIN_TIME_S": "30",
    # The retained history grows to its bound (10,000 change sets or an hour by
    # default, docs/limits.md): bounds the run reaches.
    "SEVENDB_NOTIFIER_HISTORY_ENTRIES": "500",
    "SEVENDB_NOTIFIER_HISTORY_AGE_MS": "20000",
}
SERIES_SLACK = {
    "rss_mb": 10.0,
    "disk_kb": 512.0,
    "outbox_rows": 200.0,
    "subscriptions": 8.0,
    "producers": 8.0,
}


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


@dataclass
class Run:
    data: Path
    endpoints: list[str]
    token: str
    tls: TLS | None
    stop: threading.Event = field(default_factory=threading.Event)
    acked: dict[str, int] = field(default_factory=dict)
    write_errors: int = 0
    audit_problems: list[str] = field(default_factory=list)
    audited: int = 0
    churned: dict[str, int] = field(default_factory=dict)

    def client(self) -> Client:
        return Client(self.endpoints, token=self.token, tls=self.tls)

    def count(self, what: str) -> None:
        self.churned[what] = self.churned.get(what, 0) + 1


def writer(run: Run, rate: float) -> None:
    counter = 0
    with run.client() as client:
        next_at = time.monotonic()
        while not run.stop.is_set():
            key = f"soak/{counter % KEYS:05d}"
            counter += 1
            try:
                client.put(key, str(counter).encode())
                run.acked[key] = counter
            except SevenDBError as exc:
                run.write_errors += 1
                log(f"write {key}: {exc}")
            next_at += 1 / rate
            run.stop.wait(max(0.0, next_at - time.monotonic()))


def auditor(run: Run, cursor: Path) -> None:
    """Checks each bucket's chain: every event's prev_emit_seq is the last one seen."""
    last: dict[int, Any] = {}
    with run.client() as client:
        sub = client.subscribe("prefix:soak/", cursor=cursor)
        while not run.stop.is_set():
            event = sub.poll(0.5)
            if event is None:
                continue
            seen = last.get(event.bucket)
            if seen is not None and event.prev_emit_seq != seen:
                run.audit_problems.append(
                    f"bucket {event.bucket}: {event.emit_seq} follows {event.prev_emit_seq}, "
                    f"the last seen was {seen}"
                )
            last[event.bucket] = event.emit_seq
            run.audited += 1
        sub.close()


def slow_subscriber(run: Run) -> None:
    with run.client() as client:
        options = SubscribeOptions(ack=AckMode.EXPLICIT)
        sub = client.subscribe("key:soak/00000", options=options)
        while not run.stop.is_set():
            event: Event | None = sub.poll(0.5)
            if event is not None:
                run.stop.wait(1.0)  # one a second: far slower than the writes
                sub.ack(event)
        sub.close()


def churn(run: Run, rng: random.Random) -> None:
    """Subscribers that close or vanish; producers that come and go."""
    procs: list[subprocess.Popen[bytes]] = []
    while not run.stop.wait(rng.uniform(1.0, 3.0)):
        choice = rng.random()
        try:
            if choice < 0.35:  # a subscriber that reads a little and closes
                with run.client() as client:
                    sub = client.subscribe(f"prefix:soak/{rng.randrange(10)}")
                    sub.poll(1.0)
                    sub.close()
                run.count("closed subscribers")
            elif choice < 0.6:  # a process that subscribes and is killed
                procs.append(_vanishing_subscriber(run, rng))
                run.count("vanished subscribers")
            else:  # a short-lived client: its producer is left behind
                with run.client() as client:
                    for _ in range(3):
                        client.put(f"churn/{rng.randrange(KEYS):05d}", b"churn")
                run.count("short-lived producers")
        except SevenDBError as exc:
            log(f"churn: {exc}")
        for proc in [p for p in procs if p.poll() is None and rng.random() < 0.5]:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            procs.remove(proc)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _vanishing_subscriber(run: Run, rng: random.Random) -> subprocess.Popen[bytes]:
    cursor = run.data / f"vanish-{time.monotonic_ns()}.cursor"
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sevendb.cluster.ops.cli",
            "subscribe",
            f"prefix:soak/{rng.randrange(10)}",
            "--cursor",
            str(cursor),
            "--data",
            str(run.data),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _disk_kb(node_home: Path) -> float:
    """A node's Raft files: snapshots, the journals' side files, and what its journals
    hold up to their last record (not the zeros preallocated after it: at most
    `RaftTuning.journal_preallocate_bytes` per journal, a fixed amount)."""
    total = 0
    for pattern in ("*/raft.journal?*", "*/snapshot.bin"):
        total += sum(p.stat().st_size for p in node_home.glob(pattern) if p.is_file())
    for journal in node_home.glob("*/raft.journal"):
        with contextlib.suppress(OSError):  # gone: replaced by a compaction
            data = journal.read_bytes()
            total += read_log(data, journal).end if len(data) >= HEADER_V2 else len(data)
    return total / 1024


def sample(run: Run) -> dict[str, float]:
    """One sample: sums over nodes (RSS, disk) and over buckets (outbox rows, live
    subscriptions, producers, as the leaders see them)."""
    spec = local_spec(run.data)
    rss = disk = 0.0
    rows = subs = producers = 0
    for node in spec.nodes:
        pid = running_pid(run.data, node.node_id)
        if pid is not None:
            rss += _rss_mb(pid)
        disk += _disk_kb(run.data / "nodes" / node.node_id)
        status = node_status(node.grpc_address, run.tls)
        for r in status.replicas if status else []:
            if r.is_leader:
                rows += r.outbox_rows
                subs += r.subscriptions
                producers += r.producers
    return {
        "rss_mb": rss,
        "disk_kb": disk,
        "outbox_rows": rows,
        "subscriptions": subs,
        "producers": producers,
    }


def restart_a_follower(run: Run) -> None:
    spec = local_spec(run.data)
    status = {n.node_id: node_status(n.grpc_address, run.tls) for n in spec.nodes}
    leaders = {n for n, s in status.items() if s and any(r.is_leader for r in s.replicas)}
    victim = next((n for n in status if n not in leaders), spec.nodes[-1].node_id)
    log(f"stopping node {victim} (a follower) and starting it again")
    stop_nodes(run.data, [victim])
    start_node(run.data, victim)


def verdict(samples: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    third = max(1, len(samples) // 3)
    middle, last = samples[third : 2 * third], samples[2 * third :]
    out = {}
    for name, slack in SERIES_SLACK.items():
        median = statistics.median(s[name] for s in middle) if middle else 0.0
        peak = max((s[name] for s in middle), default=0.0)
        end = max((s[name] for s in last), default=0.0)
        out[name] = {
            "after_warmup_median": round(median, 1),
            "middle_third_max": round(peak, 1),
            "last_third_max": round(end, 1),
            # peaks against peaks: a saw-tooth (a log between compactions) is flat
            "flat": end <= peak * 1.10 + slack,
        }
    return out


def check_writes(run: Run) -> list[str]:
    """Every key holds its last acknowledged value, or a later one (a write whose
    answer was lost may have committed too)."""
    missing = []
    with run.client() as client:
        for key, value in sorted(run.acked.items()):
            record = client.get(key)
            if record is None or int(record.value.decode()) < value:
                found = None if record is None else record.value
                missing.append(f"{key}: acknowledged {value}, found {found!r}")
    return missing


def soak(
    minutes: float, rate: float, data: Path, seed: int = 1, trace: tuple[int, float] = (0, 0.0)
) -> dict[str, Any]:
    """`trace`: (frames, seconds between memory dumps), (0, 0.0) for none."""
    os.environ.update(LIFECYCLE_ENV)
    if trace[1] > 0:
        os.environ["SEVENDB_NODE_TRACEMALLOC_FRAMES"] = str(trace[0])
        os.environ["SEVENDB_NODE_MEMORY_DUMP_S"] = str(trace[1])
    cluster_up(data, nodes=3, buckets=4, replicas=3, progress=log)
    spec = local_spec(data)
    run = Run(data, [n.grpc_address for n in spec.nodes], local_token(data), local_tls(data))
    rng = random.Random(seed)
    threads = [
        threading.Thread(target=writer, args=(run, rate), name="writer"),
        threading.Thread(target=auditor, args=(run, data / "auditor.cursor"), name="auditor"),
        threading.Thread(target=slow_subscriber, args=(run,), name="slow"),
        threading.Thread(target=churn, args=(run, rng), name="churn"),
    ]
    for t in threads:
        t.start()
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    end = started + minutes * 60
    restarted = False
    try:
        while time.monotonic() < end:
            time.sleep(SAMPLE_S)
            samples.append(sample(run))
            log(f"{len(samples):4d} {samples[-1]}")
            if not restarted and time.monotonic() - started > minutes * 30:
                restart_a_follower(run)
                restarted = True
    finally:
        run.stop.set()
        for t in threads:
            t.join(60)
    missing = check_writes(run)
    cluster_down(data, progress=log)
    series = verdict(samples)
    ok = all(v["flat"] for v in series.values()) and not missing and not run.audit_problems
    return {
        "minutes": minutes,
        "rate": rate,
        "writes_acknowledged_keys": len(run.acked),
        "write_errors": run.write_errors,
        "events_audited": run.audited,
        "audit_problems": run.audit_problems[:20],
        "acknowledged_writes_missing": missing[:20],
        "churn": run.churned,
        "series": series,
        "samples": samples,
        "ok": ok,
    }


def report(result: dict[str, Any]) -> None:
    print(f"soak: {result['minutes']} min at {result['rate']} writes/s")
    print(
        f"{'series':<14} {'median':>10} {'max, middle third':>18} {'max, last third':>16}  verdict"
    )
    for name, v in result["series"].items():
        word = "flat" if v["flat"] else "GROWING"
        print(
            f"{name:<14} {v['after_warmup_median']:>10} {v['middle_third_max']:>18} "
            f"{v['last_third_max']:>16}  {word}"
        )
    print(
        f"acknowledged writes missing: {len(result['acknowledged_writes_missing'])}; "
        f"gaps or duplicates: {len(result['audit_problems'])} in {result['events_audited']} "
        f"events; write errors (retried): {result['write_errors']}; churn: {result['churn']}"
    )
    print("OK" if result["ok"] else "NOT OK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the run (default 5)")
    parser.add_argument("--rate", type=float, default=100.0, help="writes per second (default 100)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument(
        "--trace-memory", type=int, default=0, metavar="FRAMES", help="nodes trace allocations"
    )
    parser.add_argument(
        "--dump-minutes", type=float, default=0.0, help="a memory dump per node this often"
    )
    parser.add_argument("--dumps", type=Path, help="copy the nodes' memory dumps here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sevendb-soak-") as tmp:
        data = Path(tmp) / "data"
        result = soak(
            args.minutes, args.rate, data, trace=(args.trace_memory, args.dump_minutes * 60)
        )
        if args.dumps:
            for dump in data.glob("nodes/*/memory/*.txt"):
                node = dump.parent.parent.name
                (args.dumps / node).mkdir(parents=True, exist_ok=True)
                shutil.copy(dump, args.dumps / node / dump.name)
    if args.json:  # first: an hour's result outlives a bug in the printing
        args.json.write_text(json.dumps(result, indent=2))
    report(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
