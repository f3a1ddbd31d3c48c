"""The README demo.

Part 1 runs a real local cluster: three node processes replicating four buckets,
writes and reads through the CLI, `kill -9` of a bucket leader while writes go
on, a restart, and every replica converging to the same state.

Part 2 drives one bucket's deterministic core in-process — the same code every
replica runs — through the emission lifecycle: rows computed per subscription,
an OUTBOX_WRITE making them durable, the client deduping a resent event, acks
and reconnect decisions. (The emission issue moves this onto the cluster.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

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
    """Run both parts, printing each step; returns an exit code."""
    code = run_cluster_demo(data_dir or Path(".sevendb-demo"), out)
    out("")
    return code or run_core_demo(out)


def run_cluster_demo(data_dir: Path, out: Callable[[str], None] = print) -> int:
    """Part 1: a real local cluster through the CLI, with a crash."""
    import shutil

    from sevendb.cluster.cli import main as cli
    from sevendb.cluster.local import cluster_down, running_pid
    from sevendb.cluster.topology import ClusterSpec

    def run(*args: str) -> int:
        out("$ sevendb " + " ".join(args))
        sys.stdout.flush()
        return cli([*args, "--data", str(data_dir)])

    if (data_dir / "cluster.json").exists():
        with contextlib.suppress(Exception):
            cluster_down(data_dir)
        shutil.rmtree(data_dir)
    out("== part 1: a local 3-node cluster (data in " + str(data_dir) + ")")
    try:
        if run("cluster", "up", "--nodes", "3", "--buckets", "4") != 0:
            return 1
        for i in range(1, 6):
            run("write", f"orders/{i}", "new")
        run("write", "orders/1", "paid", "--expect-version", "1")
        out("(a write with a stale expected version is refused and changes nothing:)")
        run("write", "orders/1", "lost", "--expect-version", "1")
        run("get", "orders/1")
        run("status")
        spec = ClusterSpec.load(data_dir)
        bucket = spec.bucket_for_key("orders/1").bucket
        from sevendb.cluster.local import node_status

        leader = next(
            n.node_id
            for n in spec.nodes
            if any(
                r.bucket == bucket and r.is_leader
                for r in (node_status(n.grpc_address) or _NO_STATUS).replicas
            )
        )
        pid = running_pid(data_dir, leader)
        assert pid is not None
        out(f"\n== kill -9 {leader} (pid {pid}), the leader of bucket {bucket}; writes go on")
        os.kill(pid, signal.SIGKILL)
        for i in range(6, 9):
            run("write", f"orders/{i}", "new")
        run("get", "orders/1")
        out(f"\n== restart {leader}: it catches up from its journal and the leader")
        run("cluster", "up")
        _wait_converged(spec, out)
        run("status")
    finally:
        out("")
        cluster_down(data_dir)
        out("cluster stopped")
    return 0


def _wait_converged(spec: object, out: Callable[[str], None], timeout_s: float = 60) -> None:
    from sevendb.cluster.local import node_status

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views: dict[int, set[tuple[int, str]]] = {}
        for node in spec.nodes:  # type: ignore[attr-defined]
            status = node_status(node.grpc_address)
            for r in (status or _NO_STATUS).replicas:
                views.setdefault(r.bucket, set()).add((r.applied_index, r.digest))
        if views and all(len(v) == 1 for v in views.values()):
            out("every replica of every bucket has the same applied index and state digest")
            return
        time.sleep(0.2)
    out("replicas did not converge in time")


def run_core_demo(out: Callable[[str], None] = print) -> int:
    """Part 2: the emission lifecycle on one bucket's core, in-process."""
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

    out("== part 2: the emission lifecycle on one bucket's core (two replicas, one log)")
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
    rows = sm.outbox_rows("sub-1")
    start = sm.subscription("sub-1").start  # type: ignore[union-attr]
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
        f"{purge.result.purged_rows} rows purged, {sm.outbox_size()} left"
    )
    bad = commit(OutboxPurge(sm.lease_index, (Ack("sub-1", "mallory", delivered[-1].emit_seq),)))
    assert isinstance(bad.result, PurgeResult)
    out(f"ack by another principal: {bad.result.acks[0].status}: {bad.result.acks[0].message}")

    out("\n== reconnect decisions (seed 000 §5.2)")
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
