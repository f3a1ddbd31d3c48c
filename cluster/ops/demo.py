"""The README demo.

Part 1 runs a real local cluster: three node processes replicating four buckets,
a subscriber process tailing a prefix, writes and reads through the CLI, a write
load during which the lease holder of a bucket is killed with `kill -9` (the
stream continues), the subscriber killed and restarted from its cursor (it
resumes), the node restarted, and every replica converging to the same state.

Part 2 drives one bucket's deterministic core in-process — the same code every
replica runs — through the emission lifecycle: rows computed per subscription,
an OUTBOX_WRITE making them durable, the client deduping a resent event, acks
and reconnect decisions - what part 1 did across processes, step by step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    NOT_EXISTS,
    Ack,
    Entry,
    Expected,
    InitProducer,
    Lease,
    Op,
    OpKind,
    OutboxPurge,
    ProducerRef,
    Subscribe,
    Write,
    encode_entry,
)
from sevendb.outbox.model import Applied, OutboxRow, PurgeResult, SubscribeResult, WriteResult
from sevendb.outbox.query import Query, plan_query
from sevendb.outbox.state import BucketStateMachine
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk.cursor import StreamCursor

_NO_STATUS = pb.StatusResponse()


def _event_json(row: OutboxRow) -> str:
    changes = [
        {
            "key": c.key,
            "op": c.op.name,
            "value": c.value.decode(errors="replace"),
            "version": c.version,
        }
        for c in row.delta.changes
    ]
    return json.dumps(
        {"emit_seq": str(row.emit_seq), "prev": str(row.prev_emit_seq), "changes": changes}
    )


def run_demo(data_dir: Path | None = None, out: Callable[[str], None] = print) -> int:
    """Run the three parts, printing each step; returns an exit code."""
    data_dir = data_dir or Path(".sevendb-demo")
    code = run_cluster_demo(data_dir, out)
    out("")
    code = code or run_spark_demo(data_dir, out)
    out("")
    return code or run_core_demo(out)


def run_spark_demo(data_dir: Path, out: Callable[[str], None] = print) -> int:
    """Part 2: Spark reads the drained outbox the cluster archived (every node keeps
    a copy; the jobs deduplicate): the audit checks every subscription's chain, the
    stats count deliveries and commit-to-ack latency."""
    from sevendb.cluster.archive import spark_jobs
    from sevendb.cluster.archive.writer import archive_root

    root = archive_root(data_dir.resolve())
    out(f"== part 2: Spark over the drained outbox archived in {root}")
    out("(starting a local Spark session: ~10 s)")
    sys.stdout.flush()
    spark = spark_jobs.spark_session("local[*]", app_name="sevendb-demo")
    try:
        for job in ("audit", "stats"):
            out(f"$ sevendb spark {job}")
            sys.stdout.flush()
            code = spark_jobs.main([job, str(root), "--progress-s", "30"], spark=spark)
            sys.stdout.flush()
            if code != 0:
                out(f"sevendb spark {job} exited {code}")
                return code
    finally:
        spark.stop()
    return 0


class _Subscriber:
    """`sevendb subscribe` in its own process; its JSON lines are echoed and kept."""

    def __init__(self, data_dir: Path, query: str, out: Callable[[str], None]) -> None:
        self.cursor = data_dir / "demo-subscriber.cursor"
        self.lines: list[dict[str, Any]] = []
        self._out = out
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sevendb.cluster.ops.cli",
                "subscribe",
                query,
                "--data",
                str(data_dir),
                "--cursor",
                str(self.cursor),
            ],
            stdout=subprocess.PIPE,
            stderr=open(data_dir / "demo-subscriber.log", "a"),  # noqa: SIM115 - the child's
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = json.loads(raw)
            self.lines.append(line)
            seq = line["emit_seq"]
            self._out(
                f"  [subscriber pid {self._proc.pid}] {line['key']} {line['op']} "
                f"{line['value']!r} v{line['version']}  emit_seq=(..{seq[0][-4:]}, {seq[1]}, "
                f"{seq[2]})"
            )

    def keys(self) -> set[str]:
        return {line["key"] for line in list(self.lines)}

    def wait_keys(self, keys: set[str], timeout_s: float = 60) -> bool:
        deadline = time.monotonic() + timeout_s
        while not keys <= self.keys():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._reader.join(5)

    def stop(self) -> None:
        self._proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(10)
        if self._proc.poll() is None:
            self.kill()
        self._reader.join(5)


def run_cluster_demo(data_dir: Path, out: Callable[[str], None] = print) -> int:
    """Part 1: a real local cluster through the CLI: a subscriber, a write load, a
    crash of the lease holder, a subscriber killed and resumed from its cursor, the
    node restarted, a node added and a bucket migrated to it under load."""
    import shutil

    from sevendb.cluster.ops.local import cluster_down

    if (data_dir / "client.toml").exists():
        with contextlib.suppress(Exception):
            cluster_down(data_dir)
        shutil.rmtree(data_dir)
    out("== part 1: a local 3-node cluster (data in " + str(data_dir) + ")")
    tour = _ClusterTour(data_dir, out)
    try:
        if tour.run("cluster", "up", "--nodes", "3", "--buckets", "4") != 0:
            return 1
        ok = tour.steps()
        tour.run("status")
        return 0 if ok else 1
    finally:
        out("")
        if tour.subscriber is not None:
            tour.subscriber.stop()
        cluster_down(data_dir)
        out("cluster stopped")


class _ClusterTour:
    """Part 1's steps, each printing what it shows; a step returns False if what it
    shows did not hold."""

    def __init__(self, data_dir: Path, out: Callable[[str], None]) -> None:
        self.data_dir = data_dir
        self.out = out
        self.subscriber: _Subscriber | None = None
        self.written: set[str] = set()

    def run(self, *args: str) -> int:
        from sevendb.cluster.ops.cli import main as cli

        self.out("$ sevendb " + " ".join(args))
        sys.stdout.flush()
        return cli([*args, "--data", str(self.data_dir)])

    @functools.cached_property
    def tls(self) -> Any:
        """The cluster's client TLS settings (read once, when the cluster is up)."""
        from sevendb.cluster.ops.local import local_tls

        return local_tls(self.data_dir)

    def node_status(self, address: str, *, digests: bool = False) -> Any:
        from sevendb.cluster.ops.local import node_status

        return node_status(address, self.tls, digests=digests)

    def steps(self) -> bool:
        from sevendb.cluster.ops.local import local_spec, local_token
        from sevendb.sdk import Client

        spec = local_spec(self.data_dir)
        self.subscribe()
        endpoints = [n.grpc_address for n in spec.nodes]
        with Client(endpoints, token=local_token(self.data_dir), tls=self.tls) as client:
            self.first_writes()
            bucket = spec.bucket_for_key("orders/1").bucket
            holder = _holder(spec, bucket, self.node_status)
            return (
                self.kill_the_holder(client, spec, bucket, holder)
                and self.kill_the_subscriber(client)
                and self.restart(spec, holder)
                and self.migrate(client, bucket)
            )

    def subscribe(self) -> None:
        cursor = self.data_dir / "demo-subscriber.cursor"
        self.out("\n== a subscriber tails prefix:orders/ in its own process (every bucket)")
        self.out(f"$ sevendb subscribe prefix:orders/ --cursor {cursor} &")
        self.subscriber = _Subscriber(self.data_dir, "prefix:orders/", self.out)
        # The CLI saves its cursor file once every bucket's stream is up.
        _wait(self.subscriber.cursor.exists, 30)
        time.sleep(0.5)

    def first_writes(self) -> None:
        for i in range(1, 4):
            self.run("write", f"orders/{i}", "new")
        self.run("write", "orders/1", "paid", "--expect-version", "1")
        self.out("(a write with a stale expected version is refused and changes nothing:)")
        self.run("write", "orders/1", "lost", "--expect-version", "1")
        self.run("get", "orders/1")
        self.written |= {"orders/1", "orders/2", "orders/3"}

    def kill_the_holder(self, client: Any, spec: Any, bucket: int, holder: str) -> bool:
        from sevendb.cluster.ops.local import running_pid

        assert self.subscriber is not None
        pid = running_pid(self.data_dir, holder)
        assert pid is not None
        self.out(
            f"\n== a write load; meanwhile kill -9 {holder} (pid {pid}), the notifier lease "
            f"holder (and Raft leader) of bucket {bucket}"
        )
        load = threading.Thread(
            target=_write_load, args=(client, range(10, 40), self.written), daemon=True
        )
        load.start()
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        load.join(60)
        ok = self.subscriber.wait_keys(self.written)
        self.out(
            f"the stream continued: the subscriber has {len(self.subscriber.keys())} of "
            f"{len(self.written)} written keys, "
            + ("none missing" if ok else "SOME MISSING")
            + f"; new holder of bucket {bucket}: {_holder(spec, bucket, self.node_status)}"
        )
        return ok

    def kill_the_subscriber(self, client: Any) -> bool:
        assert self.subscriber is not None
        self.out("\n== kill -9 the subscriber; writes go on; restart it with its cursor")
        time.sleep(0.3)  # its cursor is saved within 20 ms of printing
        self.subscriber.kill()
        before = self.subscriber.keys()
        _write_load(client, range(40, 45), self.written)
        self.subscriber = _Subscriber(self.data_dir, "prefix:orders/", self.out)
        ok = self.subscriber.wait_keys({f"orders/{i}" for i in range(40, 45)})
        repeated = len(before & self.subscriber.keys())
        self.out(
            f"it reconnected and resumed after its cursor: {len(self.subscriber.lines)} new "
            f"events, {'nothing' if ok else 'SOMETHING'} missing, {repeated} repeated "
            "(only events printed after the last cursor save can repeat)"
        )
        return ok

    def restart(self, spec: Any, holder: str) -> bool:
        self.out(f"\n== restart {holder}: it catches up from its journal and the leader")
        self.run("cluster", "up")
        _wait_converged(spec, self.node_status, self.out)
        return True

    def migrate(self, client: Any, bucket: int) -> bool:
        from sevendb.cluster.ops.local import local_spec

        assert self.subscriber is not None
        self.out(f"\n== add a node, and migrate bucket {bucket} to it under the write load")
        self.run("node", "add")
        spec = local_spec(self.data_dir)
        leader = _leader(spec, bucket, self.node_status)
        keep = [n for n in spec.buckets[bucket].nodes if n != leader][:2]
        target = ",".join([spec.nodes[-1].node_id, *keep])
        during: set[str] = set()
        load = threading.Thread(
            target=_write_load, args=(client, range(50, 90), during), daemon=True
        )
        load.start()
        if self.run("bucket", "migrate", str(bucket), "--to", target) != 0:
            return False
        load.join(60)
        after = [
            k
            for k in (f"orders/{i}" for i in range(100, 400))
            if spec.bucket_for_key(k).bucket == bucket
        ][:5]
        for key in after:  # in the new epoch
            client.put(key, b"new")
        ok = self.subscriber.wait_keys(during | set(after))
        missing = sorted((during | set(after)) - self.subscriber.keys())
        epochs = sorted(
            {line["emit_seq"][1] for line in self.subscriber.lines if line["bucket"] == bucket}
        )
        self.out(
            f"the subscriber kept printing: {'nothing' if ok else missing} missing; "
            f"bucket {bucket}'s events went from epoch {epochs[0]} to epoch {epochs[-1]}, "
            "emit_seq still increasing"
        )
        return ok


