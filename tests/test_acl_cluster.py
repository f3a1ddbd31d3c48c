"""Access control on a real cluster (issue 29): producer-id ownership, and the ACL
matrix - every client RPC called by a principal allowed to and by one that is not.
One cluster for the whole module (CI time)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from cluster_harness import STARTED, LocalCluster, RawStream, wait_for
from test_cli_bad_input import Run, sevendb

from sevendb.cluster.common.acl import Grant, Permission
from sevendb.cluster.common.auth import auth_metadata
from sevendb.outbox.keys import bucket_of
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk import InvalidArgument

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path_factory.mktemp("acl") / "data", buckets=2)
    try:
        c.wait_settled()
        with c.admin() as admin:
            admin.grant(Grant("reader", Permission.READ, "m/"))
            admin.grant(Grant("writer", Permission.WRITE, "m/"))
            admin.grant(Grant("ops", Permission.ADMIN))
        c.grant_all("mallory")  # may write every key: only the producer id is not hers
        yield c
    finally:
        c.stop()


@pytest.fixture
def live(cluster: LocalCluster) -> LocalCluster:
    STARTED.append(Path(cluster.data_dir))
    return cluster


def _stub(cluster: LocalCluster) -> pb_grpc.SevenDBStub:
    return cluster.stub(cluster.spec.nodes[0].grpc_address)


def _as(cluster: LocalCluster, principal: str) -> tuple[tuple[str, str], ...]:
    return auth_metadata(cluster.token(principal))


def test_another_principal_cannot_init_or_write_with_my_producer_id(live: LocalCluster) -> None:
    """The defect of issue 29: any principal could InitProducer another's producer id,
    which fenced the owner (its next write: PRODUCER_FENCED), or write with it."""
    stub, mine, theirs = _stub(live), _as(live, "default"), _as(live, "mallory")
    made = stub.InitProducer(pb.InitProducerRequest(bucket=0), metadata=mine, timeout=10)
    with pytest.raises(grpc.RpcError) as denied:
        stub.InitProducer(
            pb.InitProducerRequest(producer_id=made.producer_id, bucket=0),
            metadata=theirs,
            timeout=10,
        )
    assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "ownership" in (denied.value.details() or "")
    key = next(f"own/{i}" for i in range(100) if _bucket(live, f"own/{i}") == 0)
    ref = pb.ProducerRef(producer_id=made.producer_id, producer_epoch=made.producer_epoch)
    op = pb.Op(kind=pb.Op.SET, key=key, value=b"stolen")
    with pytest.raises(grpc.RpcError) as stolen:
        stub.Write(pb.WriteRequest(ops=[op], producer=ref), metadata=theirs, timeout=10)
    assert stolen.value.code() is grpc.StatusCode.PERMISSION_DENIED
    # The owner was neither fenced nor robbed of its sequence 0.
    op.value = b"mine"
    written = stub.Write(pb.WriteRequest(ops=[op], producer=ref), metadata=mine, timeout=10)
    assert not written.duplicate
    got = stub.Get(pb.GetRequest(key=key), metadata=mine, timeout=10)
    assert got.value == b"mine"


def _bucket(cluster: LocalCluster, key: str) -> int:
    return bucket_of(key, len(cluster.spec.buckets))


# ---- the ACL matrix: every RPC, a principal allowed and one denied ----------------------

PD = grpc.StatusCode.PERMISSION_DENIED
OK = grpc.StatusCode.OK
BUCKET = 0


def _code(fn: Callable[[], object]) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return OK


class _Matrix:
    """Calls of one RPC as a principal, against the cluster."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.stub = _stub(cluster)
        holder = cluster.spec.node(cluster.holder_node(BUCKET)).grpc_address
        self.holder = cluster.stub(holder)
        self.keys = [k for k in (f"m/{i:03}" for i in range(60)) if _bucket(cluster, k) == BUCKET]

    def md(self, principal: str) -> tuple[tuple[str, str], ...]:
        return _as(self.cluster, principal)

    def write(self, principal: str, key: str) -> grpc.StatusCode:
        op = pb.Op(kind=pb.Op.SET, key=key, value=b"v")
        return _code(
            lambda: self.stub.Write(
                pb.WriteRequest(ops=[op]), metadata=self.md(principal), timeout=10
            )
        )

    def write_many(self, principal: str, key: str) -> grpc.StatusCode:
        request = pb.WriteManyRequest(
            writes=[pb.WriteRequest(ops=[pb.Op(kind=pb.Op.SET, key=key, value=b"v")])]
        )
        got = self.stub.WriteMany(request, metadata=self.md(principal), timeout=10)
        return grpc.StatusCode.OK if got.outcomes[0].HasField("ok") else _status(got.outcomes[0])

    def write_stream(self, principal: str, key: str) -> grpc.StatusCode:
        request = pb.WriteManyRequest(
            id=1, writes=[pb.WriteRequest(ops=[pb.Op(kind=pb.Op.DEL, key=key)])]
        )
        answers = self.stub.WriteStream(iter([request]), metadata=self.md(principal), timeout=10)
        outcome = next(iter(answers)).answers[0].outcomes[0]
        return grpc.StatusCode.OK if outcome.HasField("ok") else _status(outcome)

    def subscribe(self, principal: str, prefix: str, sub_id: str) -> RawStream:
        request = pb.SubscribeRequest(
            bucket=BUCKET, sub_id=sub_id, query=pb.Query(kind=pb.Query.PREFIX, arg=prefix)
        )
        return RawStream(self.holder.Subscribe(request, metadata=self.md(principal)))


