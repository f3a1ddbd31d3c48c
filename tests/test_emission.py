"""Emission end to end against real processes (docs/contract.md §12): every committed write
reaches each subscriber exactly once, in order, through kill -9 of the lease holder
(FTO-01), a crash between OUTBOX_WRITE and send (FTO-02), reconnects (REC-01),
compaction and stalls (REC-02), a killed and restarted client process, and another
principal trying to take over. Each test checks the full delivered sequence against
the committed writes."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.cluster.common.auth import mint_token
from sevendb.cluster.common.layout import node_dir
from sevendb.cluster.server.faults import KILL_BEFORE_SEND, fault_file
from sevendb.outbox.emitseq import EmitSeq
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk import (
    BrokenReason,
    Client,
    Event,
    Recovery,
    StreamReset,
    SubscribeOptions,
    Subscription,
    SubscriptionBroken,
    Unauthenticated,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    monkeypatch.setenv("SEVENDB_TEST_FAULTS", "1")
    c = LocalCluster.start(tmp_path / "data", buckets=2)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def patient_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    """A cluster whose leaders keep leading for 30 s without hearing a majority (3 s by
    default): for tests that freeze a leader's peers and then talk to the leader."""
    monkeypatch.setenv("SEVENDB_RAFT_LEADER_FALLBACK_S", "30")
    c = LocalCluster.start(tmp_path / "data", buckets=2)
    try:
        yield c
    finally:
        c.stop()


# ---- helpers ---------------------------------------------------------------------------


class Collector:
    """Iterates a subscription in a thread, recording every event it is given."""

    def __init__(self, sub: Subscription) -> None:
        self.sub = sub
        self.events: list[Event] = []
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                event = self.sub.poll(0.05)
                if event is not None:
                    self.events.append(event)
        except BaseException as exc:
            self.error = exc

    def keys(self) -> set[str]:
        return {c.key for e in list(self.events) for c in e.changes}

    def wait_keys(self, keys: set[str], timeout_s: float = 60) -> None:
        wait_for(
            lambda: keys <= self.keys() or self.error is not None,
            timeout_s,
            f"{len(keys - self.keys())} of {len(keys)} events",
        )
        assert self.error is None, self.error

    def stop(self, close: bool = True) -> None:
        self._stop.set()
        self._thread.join(10)
        if close:
            self.sub.close()


class Writer:
    """Writes unique keys with an idempotent producer (a retry never commits twice)."""

    def __init__(self, client: Client, prefix: str) -> None:
        self.producer = client.producer()
        self.prefix = prefix
        self.attempted: list[str] = []

    def write(self, count: int, pause_s: float = 0.0) -> None:
        start = len(self.attempted)
        for i in range(start, start + count):
            key = f"{self.prefix}{i:05d}"
            self.attempted.append(key)
            self.producer.put(key, f"v{i}".encode())
            if pause_s:
                time.sleep(pause_s)


def committed(client: Client, keys: list[str]) -> dict[str, int]:
    """Ground truth: the commit index each write landed at (every key written once),
    read with paged Syncs of every bucket."""
    wanted = set(keys)
    out = {}
    for bucket in range(client.layout(refresh=True).buckets):
        for record in client.sync_bucket(bucket):
            if record.key in wanted:
                assert record.version == 1, f"{record.key} committed twice"
                out[record.key] = record.mod_commit_index
    return out


def check_delivery(
    events: list[Event], truth: dict[str, int], layout_buckets: int, *, prefix: str
) -> None:
    """Per bucket: strictly increasing emit_seq, an unbroken prev chain, and exactly
    the committed writes (key at the commit index it committed at) - no gap, no
    duplicate, no reorder, nothing uncommitted."""
    from sevendb.outbox.keys import bucket_of

    by_bucket: dict[int, list[Event]] = {}
    for event in events:
        by_bucket.setdefault(event.bucket, []).append(event)
    delivered: dict[str, int] = {}
    for bucket, stream in by_bucket.items():
        for before, after in itertools.pairwise(stream):
            assert after.emit_seq > before.emit_seq, f"bucket {bucket}: reorder or duplicate"
            assert after.prev_emit_seq == before.emit_seq, f"bucket {bucket}: broken chain"
        for event in stream:
            for change in event.changes:
                assert change.key.startswith(prefix)
                assert bucket_of(change.key, layout_buckets) == bucket
                assert change.key not in delivered, f"{change.key} delivered twice"
                delivered[change.key] = event.emit_seq.commit_index
    assert delivered == truth


def stub(cluster: LocalCluster, node_index: int = 0) -> pb_grpc.SevenDBStub:
    address = cluster.spec.nodes[node_index].grpc_address
    return cluster.stub(address)


def auth(cluster: LocalCluster, principal: str = "default") -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {cluster.token(principal)}"),)


# ---- the happy path and the contract's scenarios ----------------------------------------


