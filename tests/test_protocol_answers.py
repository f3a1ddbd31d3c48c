"""The protocol's answers to what the contract refuses, against real node processes
(docs/wire.md): a Reconnect from a position the subscription never reached, or from
another bucket, is INVALID_SEQUENCE once the holder has made sure it is current (never
an endless UNAVAILABLE); a newer stream of a subscription fences the older, which ends
FAILED_PRECONDITION / STREAM_SUPERSEDED; malformed bytes get INVALID_ARGUMENT on every
method, after the token is checked and without a traceback; a Session refuses an open
stream_id by ending the call, never with a StreamEnd for that id. A stream that asks
for packed changes gets the same events with their changes packed, and only it."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.cluster.ops.local import log_file
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.keys import bucket_of
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk import SubscriptionBroken

pytestmark = pytest.mark.slow

BUCKET = 0


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> LocalCluster:
    c = LocalCluster.start(tmp_path / "data", buckets=2)
    request.addfinalizer(c.stop)
    c.wait_settled()  # raw clients here do not follow a lease move (the SDK does)
    return c


def _auth(cluster: LocalCluster) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {cluster.token()}"),)


def _holder(cluster: LocalCluster, bucket: int = BUCKET) -> str:
    return cluster.spec.node(cluster.holder_node(bucket)).grpc_address


def _subscribe(cluster: LocalCluster, sub_id: str, prefix: str) -> pb.EmitSeq:
    """A raw subscription on BUCKET; its start position (the stream is closed)."""
    query = pb.Query(kind=pb.Query.PREFIX, arg=prefix)
    request = pb.SubscribeRequest(bucket=BUCKET, query=query, sub_id=sub_id)
    stream = cluster.stub(_holder(cluster)).Subscribe(request, metadata=_auth(cluster))
    start = next(stream).sub_ack.start_emit_seq
    stream.cancel()
    return start


def _moved(seq: pb.EmitSeq, *, uuid: str | None = None, by: int = 0) -> pb.EmitSeq:
    out = pb.EmitSeq()
    out.CopyFrom(seq)
    if uuid is not None:
        out.epoch_id.bucket_uuid = uuid
    out.commit_index += by
    return out


def _reconnect_answer(
    cluster: LocalCluster, request: pb.ReconnectRequest
) -> list[pb.StreamMessage]:
    """A Reconnect call's messages; it must end normally (raises otherwise)."""
    return list(
        cluster.stub(_holder(cluster)).Reconnect(request, metadata=_auth(cluster), timeout=30)
    )


def _drain(call: Any, into: list[Any], ended: threading.Event) -> None:
    """Read a call's messages into `into` until it ends (however), then set `ended`."""
    try:
        into.extend(call)
    except grpc.RpcError:
        pass
    finally:
        ended.set()


class _Stream:
    """Reads a server-streaming call in a thread: its messages, then how it ended."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.messages: list[pb.StreamMessage] = []
        self.ended = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        _drain(self.call, self.messages, self.ended)

    def event_keys(self) -> list[str]:
        return [
            c.key
            for m in list(self.messages)
            if m.WhichOneof("kind") == "events"
            for e in m.events.events
            for c in e.delta.changes
        ]


class _Session:
    """A raw Session call: requests put in, every item read out in a thread."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.requests: queue.Queue[pb.SessionRequest | pb.SessionRequests | None] = queue.Queue()
        """A request goes in a message of its own; a SessionRequests as it is."""
        self.responses: list[pb.SessionResponse] = []
        self.call = cluster.stub(_holder(cluster)).Session(self._send(), metadata=_auth(cluster))
        self.ended = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _send(self) -> Iterator[pb.SessionRequests]:
        while (request := self.requests.get()) is not None:
            if isinstance(request, pb.SessionRequest):
                request = pb.SessionRequests(requests=[request])
            yield request

    def _run(self) -> None:
        _drain(self.call, self.responses, self.ended)

    def items(self, stream_id: int) -> list[pb.SessionItem]:
        return [i for r in list(self.responses) for i in r.items if i.stream_id == stream_id]

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()