def _status(outcome: pb.WriteOutcome) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == outcome.code)


def test_the_acl_matrix_every_rpc_allowed_and_denied(live: LocalCluster) -> None:
    """Each client RPC, called by a principal whose grants allow it and by one whose
    grants do not: PERMISSION_DENIED naming the permission, or the unreadable keys left
    out (Sync, Range, MetaRead), or another's subscription not found."""
    m = _Matrix(live)
    key, other = m.keys[0], m.keys[1]
    seen: dict[str, tuple[object, object]] = {}
    # Writes: write on m/ (writer) yes; read only (reader) no.
    seen["Write"] = (m.write("writer", key), m.write("reader", key))
    seen["WriteMany"] = (m.write_many("writer", other), m.write_many("reader", other))
    seen["WriteStream"] = (m.write_stream("writer", other), m.write_stream("reader", other))
    assert m.write("writer", "elsewhere") is PD  # only under its prefix
    init = pb.InitProducerRequest(bucket=BUCKET)
    seen["InitProducer"] = (
        _code(lambda: m.stub.InitProducer(init, metadata=m.md("writer"), timeout=10)),
        _code(lambda: m.stub.InitProducer(init, metadata=m.md("reader"), timeout=10)),
    )
    # Transactions: INIT needs what InitProducer needs; TxnMark and ListTransactions
    # are for nodes and administrators.
    init_txn = pb.TxnRequest(action=pb.TxnRequest.INIT, transactional_id="acl-txn")
    seen["Txn"] = (
        _code(lambda: m.stub.Txn(init_txn, metadata=m.md("writer"), timeout=10)),
        _code(lambda: m.stub.Txn(init_txn, metadata=m.md("reader"), timeout=10)),
    )
    join = pb.TxnMarkRequest(
        bucket=BUCKET, txn=pb.TxnRef(transactional_id="acl-txn", number=1), owner="writer"
    )
    seen["TxnMark"] = (
        _code(lambda: m.stub.TxnMark(join, metadata=m.md("ops"), timeout=10)),
        _code(lambda: m.stub.TxnMark(join, metadata=m.md("writer"), timeout=10)),
    )
    txn_listing = pb.ListTransactionsRequest()
    seen["ListTransactions"] = (
        _code(lambda: m.stub.ListTransactions(txn_listing, metadata=m.md("ops"), timeout=10)),
        _code(lambda: m.stub.ListTransactions(txn_listing, metadata=m.md("writer"), timeout=10)),
    )
    with pytest.raises(grpc.RpcError) as named:
        m.stub.Write(
            pb.WriteRequest(ops=[pb.Op(kind=pb.Op.SET, key=key, value=b"x")]),
            metadata=m.md("reader"),
            timeout=10,
        )
    assert "lacks the write permission on key" in (named.value.details() or "")
    # Reads: read on m/ (reader) yes; write only (writer) no / left out.
    get = pb.GetRequest(key=key)
    seen["Get"] = (
        _code(lambda: m.stub.Get(get, metadata=m.md("reader"), timeout=10)),
        _code(lambda: m.stub.Get(get, metadata=m.md("writer"), timeout=10)),
    )
    sync = pb.SyncRequest(bucket=BUCKET, limit=1000)
    synced = {
        p: {i.key for i in m.stub.Sync(sync, metadata=m.md(p), timeout=10).items}
        for p in ("reader", "writer")
    }
    seen["Sync"] = (key in synced["reader"], bool(synced["writer"]))
    ranged = {
        p: [
            i.key
            for i in m.stub.Range(pb.RangeRequest(prefix="m/"), metadata=m.md(p), timeout=10).items
        ]
        for p in ("reader", "writer")
    }
    seen["Range"] = (key in ranged["reader"], bool(ranged["writer"]))
    history = pb.HistoryRequest(bucket=BUCKET, query=pb.Query(kind=pb.Query.PREFIX, arg="m/"))
    historied = {
        p: [
            c.key
            for e in m.stub.History(history, metadata=m.md(p), timeout=10).events
            for c in e.delta.changes
        ]
        for p in ("reader", "writer")
    }
    seen["History"] = (key in historied["reader"], bool(historied["writer"]))
    # Subscriptions: reader may watch m/ (not everything); writer may not watch m/.
    sub = m.subscribe("reader", "m/", "acl-reader")
    assert sub.first().HasField("sub_ack")
    seen["Subscribe"] = (sub.code(), m.subscribe("writer", "m/", "acl-writer").code())
    assert m.subscribe("reader", "", "acl-all").code() is PD  # covered only in part
    m.write("default", key)
    wait_for(lambda: sub.events(), 30, "the reader's event")
    position = sub.events()[-1].emit_seq
    sub.call.cancel()
    ack = pb.AckBatch(acks=[pb.ClientAck(sub_id="acl-reader", up_to_emit_seq=position)])
    acked = {
        p: m.holder.Ack(ack, metadata=m.md(p), timeout=10).results[0].status
        for p in ("writer", "reader")
    }
    seen["Ack"] = (acked["reader"], acked["writer"])
    reconnect = pb.ReconnectRequest(sub_id="acl-reader", last_processed_emit_seq=position)
    again = {
        p: RawStream(m.holder.Reconnect(reconnect, metadata=m.md(p))) for p in ("reader", "writer")
    }
    seen["Reconnect"] = (
        again["reader"].first().HasField("reconnect_ack"),
        again["writer"].code(),
    )
    again["reader"].call.cancel()
    session = {
        p: m.holder.Session(
            iter(
                [
                    pb.SessionRequests(
                        requests=[
                            pb.SessionRequest(
                                stream_id=1,
                                subscribe=pb.SubscribeRequest(
                                    bucket=BUCKET,
                                    sub_id=f"acl-session-{p}",
                                    query=pb.Query(kind=pb.Query.PREFIX, arg="m/"),
                                ),
                            )
                        ]
                    )
                ]
            ),
            metadata=m.md(p),
            timeout=10,
        )
        for p in ("reader", "writer")
    }
    first = {p: next(iter(call)).items[0] for p, call in session.items()}
    for call in session.values():
        call.cancel()
    seen["Session"] = (
        first["reader"].message.HasField("sub_ack"),
        grpc.StatusCode(_by_value(first["writer"].end.code)),
    )
    # Administration: a principal granted admin (ops) yes, others no.
    admin_calls: dict[str, Callable[[str], object]] = {
        "AddMember": lambda p: m.stub.AddMember(
            pb.MemberRequest(bucket=99), metadata=m.md(p), timeout=10
        ),
        "RemoveMember": lambda p: m.stub.RemoveMember(
            pb.MemberRequest(bucket=99), metadata=m.md(p), timeout=10
        ),
        "TransferLeader": lambda p: m.stub.TransferLeader(
            pb.MemberRequest(bucket=99), metadata=m.md(p), timeout=10
        ),
        "CreateEpoch": lambda p: m.stub.CreateEpoch(
            pb.EpochRequest(bucket=99), metadata=m.md(p), timeout=10
        ),
        "RecoverBucket": lambda p: m.stub.RecoverBucket(
            pb.RecoverRequest(bucket=99), metadata=m.md(p), timeout=10
        ),
        "BackupBucket": lambda p: list(
            m.stub.BackupBucket(pb.BackupRequest(bucket=99), metadata=m.md(p), timeout=10)
        ),
        "MetaWrite": lambda p: m.stub.MetaWrite(
            pb.MetaWriteRequest(ops=[pb.MetaOp(key="acl/x/fly/", value=b"{}")]),
            metadata=m.md(p),
            timeout=10,
        ),
        "JoinBundle": lambda p: m.stub.JoinBundle(
            pb.JoinBundleRequest(), metadata=m.md(p), timeout=10
        ),
        "MintToken": lambda p: m.stub.MintToken(
            pb.MintTokenRequest(principal="someone", ttl_s=60), metadata=m.md(p), timeout=10
        ),
    }
    for name, call in admin_calls.items():
        seen[name] = (_code(lambda c=call: c("ops")), _code(lambda c=call: c("writer")))  # type: ignore[misc]
    meta = {
        p: [
            r.key
            for r in m.stub.MetaRead(pb.MetaReadRequest(), metadata=m.md(p), timeout=10).records
        ]
        for p in ("ops", "nobody")
    }
    seen["MetaRead"] = (
        any(k.startswith("acl/") for k in meta["ops"]),
        any(k.startswith("acl/") for k in meta["nobody"]),
    )
    listing = pb.ListSubscriptionsRequest(bucket=BUCKET)
    listed = {
        p: {
            s.sub_id
            for s in m.stub.ListSubscriptions(listing, metadata=m.md(p), timeout=10).subscriptions
        }
        for p in ("ops", "writer")
    }
    seen["ListSubscriptions"] = ("acl-reader" in listed["ops"], "acl-reader" in listed["writer"])
    show = pb.SubscriptionRequest(bucket=BUCKET, sub_id="acl-reader")
    seen["ShowSubscription"] = (
        _code(lambda: m.stub.ShowSubscription(show, metadata=m.md("ops"), timeout=10)),
        _code(lambda: m.stub.ShowSubscription(show, metadata=m.md("writer"), timeout=10)),
    )
    beat = pb.GroupBeatRequest(
        bucket=BUCKET, group="acl", member="m1", query=pb.Query(kind=pb.Query.PREFIX, arg="m/")
    )
    seen["GroupBeat"] = (
        _code(lambda: m.stub.GroupBeat(beat, metadata=m.md("reader"), timeout=10)),
        _code(lambda: m.stub.GroupBeat(beat, metadata=m.md("writer"), timeout=10)),
    )
    unsubscribe = pb.UnsubscribeRequest(sub_id="acl-reader", bucket=BUCKET)
    denied_unsubscribe = _code(
        lambda: m.stub.Unsubscribe(unsubscribe, metadata=m.md("writer"), timeout=10)
    )
    seen["Unsubscribe"] = (
        _code(lambda: m.stub.Unsubscribe(unsubscribe, metadata=m.md("reader"), timeout=10)),
        denied_unsubscribe,
    )
    drop = pb.SubscriptionRequest(bucket=BUCKET, sub_id="acl-session-reader")
    denied_drop = _code(
        lambda: m.stub.DeleteSubscription(drop, metadata=m.md("writer"), timeout=10)
    )
    seen["DeleteSubscription"] = (
        _code(lambda: m.stub.DeleteSubscription(drop, metadata=m.md("ops"), timeout=10)),
        denied_drop,
    )
    # No token at all: anyone.
    seen["Status"] = (_code(lambda: m.stub.Status(pb.StatusRequest(), timeout=10)), None)
    seen["ClusterInfo"] = (
        _code(lambda: m.stub.ClusterInfo(pb.ClusterInfoRequest(), timeout=10)),
        None,
    )

    invalid, not_found = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    accepted, not_owner = pb.AckResult.ACCEPTED, pb.AckResult.NOT_OWNER
    expected: dict[str, tuple[object, object]] = {
        "Write": (OK, PD),
        "WriteMany": (OK, PD),
        "WriteStream": (OK, PD),
        "InitProducer": (OK, PD),
        "Txn": (OK, PD),
        "TxnMark": (OK, PD),
        "ListTransactions": (OK, PD),
        "Get": (OK, PD),
        "Sync": (True, False),  # the writer's page leaves the m/ keys out
        "Range": (True, False),
        "History": (True, False),  # the writer's page leaves the m/ changes out
        "Subscribe": (OK, PD),
        "Reconnect": (True, PD),  # another's subscription: NOT_OWNER
        "Session": (True, PD),
        "Ack": (accepted, not_owner),
        "Unsubscribe": (OK, PD),  # another's subscription: NOT_OWNER
        "GroupBeat": (OK, PD),  # a member must be able to read its query
        "AddMember": (invalid, PD),  # allowed: refused past the check (no bucket 99)
        "RemoveMember": (invalid, PD),
        "TransferLeader": (invalid, PD),
        "CreateEpoch": (invalid, PD),
        "RecoverBucket": (invalid, PD),
        "BackupBucket": (invalid, PD),
        "MetaWrite": (invalid, PD),  # allowed: a malformed acl/ record refused
        "JoinBundle": (OK, PD),
        "MintToken": (OK, PD),
        "MetaRead": (True, False),  # acl/ records only for administrators
        "ListSubscriptions": (True, False),
        "ShowSubscription": (OK, not_found),  # another's: not even its existence
        "DeleteSubscription": (OK, not_found),
        "Status": (OK, None),  # no token needed: nothing to deny
        "ClusterInfo": (OK, None),
    }
    methods = {method.name for method in pb.DESCRIPTOR.services_by_name["SevenDB"].methods}
    assert set(expected) == methods, "a new RPC needs its row in the ACL matrix"
    assert seen == expected


