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
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.cluster.common.layout import node_dir
from sevendb.cluster.common.topology import BucketSpec
from sevendb.cluster.ops.cli import main as cli_main
from sevendb.cluster.ops.local import (
    cluster_up,
    local_nodes,
    log_file,
    running_pid,
    start_node,
    stop_nodes,
)
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk.client import Client

pytestmark = pytest.mark.slow

JOURNAL = "raft.journal"
SNAPSHOT = "snapshot.bin"
_LEN = struct.Struct("<I")


def bucket_dir(c: LocalCluster, node_id: str, bucket: int = 0) -> Path:
    return node_dir(c.data_dir, node_id) / f"bucket-{bucket}"


def records(path: Path) -> list[tuple[int, bytes]]:
    return records_of(path.read_bytes())


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
    return c.stub(address)


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
    one_bucket = LocalCluster.start(tmp_path / "data", buckets=1)
    yield one_bucket  # pytest runs the rest even when the test failed
    one_bucket.stop()


def damage_a_while_b_was_down(c: LocalCluster, writes: int) -> tuple[str, str, str, dict[str, int]]:
    """The issue's setup: follower B stopped, `writes` acknowledged by follower A and
    the leader C, everything stopped, one byte of A's journal flipped in the record of
    the 11th write, A and B started. Returns A, B, C and the acknowledged writes."""
    a, b, c_node = followers(c)
    stop_nodes(c.data_dir, [b])
    with c.client() as client:
        acked = {
            f"w{i:03d}": client.put(f"w{i:03d}", b"v").committed.commit_index for i in range(writes)
        }
    c.stop()
    journal = bucket_dir(c, a) / JOURNAL
    offset = next(off for off, body in records(journal) if b"w010" in body)
    flip_byte(journal, offset + 30)
    start_node(c.data_dir, a)
    start_node(c.data_dir, b)
    return a, b, c_node, acked


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
    a, b, c_node, acked = damage_a_while_b_was_down(cluster, 50)

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


# ---- the fault-injection matrix ---------------------------------------------------------

FILES = ("journal", "snapshot", "state", "commit")
"""Every file a replica keeps: the log, the snapshot, the term/vote record, the commit
hint (a node's configuration and the cluster's genesis have their own test)."""
DAMAGES = ("torn tail", "flipped byte", "zeroed range", "length prefix", "deleted", "emptied")
_FILE_NAMES = {
    "journal": JOURNAL,
    "snapshot": SNAPSHOT,
    "state": JOURNAL + ".state",
    "commit": JOURNAL + ".commit",
}
WRITES_BEFORE, WRITES_AFTER, MIN_ENTRIES = 30, 12, 25
"""Writes per bucket before the snapshots everywhere, then after them (in the log, no
second snapshot: fewer than MIN_ENTRIES since the first)."""