def _put_keys(cluster: LocalCluster, prefix: str, count: int) -> list[str]:
    keys = [k for i in range(400) if bucket_of(k := f"{prefix}{i:03d}", 2) == BUCKET][:count]
    with cluster.client() as client:
        for key in keys:
            client.put(key, b"v")
    return keys


# ---- Reconnect from a position the subscription never reached --------------------------


def test_reconnect_from_beyond_the_log_is_invalid_sequence(cluster: LocalCluster) -> None:
    """A position past anything the bucket committed: INVALID_SEQUENCE and a normal
    end, on a call of its own and on a Session, and the subscription still resumes
    from its real position."""
    start = _subscribe(cluster, "far-1", "far/")
    far = pb.ReconnectRequest(sub_id="far-1", last_processed_emit_seq=_moved(start, by=10_000))
    [ack] = _reconnect_answer(cluster, far)
    assert ack.reconnect_ack.status == pb.ReconnectAck.INVALID_SEQUENCE
    session = _Session(cluster)
    try:
        session.requests.put(pb.SessionRequest(stream_id=1, reconnect=far))
        wait_for(lambda: len(session.items(1)) == 2, 30, "the Session stream's answer")
        answer, end = session.items(1)
        assert answer.message.reconnect_ack.status == pb.ReconnectAck.INVALID_SEQUENCE
        assert end.HasField("end") and end.end.code == 0
    finally:
        session.close()
    resumed = _Stream(
        cluster.stub(_holder(cluster)).Reconnect(
            pb.ReconnectRequest(sub_id="far-1", last_processed_emit_seq=start),
            metadata=_auth(cluster),
        )
    )
    wait_for(lambda: resumed.messages, 30, "the real position's ReconnectAck")
    assert resumed.messages[0].reconnect_ack.status == pb.ReconnectAck.OK
    resumed.call.cancel()


def test_reconnect_with_another_buckets_position_is_invalid_sequence(
    cluster: LocalCluster,
) -> None:
    """The request names the subscription's bucket; a position carrying another
    bucket's uuid is INVALID_SEQUENCE from that bucket's holder, not a redirect."""
    start = _subscribe(cluster, "other-1", "oth/")
    other = cluster.spec.buckets[1 - BUCKET].bucket_uuid
    for position in (_moved(start, uuid=other), _moved(start, uuid=other, by=10_000)):
        request = codec.reconnect_request("other-1", BUCKET, codec.seq_from_pb(position))
        [ack] = _reconnect_answer(cluster, request)
        assert ack.reconnect_ack.status == pb.ReconnectAck.INVALID_SEQUENCE, position


def _rewrite_cursor(path: Path, move: Any) -> None:
    body = json.loads(path.read_text())
    for cursor in body["cursors"]:
        cursor["position"] = move(EmitSeq(*cursor["position"])).pack()
    path.write_text(json.dumps(body))


@pytest.mark.parametrize("damage", ["beyond the log", "another bucket"])
def test_an_sdk_client_with_a_bad_cursor_is_told_invalid_sequence(
    cluster: LocalCluster, tmp_path: Path, damage: str
) -> None:
    """A cursor file whose position the subscription never reached: the SDK hears
    INVALID_SEQUENCE (and raises, its default policy) instead of retrying for ever."""
    key = next(k for i in range(100) if bucket_of(k := f"cur/{i}", 2) == BUCKET)
    cursor = tmp_path / "c.cursor"
    other = cluster.spec.buckets[1 - BUCKET].bucket_uuid
    with cluster.client() as client:
        sub = client.subscribe(f"key:{key}", cursor=cursor)
        client.put(key, b"1")
        wait_for(lambda: sub.poll(0.1) is not None, 30, "the event")
        sub.close()
        if damage == "beyond the log":
            _rewrite_cursor(cursor, lambda p: p._replace(commit_index=p.commit_index + 10_000))
        else:
            _rewrite_cursor(cursor, lambda p: p._replace(bucket_uuid=other))
        with pytest.raises(SubscriptionBroken) as broken:
            client.subscribe(f"key:{key}", cursor=cursor)
        assert broken.value.reason == "INVALID_SEQUENCE", broken.value