def _by_value(code: int) -> tuple[int, str]:
    return next(c.value for c in grpc.StatusCode if c.value[0] == code)


def test_a_revoked_reader_receives_nothing_more_and_cannot_resume(live: LocalCluster) -> None:
    """A grant taken back while the subscription streams: the next change it would
    deliver ends the stream PERMISSION_DENIED instead (the subscriber never receives
    it), and a Reconnect is refused; granted again, it resumes where it was."""
    m = _Matrix(live)
    grant = Grant("watcher", Permission.READ, "m/")
    with live.admin() as admin:
        admin.grant(grant)
    sub = m.subscribe("watcher", "m/", "acl-watcher")
    assert sub.first().HasField("sub_ack")
    m.write("default", m.keys[2])
    wait_for(lambda: sub.events(), 30, "the first event")
    position = sub.events()[-1].emit_seq
    with live.admin() as admin:
        assert admin.revoke_grant(grant)
    m.write("default", m.keys[3])
    wait_for(lambda: sub.ended.is_set(), 30, "the stream's end")
    assert sub.error is not None and sub.error.code() is PD
    assert "lacks the read permission on key" in (sub.error.details() or "")
    assert [e.delta.changes[0].key for e in sub.events()] == [m.keys[2]]
    reconnect = pb.ReconnectRequest(sub_id="acl-watcher", last_processed_emit_seq=position)
    refused = RawStream(m.holder.Reconnect(reconnect, metadata=m.md("watcher")))
    assert refused.code() is PD
    with live.admin() as admin:
        admin.grant(grant)
    resumed = RawStream(m.holder.Reconnect(reconnect, metadata=m.md("watcher")))
    wait_for(lambda: resumed.events(), 30, "the change after the revocation, now granted")
    assert resumed.events()[0].delta.changes[0].key == m.keys[3]
    resumed.call.cancel()


