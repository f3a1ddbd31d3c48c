"""Subscription set-up in bulk against a real node process (docs/cluster.md, "Batching
on the node"): concurrent Subscribe calls, and the Subscribe requests of one Session,
share SUBSCRIBE_BATCH entries, and each gets its own answer; one refused by the
state machine (NOT_OWNER) is refused alone.

A new subscription starts at the emit_seq of the entry that made it, so the SubAcks'
`start_emit_seq` commit indexes tell how many entries the SUBSCRIBEs took: one per
SUBSCRIBE before the node batched them.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from cluster_harness import LocalCluster, RawStream

from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

BUCKET = 0
CONCURRENT = 48


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster.start(tmp_path_factory.mktemp("subbatch") / "data", nodes=1)
    try:
        cluster.wait_settled()
        cluster.grant_all("alice", "mallory")
        yield cluster
    finally:
        cluster.stop()


def _stub(cluster: LocalCluster) -> pb_grpc.SevenDBStub:
    return cluster.stub(cluster.spec.nodes[0].grpc_address)


def _auth(cluster: LocalCluster, principal: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {cluster.token(principal)}"),)


def _request(sub_id: str) -> pb.SubscribeRequest:
    query = pb.Query(kind=pb.Query.PREFIX, arg=f"{sub_id}/")
    return pb.SubscribeRequest(bucket=BUCKET, sub_id=sub_id, query=query)


def _taken(cluster: LocalCluster, sub_id: str) -> None:
    """`sub_id` made by alice, on a call of its own."""
    stream = RawStream(_stub(cluster).Subscribe(_request(sub_id), metadata=_auth(cluster, "alice")))
    assert stream.first() is not None and stream.messages[0].HasField("sub_ack")
    stream.call.cancel()


def _entries(acks: list[pb.SubAck]) -> int:
    """How many log entries made these new subscriptions."""
    return len({ack.start_emit_seq.commit_index for ack in acks})


def test_concurrent_subscribe_calls_share_entries(cluster: LocalCluster) -> None:
    _taken(cluster, "calls-taken")
    stub = _stub(cluster)
    alice, mallory = _auth(cluster, "alice"), _auth(cluster, "mallory")
    streams = {
        f"calls-{i}": RawStream(stub.Subscribe(_request(f"calls-{i}"), metadata=alice))
        for i in range(CONCURRENT)
    }
    thief = RawStream(stub.Subscribe(_request("calls-taken"), metadata=mallory))
    try:
        acks = []
        for sub_id, stream in streams.items():
            first = stream.first()
            assert first is not None and first.HasField("sub_ack"), (sub_id, stream.error)
            assert first.sub_ack.sub_id == sub_id and not first.sub_ack.resumed
            acks.append(first.sub_ack)
        assert thief.code() is grpc.StatusCode.PERMISSION_DENIED
        assert thief.error is not None
        assert dict(thief.error.trailing_metadata())[codec.ERROR_CODE_KEY] == "NOT_OWNER"
        assert _entries(acks) < CONCURRENT, "one entry per SUBSCRIBE: not batched"
    finally:
        for stream in [*streams.values(), thief]:
            stream.call.cancel()


def _session(
    cluster: LocalCluster, principal: str, requests: list[pb.SessionRequest]
) -> dict[int, pb.SessionItem]:
    """Send `requests` in one message of a Session call: each stream's first answer."""
    answers: dict[int, pb.SessionItem] = {}
    message = pb.SessionRequests(requests=requests)
    session = _stub(cluster).Session(iter([message]), metadata=_auth(cluster, principal))
    try:
        for response in session:
            for item in response.items:
                answers.setdefault(item.stream_id, item)
            if len(answers) == len(requests):
                break
    finally:
        session.cancel()
    return answers


def test_the_subscribes_of_one_session_share_entries(cluster: LocalCluster) -> None:
    _taken(cluster, "session-taken")
    requests = [
        pb.SessionRequest(stream_id=i, subscribe=_request(f"session-{i}"))
        for i in range(CONCURRENT)
    ]
    answers = _session(cluster, "alice", requests)
    acks = []
    for i in range(CONCURRENT):
        assert answers[i].message.HasField("sub_ack"), answers[i]
        assert answers[i].message.sub_ack.sub_id == f"session-{i}"
        acks.append(answers[i].message.sub_ack)
    assert _entries(acks) < CONCURRENT, "the Session's SUBSCRIBEs were not batched"
    # Mallory's Session asks for alice's subscription among new ones of its own: that
    # one is refused alone, the others are made.
    theirs = [pb.SessionRequest(stream_id=i, subscribe=_request(f"m-{i}")) for i in range(8)]
    theirs.append(pb.SessionRequest(stream_id=8, subscribe=_request("session-taken")))
    answers = _session(cluster, "mallory", theirs)
    assert answers[8].HasField("end") and answers[8].end.error == "NOT_OWNER"
    assert answers[8].end.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert all(answers[i].message.sub_ack.sub_id == f"m-{i}" for i in range(8))