def test_a_holder_that_cannot_make_sure_it_is_current_does_not_say_invalid(
    cluster: LocalCluster,
) -> None:
    """A holder cut off from its peers cannot tell a client ahead of the log from a
    newer holder it does not know of: it answers UNAVAILABLE (retry). Once it can
    reach them again, the same request is INVALID_SEQUENCE."""
    start = _subscribe(cluster, "cut-1", "cut/")
    far = pb.ReconnectRequest(sub_id="cut-1", last_processed_emit_seq=_moved(start, by=10_000))
    address = _holder(cluster)
    holder = cluster.holder_node(BUCKET)
    others = [n.node_id for n in cluster.spec.nodes if n.node_id != holder]
    with cluster.paused(others), pytest.raises(grpc.RpcError) as retry:
        list(cluster.stub(address).Reconnect(far, metadata=_auth(cluster), timeout=30))
    assert retry.value.code() == grpc.StatusCode.UNAVAILABLE, retry.value

    def answer() -> int | None:
        try:
            [ack] = _reconnect_answer(cluster, far)
        except grpc.RpcError as exc:  # a lease still moving back
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return None
        return ack.reconnect_ack.status

    assert wait_for(answer, 60, "an answer") == pb.ReconnectAck.INVALID_SEQUENCE


# ---- one stream per subscription ---------------------------------------------------


def test_a_newer_stream_of_a_subscription_fences_the_older(cluster: LocalCluster) -> None:
    """Each newer Reconnect stream (a call of its own, then a Session stream, then a
    call again) ends the one before with FAILED_PRECONDITION and the
    STREAM_SUPERSEDED error; only the newest receives the next event."""
    start = _subscribe(cluster, "fence-1", "fen/")
    request = pb.ReconnectRequest(sub_id="fence-1", last_processed_emit_seq=start)
    s = cluster.stub(_holder(cluster))

    def reconnect_call() -> _Stream:
        stream = _Stream(s.Reconnect(request, metadata=_auth(cluster)))
        wait_for(lambda: stream.messages, 30, "a ReconnectAck")
        assert stream.messages[0].reconnect_ack.status == pb.ReconnectAck.OK
        return stream

    def superseded(code: int, error: str) -> None:
        assert code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert error == codec.STREAM_SUPERSEDED

    first = reconnect_call()
    second = reconnect_call()
    assert first.ended.wait(30), "the older call still open"
    trailers = dict(first.call.trailing_metadata())
    superseded(first.call.code().value[0], trailers.get(codec.ERROR_CODE_KEY, ""))
    [key] = _put_keys(cluster, "fen/a", 1)
    wait_for(lambda: key in second.event_keys(), 30, "the newer stream's event")
    assert key not in first.event_keys()

    session = _Session(cluster)
    try:
        session.requests.put(pb.SessionRequest(stream_id=7, reconnect=request))
        wait_for(lambda: session.items(7), 30, "the Session stream's ReconnectAck")
        assert second.ended.wait(30), "the call fenced by a Session stream still open"
        superseded(
            second.call.code().value[0], dict(second.call.trailing_metadata())[codec.ERROR_CODE_KEY]
        )
        third = reconnect_call()
        wait_for(lambda: any(i.HasField("end") for i in session.items(7)), 30, "a StreamEnd")
        [end] = [i.end for i in session.items(7) if i.HasField("end")]
        superseded(end.code, end.error)
        [key] = _put_keys(cluster, "fen/b", 1)
        wait_for(lambda: key in third.event_keys(), 30, "the newest stream's event")
        third.call.cancel()
    finally:
        session.close()


# ---- packed changes --------------------------------------------------------------------