# ---- the CLI: acl grant|revoke|list, range, delete ----------------------------------------


def _cli(cluster: LocalCluster, *args: str, token: str | None = None) -> Run:
    extra = ("--token", token) if token else ()
    return sevendb(*args, *extra, data=cluster.data_dir)


def test_acl_commands_grant_list_and_revoke_and_refuse_bad_input(live: LocalCluster) -> None:
    granted = _cli(live, "acl", "grant", "cli-user", "read", "--prefix", "cli/")
    assert granted.code == 0, granted.err
    assert granted.out.strip() == "granted: cli-user read prefix 'cli/'"
    again = _cli(live, "acl", "grant", "cli-user", "read", "--prefix", "cli/")
    assert again.out.strip() == "already: cli-user read prefix 'cli/'"
    listed = _cli(live, "acl", "list", "cli-user")
    assert listed.out.strip() == "cli-user read prefix 'cli/'"
    everyone = _cli(live, "acl", "list").out.splitlines()
    assert "default read every key" in everyone and "ops admin (cluster)" in everyone
    for bad, says in (
        (("cli-user", "fly"), "unknown permission 'fly'"),
        (("bad name!", "read"), "principal 'bad name!'"),
        (("cli-user", "admin", "--prefix", "x/"), "admin is granted on the cluster"),
    ):
        run = _cli(live, "acl", "grant", *bad)
        assert run.code == 2
        run.one_line_error("InvalidArgument", says)
    denied = _cli(live, "acl", "grant", "cli-user", "write", token=live.token("writer"))
    assert denied.code == 1
    denied.one_line_error("PERMISSION_DENIED", "lacks the admin permission")
    assert _cli(live, "acl", "list", "cli-user").out.strip() == "cli-user read prefix 'cli/'"
    revoked = _cli(live, "acl", "revoke", "cli-user", "read", "--prefix", "cli/")
    assert revoked.out.strip() == "revoked: cli-user read prefix 'cli/'"
    gone = _cli(live, "acl", "revoke", "cli-user", "read", "--prefix", "cli/")
    assert gone.code == 0 and gone.out.strip() == "no such grant: cli-user read prefix 'cli/'"
    assert _cli(live, "acl", "list", "cli-user").out.strip() == "no grants for cli-user"


