"""The `Client` against a real gRPC server in this process that plays a node: what
`status` returns, that a node without `Session` is refused, not served a call per
stream (a cluster runs one version: docs/emission.md), and that RESOURCE_EXHAUSTED
with a `sevendb-retry-after-ms` trailer (a rate limit) is retried after that long."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from sdk_facade import KINDS, make_client

from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk import (
    AsyncClient,
    BrokenReason,
    ErrorCode,
    InvalidArgument,
    NodeStatus,
    ReplicaStatus,
    ResourceExhausted,
    RetryPolicy,
    SubscriptionBroken,
    Unavailable,
)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """Each test runs against a `Client` and an `AsyncClient` (tests/sdk_facade.py)."""
    return str(request.param)


_START = pb.EmitSeq(epoch_id=pb.EmitSeq.EpochId(bucket_uuid="u0", epoch_counter=1), commit_index=3)


class _OldNode(pb_grpc.SevenDBServicer):  # type: ignore[misc]
    """One bucket; `Status`; `Subscribe` on a call of its own (answers, then holds the
    stream open), and no `Session` (the generated base answers UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.subscribes = 0

    def ClusterInfo(
        self, request: pb.ClusterInfoRequest, context: grpc.ServicerContext
    ) -> pb.ClusterInfoResponse:
        return pb.ClusterInfoResponse(
            cluster_id="c", buckets=[pb.BucketInfo(bucket=0, bucket_uuid="u0")], nodes=["n"]
        )

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        replica = pb.ReplicaStatus(
            bucket=0,
            bucket_uuid="u0",
            address="127.0.0.1:9",
            is_leader=True,
            term=2,
            commit_index=7,
            members=["127.0.0.1:9", "127.0.0.1:10"],
            digest="abc" if request.with_digests else "",
        )
        return pb.StatusResponse(node_id="n1", replicas=[replica])

    def Subscribe(
        self, request: pb.SubscribeRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StreamMessage]:
        self.subscribes += 1
        yield pb.StreamMessage(sub_ack=pb.SubAck(sub_id=request.sub_id, start_emit_seq=_START))
        ended = threading.Event()
        context.add_callback(ended.set)
        ended.wait(30)


@pytest.fixture
def old_node() -> Iterator[tuple[str, _OldNode]]:
    servicer = _OldNode()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_SevenDBServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


def test_status_is_a_dataclass_of_the_node_s_replicas(
    old_node: tuple[str, _OldNode], kind: str
) -> None:
    address, _ = old_node
    with make_client(kind, [address], tls=None) as client:
        status = client.status(address, digests=True)
    assert isinstance(status, NodeStatus)
    assert status.node_id == "n1"
    [replica] = status.replicas
    assert isinstance(replica, ReplicaStatus)
    assert (replica.bucket, replica.is_leader, replica.term, replica.commit_index) == (
        0,
        True,
        2,
        7,
    )
    assert replica.members == ("127.0.0.1:9", "127.0.0.1:10")
    assert replica.connected == ()
    assert replica.digest == "abc"


def test_status_of_a_node_that_does_not_answer_is_unavailable(kind: str) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    retry = RetryPolicy(call_timeout_s=2.0)
    with (
        make_client(kind, [address], tls=None, retry=retry) as client,
        pytest.raises(Unavailable, match=address),
    ):
        client.status(address)


def test_a_node_without_session_is_refused_not_served_a_call_per_stream(
    old_node: tuple[str, _OldNode], kind: str
) -> None:
    """Before, the SDK fell back to a Subscribe call of its own for such a node and the
    subscription came up; rolling upgrades are not supported, so it is refused."""
    address, servicer = old_node
    started = time.monotonic()
    with (
        make_client(kind, [address], tls=None) as client,
        pytest.raises(SubscriptionBroken) as broken,
    ):
        client.subscribe("all")
    assert broken.value.reason is BrokenReason.UNIMPLEMENTED
    assert time.monotonic() - started < 10  # at once, not after the 30 s ready timeout
    assert servicer.subscribes == 0


class _BusyNode(pb_grpc.SevenDBServicer):  # type: ignore[misc]
    """One bucket, answering like a node under a rate limit: the first `refusals`
    calls of `Get`, and of write requests on `WriteStream`, are refused with
    RESOURCE_EXHAUSTED and a `sevendb-retry-after-ms` trailer (`per_write`: each write's
    outcome is refused instead, with no trailer); then every write commits."""

    def __init__(self, refusals: int, retry_after_ms: int = 300, per_write: bool = False) -> None:
        self.refusals = refusals
        self.retry_after_ms = retry_after_ms
        self.per_write = per_write
        self.get_times: list[float] = []
        self.write_times: list[float] = []
        self.refs: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()

    def _refuse(self) -> bool:
        with self._lock:
            if self.refusals:
                self.refusals -= 1
                return True
            return False

    def _abort(self, context: grpc.ServicerContext) -> None:
        context.set_trailing_metadata(((codec.RETRY_AFTER_KEY, str(self.retry_after_ms)),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "over the principal's write rate")

    def ClusterInfo(
        self, request: pb.ClusterInfoRequest, context: grpc.ServicerContext
    ) -> pb.ClusterInfoResponse:
        return pb.ClusterInfoResponse(
            cluster_id="c", buckets=[pb.BucketInfo(bucket=0, bucket_uuid="u0")], nodes=["n"]
        )

    def InitProducer(
        self, request: pb.InitProducerRequest, context: grpc.ServicerContext
    ) -> pb.InitProducerResponse:
        return pb.InitProducerResponse(producer_id=request.producer_id, producer_epoch=0)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetResponse:
        self.get_times.append(time.monotonic())
        if self._refuse():
            self._abort(context)
        return pb.GetResponse(found=True, value=b"v", version=1)

    def WriteStream(
        self, requests: Iterator[pb.WriteManyRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.WriteStreamResponse]:
        for request in requests:
            self.write_times.append(time.monotonic())
            self.refs.extend(
                (w.producer.producer_id, w.producer.producer_epoch, w.producer.sequence)
                for w in request.writes
            )
            refused = self._refuse()
            if refused and not self.per_write:
                self._abort(context)
            answer = pb.WriteManyResponse(id=request.id)
            for _ in request.writes:
                if refused:
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                    answer.outcomes.add(code=code, message="over the rate")
                else:
                    answer.outcomes.add(ok=pb.WriteResponse(bucket=0, committed=_START))
            yield pb.WriteStreamResponse(answers=[answer])


@contextlib.contextmanager
def _serve(servicer: pb_grpc.SevenDBServicer) -> Iterator[str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_SevenDBServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_a_call_refused_with_a_retry_after_is_retried_after_that_long(kind: str) -> None:
    """RESOURCE_EXHAUSTED was `InvalidArgument`, never retried."""
    node = _BusyNode(refusals=2, retry_after_ms=300)
    with _serve(node) as address, make_client(kind, [address], tls=None) as client:
        record = client.get("k")
    assert record is not None and record.value == b"v"
    assert len(node.get_times) == 3
    gaps = [b - a for a, b in zip(node.get_times, node.get_times[1:], strict=False)]
    assert min(gaps) >= 0.3


def test_a_write_refused_with_a_retry_after_is_retried_after_that_long(kind: str) -> None:
    node = _BusyNode(refusals=1, retry_after_ms=400)
    with _serve(node) as address, make_client(kind, [address], tls=None) as client:
        result = client.put("k", b"v")
    assert result.bucket == 0
    assert len(node.write_times) == 2
    assert node.write_times[1] - node.write_times[0] >= 0.4
    assert node.refs[0] == node.refs[1]  # the same write: the same producer sequence


def test_a_write_whose_own_outcome_is_resource_exhausted_is_retried(kind: str) -> None:
    node = _BusyNode(refusals=2, per_write=True)
    with _serve(node) as address, make_client(kind, [address], tls=None) as client:
        client.put("k", b"v")
    assert len(node.write_times) == 3
    assert len(set(node.refs)) == 1


def test_a_rate_limit_past_the_retry_budget_is_resource_exhausted(kind: str) -> None:
    node = _BusyNode(refusals=1000, retry_after_ms=200)
    retry = RetryPolicy(deadline_s=1.0)
    with _serve(node) as address, make_client(kind, [address], tls=None, retry=retry) as client:
        with pytest.raises(ResourceExhausted) as get:
            client.get("k")
        with pytest.raises(ResourceExhausted) as put:
            client.put("k", b"v")
    assert get.value.retry_after_s == 0.2 and put.value.retry_after_s == 0.2
    assert get.value.code is ErrorCode.RESOURCE_EXHAUSTED


# ---- AsyncClient only -------------------------------------------------------------------


def test_a_client_with_nothing_to_reach_is_unavailable_in_time() -> None:
    async def main() -> None:
        retry = RetryPolicy(deadline_s=1.0, call_timeout_s=0.5)
        async with AsyncClient(["127.0.0.1:1"], tls=None, retry=retry) as client:
            with pytest.raises(Unavailable, match="cannot reach the cluster"):
                await client.get("k")
            with pytest.raises(InvalidArgument, match="query must be"):
                await client.subscribe("orders/")

    asyncio.run(main())


def test_an_async_client_used_on_a_second_loop_is_refused() -> None:
    """Its channels and tasks belong to the loop it first ran on."""
    client = AsyncClient(["127.0.0.1:1"], tls=None, retry=RetryPolicy(deadline_s=0.3))

    async def get() -> None:
        await client.get("k")

    with pytest.raises(Unavailable):  # the first loop: the engine is made on it
        asyncio.run(get())
    with pytest.raises(InvalidArgument, match="belongs to the event loop it first ran on"):
        asyncio.run(get())
