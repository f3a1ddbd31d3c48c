"""Transactions under `kill -9` at the simulator's crash points (issue 29, docs/transactions.md),
against real processes with fault points (cluster/server/faults.py): the coordinator
bucket's leader or a participant bucket's leader killed between the decision and the
markers, and the coordinator's leader killed before the decision. Each ends all or
nothing in every bucket, and a read_committed subscriber gets each bucket's share of a
committed transaction once, in one event, with its chain unbroken."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_harness import LocalCluster, wait_for
from test_emission import Collector, check_delivery, committed

from sevendb.cluster.common.auth import auth_metadata
from sevendb.cluster.common.layout import node_dir
from sevendb.cluster.server.faults import (
    KILL_AFTER_TXN_DECISION,
    KILL_BEFORE_TXN_DECISION,
    fault_file,
)
from sevendb.outbox.keys import bucket_of
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk import Client, TransactionTimedOut
from sevendb.sdk.streams import Event

pytestmark = pytest.mark.slow


@pytest.fixture
def faulty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    monkeypatch.setenv("SEVENDB_TEST_FAULTS", "1")
    c = LocalCluster.start(tmp_path / "data", buckets=2)
    try:
        c.wait_settled()  # each bucket led by its preferred node: two different nodes
        yield c
    finally:
        c.stop()


def keys_of(prefix: str, bucket: int) -> list[str]:
    return [k for k in (f"{prefix}{i}" for i in range(200)) if bucket_of(k, 2) == bucket][:2]


def pending_ids(cluster: LocalCluster, node: str) -> list[str]:
    stub = cluster.stub(cluster.spec.node(node).grpc_address)
    admin = auth_metadata(cluster.token("admin"))
    listed = stub.ListTransactions(pb.ListTransactionsRequest(), metadata=admin, timeout=10)
    return [t.transactional_id for t in listed.transactions]


def end_at(
    cluster: LocalCluster, client: Client, node: str, tid: str, number: int, fault: str
) -> None:
    """Arm `fault` on `node` and send it the transaction's COMMIT; the node dies in the
    call (SIGKILL at the fault point)."""
    session = client._core._txn_sessions[tid]
    fault_file(node_dir(cluster.data_dir, node), fault).touch()
    commit = pb.TxnRequest(
        action=pb.TxnRequest.COMMIT, transactional_id=tid, epoch=session.epoch, number=number
    )
    with pytest.raises(grpc.RpcError):
        cluster.stub(cluster.spec.node(node).grpc_address).Txn(
            commit, metadata=auth_metadata(cluster.token()), timeout=10
        )
    wait_for(lambda: cluster.status(node) is None, 30, f"{node} to die")


def check_one_event_per_bucket(events: list[Event], keys: dict[int, list[str]]) -> None:
    for bucket, mine in keys.items():
        carrying = [e for e in events if set(mine) & {c.key for c in e.changes}]
        assert len(carrying) == 1, f"bucket {bucket}: the commit in {len(carrying)} events"
        assert sorted(c.key for c in carrying[0].changes) == sorted(mine)


@pytest.mark.parametrize("victim", ["coordinator", "participant"])
def test_a_leader_killed_between_the_decision_and_the_markers(
    faulty: LocalCluster, victim: str
) -> None:
    """The node that took the COMMIT leads the coordinator bucket, or the other
    (participant) bucket, and dies right after the decision committed, before any
    marker: the coordinator's (new) leader writes every marker, the participant's new
    leader takes its own."""
    tid = f"crash-{victim}"
    coordinator = bucket_of(tid, 2)
    participant = 1 - coordinator
    keys = {b: keys_of(f"kd{victim[0]}/", b) for b in (0, 1)}
    node = faulty.leader_node(coordinator if victim == "coordinator" else participant)
    other = faulty.leader_node(participant if victim == "coordinator" else coordinator)
    assert node != other, "wait_settled spreads the two buckets' leaders"
    survivor = next(n.node_id for n in faulty.spec.nodes if n.node_id != node)
    with faulty.client() as client:
        collector = Collector(client.subscribe(f"prefix:kd{victim[0]}/"))
        txn = client.transaction(tid)
        for bucket in (0, 1):
            for key in keys[bucket]:
                txn.put(key, b"v")
        end_at(faulty, client, node, tid, txn.number, KILL_AFTER_TXN_DECISION)
        everything = [k for b in (0, 1) for k in keys[b]]
        wait_for(
            lambda: all(client.get(k) is not None for k in everything),
            60,
            "the survivors to write every COMMIT marker",
        )
        wait_for(lambda: tid not in pending_ids(faulty, survivor), 60, "the COMPLETE")
        collector.wait_keys(set(everything))
        collector.stop()
        truth = committed(client, everything)
    check_delivery(collector.events, truth, 2, prefix=f"kd{victim[0]}/")
    check_one_event_per_bucket(collector.events, keys)


@pytest.mark.parametrize("then", ["timeout", "retried commit"])
def test_the_coordinator_s_leader_killed_before_the_decision(
    faulty: LocalCluster, then: str
) -> None:
    """The coordinator bucket's leader takes the COMMIT and dies before proposing the
    decision: the transaction is still open at the new leader. Either its timeout
    aborts it there (nothing visible anywhere, ever; its later calls are
    TRANSACTION_TIMED_OUT), or its producer's retried COMMIT decides it (everything
    visible, delivered once)."""
    tid = f"undecided-{then[0]}"
    prefix = f"ku{then[0]}/"
    coordinator = bucket_of(tid, 2)
    keys = {b: keys_of(prefix, b) for b in (0, 1)}
    everything = [k for b in (0, 1) for k in keys[b]]
    node = faulty.leader_node(coordinator)
    survivor = next(n.node_id for n in faulty.spec.nodes if n.node_id != node)
    with faulty.client() as client:
        collector = Collector(client.subscribe(f"prefix:{prefix}"))
        timeout_ms = 4000 if then == "timeout" else 60_000
        txn = client.transaction(tid, timeout_ms=timeout_ms)
        for bucket in (0, 1):
            for key in keys[bucket]:
                txn.put(key, b"v")
        end_at(faulty, client, node, tid, txn.number, KILL_BEFORE_TXN_DECISION)
        assert tid in pending_ids(faulty, survivor)  # open at the new leader, undecided
        assert all(client.get(k) is None for k in everything)
        if then == "timeout":
            wait_for(lambda: tid not in pending_ids(faulty, survivor), 60, "the timeout's abort")
            with pytest.raises(TransactionTimedOut):
                txn.commit()
            client.put(prefix + "after", b"plain")  # delivered after nothing of the txn
            collector.wait_keys({prefix + "after"})
            collector.stop()
            assert all(client.get(k) is None for k in everything)
            assert [c.key for e in collector.events for c in e.changes] == [prefix + "after"]
            return
        txn.commit()  # the SDK retries at the coordinator's new leader
        wait_for(lambda: tid not in pending_ids(faulty, survivor), 60, "the COMPLETE")
        collector.wait_keys(set(everything))
        collector.stop()
        truth = committed(client, everything)
    check_delivery(collector.events, truth, 2, prefix=prefix)
    check_one_event_per_bucket(collector.events, keys)