def test_range_pages_in_key_order_across_buckets_and_leaves_out_unreadable_keys(
    live: LocalCluster,
) -> None:
    keys = [f"rng/{i:02}" for i in range(23)]
    with live.client() as client:
        for key in keys:
            client.put(key, key.encode())
        client.put("rnh/outside", b"x")
        client.put("m/range", b"r")  # one key the reader may read
        assert {_bucket(live, k) for k in keys} == {0, 1}  # the range spans both buckets
        pages, token = [], ""
        while True:
            page = client.range(prefix="rng/", limit=5, page_token=token)
            pages.append([r.key for r in page.records])
            token = page.next_page_token
            if not token:
                break
        assert [k for p in pages for k in p] == keys
        assert all(len(p) <= 5 for p in pages)
        window = client.range(start="rng/05", end="rng/09")
        assert [r.key for r in window.records] == keys[5:9]
        assert [r.value for r in window.records] == [k.encode() for k in keys[5:9]]
        stale_ok = client.range(prefix="rng/", serializable=True, limit=100)
        assert [r.key for r in stale_ok.records] == keys
        with pytest.raises(InvalidArgument):
            client.range(prefix="rng/", start="a")
        with pytest.raises(InvalidArgument, match="page_token"):
            client.range(prefix="rng/", page_token="not-a-token")
    with live.client(principal="reader") as reader:
        # reader may read m/ only: everything else is left out, paging still ends
        seen, token = [], ""
        while True:
            page = reader.range(limit=7, page_token=token)
            seen += [r.key for r in page.records]
            token = page.next_page_token
            if not token:
                break
        assert "m/range" in seen and all(k.startswith("m/") for k in seen)
        assert seen == sorted(seen)