def _events(stream: _Stream) -> list[pb.DataEvent]:
    return [
        e
        for m in list(stream.messages)
        if m.WhichOneof("kind") == "events"
        for e in m.events.events
    ]


def _content(event: pb.DataEvent) -> tuple[Any, ...]:
    """What an event says, whichever way its changes came."""
    changes = (
        codec.unpack_changes(event.packed_changes)
        if event.packed_changes
        else codec.changes_from_pb(event.delta.changes)
    )
    return (
        codec.seq_from_pb(event.emit_seq),
        codec.seq_from_pb(event.prev_emit_seq),
        changes,
        event.delta.commit_time_ms,
    )


def test_a_stream_that_asks_for_packed_changes_gets_the_same_events_packed(
    cluster: LocalCluster,
) -> None:
    from sevendb.sdk import set_op

    s = cluster.stub(_holder(cluster))
    query = pb.Query(kind=pb.Query.PREFIX, arg="pk/")

    def subscribe(sub_id: str, packed: bool) -> _Stream:
        request = pb.SubscribeRequest(
            bucket=BUCKET, query=query, sub_id=sub_id, packed_changes=packed
        )
        stream = _Stream(s.Subscribe(request, metadata=_auth(cluster)))
        wait_for(lambda: stream.messages, 30, "a SubAck")
        return stream

    plain, packed = subscribe("pk-plain", False), subscribe("pk-packed", True)
    keys = _put_keys(cluster, "pk/", 6)
    with cluster.client() as client:  # one write of three changes: one event of three
        client.write([set_op(key, b"again") for key in keys[:3]])
    wait_for(lambda: len(_events(plain)) == 7 and len(_events(packed)) == 7, 30, "7 events each")
    assert all(not e.packed_changes and e.delta.changes for e in _events(plain))
    assert all(e.packed_changes and not e.delta.changes for e in _events(packed))
    assert [len(_content(e)[2]) for e in _events(packed)] == [1] * 6 + [3]
    # The same events (emit_seq, changes); each chain of prev_emit_seq starts at its SubAck.
    assert [_content(e)[0::2] for e in _events(packed)] == [
        _content(e)[0::2] for e in _events(plain)
    ]
    packed.call.cancel()
    start = next(m for m in packed.messages if m.WhichOneof("kind") == "sub_ack")
    again = _Stream(
        s.Reconnect(
            pb.ReconnectRequest(
                sub_id="pk-packed",
                last_processed_emit_seq=start.sub_ack.start_emit_seq,
                packed_changes=True,
            ),
            metadata=_auth(cluster),
        )
    )
    wait_for(lambda: len(_events(again)) == 7, 30, "the 7 events again, caught up")
    assert [_content(e) for e in _events(again)] == [_content(e) for e in _events(packed)]
    assert all(e.packed_changes for e in _events(again))
    plain.call.cancel()
    again.call.cancel()


# ---- malformed requests ----------------------------------------------------------------

_SERVICE = pb.DESCRIPTOR.services_by_name["SevenDB"]
_NO_TOKEN = {"Status", "ClusterInfo"}
_TRUNCATED = b"\x0a\x05ab"  # a length-delimited field 1 of 5 bytes, 2 present: no message


def _send_raw(channel: grpc.Channel, method: Any, raw: bytes, metadata: Any) -> grpc.RpcError:
    path = f"/{_SERVICE.full_name}/{method.name}"
    try:
        if method.client_streaming:
            list(channel.stream_stream(path)(iter([raw]), metadata=metadata, timeout=30))
        elif method.server_streaming:
            list(channel.unary_stream(path)(raw, metadata=metadata, timeout=30))
        else:
            channel.unary_unary(path)(raw, metadata=metadata, timeout=30)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"{method.name} accepted malformed bytes")


