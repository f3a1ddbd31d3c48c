"""Transactions on a real cluster (issue 29, docs/transactions.md): atomic writes across
buckets, invisible until the commit; abort; fencing of an earlier instance; a write to
a bucket not added; the timeout; listing. One cluster for the module (CI time)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_harness import STARTED, LocalCluster, wait_for
from test_cli_bad_input import sevendb

from sevendb.cluster.common.auth import auth_metadata
from sevendb.cluster.common.layout import node_dir
from sevendb.cluster.server.faults import KILL_AFTER_TXN_DECISION, fault_file
from sevendb.outbox.keys import bucket_of
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk import (
    AckMode,
    InvalidTxnState,
    ProducerFenced,
    SubscribeOptions,
    TransactionTimedOut,
)
from sevendb.sdk.client import Client, Transaction
from sevendb.sdk.streams import Event
from sevendb.sdk.subscription import Subscription

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path_factory.mktemp("txn") / "data", buckets=2)
    try:
        c.wait_settled()
        yield c
    finally:
        c.stop()


@pytest.fixture
def live(cluster: LocalCluster) -> LocalCluster:
    STARTED.append(Path(cluster.data_dir))
    return cluster


def keys_in_both(prefix: str) -> tuple[str, str]:
    a = next(f"{prefix}{i}" for i in range(100) if bucket_of(f"{prefix}{i}", 2) == 0)
    b = next(f"{prefix}{i}" for i in range(100) if bucket_of(f"{prefix}{i}", 2) == 1)
    return a, b


def test_a_transaction_across_buckets_is_visible_at_the_commit_and_delivered_whole(
    live: LocalCluster,
) -> None:
    a, b = keys_in_both("t1/")
    with live.client() as client:
        sub = client.subscribe("prefix:t1/")
        with client.transaction("t1-app") as txn:
            txn.put(a, b"1")
            txn.put(b, b"2")
            txn.put(a + "x", b"3")
            assert client.get(a) is None and client.get(b) is None  # pending: invisible
        assert client.get(a) is not None and client.get(b) is not None
        seen: dict[str, bytes] = {}
        events = 0
        for event in sub:
            events += 1
            for change in event.changes:
                seen[change.key] = change.value
            if len(seen) == 3:
                break
        assert seen == {a: b"1", b: b"2", a + "x": b"3"}
        assert events == 2  # one per bucket: each at its COMMIT marker
        sub.close()


def test_an_aborted_transaction_is_never_visible(live: LocalCluster) -> None:
    a, b = keys_in_both("t2/")
    with live.client() as client:
        txn = client.transaction("t2-app")
        txn.put(a, b"1")
        txn.put(b, b"2")
        txn.abort()
        with pytest.raises(RuntimeError), client.transaction("t2-app") as doomed:
            doomed.put(a, b"3")
            raise RuntimeError("the block fails: the transaction aborts")
        client.put(b + "marker", b"after")
        assert client.get(a) is None and client.get(b) is None
        # the next transaction of the id commits
        with client.transaction("t2-app") as txn:
            txn.put(a, b"4")
        record = client.get(a)
        assert record is not None and record.value == b"4"


def test_a_second_instance_fences_the_first(live: LocalCluster) -> None:
    a, b = keys_in_both("t3/")
    with live.client() as first, live.client() as second:
        zombie = first.transaction("t3-app")
        zombie.put(a, b"zombie")
        with second.transaction("t3-app") as txn:  # INIT: fences the first instance
            txn.put(b, b"new")
        with pytest.raises(ProducerFenced):
            zombie.put(b, b"zombie")
            zombie.commit()
        assert first.get(a) is None
        record = first.get(b)
        assert record is not None and record.value == b"new"


def test_a_write_to_a_bucket_not_added_is_refused(live: LocalCluster) -> None:
    a, b = keys_in_both("t4/")
    with live.client() as client:
        txn = client.transaction("t4-app")
        txn.put(a, b"1")  # adds bucket of a only
        stub = live.stub(live.spec.nodes[0].grpc_address)
        ref = pb.TxnRef(transactional_id="t4-app", epoch=0, number=txn.number, sequence=1)
        request = pb.WriteRequest(ops=[pb.Op(kind=pb.Op.SET, key=b, value=b"x")], txn=ref)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Write(request, metadata=auth_metadata(live.token()), timeout=10)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "not added" in (refused.value.details() or "")
        txn.abort()


def test_a_transaction_past_its_timeout_is_aborted_and_listed_until_then(
    live: LocalCluster,
) -> None:
    a, _ = keys_in_both("t5/")
    stub = live.stub(live.spec.nodes[0].grpc_address)
    admin = auth_metadata(live.token("admin"))
    with live.client() as client:
        txn = client.transaction("t5-app", timeout_ms=1500)
        txn.put(a, b"late")
        listed = stub.ListTransactions(pb.ListTransactionsRequest(), metadata=admin, timeout=10)
        mine = [t for t in listed.transactions if t.transactional_id == "t5-app"]
        assert [(t.phase, t.number) for t in mine] == [("ONGOING", txn.number)]

        def gone() -> bool:
            answer = stub.ListTransactions(pb.ListTransactionsRequest(), metadata=admin, timeout=10)
            return not [t for t in answer.transactions if t.transactional_id == "t5-app"]

        wait_for(gone, 30, "the coordinator to abort the transaction past its timeout")
        with pytest.raises(TransactionTimedOut):
            txn.commit()
        assert client.get(a) is None


def test_cli_lists_an_open_transaction_and_resolves_it(live: LocalCluster) -> None:
    a, b = keys_in_both("t6/")
    with live.client() as client:
        txn = client.transaction("t6-app")
        txn.put(a, b"1")
        txn.put(b, b"2")
        listed = sevendb("txn", "list", "--json", data=live.data_dir)
        assert listed.code == 0, listed.err
        (row,) = [r for r in json.loads(listed.out) if r["transactional_id"] == "t6-app"]
        assert (row["phase"], row["buckets"], row["owner"]) == ("ONGOING", [0, 1], "default")
        done = sevendb("txn", "resolve", "t6-app", str(txn.number), "commit", data=live.data_dir)
        assert done.code == 0, done.err
        assert "commit decided" in done.out
        wait_for(lambda: client.get(b) is not None, 30, "the resolved commit's markers")
        record = client.get(a)
        assert record is not None and record.value == b"1"
        # the owner's own commit is answered as the decision it matches (an abort is not)
        txn.commit()
        stub = live.stub(live.spec.nodes[0].grpc_address)
        abort = pb.TxnRequest(
            action=pb.TxnRequest.ABORT, transactional_id="t6-app", number=txn.number
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.Txn(abort, metadata=auth_metadata(live.token()), timeout=10)
        assert "already decided (COMMIT)" in (refused.value.details() or "")
        bad = sevendb("txn", "resolve", "t6-app", "99", "abort", data=live.data_dir)
        assert bad.code == 1 and "never begun" in bad.err
        assert "Traceback" not in bad.err


def test_read_uncommitted_sees_an_aborted_write_read_committed_never(live: LocalCluster) -> None:
    a, _ = keys_in_both("t7/")
    with live.client() as client:
        dirty = client.subscribe(
            "prefix:t7/", options=SubscribeOptions(isolation="read_uncommitted")
        )
        clean = client.subscribe("prefix:t7/")
        txn = client.transaction("t7-app")
        txn.put(a, b"never")
        txn.abort()
        client.put(a, b"plain")
        got_dirty = [(c.key, c.value, c.version) for e in _take(dirty, 2) for c in e.changes]
        assert got_dirty == [(a, b"never", 0), (a, b"plain", 1)]
        got_clean = [(c.key, c.value, c.version) for e in _take(clean, 1) for c in e.changes]
        assert got_clean == [(a, b"plain", 1)]
        dirty.close()
        clean.close()


def test_a_commit_is_aborted_when_a_participant_lacks_the_writes_sent_to_it(
    live: LocalCluster,
) -> None:
    """The COMMIT names how many writes went to each bucket; each bucket is checked
    (PREPARE) before the decision. One that does not hold them (here: the COMMIT claims
    one write more than bucket b took) makes the transaction abort instead, in every
    bucket, so no COMMIT marker ever meets a participant without its writes."""
    a, b = keys_in_both("t9/")
    with live.client() as client:
        sub = client.subscribe("prefix:t9/")
        txn = client.transaction("t9-app")
        txn.put(a, b"1")
        txn.put(b, b"2")
        session = client._core._txn_sessions["t9-app"]
        commit = pb.TxnRequest(
            action=pb.TxnRequest.COMMIT,
            transactional_id="t9-app",
            epoch=session.epoch,
            number=txn.number,
            buckets=[0, 1],
            writes=[1, 2],
        )
        stub = live.stub(live.spec.nodes[0].grpc_address)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Txn(commit, metadata=auth_metadata(live.token()), timeout=30)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        detail = refused.value.details() or ""
        assert "is aborted, not committed: bucket 1:" in detail
        assert "holds 1 of the 2 writes sent to it" in detail
        with pytest.raises(InvalidTxnState, match="already decided"):
            txn.commit()  # the SDK's own commit: the abort stands
        client.put(a + "after", b"plain")
        (event,) = _take(sub, 1)  # nothing of the transaction before the plain write
        assert [c.key for c in event.changes] == [a + "after"]
        assert client.get(a) is None and client.get(b) is None
        sub.close()
        # the SDK's commit sends the counts: a transaction as written commits
        with client.transaction("t9-app") as ok:
            ok.put(a, b"3")
            ok.put(b, b"4")
            ok.put(b + "x", b"5")
        record = client.get(b + "x")
        assert record is not None and record.value == b"5"


def _take(sub: Subscription, n: int) -> list[Event]:
    out = []
    for event in sub:
        out.append(event)
        if len(out) == n:
            break
    return out


@pytest.fixture
def faulty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    monkeypatch.setenv("SEVENDB_TEST_FAULTS", "1")
    c = LocalCluster.start(tmp_path / "data", buckets=2)
    try:
        c.wait_settled()
        yield c
    finally:
        c.stop()


def _commit_killing(faulty: LocalCluster, client: Client, txn: Transaction, victim: str) -> None:
    """COMMIT `txn` through node `victim`, armed to die once the decision is committed
    and before any marker (fault point `kill-after-txn-decision`)."""
    epoch = client._core._txn_sessions[txn.transactional_id].epoch
    address = next(n.grpc_address for n in faulty.spec.nodes if n.node_id == victim)
    fault_file(node_dir(faulty.data_dir, victim), KILL_AFTER_TXN_DECISION).touch()
    commit = pb.TxnRequest(
        action=pb.TxnRequest.COMMIT,
        transactional_id=txn.transactional_id,
        epoch=epoch,
        number=txn.number,
    )
    with pytest.raises(grpc.RpcError):  # the node dies inside the call
        faulty.stub(address).Txn(commit, metadata=auth_metadata(faulty.token()), timeout=10)


def test_a_decided_commit_is_finished_after_the_deciding_node_is_killed(
    faulty: LocalCluster,
) -> None:
    """kill -9 of the node that took the COMMIT, after the decision committed and before
    any marker: the coordinator's leader (a survivor) writes the markers."""
    a, b = keys_in_both("t8/")
    nodes = faulty.spec.nodes
    victim = nodes[0]
    with faulty.client() as client:
        txn = client.transaction("t8-app")
        txn.put(a, b"1")
        txn.put(b, b"2")
        _commit_killing(faulty, client, txn, victim.node_id)
        wait_for(lambda: faulty.status(victim.node_id) is None, 30, "the victim to die")

        def both() -> bool:
            return client.get(a) is not None and client.get(b) is not None

        wait_for(both, 60, "the survivors' driver to write the COMMIT markers")
        record = client.get(b)
        assert record is not None and record.value == b"2"
        stub = faulty.stub(nodes[1].grpc_address)
        admin = auth_metadata(faulty.token("admin"))

        def complete() -> bool:
            listed = stub.ListTransactions(pb.ListTransactionsRequest(), metadata=admin, timeout=10)
            return not [t for t in listed.transactions if t.transactional_id == "t8-app"]

        wait_for(complete, 60, "the transaction to complete")