def _wait(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _holder(spec: Any, bucket: int, node_status: Callable[[str], Any]) -> str:
    """The node emitting for `bucket` (waits for one)."""
    return _node_where(spec, bucket, node_status, "emitting")


def _leader(spec: Any, bucket: int, node_status: Callable[[str], Any]) -> str:
    """The node leading `bucket`'s group (waits for one: an election may be under way)."""
    return _node_where(spec, bucket, node_status, "is_leader")


def _node_where(spec: Any, bucket: int, node_status: Callable[[str], Any], flag: str) -> str:
    """The first node whose replica of `bucket` has `flag` set, waiting up to 30 s;
    "none" when none has."""
    found: list[str] = []

    def find() -> bool:
        for n in spec.nodes:
            status = node_status(n.grpc_address)
            if status is not None and any(
                r.bucket == bucket and getattr(r, flag) for r in status.replicas
            ):
                found.append(n.node_id)
                return True
        return False

    _wait(find, 30)
    return found[0] if found else "none"


def _write_load(client: Any, numbers: range, written: set[str]) -> None:
    producer = client.producer()
    for i in numbers:
        producer.put(f"orders/{i}", b"new")
        written.add(f"orders/{i}")
        time.sleep(0.01)


def _wait_converged(
    spec: object, node_status: Callable[..., Any], out: Callable[[str], None], timeout_s: float = 60
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views: dict[int, set[tuple[int, str]]] = {}
        for node in spec.nodes:  # type: ignore[attr-defined]
            status = node_status(node.grpc_address, digests=True)
            for r in (status or _NO_STATUS).replicas:
                views.setdefault(r.bucket, set()).add((r.applied_index, r.digest))
        if views and all(len(v) == 1 for v in views.values()):
            out("every replica of every bucket has the same applied index and state digest")
            return
        time.sleep(0.2)
    out("replicas did not converge in time")


def run_core_demo(out: Callable[[str], None] = print) -> int:
    """Part 3: the emission lifecycle on one bucket's core, in-process. (Longer than
    our 80 lines on purpose: a linear script, read top to bottom beside what it
    prints; split, its steps would pass half a dozen values between them.)"""
    sm = BucketStateMachine("bucket-demo")
    replica = BucketStateMachine("bucket-demo")  # a second replica applying the same log
    log_index = 0
    clock_ms = 1_700_000_000_000

    def commit(entry: Entry) -> Applied:
        nonlocal log_index, clock_ms
        log_index += 1
        clock_ms += 5
        data = encode_entry(entry)
        replica.apply(log_index, data)
        return sm.apply(log_index, data)

    out("== part 3: the emission lifecycle on one bucket's core (two replicas, one log)")
    commit(Lease("node-1"))
    query = Query.parse("prefix:orders/")
    sub = commit(Subscribe("sub-1", "alice", query, plan_query(query).plan_hash, clock_ms))
    assert isinstance(sub.result, SubscribeResult)
    out(f"subscribed sub-1 to {query}; its stream starts at {sub.result.start}")
    commit(InitProducer(42))
    for i, (key, value) in enumerate(
        [("orders/1", b"new"), ("users/9", b"bob"), ("orders/2", b"new"), ("orders/1", b"paid")]
    ):
        result = commit(Write((Op(OpKind.SET, key, value),), ProducerRef(42, 0, i))).result
        assert isinstance(result, WriteResult)
        out(f"write {key}={value.decode()} committed at {result.commit}")
    retry = commit(Write((Op(OpKind.SET, "orders/1", b"paid"),), ProducerRef(42, 0, 3))).result
    assert isinstance(retry, WriteResult)
    out(f"producer retry of sequence 3: duplicate={retry.duplicate}, original {retry.commit}")
    stale = commit(Write((Op(OpKind.SET, "orders/2", b"x", Expected.exact(7)),))).result
    assert isinstance(stale, WriteResult) and stale.error is not None
    out(f"write with a stale expected version: {stale.error.code}: {stale.error.message}")
    created = commit(Write((Op(OpKind.SET, "orders/3", b"new", NOT_EXISTS),))).result
    assert isinstance(created, WriteResult)
    out(f"create-if-absent orders/3 committed at {created.commit}")

    out("\n== the lease holder outboxes the computed rows, then streams them")
    proposal = sm.propose_outbox_write(sm.lease_index, clock_ms)
    assert proposal is not None
    out(
        f"OUTBOX_WRITE {proposal.row_count} rows for ({proposal.from_index}, "
        f"{proposal.through_index}], digest {proposal.digest:#x}"
    )
    commit(proposal)
    rows = sm.subs.outbox_rows("sub-1")
    start = sm.subs.get("sub-1").start  # type: ignore[union-attr]
    cursor: StreamCursor[OutboxRow] = StreamCursor(start)
    delivered: list[OutboxRow] = []
    # The network resends the first event (at-least-once); the SDK dedupes it.
    for row in (rows[0], rows[0], *rows[1:]):
        offered = cursor.offer(row)
        if offered.duplicate:
            out(f"  (duplicate of {row.emit_seq} dropped by the client)")
        for event in offered.ready:
            delivered.append(event)
            out("  event " + _event_json(event))

    out("\n== the client acks what it processed; the purge is replicated")
    ack = Ack("sub-1", "alice", delivered[1].emit_seq)
    purge = commit(OutboxPurge(sm.lease_index, (ack,), now_ms=clock_ms))
    assert isinstance(purge.result, PurgeResult)
    out(
        f"ack through {ack.up_to}: {purge.result.acks[0].status}, "
        f"{purge.result.purged_rows} rows purged, {sm.subs.outbox_size()} left"
    )
    bad = commit(OutboxPurge(sm.lease_index, (Ack("sub-1", "mallory", delivered[-1].emit_seq),)))
    assert isinstance(bad.result, PurgeResult)
    out(f"ack by another principal: {bad.result.acks[0].status}: {bad.result.acks[0].message}")

    out("\n== reconnect decisions (docs/contract.md §5.2)")
    for label, seq in [
        ("after the ack", delivered[1].emit_seq),
        ("from before the ack", delivered[0].emit_seq),
        ("from the future", EmitSeq("bucket-demo", 1, 10_000)),
    ]:
        decision = sm.decide_reconnect("sub-1", "alice", seq)
        out(f"  {label} {seq}: {decision.status.name}, resend {len(decision.resume)} event(s)")
    out(f"  unknown subscription: {sm.decide_reconnect('nope', 'alice', start).status.name}")

    out("\n== determinism: both replicas hold byte-identical state")
    out(f"  replica A digest {sm.digest()}\n  replica B digest {replica.digest()}")
    if sm.digest() != replica.digest():
        out("replicas diverged")
        return 1
    return 0
