"""Disk faults never cost an acknowledged write (docs/raft.md, "Disk faults").

Real node processes: a cluster is stopped, one or more replicas' files are damaged
directly on disk, and the cluster (or part of it) is started again. A replica that
finds damage it cannot explain by a torn write repairs itself from the leader before
it serves or votes again; when no reachable replica holds every acknowledged entry,
the bucket refuses with DATA_LOSS instead of serving a shorter history.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.cluster.common.layout import node_dir
from sevendb.cluster.ops.local import log_file, start_node, stop_nodes
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

JOURNAL = "raft.journal"
SNAPSHOT = "snapshot.bin"
_LEN = struct.Struct("<I")


def bucket_dir(c: LocalCluster, node_id: str, bucket: int = 0) -> Path:
    return node_dir(c.data_dir, node_id) / f"bucket-{bucket}"


def records(path: Path) -> list[tuple[int, bytes]]:
    """(offset, body) of each record of a journal file, read with the format of
    docs/raft.md ("Files") and without the journal's code."""
    data = path.read_bytes()
    version = struct.unpack_from("<I", data, 8)[0]
    pos = 16 if version == 1 else 1536  # version 2: a preamble and two 512-byte slots
    out = []
    while pos + 4 <= len(data):
        (length,) = _LEN.unpack_from(data, pos)
        if pos + 8 + length > len(data):
            break
        out.append((pos, data[pos + 4 : pos + 4 + length]))
        pos += 8 + length
    return out


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def followers(c: LocalCluster, bucket: int = 0) -> tuple[str, str, str]:
    """(a follower, the other follower, the leader), once the preferred node leads."""
    c.wait_settled()
    leader = c.leader_node(bucket)
    a, b = sorted(n.node_id for n in c.spec.nodes if n.node_id != leader)
    return a, b, leader


def stub(c: LocalCluster, node_id: str) -> pb_grpc.SevenDBStub:
    address = c.spec.node(node_id).grpc_address
    return pb_grpc.SevenDBStub(grpc.insecure_channel(address))  # type: ignore[no-untyped-call]


def get_status(c: LocalCluster, node_id: str, key: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message of one Get sent to `node_id` (OK if it answered)."""
    metadata = (("authorization", f"Bearer {c.token()}"),)
    try:
        stub(c, node_id).Get(pb.GetRequest(key=key), timeout=5, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def leaders_among(c: LocalCluster, node_ids: list[str], bucket: int = 0) -> list[str]:
    out = []
    for node_id in node_ids:
        status = c.status(node_id)
        if status is not None and any(r.bucket == bucket and r.is_leader for r in status.replicas):
            out.append(node_id)
    return out


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path / "data", buckets=1)
    try:
        yield c
    finally:
        c.stop()


def test_a_corrupt_record_mid_journal_with_a_stopped_peer_loses_no_acknowledged_write(
    cluster: LocalCluster,
) -> None:
    """The measured repro of issue 33: stop follower B; 50 writes acknowledged by A and
    the leader C; stop all; flip one byte of A's journal at the record of the 11th
    write (39 valid records after it); start A and B only. BEFORE: A dropped everything
    after the bad record as a "torn tail", A and B elected a leader and 40 of the 50
    acknowledged writes were gone. AFTER: A knows it lost acknowledged entries, votes
    for no one who lacks them and does not campaign: no leader, and the bucket answers
    DATA_LOSS naming the replicas; once C is back, every write is there."""
    a, b, c_node = followers(cluster)
    stop_nodes(cluster.data_dir, [b])
    with cluster.client() as client:
        acked = {
            f"w{i:03d}": client.put(f"w{i:03d}", b"v").committed.commit_index for i in range(50)
        }
    cluster.stop()
    journal = bucket_dir(cluster, a) / JOURNAL
    offset = next(off for off, body in records(journal) if b"w010" in body)
    flip_byte(journal, offset + 30)
    start_node(cluster.data_dir, a)
    start_node(cluster.data_dir, b)

    def refused_with_data_loss() -> tuple[grpc.StatusCode, str] | None:
        assert leaders_among(cluster, [a, b]) == [], "a leader without the writes"
        code, message = get_status(cluster, b, "w020")
        return (code, message) if code == grpc.StatusCode.DATA_LOSS else None

    _code, message = wait_for(refused_with_data_loss, 60, "DATA_LOSS from the bucket")
    assert "bucket 0" in message
    spec = cluster.spec
    assert spec.node(a).raft_address(0) in message and spec.node(b).raft_address(0) in message
    # Elections keep failing for a while; still no leader without the writes.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert leaders_among(cluster, [a, b]) == []
        time.sleep(0.2)
    assert "lost acknowledged entries" in log_file(cluster.data_dir, a).read_text()

    start_node(cluster.data_dir, c_node)
    cluster.wait_converged()
    with cluster.client() as client:
        for key, index in acked.items():
            record = client.get(key)
            assert record is not None and record.mod_commit_index == index, key
