"""Access control on a real cluster (issue 29): producer-id ownership, and the ACL
matrix - every client RPC called by a principal allowed to and by one that is not.
One cluster for the whole module (CI time)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_harness import STARTED, LocalCluster

from sevendb.cluster.common.auth import auth_metadata
from sevendb.outbox.keys import bucket_of
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path_factory.mktemp("acl") / "data", buckets=2)
    try:
        c.wait_settled()
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
