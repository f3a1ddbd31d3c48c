"""The `Client` against a real gRPC server in this process that plays a node: what
`status` returns, and that a node without `Session` is refused, not served a call
per stream (a cluster runs one version: docs/emission.md)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk import (
    BrokenReason,
    Client,
    NodeStatus,
    ReplicaStatus,
    RetryPolicy,
    SubscriptionBroken,
    Unavailable,
)

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


def test_status_is_a_dataclass_of_the_node_s_replicas(old_node: tuple[str, _OldNode]) -> None:
    address, _ = old_node
    with Client([address]) as client:
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


def test_status_of_a_node_that_does_not_answer_is_unavailable() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    retry = RetryPolicy(call_timeout_s=2.0)
    with Client([address], retry=retry) as client, pytest.raises(Unavailable, match=address):
        client.status(address)


def test_a_node_without_session_is_refused_not_served_a_call_per_stream(
    old_node: tuple[str, _OldNode],
) -> None:
    """Before, the SDK fell back to a Subscribe call of its own for such a node and the
    subscription came up; rolling upgrades are not supported, so it is refused."""
    address, servicer = old_node
    started = time.monotonic()
    with Client([address]) as client, pytest.raises(SubscriptionBroken) as broken:
        client.subscribe("all")
    assert broken.value.reason is BrokenReason.UNIMPLEMENTED
    assert time.monotonic() - started < 10  # at once, not after the 30 s ready timeout
    assert servicer.subscribes == 0