def test_cli_range_and_delete(live: LocalCluster) -> None:
    with live.client() as client:
        for i in range(4):
            client.put(f"clr/{i}", f"v{i}".encode())
    listed = _cli(live, "range", "--prefix", "clr/", "--limit", "3")
    assert listed.code == 0, listed.err
    assert [json.loads(line)["key"] for line in listed.out.splitlines()] == [
        f"clr/{i}" for i in range(4)
    ]
    capped = _cli(live, "range", "--prefix", "clr/", "--max", "2")
    assert len(capped.out.splitlines()) == 2
    deleted = _cli(live, "delete", "clr/1")
    assert deleted.code == 0 and json.loads(deleted.out)["deleted"] is True
    assert _cli(live, "get", "clr/1").code == 1
    guarded = _cli(live, "delete", "clr/2", "--expect-version", "7")
    assert guarded.code == 1
    guarded.one_line_error("PreconditionFailed")
    assert _cli(live, "get", "clr/2").code == 0
    both = _cli(live, "range", "--prefix", "clr/", "--start", "a")
    assert both.code == 2
    both.one_line_error("InvalidArgument", "not both")
    refused = _cli(live, "delete", "clr/3", token=live.token("reader"))
    assert refused.code == 1
    # The SDK inits its producer first: a principal with no write grant at all is
    # refused there, told which grant includes the permission.
    refused.one_line_error("PermissionDenied", "lacks the idempotent_write permission", "write")
    watch = _cli(live, "subscribe", "prefix:clr/", "--count", "1", token=live.token("writer"))
    assert watch.code == 1
    watch.one_line_error("PERMISSION_DENIED", "lacks the read permission on every key under")