def _length_field(file: str, data: bytes) -> int | None:
    """Offset of a length field of the file, or None if it has none (the hint)."""
    if file == "journal":
        offsets = [offset for offset, _ in records_of(data)]
        return offsets[len(offsets) // 2]
    if file == "snapshot":
        return data.index(b"\xc6" if b"\xc6" in data[8:40] else b"\xc4", 8)  # msgpack bin
    if file == "state":
        return 8 + 4 + 8 + 8 + 1  # magic, version, term, commit, vote tag: vote length
    return None


def damage(path: Path, file: str, kind: str) -> bool:
    """Damage one file as `kind` says; False when the damage does not apply to it.
    "Mid-file" is the middle of what the file holds: a journal's records, not its
    header."""
    data = path.read_bytes()
    start = 1536 if file == "journal" else 0
    # A journal's records end before the zeros preallocated after them.
    end = _records_end(data) if file == "journal" else len(data)
    middle, third = (start + end) // 2, (end - start) // 3
    if kind == "torn tail":
        path.write_bytes(data[: end - min(7, end // 2)])
    elif kind == "flipped byte":
        flip_byte(path, middle)
    elif kind == "zeroed range":
        path.write_bytes(data[: start + third] + bytes(third) + data[start + 2 * third :])
    elif kind == "length prefix":
        offset = _length_field(file, data)
        if offset is None:
            return False
        path.write_bytes(data[: offset + 1] + b"\xff\xff\x7f" + data[offset + 4 :])
    elif kind == "deleted":
        path.unlink()
    else:
        path.write_bytes(b"")
    return True


def records_of(data: bytes) -> list[tuple[int, bytes]]:
    """(offset, body) of each record of a journal file, read with the format of
    docs/raft.md ("Files") and without the journal's code."""
    version = struct.unpack_from("<I", data, 8)[0]
    pos = 16 if version == 1 else 1536  # version 2: a preamble and two 512-byte slots
    out = []
    while pos + 4 <= len(data):
        (length,) = _LEN.unpack_from(data, pos)
        if length == 0 or pos + 8 + length > len(data):
            break  # zeros: space preallocated past the last record
        out.append((pos, data[pos + 4 : pos + 4 + length]))
        pos += 8 + length
    return out


def _records_end(data: bytes) -> int:
    """Where a journal file's records end."""
    found = records_of(data)
    if not found:
        return 1536
    offset, body = found[-1]
    return offset + 8 + len(body)


def _outcome(c: LocalCluster, bucket: int, damaged: list[str]) -> str:
    """What the damaged replicas' logs say of the damage, for the outcome table."""
    seen = set()
    for node_id in damaged:
        for line in log_file(c.data_dir, node_id).read_text().splitlines():
            mine = f"bucket {bucket} replica" in line or f"/bucket-{bucket}/" in line
            if not mine:
                continue
            if "repaired by" in line:
                seen.add("repaired by the leader")
            elif "repaired in place" in line:
                seen.add("repaired in place")
            elif "torn tail" in line:
                seen.add("torn tail cut")
    return ", ".join(sorted(seen)) or "nothing to repair"


@pytest.mark.parametrize("replicas_damaged", [1, 2], ids=["one", "majority"])
def test_fault_matrix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replicas_damaged: int
) -> None:
    """Every file a replica keeps x every kind of damage, one case per bucket of one
    cluster, on one replica or on two of three (the third intact). The damage is done
    to the stopped nodes' files. Then: every bucket converges (no replica quarantined
    or repairing, one digest) and every acknowledged write reads back with its commit
    index: nothing lost, never a shorter history. The outcomes are docs/raft.md's
    table (printed with -s)."""
    monkeypatch.setenv("SEVENDB_RAFT_COMPACTION_MIN_ENTRIES", str(MIN_ENTRIES))
    monkeypatch.setenv("SEVENDB_RAFT_COMPACTION_LOG_RATIO", "0")
    cases = [(f, d) for f in FILES for d in DAMAGES]
    c = LocalCluster.start(tmp_path / "data", buckets=len(cases))
    try:
        spec = c.spec
        nodes = [n.node_id for n in spec.nodes]
        keys = _keys_per_bucket(spec.bucket_for_key, len(cases))
        with c.client() as client:
            acked = _write(client, keys, 0, WRITES_BEFORE)
            every = [bucket_dir(c, n, b) / SNAPSHOT for n in nodes for b in range(len(cases))]
            wait_for(lambda: all(p.exists() for p in every), 60, "a snapshot on every replica")
            acked.update(_write(client, keys, WRITES_BEFORE, WRITES_BEFORE + WRITES_AFTER))
        c.stop()
        damaged: dict[int, list[str]] = {}
        for bucket, (file, kind) in enumerate(cases):
            victims = [nodes[(bucket + i) % 3] for i in range(replicas_damaged)]
            path = bucket_dir(c, victims[0], bucket) / _FILE_NAMES[file]
            if damage(path, file, kind):
                for other in victims[1:]:
                    damage(bucket_dir(c, other, bucket) / _FILE_NAMES[file], file, kind)
                damaged[bucket] = victims
        for node_id in nodes:
            start_node(c.data_dir, node_id)
        c.wait_converged(120)
        with c.client() as client:
            for bucket in range(len(cases)):
                held = {r.key: r.mod_commit_index for r in client.sync_bucket(bucket)}
                expected = {k: i for k, i in acked.items() if k in keys[bucket]}
                assert held == expected, (bucket, cases[bucket])
        rows = [
            f"| {file} | {kind} | "
            + (_outcome(c, bucket, damaged[bucket]) if bucket in damaged else "n/a")
            + " |"
            for bucket, (file, kind) in enumerate(cases)
        ]
        print(f"\n{replicas_damaged} replica(s) damaged:\n" + "\n".join(rows))
        for bucket, victims in damaged.items():
            if "repaired" in rows[bucket]:
                for node_id in victims:  # each repair is counted in /metrics
                    assert _repairs_metric(c, node_id, bucket) >= 1, (node_id, rows[bucket])
        assert all(
            "repair" in row or "torn tail" in row or "n/a" in row or "nothing" in row
            for row in rows
        )
    finally:
        c.stop()


def _repairs_metric(c: LocalCluster, node_id: str, bucket: int) -> float:
    node = c.spec.node(node_id)
    with urllib.request.urlopen(f"http://{node.host}:{node.metrics_port}/metrics") as page:
        text = page.read().decode()
    line = f'sevendb_replica_disk_repairs_total{{bucket="{bucket}"}} '
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


def _keys_per_bucket(bucket_for_key: Callable[[str], BucketSpec], buckets: int) -> list[list[str]]:
    keys: list[list[str]] = [[] for _ in range(buckets)]
    n = 0
    while min(len(k) for k in keys) < WRITES_BEFORE + WRITES_AFTER:
        key = f"key-{n}"
        n += 1
        bucket = bucket_for_key(key).bucket
        if len(keys[bucket]) < WRITES_BEFORE + WRITES_AFTER:
            keys[bucket].append(key)
    return keys


def _write(client: Client, keys: list[list[str]], start: int, stop: int) -> dict[str, int]:
    """Write keys[b][start:stop] of every bucket; their commit indexes, by key."""
    acked = {}
    for i in range(start, stop):
        for bucket_keys in keys:
            key = bucket_keys[i]
            acked[key] = client.put(key, b"v" * 64).committed.commit_index
    return acked


def _the_bucket_serves(c: LocalCluster, acked: dict[str, int]) -> None:
    with c.client() as client:
        held = {r.key: r.mod_commit_index for r in client.sync_bucket(0)}
    assert held == acked


def test_damaged_cluster_metadata_is_refused_and_loses_nothing(cluster: LocalCluster) -> None:
    """The files a node is configured from - its node.toml and the cluster's
    genesis.json - damaged each way in turn on every node: no node starts on a file it
    cannot read (it says which and exits), nothing is served from a damaged one, and
    with the files restored every acknowledged write is there. A damaged metadata cache
    (cluster-cache.json) is not trusted: the node says so, starts from the genesis and
    learns the metadata again. (The metadata group's own journal is a replica's, like
    a bucket's: the matrix above covers it.)"""
    with cluster.client() as client:
        acked = {f"m{i}": client.put(f"m{i}", b"v").committed.commit_index for i in range(20)}
    nodes = local_nodes(cluster.data_dir)
    cluster.stop()
    for name in ("genesis.json", "node.toml"):
        files = [node_dir(cluster.data_dir, n) / name for n in nodes]
        intact = [f.read_bytes() for f in files]
        for kind in DAMAGES:
            if not all([damage(f, "cluster", kind) for f in files]):
                continue  # TOML and JSON have no length prefix
            sizes = {n: log_file(cluster.data_dir, n).stat().st_size for n in nodes}
            for node_id in nodes:
                start_node(cluster.data_dir, node_id)
            wait_for(
                lambda: all(running_pid(cluster.data_dir, n) is None for n in nodes),
                30,
                f"every node to refuse a {name} with a {kind}",
            )
            for node_id in nodes:
                log = log_file(cluster.data_dir, node_id).read_text()[sizes[node_id] :]
                assert name in log and "serving gRPC" not in log, (name, kind, log[-500:])
            for f, data in zip(files, intact, strict=True):
                f.write_bytes(data)
    cache = node_dir(cluster.data_dir, nodes[0]) / "cluster-cache.json"
    assert damage(cache, "cluster", "flipped byte")
    cluster.restart()
    cluster.wait_converged()
    _the_bucket_serves(cluster, acked)
    assert "ignoring the metadata cache" in log_file(cluster.data_dir, nodes[0]).read_text()


def test_an_up_that_times_out_stops_the_nodes_it_started(cluster: LocalCluster) -> None:
    """One node cannot start (its node.toml is damaged): `up` waits, says which, and
    at its timeout stops the two healthy nodes it started instead of leaving them
    running behind an error."""
    nodes = local_nodes(cluster.data_dir)
    cluster.stop()
    assert damage(node_dir(cluster.data_dir, nodes[0]) / "node.toml", "cluster", "emptied")
    lines: list[str] = []
    with pytest.raises(TimeoutError, match="not running"):
        cluster_up(cluster.data_dir, timeout_s=10, progress=lines.append)
    assert all(running_pid(cluster.data_dir, n) is None for n in nodes)
    assert any(line.startswith("stopped the nodes this start started") for line in lines)


def test_an_operator_accepts_the_loss_and_the_longest_history_goes_on(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """The repro's DATA_LOSS, decided by the operator instead of by C's return:
    `sevendb bucket recover 0` shows the replicas (exit 1: the bucket is in DATA_LOSS);
    with --accept-loss the damaged replica stops waiting for what it lost, the longest
    surviving log is elected, and the writes it held are served again; the others are
    gone, as the operator accepted."""
    a, b, _, acked = damage_a_while_b_was_down(cluster, 20)
    wait_for(
        lambda: get_status(cluster, b, "w000")[0] == grpc.StatusCode.DATA_LOSS, 60, "DATA_LOSS"
    )
    data = ["--data", str(cluster.data_dir)]
    assert cli_main(["status", *data]) == 1  # C is down
    status = capsys.readouterr().out
    assert status.count("DATA_LOSS") >= 2, status
    assert cli_main(["bucket", "recover", "0", *data]) == 1
    assert "--accept-loss" in capsys.readouterr().out
    assert cli_main(["bucket", "recover", "0", "--accept-loss", *data]) == 0
    assert capsys.readouterr().out.count("told to accept the loss") == 3
    wait_for(lambda: leaders_among(cluster, [a, b]) == [a], 30, "the longest log to lead")
    with cluster.client() as client:
        kept = {r.key: r.mod_commit_index for r in client.sync_bucket(0)}
    assert kept == {k: i for k, i in acked.items() if k < "w010"}
    assert "accepted the loss" in log_file(cluster.data_dir, a).read_text()
    assert cli_main(["status", *data]) == 1
    assert "DATA_LOSS" not in capsys.readouterr().out