def test_malformed_requests_get_invalid_argument_after_the_token_and_no_traceback(
    cluster: LocalCluster,
) -> None:
    """Bytes that are not the method's message, on every method: INVALID_ARGUMENT with
    a valid token (GetRequest `0a 02 ff fe` too: bad UTF-8), UNAUTHENTICATED without
    one before anything is parsed (the methods that need one), and the node logs one
    WARNING line for all of them, no traceback. It goes on serving."""
    node = cluster.holder_node(BUCKET)
    channel = cluster.channel(cluster.spec.node(node).grpc_address)
    md = _auth(cluster)
    for method in _SERVICE.methods:
        refused = _send_raw(channel, method, _TRUNCATED, md)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, (method.name, refused)
        anonymous = _send_raw(channel, method, _TRUNCATED, ())
        expected = grpc.StatusCode.UNAUTHENTICATED
        if method.name in _NO_TOKEN or method.name == "WriteStream":
            # No token needed; WriteStream answers each request (its id is read first).
            expected = grpc.StatusCode.INVALID_ARGUMENT
        assert anonymous.code() == expected, (method.name, anonymous)
    get = _SERVICE.methods_by_name["Get"]
    bad_utf8 = _send_raw(channel, get, b"\x0a\x02\xff\xfe", md)
    assert bad_utf8.code() == grpc.StatusCode.INVALID_ARGUMENT, bad_utf8
    assert "UTF-8" in (bad_utf8.details() or "")
    with cluster.client() as client:
        client.put("after/1", b"fine")
        assert client.get("after/1").value == b"fine"
    log = log_file(cluster.data_dir, node).read_text()
    assert "Traceback" not in log and " ERROR " not in log and '"level": "ERROR"' not in log
    warnings = [line for line in log.splitlines() if "malformed" in line]
    assert len(warnings) == 1, warnings


# ---- Session: a stream id that is open ------------------------------------------------


def test_a_session_refuses_an_open_stream_id_by_ending_the_call(cluster: LocalCluster) -> None:
    """Opening a stream_id that is open ends the whole call INVALID_ARGUMENT; no
    StreamEnd for that id is sent, so nothing can be taken for the open stream's end."""
    session = _Session(cluster)
    query = pb.Query(kind=pb.Query.PREFIX, arg="dup/")
    subscribe = pb.SubscribeRequest(bucket=BUCKET, query=query, sub_id="dup-1")
    try:
        session.requests.put(pb.SessionRequest(stream_id=1, subscribe=subscribe))
        wait_for(lambda: session.items(1), 30, "the SubAck")
        session.requests.put(pb.SessionRequest(stream_id=1, subscribe=subscribe))
        assert session.ended.wait(30), "the call goes on"
        assert session.call.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stream 1 is already open" in session.call.details()
        assert [i.WhichOneof("kind") for i in session.items(1)] == ["message"]
    finally:
        session.close()


def test_a_session_message_of_too_many_requests_ends_the_call_and_opens_nothing(
    cluster: LocalCluster,
) -> None:
    """One message may carry at most REQUESTS_PER_MESSAGE_MAX requests: more ends the
    call INVALID_ARGUMENT before any of them is looked at."""
    session = _Session(cluster)
    query = pb.Query(kind=pb.Query.KEY, arg="many/0")
    subscribe = pb.SubscribeRequest(bucket=BUCKET, query=query, sub_id="many-0")
    closes = [pb.SessionRequest(stream_id=i, close=True) for i in range(2, 4098)]
    try:
        session.requests.put(
            pb.SessionRequests(
                requests=[pb.SessionRequest(stream_id=1, subscribe=subscribe), *closes]
            )
        )
        assert session.ended.wait(30), "the call goes on"
        assert session.call.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 4096 requests, not 4097" in session.call.details()
        assert session.items(1) == []
    finally:
        session.close()
    listing = pb.ListSubscriptionsRequest(bucket=BUCKET, limit=1000)
    stub = cluster.stub(_holder(cluster))
    listed = stub.ListSubscriptions(listing, metadata=_auth(cluster), timeout=10)
    assert "many-0" not in {s.sub_id for s in listed.subscriptions}
