"""Real processes: acknowledged writes survive kill -9 of a leader, a follower, or
every node; replicas converge to identical state."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.outbox import limits
from sevendb.outbox.errors import InvalidArgument, PreconditionFailed
from sevendb.sdk import Client, WriteResult, set_op
from sevendb.sdk.writer import EAGER_CALLS, _Stream

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path / "data")
    try:
        yield c
    finally:
        c.stop()


def test_a_settled_up_returns_once_each_bucket_is_led_and_emitted_by_its_preferred_node(
    tmp_path: Path,
) -> None:
    """A fresh cluster hands each bucket's leadership to its preferred node about a
    second after the first election; `cluster_up(settled=True)` (what the benchmarks
    start) returns only then, so a measurement from the first request on does not
    include the hand-over (one put a 47 ms stall into the latency run's p99)."""
    cluster = LocalCluster.start(tmp_path / "data", buckets=3, settled=True)
    try:
        preferred = cluster.spec.preferred_leaders()
        for node in cluster.spec.nodes:
            status = cluster.status(node.node_id)
            assert status is not None
            for r in status.replicas:
                mine = preferred[r.bucket] == node.node_id
                assert (r.is_leader, r.emitting) == (mine, mine), (node.node_id, r.bucket)
    finally:
        cluster.stop()


def write_batch(client: Client, prefix: str, count: int) -> dict[str, WriteResult]:
    return {f"{prefix}{i}": client.put(f"{prefix}{i}", f"v{i}".encode()) for i in range(count)}


def verify_acked(client: Client, acked: dict[str, WriteResult]) -> None:
    """Every acknowledged write is there, at the log position it was acknowledged at."""
    for key, result in acked.items():
        record = client.get(key)
        assert record is not None, f"acknowledged write {key} lost"
        assert record.value == f"v{key.rsplit('-', 1)[-1]}".encode(), key
        assert record.mod_commit_index == result.committed.commit_index, key


def test_write_get_and_preconditions(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        first = client.put("k", b"1")
        assert first.versions == {"k": 1}
        assert client.put("k", b"2", expected_version=1).versions == {"k": 2}
        with pytest.raises(PreconditionFailed):
            client.put("k", b"3", expected_version=1)
        with pytest.raises(PreconditionFailed):
            client.put("k", b"3", must_not_exist=True)
        record = client.get("k")
        assert record is not None and record.value == b"2" and record.version == 2
        assert client.get("missing") is None


@pytest.mark.parametrize("victim", ["leader", "follower"])
def test_acknowledged_writes_survive_kill9(cluster: LocalCluster, victim: str) -> None:
    with cluster.client() as client:
        acked = write_batch(client, "a-", 60)
        leader = cluster.leader_node(0)
        node = (
            leader
            if victim == "leader"
            else next(n.node_id for n in cluster.spec.nodes if n.node_id != leader)
        )
        cluster.kill9(node)
        acked |= write_batch(client, "b-", 60)  # the client rides over the failover
        cluster.restart()
        acked |= write_batch(client, "c-", 20)
        cluster.wait_converged()
        verify_acked(client, acked)


def test_acknowledged_writes_survive_kill9_of_every_node(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        acked = write_batch(client, "a-", 100)
    for node in cluster.spec.nodes:
        cluster.kill9(node.node_id)
    cluster.restart()
    cluster.wait_converged()
    with cluster.client() as client:
        verify_acked(client, acked)


def test_writes_under_concurrent_load_and_leader_kill(cluster: LocalCluster) -> None:
    acked: dict[str, WriteResult] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def writer(w: int) -> None:
        with cluster.client() as client:
            i = 0
            while not stop.is_set():
                key = f"w{w}-{i}"
                result = client.put(key, f"v{i}".encode())
                with lock:
                    acked[key] = result
                i += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(acked) > 100, 30, "100 acknowledged writes")
    cluster.kill9(cluster.leader_node(0))
    wait_for(lambda: len(acked) > 300, 60, "writes to continue after the leader died")
    stop.set()
    for t in threads:
        t.join(30)
    cluster.restart()
    cluster.wait_converged()
    with cluster.client() as client:
        verify_acked(client, acked)


def test_idempotent_producer_retries_across_leader_change_commit_once(
    cluster: LocalCluster,
) -> None:
    with cluster.client() as client:
        producer = client.producer(len(cluster.spec.buckets))
        puts = 0
        for i in range(40):
            producer.put("counter", str(i).encode())
            puts += 1
        cluster.kill9(cluster.leader_node(cluster.spec.bucket_for_key("counter").bucket))
        for i in range(40, 80):
            producer.put("counter", str(i).encode())
            puts += 1
        record = client.get("counter")
        assert record is not None and record.value == b"79"
        assert record.version == puts  # no retry committed twice


def test_a_refused_idempotent_write_leaves_its_sequence_to_the_next(
    cluster: LocalCluster,
) -> None:
    # A write refused before the log (too large; a value of the wrong type) used to
    # take a sequence all the same, and every later write of the producer to that
    # bucket was refused as OUT_OF_ORDER_SEQUENCE.
    with cluster.client() as client:
        producer = client.producer(len(cluster.spec.buckets))
        producer.put("ipr/k", b"1")
        with pytest.raises(InvalidArgument):
            producer.put("ipr/k", b"x" * (limits.VALUE_BYTES_MAX + 1))
        with pytest.raises(InvalidArgument, match="must be bytes"):
            producer.put("ipr/k", "not bytes")  # type: ignore[arg-type]
        result = producer.put("ipr/k", b"2")
        assert not result.duplicate
        record = client.get("ipr/k")
        assert record is not None and (record.value, record.version) == (b"2", 2)


def test_write_many_gives_each_write_its_own_outcome(cluster: LocalCluster) -> None:
    import grpc

    from sevendb.proto import sevendb_pb2 as pb

    with cluster.client() as client:
        client.put("wm/taken", b"1")
        stub = cluster.stub(cluster.spec.nodes[0].grpc_address)
        keys = [f"wm/{i}" for i in range(200)]
        other = next(
            k for k in keys if client.layout().bucket_of(k) != client.layout().bucket_of("wm/0")
        )
        request = pb.WriteManyRequest(
            writes=[
                pb.WriteRequest(ops=[pb.Op(key="wm/0", value=b"a")]),
                pb.WriteRequest(
                    ops=[
                        pb.Op(
                            key="wm/taken", value=b"b", expected=pb.ExpectedVersion(not_exists=True)
                        )
                    ]
                ),
                pb.WriteRequest(ops=[pb.Op(key="wm/0", value=b"c"), pb.Op(key=other, value=b"d")]),
                pb.WriteRequest(ops=[pb.Op(key="", value=b"e")]),
                pb.WriteRequest(ops=[pb.Op(key="wm/1", value=b"f")]),
                pb.WriteRequest(ops=[pb.Op(kind=7, key="wm/2", value=b"g")]),  # type: ignore[arg-type]
            ]
        )
        outcomes = stub.WriteMany(request, metadata=client.metadata, timeout=10).outcomes
        assert [o.HasField("ok") for o in outcomes] == [True, False, False, False, True, False]
        assert outcomes[5].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "bad op" in outcomes[5].message
        assert outcomes[1].error == "PRECONDITION_FAILED"
        assert outcomes[1].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "atomic within one bucket" in outcomes[2].message
        assert outcomes[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        record = client.get("wm/taken")
        assert record is not None and record.value == b"1"  # refused writes changed nothing
        assert client.get(other) is None
        assert client.get("wm/2") is None
        assert [client.get(k).value for k in ("wm/0", "wm/1")] == [b"a", b"f"]  # type: ignore[union-attr]


def test_write_stream_answers_each_request_by_id_and_survives_a_bad_one(
    cluster: LocalCluster,
) -> None:
    import grpc

    from sevendb.outbox import limits
    from sevendb.proto import sevendb_pb2 as pb
    from sevendb.proto import sevendb_pb2_grpc as pb_grpc

    cluster.wait_settled()  # a fresh cluster hands leadership over ~2 s after start
    channel = cluster.channel(cluster.spec.nodes[0].grpc_address)
    stub = pb_grpc.SevenDBStub(channel)  # type: ignore[no-untyped-call]
    with cluster.client() as client:
        too_many = [pb.WriteRequest(ops=[pb.Op(key="ws/x", value=b"x")])] * (
            limits.WRITES_PER_BATCH_MAX + 1
        )
        requests = [
            pb.WriteManyRequest(
                id=7, writes=[pb.WriteRequest(ops=[pb.Op(key="ws/a", value=b"a")])]
            ),
            pb.WriteManyRequest(id=8, writes=too_many),
            pb.WriteManyRequest(
                id=9,
                writes=[
                    pb.WriteRequest(ops=[pb.Op(key="ws/b", value=b"b")]),
                    pb.WriteRequest(ops=[pb.Op(key="", value=b"c")]),
                ],
            ),
        ]
        answers = {}
        for message in stub.WriteStream(iter(requests), metadata=client.metadata, timeout=20):
            for answer in message.answers:
                assert answer.id not in answers
                answers[answer.id] = answer.outcomes
        # The client closed its side: the stream ended once every request was answered.
        assert sorted(answers) == [7, 8, 9]
        assert [o.HasField("ok") for o in answers[7]] == [True]
        assert len(answers[8]) == limits.WRITES_PER_BATCH_MAX + 1
        assert {o.code for o in answers[8]} == {grpc.StatusCode.INVALID_ARGUMENT.value[0]}
        assert [o.HasField("ok") for o in answers[9]] == [True, False]
        assert client.get("ws/x") is None  # the refused request changed nothing
        assert [client.get(k).value for k in ("ws/a", "ws/b")] == [b"a", b"b"]  # type: ignore[union-attr]
        # No token: every request is answered UNAUTHENTICATED (the stream is not ended
        # under the client's writes) and nothing is written.
        (message,) = stub.WriteStream(iter(requests[:1]), timeout=10)
        assert [a.id for a in message.answers] == [7]
        assert [o.code for o in message.answers[0].outcomes] == [
            grpc.StatusCode.UNAUTHENTICATED.value[0]
        ]
        assert client.get("ws/a").version == 1  # type: ignore[union-attr]
    channel.close()  # type: ignore[no-untyped-call]


def test_a_burst_of_writes_shares_one_call_and_one_raft_entry(cluster: LocalCluster) -> None:
    """Writes queued while the SDK's loop is busy leave in one WriteMany call, and the
    leader proposes that call's writes as one entry (not the first few one each)."""
    with cluster.client() as client:
        layout = client.layout()
        keys = [k for k in (f"burst/{i}" for i in range(400)) if layout.bucket_of(k) == 0][:60]
        client.put(keys[0], b"warm")
        pipeline = client._pipeline()
        # The SDK now knows bucket 0's leader, also when the leader itself answered
        # (it names the leader only when that is another node); before, the burst
        # then went round-robin to all three nodes: 3 calls.
        assert pipeline._leaders.get(0) == cluster.spec.node(cluster.leader_node(0)).grpc_address
        calls_before, writes_before = pipeline.calls, pipeline.writes
        gate = threading.Event()
        pipeline._engine.loop.call_soon_threadsafe(gate.wait)  # the loop is busy until released
        futures = [client.write_async([set_op(k, b"v")]) for k in keys]
        gate.set()
        results = [f.result(timeout=10) for f in futures]
        assert (pipeline.calls - calls_before, pipeline.writes - writes_before) == (1, len(keys))
        assert len({r.committed.commit_index for r in results}) == 1


def test_closing_the_client_from_a_write_callback_does_not_wait_for_itself(
    cluster: LocalCluster,
) -> None:
    """A write's callback runs on the SDK's loop thread; `Client.close` there cannot
    wait on that loop (it blocked it for 10 s, then raised): it shuts down from
    another thread, and the loop stops."""
    import threading

    client = cluster.client()
    client.put("callback/warm", b"v")
    engine = client._engine
    assert engine is not None
    closed = threading.Event()

    def close_it(_: object) -> None:
        client.close()
        closed.set()

    client.write_async([set_op("callback/k", b"v")]).add_done_callback(close_it)
    assert closed.wait(5)
    wait_for(lambda: not engine.loop.is_running(), 10, "the SDK loop to stop")


def test_writes_on_a_stream_cancelled_under_them_are_retried(cluster: LocalCluster) -> None:
    """grpc cancels a whole write stream when a task inside its `call.write` is
    cancelled (the SDK did that, seen under load), and such a local cancel is not
    the client closing: the requests in flight on it are sent again and commit (they
    used to fail with CANCELLED "the client is closing")."""
    cluster.wait_settled()
    with cluster.client() as client:
        layout = client.layout()
        keys = [k for k in (f"cancel/{i}" for i in range(400)) if layout.bucket_of(k) == 0][:20]
        client.put(keys[0], b"warm")  # the SDK learns bucket 0's leader and opens a stream
        pipeline = client._pipeline()
        with cluster.paused([cluster.leader_node(0)]):  # the requests stay in flight
            futures = [client.write_async([set_op(key, b"v")]) for key in keys[1:]]

            def in_flight() -> _Stream | None:  # the leader may have moved since the put
                return next((s for s in list(pipeline._streams.values()) if s.waiting), None)

            stream = wait_for(in_flight, 10, "requests in flight on a stream")
            pipeline._engine.loop.call_soon_threadsafe(stream.call.cancel)
        results = [f.result(timeout=30) for f in futures]
        assert [client.get(key).value for key in keys[1:]] == [b"v"] * len(results)


def test_writes_leave_at_once_below_eager_calls_and_then_wait_and_leave_together(
    cluster: LocalCluster,
) -> None:
    """A write leaves at once while fewer than `EAGER_CALLS` requests are in flight to
    its node (under light load nothing waits for an answer); beyond that, writes that
    come in loop turns of their own (fewer than `PIPELINE_MIN_WRITES`) wait for an
    answer and then leave as one request: with several buckets, a request per turn
    made Raft entries of a few writes each."""
    assert EAGER_CALLS == 2
    with cluster.client() as client:
        layout = client.layout()
        keys = [k for k in (f"wait/{i}" for i in range(400)) if layout.bucket_of(k) == 0][:10]
        client.put(keys[0], b"warm")  # the SDK learns bucket 0's leader
        pipeline = client._pipeline()
        calls = pipeline.calls
        with cluster.paused([cluster.leader_node(0)]):  # requests stay in flight
            first = client.write_async([set_op(keys[1], b"v")])
            wait_for(lambda: pipeline.calls == calls + 1, 10, "the first request to leave")
            second = client.write_async([set_op(keys[2], b"v")])
            wait_for(lambda: pipeline.calls == calls + 2, 10, "the second request to leave")
            later = []
            for key in keys[3:]:
                later.append(client.write_async([set_op(key, b"v")]))
                wait_for(lambda: not pipeline._inbox, 10, "the loop to take the write")
            assert pipeline.calls == calls + 2  # the later writes wait
        first.result(timeout=10)
        second.result(timeout=10)
        results = [f.result(timeout=10) for f in later]
        assert pipeline.calls == calls + 3
        assert len({r.committed.commit_index for r in results}) == 1