def test_every_committed_write_reaches_a_prefix_subscriber_once_in_order(
    cluster: LocalCluster,
) -> None:
    with cluster.client() as client:
        collector = Collector(client.subscribe("prefix:p/"))
        writer = Writer(client, "p/")
        writer.write(60)
        client.put("other/1", b"not matched")
        collector.wait_keys(set(writer.attempted))
        collector.stop()
        check_delivery(collector.events, committed(client, writer.attempted), 2, prefix="p/")
        assert {e.bucket for e in collector.events} == {0, 1}  # merged across buckets


def test_fto01_kill9_of_the_lease_holder_mid_stream(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        collector = Collector(client.subscribe("prefix:f/"))
        writer = Writer(client, "f/")
        writer.write(40)
        victim = cluster.holder_node(0)
        done = threading.Thread(target=writer.write, args=(120, 0.002))
        done.start()
        time.sleep(0.1)
        cluster.kill9(victim)
        done.join(60)
        collector.wait_keys(set(writer.attempted))
        new_holder = cluster.holder_node(0)
        assert new_holder != victim
        collector.stop()
        check_delivery(collector.events, committed(client, writer.attempted), 2, prefix="f/")
        assert collector.sub.stats().reconnects >= 1


def test_fto02_crash_after_outbox_write_before_send(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        collector = Collector(client.subscribe("prefix:g/"))
        writer = Writer(client, "g/")
        writer.write(20)
        collector.wait_keys(set(writer.attempted))
        victim = cluster.holder_node(0)
        # Armed: the holder dies when it next has outboxed rows ready to send.
        fault_file(node_dir(cluster.data_dir, victim), KILL_BEFORE_SEND).touch()
        writer.write(40)
        wait_for(lambda: cluster.status(victim) is None, 30, f"{victim} to die at the fault point")
        collector.wait_keys(set(writer.attempted))
        collector.stop()
        # The rows that holder outboxed but never sent were sent by its successor.
        check_delivery(collector.events, committed(client, writer.attempted), 2, prefix="g/")
        cluster.restart()  # the fault file is gone: it comes back normally
        cluster.wait_converged()


def test_rec01_reconnect_resumes_exactly_after_the_cursor(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # No duplicate at all is only right while the lease stays put: a stream that moves
    # to a new holder may resend events its client already had (the cursor drops them,
    # counted). A fresh cluster hands leadership over ~2 s after start (seen mid-test).
    cluster.wait_settled()
    cursor = tmp_path / "r.cursor"
    with cluster.client() as client:
        writer = Writer(client, "r/")
        first = Collector(client.subscribe("prefix:r/", cursor=cursor))
        writer.write(30)
        first.wait_keys(set(writer.attempted))
        first.stop()  # persists and acks everything processed
        writer.write(30)  # written while nobody listens
        second = Collector(client.subscribe("prefix:r/", cursor=cursor))
        writer.write(10)
        second.wait_keys(set(writer.attempted[30:]))
        second.stop()
        assert second.sub.stats().duplicates_dropped == 0
        truth = committed(client, writer.attempted)
        check_delivery(first.events + second.events, truth, 2, prefix="r/")
        # The second run started exactly where the first stopped.
        assert not set(first.keys()) & set(second.keys())


def test_rec01_reconnect_is_catch_up_then_live(cluster: LocalCluster) -> None:
    """Raw protocol: ReconnectAck OK, the retained events, CaughtUp, then live events
    only - never a live event before CaughtUp."""
    cluster.wait_settled()  # no lease move while the raw stream is read
    md = auth(cluster)
    holder = cluster.spec.node(cluster.holder_node(0)).grpc_address
    s = cluster.stub(holder)
    query = pb.Query(kind=pb.Query.PREFIX, arg="c/")
    stream = s.Subscribe(pb.SubscribeRequest(bucket=0, query=query, sub_id="raw-1"), metadata=md)
    start = next(stream).sub_ack.start_emit_seq
    stream.cancel()
    with cluster.client() as client:
        keys = [k for k in (f"c/{i}" for i in range(400)) if client.layout().bucket_of(k) == 0]
        backlog = {k: client.put(k, b"old").committed for k in keys[:10]}
        again = s.Reconnect(
            pb.ReconnectRequest(sub_id="raw-1", last_processed_emit_seq=start), metadata=md
        )
        ack = next(again).reconnect_ack
        assert ack.status == pb.ReconnectAck.OK
        assert ack.next_commit_index == start.commit_index + 1
        live = {k: client.put(k, b"new").committed for k in keys[10:15]}
        seen: list[tuple[str, str]] = []
        for message in again:
            kind = message.WhichOneof("kind")
            if kind == "caught_up":
                seen.append(("caught_up", ""))
            elif kind == "events":
                seen.extend(
                    ("event", c.key) for e in message.events.events for c in e.delta.changes
                )
            if sum(1 for k, _ in seen if k == "event") == 15:
                break
        again.cancel()
    marker = seen.index(("caught_up", ""))
    assert [k for _, k in seen[:marker]] == list(backlog)
    assert [k for _, k in seen[marker + 1 :]] == list(live)


def test_rec02_a_stalled_subscriber_gets_stale_sequence_after_compaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SEVENDB_RAFT_STALL_WINDOW_MS", "1500")
    monkeypatch.setenv("SEVENDB_RAFT_COMPACTION_MIN_ENTRIES", "40")
    monkeypatch.setenv("SEVENDB_RAFT_COMPACTION_MIN_TIME_S", "0.5")
    monkeypatch.setenv("SEVENDB_RAFT_COMPACTION_RECHECK_S", "0.2")
    cluster = LocalCluster.start(tmp_path / "data", buckets=1)
    try:
        with cluster.client() as client:
            writer = Writer(client, "s/")
            stale = Collector(
                client.subscribe("prefix:s/", options=SubscribeOptions(on_stale=Recovery.RAISE))
            )
            writer.write(10)
            stale.wait_keys(set(writer.attempted))
            stale.stop(close=False)  # the process "hangs": no more acks, stream open
            resets: list[StreamReset] = []
            fresh = Collector(
                client.subscribe(
                    "prefix:s/",
                    name="second",
                    options=SubscribeOptions(on_reset=resets.append),
                )
            )
            writer.write(100, pause_s=0.01)  # outlives the stall window; compacts the log
            holder = cluster.holder_node(0)

            def compacted() -> bool:
                status = cluster.status(holder)
                assert status is not None
                r = status.replicas[0]
                return r.log_len < r.commit_index - 40

            wait_for(compacted, 30, "log compaction past the stalled subscriber")

            def expired() -> bool:
                status = cluster.status(holder)
                assert status is not None
                return status.replicas[0].subscriptions == 1  # "fresh" alone

            # Compaction passes a subscription as soon as it is idle; the holder's next
            # housekeeping expires it. Polling before that would process (and so ack)
            # the events it holds: the subscription would be active again, then quiet
            # and attached, which keep-alives hold for ever (docs/emission.md).
            wait_for(expired, 30, "the stalled subscription to expire")
            # The stalled stream comes back: its subscription was dropped once its stall
            # window passed (compaction itself keeps a live subscription's rows: they
            # are state, docs/contract.md §8). Through the SDK: with on_stale=RAISE the
            # application hears it ...
            [sub_id] = stale.sub.sub_ids.values()
            deadline = time.monotonic() + 30
            with pytest.raises(SubscriptionBroken, match="STALE_SEQUENCE") as broken:
                while time.monotonic() < deadline:
                    stale.sub.poll(1.0)
            assert broken.value.reason is BrokenReason.STALE_SEQUENCE
            # ... and so does any client reconnecting from that position.

            def reconnect_status() -> int | None:
                holder_index = cluster.spec.node_ids.index(cluster.holder_node(0))
                call = stub(cluster, holder_index).Reconnect(
                    pb.ReconnectRequest(
                        sub_id=sub_id,
                        last_processed_emit_seq=codec.seq_to_pb(stale.events[-1].emit_seq),
                    ),
                    metadata=auth(cluster),
                )
                status = next(call).reconnect_ack.status
                call.cancel()
                return status if status == pb.ReconnectAck.STALE_SEQUENCE else None

            wait_for(reconnect_status, 30, "STALE_SEQUENCE once the stall window passed", 0.3)
            fresh.wait_keys(set(writer.attempted[10:]))
            fresh.stop()
            assert resets == []  # the healthy subscriber never had to reset
            check_delivery(
                fresh.events,
                {k: v for k, v in committed(client, writer.attempted).items() if k >= "s/00010"},
                1,
                prefix="s/",
            )
    finally:
        cluster.stop()


def test_a_killed_client_process_resumes_from_its_cursor(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.wait_settled()  # a fresh cluster hands leadership over ~2 s after start
    cursor, out1, out2 = tmp_path / "c.cursor", tmp_path / "run1.jsonl", tmp_path / "run2.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "sevendb.cluster.ops.cli",
        "subscribe",
        "prefix:k/",
        "--data",
        str(cluster.data_dir),
        "--cursor",
        str(cursor),
    ]
    with cluster.client() as client:
        writer = Writer(client, "k/")
        with open(out1, "w") as f:
            first = subprocess.Popen(cmd, stdout=f, stderr=subprocess.DEVNULL)
        buckets = client.layout().buckets

        def subscribed() -> bool:
            """The cursor file names each bucket's subscription before the server
            hears of it, and its start once subscribed: writes before that are not
            the subscription's (a run in CI wrote two of them in between)."""
            if not cursor.exists():
                return False
            cursors = json.loads(cursor.read_text())["cursors"]
            return len(cursors) == buckets and all(c["position"] for c in cursors)

        wait_for(subscribed, 30, "the subscriber to be subscribed in every bucket")
        writer.write(50, pause_s=0.002)
        wait_for(lambda: out1.read_text().count("\n") >= 20, 30, "some events printed")
        os.kill(first.pid, signal.SIGKILL)  # mid-stream
        first.wait()
        saved = {c["bucket"]: c["position"] for c in json.loads(cursor.read_text())["cursors"]}
        writer.write(30)
        with open(out2, "w") as f:
            second = subprocess.Popen([*cmd, "--idle-exit", "3"], stdout=f, stderr=subprocess.PIPE)
        _, err = second.communicate(timeout=90)
        assert second.returncode == 0, err
        truth = committed(client, writer.attempted)
    run1 = [json.loads(line) for line in out1.read_text().splitlines()]
    run2 = [json.loads(line) for line in out2.read_text().splitlines()]
    # The restart resumed exactly after each bucket's saved cursor ...
    for bucket, position in saved.items():
        firsts = [r for r in run2 if r["bucket"] == bucket]
        if firsts:
            assert firsts[0]["prev_emit_seq"] == position
    # ... so it repeats only what run 1 printed after its last cursor save, and
    # together (deduplicated by emit_seq, as the contract asks of an application)
    # the two runs hold every committed write exactly once.
    saved_index = {b: p[2] for b, p in saved.items()}
    repeats = {r["key"] for r in run1} & {r["key"] for r in run2}
    assert all(
        r["emit_seq"][2] > saved_index.get(r["bucket"], 0) for r in run1 if r["key"] in repeats
    )
    merged = {r["key"]: r["emit_seq"][2] for r in run1 + run2}
    assert merged == truth


def test_another_principal_cannot_reconnect_ack_or_unsubscribe(cluster: LocalCluster) -> None:
    cluster.grant_all("alice")
    with cluster.client(principal="alice") as alice:
        collector = Collector(alice.subscribe("key:secret"))
        alice.put("secret", b"1")
        collector.wait_keys({"secret"})
        [(bucket, sub_id)] = collector.sub.sub_ids.items()
        position = collector.events[-1].emit_seq
        holder = cluster.spec.node(cluster.holder_node(bucket)).grpc_address
        s = cluster.stub(holder)
        bob = auth(cluster, "bob")
        seq = codec.seq_to_pb(position)
        with pytest.raises(grpc.RpcError) as denied:
            next(
                s.Reconnect(
                    pb.ReconnectRequest(sub_id=sub_id, last_processed_emit_seq=seq), metadata=bob
                )
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        result = s.Ack(
            pb.AckBatch(acks=[pb.ClientAck(sub_id=sub_id, up_to_emit_seq=seq)]), metadata=bob
        ).results[0]
        assert result.status == pb.AckResult.NOT_OWNER
        with pytest.raises(grpc.RpcError) as refused:
            s.Unsubscribe(pb.UnsubscribeRequest(sub_id=sub_id, bucket=bucket), metadata=bob)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # No token, or a forged one: refused before anything happens.
        with pytest.raises(grpc.RpcError) as anonymous:
            s.Ack(pb.AckBatch(acks=[pb.ClientAck(sub_id=sub_id, up_to_emit_seq=seq)]))
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        forged_token = mint_token(
            "not-the-secret", "alice", now_ms=time.time_ns() // 10**6, ttl_s=60
        )
        forged = (("authorization", f"Bearer {forged_token}"),)
        with pytest.raises(grpc.RpcError) as bad:
            s.Ack(
                pb.AckBatch(acks=[pb.ClientAck(sub_id=sub_id, up_to_emit_seq=seq)]),
                metadata=forged,
            )
        assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with (
            Client([holder], token="alice.forged", tls=cluster.tls) as mallory,
            pytest.raises(Unauthenticated),
        ):
            mallory.put("x", b"1")
        # Alice's subscription is untouched and still streams.
        alice.put("secret", b"2")
        wait_for(lambda: len(collector.events) == 2, 30, "alice's next event")
        collector.stop()
        assert [e.changes[0].value for e in collector.events] == [b"1", b"2"]


def test_bad_acks_are_rejected_and_change_nothing(cluster: LocalCluster, tmp_path: Path) -> None:
    # No lease move between reading the holder and the acks (in CI a preferred node's
    # lease came back after the earlier kill tests, and an ack answered NOT_HOLDER).
    cluster.wait_settled()
    with cluster.client() as client:
        # With a cursor, closing keeps the subscription on the server (to ack it below).
        collector = Collector(client.subscribe("key:acked", cursor=tmp_path / "c.cursor"))
        for i in range(3):
            client.put("acked", f"{i}".encode())
        collector.wait_keys({"acked"})
        wait_for(lambda: len(collector.events) == 3, 30, "three events")
        collector.stop()  # acks through the third event
        [(bucket, sub_id)] = collector.sub.sub_ids.items()
        holder = cluster.spec.node(cluster.holder_node(bucket)).grpc_address
        s = cluster.stub(holder)
        md = auth(cluster)

        def ack(seq: EmitSeq, sub: str = sub_id) -> pb.AckResult:
            up_to = codec.seq_to_pb(seq)
            request = pb.AckBatch(acks=[pb.ClientAck(sub_id=sub, up_to_emit_seq=up_to)])
            return s.Ack(request, metadata=md).results[0]

        first, last = collector.events[0].emit_seq, collector.events[-1].emit_seq

        def purged() -> bool:
            status = cluster.status(cluster.holder_node(bucket))
            assert status is not None
            return next(r for r in status.replicas if r.bucket == bucket).outbox_rows == 0

        wait_for(purged, 30, "the final ack to be purged")
        assert ack(last).status == pb.AckResult.DUPLICATE
        assert ack(first).status == pb.AckResult.REGRESSIVE
        future = EmitSeq(last.bucket_uuid, last.epoch_counter, last.commit_index + 1000)
        assert ack(future).status == pb.AckResult.FUTURE
        assert ack(last, "no-such-sub").status == pb.AckResult.SUBSCRIPTION_NOT_FOUND
        # The same in one batch, with an ack missing its position and one of no bucket:
        # each is answered in its place, as when alone.
        elsewhere = EmitSeq("no-such-bucket", 1, 1)
        acks = [
            pb.ClientAck(sub_id=sub, up_to_emit_seq=codec.seq_to_pb(seq))
            for sub, seq in [
                (sub_id, last),
                (sub_id, first),
                (sub_id, future),
                ("no-such-sub", last),
                (sub_id, elsewhere),
            ]
        ]
        acks.insert(3, pb.ClientAck(sub_id=sub_id))
        results = s.Ack(pb.AckBatch(acks=acks), metadata=md).results
        assert [(r.sub_id, r.status) for r in results] == [
            (sub_id, pb.AckResult.DUPLICATE),
            (sub_id, pb.AckResult.REGRESSIVE),
            (sub_id, pb.AckResult.FUTURE),
            (sub_id, pb.AckResult.SUBSCRIPTION_NOT_FOUND),
            ("no-such-sub", pb.AckResult.SUBSCRIPTION_NOT_FOUND),
            (sub_id, pb.AckResult.FUTURE),
        ]
        assert purged()  # and still nothing changed
        with pytest.raises(grpc.RpcError) as bad_query:
            next(
                s.Subscribe(
                    pb.SubscribeRequest(bucket=99, query=pb.Query(kind=pb.Query.ALL)),
                    metadata=md,
                )
            )
        assert bad_query.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _outbox_rows(cluster: LocalCluster, node_id: str, bucket: int) -> int:
    status = cluster.status(node_id)
    assert status is not None, f"{node_id} is not answering"
    return next(r for r in status.replicas if r.bucket == bucket).outbox_rows


def _peers(cluster: LocalCluster, node_id: str) -> list[str]:
    return [n.node_id for n in cluster.spec.nodes if n.node_id != node_id]


# Acks only when the subscription closes: nothing else purges its rows.
_CLOSE_ACKS_ONLY = SubscribeOptions(ack_every_events=1_000_000, ack_interval_s=3600)


def _unacked_events(
    cluster: LocalCluster, client: Client, key: str, count: int
) -> tuple[Collector, int, str]:
    """`count` writes of `key` delivered and not acked: (collector, bucket, holder)."""
    cluster.wait_settled()  # no lease move between reading the holder and the test's end
    collector = Collector(client.subscribe(f"key:{key}", options=_CLOSE_ACKS_ONLY))
    for i in range(count):
        client.put(key, f"{i}".encode())
    wait_for(lambda: len(collector.events) == count, 30, f"{count} events")
    [bucket] = collector.sub.sub_ids
    holder = cluster.holder_node(bucket)
    assert _outbox_rows(cluster, holder, bucket) == count  # nothing acked yet
    return collector, bucket, holder


def test_close_returns_once_its_final_acks_are_applied(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        collector, bucket, holder = _unacked_events(cluster, client, "closing", 5)
        collector.stop()  # close(): the final ack, held by the node until applied
        assert _outbox_rows(cluster, holder, bucket) == 0


def test_close_acks_the_new_lease_holder_after_kill9_of_the_old(cluster: LocalCluster) -> None:
    """The final ack of `close` follows the lease: sent to the dead holder, it would
    be lost and the rows would stay for the whole stall window (a day)."""
    with cluster.client() as client:
        collector, bucket, victim = _unacked_events(cluster, client, "orphan", 5)
        collector.stop(close=False)
        cluster.kill9(victim)
        collector.sub.close(ack_timeout_s=30)
        holder = cluster.holder_node(bucket)
        assert holder != victim
        assert _outbox_rows(cluster, holder, bucket) == 0


def test_close_waits_for_acks_the_holder_had_only_queued(cluster: LocalCluster) -> None:
    """An ack sent before `close` is confirmed once the holder queued it; `close`
    still waits until it is applied (the holder's peers are frozen meanwhile, so
    its purge cannot commit)."""
    cluster.wait_settled()  # no lease move between reading the holder and the test's end
    with cluster.client() as client:
        options = SubscribeOptions(ack_every_events=1_000_000, ack_interval_s=1.0)
        collector = Collector(client.subscribe("key:queued", options=options))
        for i in range(5):
            client.put("queued", f"{i}".encode())
        wait_for(lambda: len(collector.events) == 5, 30, "five events")
        [bucket] = collector.sub.sub_ids
        holder = cluster.holder_node(bucket)
        with cluster.paused(_peers(cluster, holder)):
            stream = collector.sub._flusher._progress._streams[bucket]
            last = collector.events[-1].emit_seq
            wait_for(lambda: stream.confirmed == last, 10, "the ack confirmed as queued")
            assert _outbox_rows(cluster, holder, bucket) == 5  # queued, not applied
            closing = threading.Thread(target=collector.stop)  # close(): waits
            closing.start()
            closing.join(0.5)
            assert closing.is_alive()
        closing.join(10)
        assert not closing.is_alive()
        assert _outbox_rows(cluster, holder, bucket) == 0


def test_closing_the_client_closes_its_subscriptions_and_acks_what_they_processed(
    cluster: LocalCluster,
) -> None:
    """`Client.close` ends a consumer blocked in `for` and acks (applied) what each of
    its subscriptions processed, all final acks together."""
    cluster.wait_settled()  # no lease move between reading the holder and the test's end
    client = cluster.client()
    subs = [client.subscribe("key:shut", name=f"s{i}", options=_CLOSE_ACKS_ONLY) for i in (1, 2)]
    for i in range(3):
        client.put("shut", f"{i}".encode())
    [bucket] = subs[0].sub_ids
    holder = cluster.holder_node(bucket)
    seen: list[list[int]] = [[], []]

    def consume(i: int) -> None:
        for event in subs[i]:  # ends when the client closes
            seen[i].append(event.emit_seq.commit_index)

    consumers = [threading.Thread(target=consume, args=(i,), daemon=True) for i in (0, 1)]
    for t in consumers:
        t.start()
    wait_for(lambda: all(len(x) == 3 for x in seen), 30, "three events each")
    assert _outbox_rows(cluster, holder, bucket) == 6  # nothing acked yet
    client.close()
    for t in consumers:
        t.join(10)
        assert not t.is_alive()
    assert _outbox_rows(cluster, holder, bucket) == 0


def test_a_subscription_closed_after_its_client_returns_at_once(cluster: LocalCluster) -> None:
    """The client's loop is gone: nothing can be sent, and nothing is waited for."""
    client = cluster.client()
    collector = Collector(client.subscribe("key:late"))
    client.put("late", b"v")
    wait_for(lambda: len(collector.events) == 1, 30, "the event")
    collector.stop(close=False)
    client.close()
    started = time.monotonic()
    collector.sub.close()
    assert time.monotonic() - started < 1


def test_an_ack_waiting_to_be_applied_is_not_confirmed_while_its_purge_cannot_commit(
    patient_cluster: LocalCluster,
) -> None:
    """`AckBatch.wait_applied`: with the holder's peers frozen its purge cannot commit,
    so the ack is not answered ACCEPTED; once they run again it is, after the rows
    are gone. A plain ack is ACCEPTED at once (queued) either way."""
    cluster = patient_cluster
    cluster.wait_settled()  # no lease move between reading the holder and the acks
    with cluster.client() as client:
        collector, bucket, holder = _unacked_events(cluster, client, "frozen", 3)
        sub_id = collector.sub.sub_ids[bucket]
        first, last = collector.events[0].emit_seq, collector.events[-1].emit_seq
        collector.stop(close=False)

        def ack(seq: EmitSeq, *, wait: bool, node_id: str = holder) -> pb.AckResult:
            up_to = codec.seq_to_pb(seq)
            request = pb.AckBatch(
                acks=[pb.ClientAck(sub_id=sub_id, up_to_emit_seq=up_to)], wait_applied=wait
            )
            with cluster.channel(cluster.spec.node(node_id).grpc_address) as channel:
                s = pb_grpc.SevenDBStub(channel)  # type: ignore[no-untyped-call]
                return s.Ack(request, metadata=auth(cluster), timeout=2).results[0]

        with cluster.paused(_peers(cluster, holder)):
            assert ack(first, wait=False).status == pb.AckResult.ACCEPTED  # queued only
            waited = ack(last, wait=True)
            assert waited.status in (pb.AckResult.PENDING, pb.AckResult.NOT_HOLDER), waited

        def applied() -> str | None:
            now_holding = cluster.holder_node(bucket)  # the peers may have taken the lease
            result = ack(last, wait=True, node_id=now_holding)
            return now_holding if result.status == pb.AckResult.ACCEPTED else None

        node_id = wait_for(applied, 30, "the ack to be applied once the peers run again")
        assert _outbox_rows(cluster, node_id, bucket) == 0


def test_metrics_endpoint_exports_the_contract_metrics(cluster: LocalCluster) -> None:
    cluster.wait_settled()  # the holder that emitted is the one whose metrics are read
    with cluster.client() as client:
        collector = Collector(client.subscribe("prefix:m/"))
        client.put("m/1", b"x")
        collector.wait_keys({"m/1"})
        collector.stop()
    holder = cluster.spec.node(cluster.holder_node(client.layout().bucket_of("m/1")))
    url = f"http://{holder.host}:{holder.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for name in (
        "sevendb_emit_latency_seconds_bucket",
        "sevendb_ack_lag_commit_index",
        "sevendb_notifier_outbox_size_entries",
        "sevendb_plan_hash_mismatch_total",
        "sevendb_commits_total",
        "sevendb_purged_rows_total",
    ):
        assert name in text, name
    assert "sevendb_reconnect_status" in text


def _three_events_acked_by_time(
    cluster: LocalCluster, client: Client, key: str
) -> tuple[Subscription, int, str]:
    """A subscription of `key` acking every 50 ms (and not by count), then three writes
    of it: (subscription, bucket, lease holder)."""
    cluster.wait_settled()  # no lease move between reading the holder and the test's end
    options = SubscribeOptions(ack_every_events=1000, ack_interval_s=0.05)
    sub = client.subscribe(f"key:{key}", options=options)
    for i in range(3):
        client.put(key, f"{i}".encode())
    [bucket] = sub.sub_ids
    return sub, bucket, cluster.holder_node(bucket)


def test_an_async_consumer_waiting_for_events_acks_what_it_processed(
    cluster: LocalCluster,
) -> None:
    """`async for` waits for the next event only until an ack is due: what was
    processed is acked while the consumer waits, not at its next event or close."""
    import asyncio

    with cluster.client() as client:
        sub, bucket, holder = _three_events_acked_by_time(cluster, client, "idle")

        async def scenario() -> None:
            events = aiter(sub)
            for _ in range(3):
                await asyncio.wait_for(anext(events), 30)
            waiting = asyncio.ensure_future(anext(events))  # the third is processed now
            try:
                await asyncio.to_thread(
                    wait_for,
                    lambda: _outbox_rows(cluster, holder, bucket) == 0,
                    30,
                    "the acks of a consumer waiting for more",
                )
                assert not waiting.done()
            finally:
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)

        asyncio.run(scenario())
        sub.close()


def test_events_handed_over_are_acked_only_once_processed_by_a_blocked_consumer(
    cluster: LocalCluster,
) -> None:
    """The client's loop flushes acks on a timer while the application waits. Events
    it has handed over but the application has not processed are never acked, however
    many ack intervals pass; once processed, they are acked while a `for` consumer is
    blocked waiting for more."""
    with cluster.client() as client:
        sub, bucket, holder = _three_events_acked_by_time(cluster, client, "behind")
        wait_for(lambda: sub._flusher._handed == 3, 30, "three events handed to the application")
        time.sleep(0.3)  # six ack intervals with nothing processed
        assert _outbox_rows(cluster, holder, bucket) == 3
        assert [sub.poll(5) is not None for _ in range(3)] == [True, True, True]
        blocked = threading.Thread(target=lambda: next(sub, None), daemon=True)
        blocked.start()  # marks the third processed, then waits for a fourth
        wait_for(
            lambda: _outbox_rows(cluster, holder, bucket) == 0,
            30,
            "the acks of a blocked consumer",
        )
        assert blocked.is_alive()
        sub.close()
        blocked.join(10)
        assert not blocked.is_alive()


def test_async_iteration_and_many_subscriptions_in_one_client(cluster: LocalCluster) -> None:
    """`async for` works like `for`; twenty subscriptions of one client (one loop,
    acks coalesced per node) each see every write, polled without waiting."""
    import asyncio

    with cluster.client() as client:
        many = [client.subscribe("prefix:a/", name=f"s{i}") for i in range(20)]
        aio_sub = client.subscribe("prefix:a/", name="async")
        writer = Writer(client, "a/")
        writer.write(25)

        async def consume() -> list[Event]:
            seen: list[Event] = []
            async for event in aio_sub:
                seen.append(event)
                if sum(len(e.changes) for e in seen) == 25:
                    return seen
            return seen

        events = asyncio.run(asyncio.wait_for(consume(), 60))
        aio_sub.close()
        truth = committed(client, writer.attempted)
        check_delivery(events, truth, 2, prefix="a/")
        got: list[list[Event]] = [[] for _ in many]
        deadline = time.monotonic() + 60
        while sum(len(e.changes) for g in got for e in g) < 25 * len(many):
            assert time.monotonic() < deadline, "not every subscription saw every write"
            for i, sub in enumerate(many):
                event = sub.poll(0)
                if event is not None:
                    got[i].append(event)
        for sub, events_i in zip(many, got, strict=True):
            check_delivery(events_i, truth, 2, prefix="a/")
            sub.close()


def test_a_session_carries_many_streams_and_a_bad_stream_ends_alone(
    cluster: LocalCluster,
) -> None:
    """The Session call the SDK subscribes through: the events of two subscriptions
    share messages; a request without an operation and a bad query each end their
    own stream with INVALID_ARGUMENT and change nothing else (an open stream id
    reused ends the call: tests/test_protocol_answers.py); a Reconnect
    from an unknown bucket answers INVALID_SEQUENCE and ends normally; a closed
    stream gets nothing more while the other goes on; half-closed with no stream
    open, the call ends."""
    import queue

    from sevendb.outbox.keys import bucket_of

    bucket = bucket_of("m/", 2)
    # This raw client does not follow a lease move (the SDK does): none may come.
    cluster.wait_settled()
    holder = cluster.spec.node(cluster.holder_node(bucket)).grpc_address
    s = cluster.stub(holder)
    requests: queue.Queue[pb.SessionRequest | list[pb.SessionRequest] | None] = queue.Queue()
    responses: list[pb.SessionResponse] = []

    def send() -> Iterator[pb.SessionRequests]:
        while (request := requests.get()) is not None:
            yield pb.SessionRequests(requests=request if isinstance(request, list) else [request])

    call = s.Session(send(), metadata=auth(cluster))
    reader = threading.Thread(target=lambda: responses.extend(call), daemon=True)
    reader.start()

    def items(stream_id: int) -> list[pb.SessionItem]:
        return [i for r in list(responses) for i in r.items if i.stream_id == stream_id]

    def subscribe(stream_id: int, arg: str) -> pb.SessionRequest:
        query = pb.Query(kind=pb.Query.KEY if arg == "" else pb.Query.PREFIX, arg=arg)
        return pb.SessionRequest(
            stream_id=stream_id, subscribe=pb.SubscribeRequest(bucket=bucket, query=query)
        )

    requests.put([subscribe(1, "m/"), subscribe(2, "m/")])  # two streams, one message
    wait_for(lambda: items(1) and items(2), 30, "both SubAcks")
    requests.put(pb.SessionRequest(stream_id=3))  # no op
    requests.put(subscribe(4, ""))  # a key query needs a key
    unknown = pb.EmitSeq(epoch_id=pb.EmitSeq.EpochId(bucket_uuid="nope", epoch_counter=1))
    requests.put(
        pb.SessionRequest(
            stream_id=5,
            reconnect=pb.ReconnectRequest(sub_id="x", last_processed_emit_seq=unknown),
        )
    )
    wait_for(lambda: items(3) and items(4) and len(items(5)) == 2, 30, "the bad streams' ends")
    for sid in (3, 4):
        [end] = items(sid)
        assert end.end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], end
    ack, end = items(5)
    assert ack.message.reconnect_ack.status == pb.ReconnectAck.INVALID_SEQUENCE
    assert end.HasField("end") and end.end.code == 0

    def keys(stream_id: int) -> list[str]:
        return [
            c.key
            for i in items(stream_id)
            if i.message.WhichOneof("kind") == "events"
            for e in i.message.events.events
            for c in e.delta.changes
        ]

    with cluster.client() as client:
        ours = [k for i in range(200) if bucket_of(k := f"m/{i:03d}", 2) == bucket]
        written, late = ours[:20], ours[20:22]
        for key in written:
            client.put(key, b"v")
        wait_for(lambda: keys(1) == written and keys(2) == written, 30, "every event, twice")
        assert any(len({i.stream_id for i in r.items}) > 1 for r in responses), (
            "no message carried both subscriptions' events"
        )
        requests.put(pb.SessionRequest(stream_id=1, close=True))
        # Once the close is through, only stream 2 hears of later writes.
        client.put(late[0], b"v")
        wait_for(lambda: late[0] in keys(2), 30, "stream 2's next event")
        closed_at = len(keys(1))
        client.put(late[1], b"v")
        wait_for(lambda: late[1] in keys(2), 30, "stream 2 goes on")
        assert len(keys(1)) == closed_at
    # Half-closed with no stream left open, the call ends normally.
    requests.put(pb.SessionRequest(stream_id=2, close=True))
    requests.put(None)
    reader.join(10)
    assert not reader.is_alive() and call.code() == grpc.StatusCode.OK


def test_a_catch_up_larger_than_a_grpc_message_arrives_whole(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A subscription that reconnects after 6 MB of writes to one bucket (100 values
    of 60 KiB, over the 4 MiB gRPC message limit) gets all of them: the node splits
    what it sends by size, not only by count."""
    cursor = tmp_path / "big.cursor"
    value = b"v" * (60 * 1024)
    with cluster.client() as client:
        first = Collector(client.subscribe("prefix:big/", cursor=cursor))
        client.put("big/start", b"1")
        first.wait_keys({"big/start"})
        first.stop()
        from sevendb.outbox.keys import bucket_of

        keys = [k for i in range(400) if bucket_of(k := f"big/{i:03d}", 2) == 0][:100]
        for key in keys:
            client.put(key, value)
        second = Collector(client.subscribe("prefix:big/", cursor=cursor))
        second.wait_keys(set(keys), timeout_s=60)
        second.stop()
        assert all(c.value == value for e in second.events for c in e.changes)
