"""The wire contract: committed generated code is fresh, and the messages look as agreed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import EnumDescriptor
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import Expected, ExpectKind, Op, OpKind
from sevendb.outbox.errors import ErrorCode, InvalidArgument
from sevendb.outbox.model import AckStatus, Change, Delta, ReconnectStatus
from sevendb.outbox.query import Query, QueryKind
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
GEN_PROTO = ROOT / "deploy" / "gen_proto.py"
PROTO_DIR = ROOT / "proto"
GENERATED = ("sevendb_pb2.py", "sevendb_pb2.pyi", "sevendb_pb2_grpc.py")


def run_gen_proto(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GEN_PROTO), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def field_numbers(message_type: type[Message]) -> dict[str, int]:
    return {field.name: field.number for field in message_type.DESCRIPTOR.fields}


def enum_values(descriptor: EnumDescriptor) -> dict[str, int]:
    return {value.name: value.number for value in descriptor.values}


# -- generated code is committed and fresh ---------------------------------------------


def test_generated_code_is_up_to_date() -> None:
    result = run_gen_proto("--check")
    assert result.returncode == 0, (
        "proto/ generated code is stale; run `python deploy/gen_proto.py`\n"
        + result.stdout
        + result.stderr
    )


@pytest.mark.parametrize("victim", GENERATED)
def test_check_fails_when_generated_code_differs(tmp_path: Path, victim: str) -> None:
    copy = tmp_path / "proto"
    shutil.copytree(PROTO_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    # The untouched copy passes, so the failure below is down to the edit alone.
    assert run_gen_proto("--check", "--proto-dir", str(copy)).returncode == 0

    target = copy / victim
    target.write_text(target.read_text() + "# hand edit\n")
    result = run_gen_proto("--check", "--proto-dir", str(copy))

    assert result.returncode == 1, result.stdout + result.stderr
    assert "+# hand edit" not in result.stdout  # the diff goes committed -> generated
    assert "-# hand edit" in result.stdout
    assert "gen_proto.py --proto-dir" in result.stderr
    # --check never writes.
    assert target.read_text().endswith("# hand edit\n")


def test_check_fails_when_proto_changes_without_regenerating(tmp_path: Path) -> None:
    copy = tmp_path / "proto"
    shutil.copytree(PROTO_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = copy / "sevendb.proto"
    source.write_text(source.read_text() + "\nmessage Extra { string x = 1; }\n")

    assert run_gen_proto("--check", "--proto-dir", str(copy)).returncode == 1
    # Regenerating the copy fixes it.
    assert run_gen_proto("--proto-dir", str(copy)).returncode == 0
    assert run_gen_proto("--check", "--proto-dir", str(copy)).returncode == 0


# -- the contract's shape -----------------------------------------------------------------


def test_package_name() -> None:
    assert pb.DESCRIPTOR.package == "sevendb.v1"
    assert pb.EmitSeq.DESCRIPTOR.full_name == "sevendb.v1.EmitSeq"
    assert pb.EmitSeq.EpochId.DESCRIPTOR.full_name == "sevendb.v1.EmitSeq.EpochId"


def test_emit_seq_fields() -> None:
    assert field_numbers(pb.EmitSeq) == {"epoch_id": 1, "commit_index": 2}
    assert field_numbers(pb.EmitSeq.EpochId) == {
        "bucket_uuid": 1,
        "epoch_counter": 2,
    }
    epoch_id = pb.EmitSeq.DESCRIPTOR.fields_by_name["epoch_id"]
    assert epoch_id.message_type is pb.EmitSeq.EpochId.DESCRIPTOR


def test_reconnect_ack_shape() -> None:
    assert enum_values(pb.ReconnectAck.Status.DESCRIPTOR) == {
        "OK": 0,
        "STALE_SEQUENCE": 1,
        "INVALID_SEQUENCE": 2,
        "SUBSCRIPTION_NOT_FOUND": 3,
    }
    assert field_numbers(pb.ReconnectAck) == {
        "status": 1,
        "current_epoch_id": 2,
        "next_commit_index": 3,
    }
    current = pb.ReconnectAck.DESCRIPTOR.fields_by_name["current_epoch_id"]
    assert current.message_type is pb.EmitSeq.EpochId.DESCRIPTOR


def test_sub_ack_seed_fields() -> None:
    assert field_numbers(pb.SubAck) == {
        "sub_id": 1,
        "start_emit_seq": 2,
        "bucket": 3,
        "plan_hash": 4,
        "resumed": 5,
    }


def test_ack_result_statuses() -> None:
    assert enum_values(pb.AckResult.Status.DESCRIPTOR) == {
        "ACCEPTED": 0,
        "REGRESSIVE": 1,
        "DUPLICATE": 2,
        "FUTURE": 3,
        "NOT_OWNER": 4,
        "SUBSCRIPTION_NOT_FOUND": 5,
        "STALE": 6,
        "NOT_HOLDER": 7,
        "PENDING": 8,
        "GROUP_FENCED": 9,
    }


def test_stream_message_oneof() -> None:
    oneof = pb.StreamMessage.DESCRIPTOR.oneofs_by_name["kind"]
    assert [field.name for field in oneof.fields] == [
        "sub_ack",
        "reconnect_ack",
        "events",
        "caught_up",
    ]


def test_service_methods() -> None:
    service = pb.DESCRIPTOR.services_by_name["SevenDB"]
    methods = {
        method.name: (
            method.input_type.name,
            method.output_type.name,
            method.client_streaming,
            method.server_streaming,
        )
        for method in service.methods
    }
    assert methods == {
        "Write": ("WriteRequest", "WriteResponse", False, False),
        "WriteMany": ("WriteManyRequest", "WriteManyResponse", False, False),
        "WriteStream": ("WriteManyRequest", "WriteStreamResponse", True, True),
        "Get": ("GetRequest", "GetResponse", False, False),
        "Sync": ("SyncRequest", "SyncResponse", False, False),
        "History": ("HistoryRequest", "HistoryResponse", False, False),
        "Range": ("RangeRequest", "RangeResponse", False, False),
        "InitProducer": ("InitProducerRequest", "InitProducerResponse", False, False),
        "Subscribe": ("SubscribeRequest", "StreamMessage", False, True),
        "Reconnect": ("ReconnectRequest", "StreamMessage", False, True),
        "Session": ("SessionRequests", "SessionResponse", True, True),
        "Ack": ("AckBatch", "AckResponse", False, False),
        "Unsubscribe": ("UnsubscribeRequest", "UnsubscribeResponse", False, False),
        "Status": ("StatusRequest", "StatusResponse", False, False),
        "ClusterInfo": ("ClusterInfoRequest", "ClusterInfoResponse", False, False),
        "AddMember": ("MemberRequest", "MemberResponse", False, False),
        "RemoveMember": ("MemberRequest", "MemberResponse", False, False),
        "TransferLeader": ("MemberRequest", "MemberResponse", False, False),
        "CreateEpoch": ("EpochRequest", "EpochResponse", False, False),
        "RecoverBucket": ("RecoverRequest", "RecoverResponse", False, False),
        "MetaRead": ("MetaReadRequest", "MetaReadResponse", False, False),
        "MetaWrite": ("MetaWriteRequest", "MetaWriteResponse", False, False),
        "JoinBundle": ("JoinBundleRequest", "JoinBundleResponse", False, False),
        "MintToken": ("MintTokenRequest", "MintTokenResponse", False, False),
        "ListSubscriptions": (
            "ListSubscriptionsRequest",
            "ListSubscriptionsResponse",
            False,
            False,
        ),
        "ShowSubscription": ("SubscriptionRequest", "SubscriptionInfo", False, False),
        "DeleteSubscription": ("SubscriptionRequest", "DeleteSubscriptionResponse", False, False),
        "BackupBucket": ("BackupRequest", "BackupChunk", False, True),
        "GroupBeat": ("GroupBeatRequest", "GroupBeatResponse", False, False),
        "Txn": ("TxnRequest", "TxnResponse", False, False),
        "TxnMark": ("TxnMarkRequest", "TxnMarkResponse", False, False),
        "ListTransactions": ("ListTransactionsRequest", "ListTransactionsResponse", False, False),
    }


def test_grpc_module_exports() -> None:
    from sevendb.proto import sevendb_pb2_grpc

    assert callable(sevendb_pb2_grpc.SevenDBStub)
    assert callable(sevendb_pb2_grpc.SevenDBServicer)
    assert callable(sevendb_pb2_grpc.add_SevenDBServicer_to_server)


def test_generated_modules_use_installed_package_path() -> None:
    grpc_source = (PROTO_DIR / "sevendb_pb2_grpc.py").read_text()
    assert "from sevendb.proto import sevendb_pb2" in grpc_source
    assert pb.__name__ == "sevendb.proto.sevendb_pb2"


# -- round trips -------------------------------------------------------------------------


def emit_seq(commit_index: int, epoch_counter: int = 3) -> pb.EmitSeq:
    return codec.seq_to_pb(EmitSeq("b-7f3a", epoch_counter, commit_index))


def data_event(commit_index: int) -> pb.DataEvent:
    return pb.DataEvent(
        sub_id="sub-1",
        emit_seq=emit_seq(commit_index),
        prev_emit_seq=emit_seq(commit_index - 1),
        delta=pb.Delta(
            changes=[
                pb.Change(key="user:1", op=pb.Change.SET, value=b"\x00\xffv", version=9),
                pb.Change(key="user:2", op=pb.Change.DEL, version=4),
            ],
            commit_time_ms=1_732_000_000_123,
        ),
    )


MESSAGES: dict[str, Message] = {
    "GroupBeatRequest": pb.GroupBeatRequest(
        bucket=3,
        group="workers",
        member="m-1",
        session_timeout_ms=10_000,
        leaving=True,
        query=pb.Query(kind=pb.Query.PREFIX, arg="jobs/"),
    ),
    "GroupBeatResponse": pb.GroupBeatResponse(owner="m-1", generation=2**63, members=["m-1"]),
    "GroupFence": pb.GroupFence(member="m-1", generation=7),
    "EmitSeq": emit_seq(2**64 - 1, epoch_counter=2**64 - 1),
    "Query": pb.Query(kind=pb.Query.PREFIX, arg="user:"),
    "SubscribeRequest": pb.SubscribeRequest(
        bucket=17, query=pb.Query(kind=pb.Query.ALL), sub_id="client-chosen", packed_changes=True
    ),
    "SubAck": pb.SubAck(sub_id="sub-1", start_emit_seq=emit_seq(41), bucket=17, plan_hash=2**63),
    "DataEvent": data_event(42),
    "DataEvent(packed_changes)": pb.DataEvent(
        sub_id="sub-1",
        emit_seq=emit_seq(42),
        prev_emit_seq=emit_seq(41),
        delta=pb.Delta(commit_time_ms=1_732_000_000_123),
        packed_changes=codec.pack_changes((Change("user:1", OpKind.SET, b"\x00\xffv", 9),)),
    ),
    "EventBatch": pb.EventBatch(events=[data_event(42), data_event(43)]),
    "CaughtUp": pb.CaughtUp(sub_id="sub-1", head_emit_seq=emit_seq(43)),
    "ReconnectRequest": pb.ReconnectRequest(sub_id="sub-1", last_processed_emit_seq=emit_seq(40)),
    "ReconnectAck": pb.ReconnectAck(
        status=pb.ReconnectAck.STALE_SEQUENCE,
        current_epoch_id=pb.EmitSeq.EpochId(bucket_uuid="b-7f3a", epoch_counter=4),
        next_commit_index=1,
    ),
    "StreamMessage(sub_ack)": pb.StreamMessage(sub_ack=pb.SubAck(sub_id="sub-1")),
    "StreamMessage(reconnect_ack)": pb.StreamMessage(
        reconnect_ack=pb.ReconnectAck(status=pb.ReconnectAck.OK, next_commit_index=41)
    ),
    "StreamMessage(events)": pb.StreamMessage(events=pb.EventBatch(events=[data_event(44)])),
    "StreamMessage(caught_up)": pb.StreamMessage(caught_up=pb.CaughtUp(sub_id="sub-1")),
    "SessionRequest(subscribe)": pb.SessionRequest(
        stream_id=1, subscribe=pb.SubscribeRequest(bucket=2, sub_id="sub-1")
    ),
    "SessionRequest(close)": pb.SessionRequest(stream_id=1, close=True),
    "SessionRequests": pb.SessionRequests(
        requests=[
            pb.SessionRequest(stream_id=1, subscribe=pb.SubscribeRequest(bucket=2, sub_id="s")),
            pb.SessionRequest(stream_id=2, close=True),
        ]
    ),
    "SessionResponse": pb.SessionResponse(
        items=[
            pb.SessionItem(
                stream_id=1,
                message=pb.StreamMessage(events=pb.EventBatch(events=[data_event(44)])),
            ),
            pb.SessionItem(
                stream_id=2, end=pb.StreamEnd(code=14, message="moved", leader="127.0.0.1:1")
            ),
        ]
    ),
    "AckBatch": pb.AckBatch(
        acks=[
            pb.ClientAck(sub_id="sub-1", up_to_emit_seq=emit_seq(43)),
            pb.ClientAck(sub_id="sub-2", up_to_emit_seq=emit_seq(7)),
        ]
    ),
    "AckResponse": pb.AckResponse(
        results=[
            pb.AckResult(sub_id="sub-1", status=pb.AckResult.ACCEPTED),
            pb.AckResult(sub_id="sub-2", status=pb.AckResult.REGRESSIVE, message="behind 9"),
        ]
    ),
    "UnsubscribeRequest": pb.UnsubscribeRequest(sub_id="sub-1", bucket=17),
    "UnsubscribeResponse": pb.UnsubscribeResponse(),
    "StatusRequest": pb.StatusRequest(),
    "ReplicaStatus": pb.ReplicaStatus(bucket=2, bucket_uuid="u", leader="127.0.0.1:1", digest="ab"),
    "StatusResponse": pb.StatusResponse(
        node_id="n1", replicas=[pb.ReplicaStatus(bucket=1, is_leader=True, commit_index=9)]
    ),
    "ClusterInfoRequest": pb.ClusterInfoRequest(),
    "MemberRequest": pb.MemberRequest(bucket=1, address="127.0.0.1:7001"),
    "MemberResponse": pb.MemberResponse(members=["127.0.0.1:7001"]),
    "EpochRequest": pb.EpochRequest(bucket=1, epoch_counter=2),
    "EpochResponse": pb.EpochResponse(
        epoch_id=pb.EmitSeq.EpochId(bucket_uuid="u", epoch_counter=2), commit_index=9
    ),
    "RecoverRequest": pb.RecoverRequest(bucket=2, accept_loss=True),
    "RecoverResponse": pb.RecoverResponse(has_replica=True, state="repairing"),
    "MetaRecord": pb.MetaRecord(key="node/n4", value=b"{}", version=3),
    "MetaReadRequest": pb.MetaReadRequest(after_version=4, wait_ms=10_000),
    "MetaReadResponse": pb.MetaReadResponse(
        version=5, records=[pb.MetaRecord(key="bucket/1", value=b"{}", version=2)], genesis="{}"
    ),
    "MetaOp": pb.MetaOp(key="bucket/1", value=b"{}", expected_version=2),
    "MetaWriteRequest": pb.MetaWriteRequest(ops=[pb.MetaOp(key="migration/1", delete=True)]),
    "MetaWriteResponse": pb.MetaWriteResponse(version=6),
    "JoinBundleRequest": pb.JoinBundleRequest(),
    "JoinBundleResponse": pb.JoinBundleResponse(genesis="{}", secrets="raft_password = 'x'"),
    "MintTokenRequest": pb.MintTokenRequest(principal="alice", ttl_s=3600),
    "MintTokenResponse": pb.MintTokenResponse(token="t", key_id="k0123456789", expires_ms=1),
    "ListSubscriptionsRequest": pb.ListSubscriptionsRequest(
        bucket=2, owner="alice", after_sub_id="s1", limit=50
    ),
    "SubscriptionInfo": pb.SubscriptionInfo(
        sub_id="s2",
        bucket=2,
        owner="alice",
        query=pb.Query(kind=pb.Query.PREFIX, arg="orders/"),
        start=emit_seq(3),
        head=emit_seq(40),
        acked=emit_seq(30),
        lag=10,
        last_active_ms=1_700_000_000_000,
        rows=4,
        row_bytes=120,
        pending_rows=1,
        attached=True,
        attached_known=True,
    ),
    "ListSubscriptionsResponse": pb.ListSubscriptionsResponse(
        subscriptions=[pb.SubscriptionInfo(sub_id="s2", owner="alice")], has_more=True
    ),
    "SubscriptionRequest": pb.SubscriptionRequest(bucket=2, sub_id="s2"),
    "DeleteSubscriptionResponse": pb.DeleteSubscriptionResponse(rows_dropped=5),
    "WriteManyRequest": pb.WriteManyRequest(id=5, writes=[pb.WriteRequest(ops=[pb.Op(key="a")])]),
    "WriteOutcome": pb.WriteOutcome(code=9, message="m", error="PRECONDITION_FAILED"),
    "RateLimitedOutcome": pb.WriteOutcome(code=8, error="RATE_LIMITED", retry_after_ms=250),
    "WriteManyResponse": pb.WriteManyResponse(
        outcomes=[pb.WriteOutcome(ok=pb.WriteResponse(bucket=1)), pb.WriteOutcome(code=14)]
    ),
    "WriteStreamResponse": pb.WriteStreamResponse(
        answers=[pb.WriteManyResponse(id=5, outcomes=[pb.WriteOutcome(code=14)])]
    ),
    "BucketInfo": pb.BucketInfo(bucket=3, bucket_uuid="u", nodes=["127.0.0.1:7001"]),
    "ClusterInfoResponse": pb.ClusterInfoResponse(
        cluster_id="c", buckets=[pb.BucketInfo(bucket=0, bucket_uuid="u")], nodes=["a:1"]
    ),
    "WriteRequest": pb.WriteRequest(
        ops=[
            pb.Op(
                kind=pb.Op.SET,
                key="user:1",
                value=b"alice",
                expected=pb.ExpectedVersion(exact=8),
            ),
            pb.Op(kind=pb.Op.SET, key="user:3", expected=pb.ExpectedVersion(not_exists=True)),
            pb.Op(kind=pb.Op.DEL, key="user:2"),
        ],
        producer=pb.ProducerRef(producer_id=5, producer_epoch=2, sequence=99),
    ),
    "WriteResponse": pb.WriteResponse(
        bucket=17,
        committed=emit_seq(44),
        versions=[pb.KeyVersion(key="user:1", version=9)],
        duplicate=True,
    ),
    "InitProducerRequest": pb.InitProducerRequest(producer_id=0, bucket=17),
    "InitProducerResponse": pb.InitProducerResponse(producer_id=5, producer_epoch=2, bucket=17),
    "TxnRef": pb.TxnRef(transactional_id="orders", epoch=2, number=9, sequence=3),
    "TxnRequest": pb.TxnRequest(
        action=pb.TxnRequest.ADD, transactional_id="orders", epoch=2, number=9, buckets=[0, 3]
    ),
    "TxnResponse": pb.TxnResponse(epoch=2, number=9, coordinator=1, buckets=[0, 3]),
    "TxnMarkRequest": pb.TxnMarkRequest(
        bucket=3, txn=pb.TxnRef(transactional_id="orders", number=9), outcome=1, owner="alice"
    ),
    "TxnMarkResponse": pb.TxnMarkResponse(),
    "ListTransactionsRequest": pb.ListTransactionsRequest(),
    "TransactionInfo": pb.TransactionInfo(
        transactional_id="orders", owner="alice", number=9, phase="ONGOING", buckets=[1]
    ),
    "ListTransactionsResponse": pb.ListTransactionsResponse(
        transactions=[pb.TransactionInfo(transactional_id="orders", number=9)]
    ),
    "GetRequest": pb.GetRequest(key="user:1"),
    "GetResponse": pb.GetResponse(found=True, value=b"alice", version=9, mod_commit_index=44),
    "SyncRequest": pb.SyncRequest(bucket=17, since_commit_index=40, since_key="user:1", limit=500),
    "SyncResponse": pb.SyncResponse(
        items=[pb.KeyValue(key="user:1", value=b"alice", version=9, mod_commit_index=44)],
        has_more=True,
        next_since_commit_index=44,
        next_since_key="user:1",
        applied_index=45,
    ),
    "StartPosition": pb.StartPosition(after=emit_seq(40)),
    "HistoryRequest": pb.HistoryRequest(
        bucket=17,
        query=pb.Query(kind=pb.Query.PREFIX, arg="user:"),
        after=emit_seq(40),
        through_commit_index=90,
    ),
    "HistoryEvent": pb.HistoryEvent(emit_seq=emit_seq(44), delta=pb.Delta(commit_time_ms=5)),
    "HistoryResponse": pb.HistoryResponse(
        events=[pb.HistoryEvent(emit_seq=emit_seq(44), delta=pb.Delta(commit_time_ms=5))],
        more=True,
        next_after=emit_seq(44),
        retained_after=emit_seq(3),
    ),
    "RangeRequest": pb.RangeRequest(
        prefix="user:", limit=50, page_token="k1.dXNlcjox", serializable=True, bucket=2
    ),
    "RangeResponse": pb.RangeResponse(
        items=[pb.KeyValue(key="user:1", value=b"alice", version=9, mod_commit_index=44)],
        next_page_token="k1.dXNlcjox",
    ),
    "BackupRequest": pb.BackupRequest(bucket=3),
    "BackupChunk": pb.BackupChunk(
        bucket=3,
        bucket_uuid="u-3",
        applied_index=120,
        epoch_counter=2,
        total_bytes=5,
        digest="0123456789abcdef",
        data=b"snap!",
    ),
}


@pytest.mark.parametrize("name", list(MESSAGES))
def test_round_trip(name: str) -> None:
    message = MESSAGES[name]
    wire = message.SerializeToString(deterministic=True)
    parsed = type(message).FromString(wire)
    assert parsed == message
    assert parsed.SerializeToString(deterministic=True) == wire


def test_every_top_level_message_is_round_tripped() -> None:
    covered = {type(message).DESCRIPTOR.name for message in MESSAGES.values()}
    nested = {
        "ClientAck",
        "AckResult",
        "Change",
        "Delta",
        "ExpectedVersion",
        "Op",
        "ProducerRef",
        "KeyVersion",
        "KeyValue",
        "SessionItem",
        "StreamEnd",
    }
    assert set(pb.DESCRIPTOR.message_types_by_name) <= covered | nested


def test_oneofs_report_which_kind_is_set() -> None:
    assert pb.StreamMessage(caught_up=pb.CaughtUp()).WhichOneof("kind") == "caught_up"
    assert pb.StreamMessage().WhichOneof("kind") is None
    assert pb.ExpectedVersion().WhichOneof("kind") is None  # unset means any
    assert pb.ExpectedVersion(exact=0).WhichOneof("kind") == "exact"
    parsed = pb.ExpectedVersion.FromString(pb.ExpectedVersion(exact=0).SerializeToString())
    assert parsed.WhichOneof("kind") == "exact"


# -- the codec ---------------------------------------------------------------------------


def test_reconnect_request_names_the_subscriptions_bucket_optionally() -> None:
    assert field_numbers(pb.ReconnectRequest) == {
        "sub_id": 1,
        "last_processed_emit_seq": 2,
        "bucket": 3,
        "packed_changes": 4,
        "group": 15,
    }
    # Presence is kept: bucket 0 is told apart from "not sent" (route by the uuid).
    request = codec.reconnect_request("s", 0, EmitSeq("u", 2, 9))
    parsed = pb.ReconnectRequest.FromString(request.SerializeToString())
    assert parsed.HasField("bucket") and parsed.bucket == 0
    assert not pb.ReconnectRequest(sub_id="s").HasField("bucket")
    assert codec.seq_from_pb(parsed.last_processed_emit_seq) == EmitSeq("u", 2, 9)


def test_codec_round_trips_the_core_types() -> None:
    seq = EmitSeq("b-7f3a", 4, 2**63)
    assert codec.seq_from_pb(pb.EmitSeq.FromString(codec.seq_to_pb(seq).SerializeToString())) == seq
    assert codec.epoch_to_pb(seq.epoch_id) == codec.seq_to_pb(seq).epoch_id
    for op in (
        Op(OpKind.SET, "k", b"\x00v"),
        Op(OpKind.SET, "k", b"v", Expected(ExpectKind.NOT_EXISTS)),
        Op(OpKind.DEL, "k", expected=Expected.exact(7)),
    ):
        assert codec.op_from_pb(pb.Op.FromString(codec.op_to_pb(op).SerializeToString())) == op
    for query in (Query(QueryKind.KEY, "k"), Query(QueryKind.PREFIX, "p/"), Query(QueryKind.ALL)):
        assert codec.query_from_pb(codec.query_to_pb(query)) == query
    delta = Delta((Change("a", OpKind.SET, b"1", 3), Change("b", OpKind.DEL, b"", 2)), 1234)
    msg = codec.delta_to_pb(delta)
    assert [(c.key, c.op, c.value, c.version) for c in msg.changes] == [
        ("a", pb.Change.SET, b"1", 3),
        ("b", pb.Change.DEL, b"", 2),
    ]
    assert msg.commit_time_ms == 1234


_CHANGES = st.lists(
    st.builds(
        Change,
        st.text(max_size=20),
        st.sampled_from(OpKind),
        st.binary(max_size=40),
        st.integers(0, 2**64 - 1),
    ),
    max_size=6,
).map(tuple)


@settings(max_examples=200, deadline=None)
@given(_CHANGES)
def test_packed_changes_carry_exactly_what_the_change_messages_carry(
    changes: tuple[Change, ...],
) -> None:
    unpacked = codec.unpack_changes(codec.pack_changes(changes))
    from_messages = codec.changes_from_pb(codec.delta_to_pb(Delta(changes, 0)).changes)
    assert unpacked == from_messages == changes
    assert all(type(c) is Change and type(c.op) is OpKind for c in unpacked + from_messages)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"\xc1", "not valid msgpack"),
        (b"\x05", "must be an array"),
        (b"\x91\x05", "must be a [key, op, value, version] array"),
        (b"\x91\x93\xa1k\x00\xc4\x00", "must be a [key, op, value, version] array"),
        (b"\x91\x94\xc4\x01k\x00\xc4\x00\x01", "wrong type"),  # key as bytes
        (b"\x91\x94\xa1k\xc3\xc4\x00\x01", "wrong type"),  # op true
        (b"\x91\x94\xa1k\x00\xa1v\x01", "wrong type"),  # value as str
        (b"\x91\x94\xa1k\x00\xc4\x00\xff", "wrong type"),  # version -1
        (b"\x91\x94\xa1k\x07\xc4\x00\x01", "unknown op: 7"),
    ],
)
def test_malformed_packed_changes_are_refused_with_what_is_wrong(data: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        codec.unpack_changes(data)


def test_codec_refuses_what_the_core_refuses() -> None:
    with pytest.raises(ValueError):
        codec.op_from_pb(pb.Op(kind=7, key="k"))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        codec.op_from_pb(pb.Op(kind=pb.Op.DEL, key="k", value=b"v"))
    with pytest.raises(InvalidArgument):
        codec.query_from_pb(pb.Query(kind=pb.Query.KEY))
    with pytest.raises(ValueError):
        codec.query_from_pb(pb.Query(kind=9))  # type: ignore[arg-type]


def test_the_codecs_tables_cover_every_value() -> None:
    assert set(codec.STATUS_OF) == set(ErrorCode)
    assert set(codec.ACK_STATUS) == set(AckStatus)
    assert set(codec.RECONNECT_STATUS) == set(ReconnectStatus)
    for status, value in codec.RECONNECT_STATUS.items():
        assert pb.ReconnectAck.Status.Name(value) == status.name
    assert codec.trailers(None, "") == ()
    assert codec.trailers("n:1", "NOT_OWNER") == (
        (codec.LEADER_HINT_KEY, "n:1"),
        (codec.ERROR_CODE_KEY, "NOT_OWNER"),
    )
    assert codec.trailers(None, codec.RATE_LIMITED, 250) == (
        (codec.ERROR_CODE_KEY, "RATE_LIMITED"),
        ("sevendb-retry-after-ms", "250"),
    )