def test_a_durable_subscription_resumes_after_the_commit_that_acks_its_input(
    faulty: LocalCluster,
) -> None:
    """A COMMIT carries the ack of a durable subscription's input, and the node that
    took it - the coordinator bucket's leader - dies after the decision, before any
    marker. BEFORE: a successor resuming the subscription by name meanwhile started
    before that input and got it again (a transformer then wrote its output twice:
    CI's `out/in/014 written 2 times`). AFTER: the resume waits (UNAVAILABLE, retried
    by the SDK) while a transaction holds an ack of the subscription, and starts after
    the input once the survivors' driver has written the markers."""
    coordinator = bucket_of("t9-app", 2)
    victim = faulty.leader_node(coordinator)
    key = next(f"t9/{i}" for i in range(100) if bucket_of(f"t9/{i}", 2) != coordinator)
    assert faulty.leader_node(bucket_of(key, 2)) != victim  # its stream stays up
    options = SubscribeOptions(ack=AckMode.EXPLICIT)
    with faulty.client() as first:
        sub = first.subscribe(f"key:{key}", durable="t9-xform", options=options)
        first.put(key, b"1")
        (event,) = _take(sub, 1)
        txn = first.transaction("t9-app")
        txn.put(key + "-out", b"T(1)")
        txn.ack(event)
        sub.detach()  # kept on the server, nothing acknowledged outside the transaction
        _commit_killing(faulty, first, txn, victim)
    with faulty.client() as successor:
        resumed = successor.subscribe(f"key:{key}", durable="t9-xform", options=options)
        successor.put(key, b"2")
        (first_event,) = _take(resumed, 1)
        assert [c.value for c in first_event.changes] == [b"2"]  # not the input again
        record = successor.get(key + "-out")
        assert record is not None and record.version == 1
