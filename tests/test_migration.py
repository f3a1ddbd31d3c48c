"""Bucket migration against real processes (docs/contract.md §7, §12 MIG-01): replicas move
one membership change at a time under a steady write load, EPOCH_CREATE bumps the
epoch, and every subscriber sees every committed delta exactly once, in order,
with emit_seq strictly increasing across the epoch - also when the migration
command, the leader or the joining replica is killed halfway and the command is
run again, and when it is rolled back. A rebalance after adding a node moves only
what rendezvous hashing says."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import LocalCluster, wait_for
from test_emission import Collector, Writer, check_delivery, committed

from sevendb.cluster.ops.local import add_node
from sevendb.cluster.ops.migrate import migrate_bucket, plan_rebalance, rebalance
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk import Client, Unavailable

pytestmark = pytest.mark.slow
BUCKET = 0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path / "data", buckets=2)
    try:
        yield c
    finally:
        c.stop()


class Load:
    """A writer thread committing unique keys until stopped."""

    def __init__(self, client: Client, prefix: str) -> None:
        self.writer = Writer(client, prefix)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            # A write whose outcome is unknown (a node was killed) stays in `attempted`;
            # `committed()` later reads whether it landed.
            with contextlib.suppress(Unavailable):
                self.writer.write(1, pause_s=0.005)

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(60)
        return self.writer.attempted


def replicas_of(cluster: LocalCluster, bucket: int) -> dict[str, pb.ReplicaStatus]:
    spec = cluster.spec
    out = {}
    for node in spec.nodes:
        status = cluster.status(node.node_id)
        if status is not None:
            for r in status.replicas:
                if r.bucket == bucket:
                    out[node.node_id] = r
    return out


def target_without_leader(cluster: LocalCluster, new_node: str) -> tuple[str, ...]:
    """The new node plus two current replicas, leaving the leader out (so the
    leadership and the notifier lease must move too)."""
    return target_without(cluster, new_node, cluster.leader_node(BUCKET))


def target_without(cluster: LocalCluster, new_node: str, leaving: str) -> tuple[str, ...]:
    keep = [n for n in cluster.spec.buckets[BUCKET].nodes if n != leaving]
    return (new_node, *keep[:2])


def start_migration(cluster: LocalCluster, target: tuple[str, ...]) -> subprocess.Popen[str]:
    """`sevendb bucket migrate` in its own process, returned once it has begun its
    first membership step (adding the new replica)."""
    command = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sevendb.cluster.ops.cli",
            "bucket",
            "migrate",
            str(BUCKET),
            "--to",
            ",".join(target),
            "--data",
            str(cluster.data_dir),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert command.stderr is not None
    for line in command.stderr:
        if line.startswith("step 1"):
            break
    return command


def check_epoch_rollover(collector: Collector, bucket: int, epoch: int) -> None:
    """The bucket's events go from the old epoch to the new one exactly once, the
    first new-epoch event chained to the last old-epoch one."""
    stream = [e for e in collector.events if e.bucket == bucket]
    epochs = [e.emit_seq.epoch_counter for e in stream]
    assert epochs == sorted(epochs) and epochs[0] == epoch - 1 and epochs[-1] == epoch
    first_new = next(i for i, e in enumerate(stream) if e.emit_seq.epoch_counter == epoch)
    assert stream[first_new].prev_emit_seq == stream[first_new - 1].emit_seq


def check_moved(cluster: LocalCluster, target: tuple[str, ...], epoch: int) -> None:
    spec = cluster.spec
    assert set(spec.buckets[BUCKET].nodes) == set(target) and not spec.migrations
    addresses = sorted(spec.node(n).raft_address(BUCKET) for n in target)

    def settled() -> bool:
        replicas = replicas_of(cluster, BUCKET)
        return set(replicas) == set(target) and all(
            sorted(r.members) == addresses and r.epoch_counter == epoch for r in replicas.values()
        )

    try:
        wait_for(settled, 30, "every replica to see the new membership and epoch")
    except AssertionError:
        seen = {
            n: (list(r.members), r.epoch_counter) for n, r in replicas_of(cluster, BUCKET).items()
        }
        detail = f"want {addresses} in epoch {epoch} on {target}; replicas: {seen}"
        raise AssertionError(detail) from None


def test_mig01_migration_under_load_delivers_every_delta_once_across_the_epoch(
    cluster: LocalCluster,
) -> None:
    new = add_node(cluster.data_dir).node_id
    with cluster.client() as client:
        collector = Collector(client.subscribe("prefix:m/"))
        load = Load(client, "m/")
        wait_for(lambda: len(collector.keys()) >= 30, 30, "the load to be flowing")
        leader = cluster.leader_node(BUCKET)
        target = target_without_leader(cluster, new)
        summary = migrate_bucket(cluster.admin(), BUCKET, target, progress=print)
        seen = len(collector.keys())
        wait_for(lambda: len(collector.keys()) >= seen + 30, 60, "writes after the migration")
        attempted = load.stop()
        collector.wait_keys(set(attempted))
        collector.stop()
        check_delivery(collector.events, committed(client, attempted), 2, prefix="m/")
    assert summary.steps == [f"added {new}", f"removed {leader}"]
    check_epoch_rollover(collector, BUCKET, 2)
    check_moved(cluster, target, 2)


@pytest.mark.parametrize("victim", ["command", "leader", "joining replica", "leaving replica"])
def test_an_interrupted_migration_is_resumed_by_running_it_again(
    cluster: LocalCluster, victim: str
) -> None:
    new = add_node(cluster.data_dir).node_id
    leader = cluster.leader_node(BUCKET)
    follower = next(n for n in cluster.spec.buckets[BUCKET].nodes if n != leader)
    leaving = follower if victim == "leaving replica" else leader
    target = target_without(cluster, new, leaving)
    with cluster.client() as client:
        collector = Collector(client.subscribe("prefix:r/"))
        load = Load(client, "r/")
        wait_for(lambda: len(collector.keys()) >= 20, 30, "the load to be flowing")
        command = start_migration(cluster, target)
        if victim == "command":
            command.kill()
        else:
            killed = {"joining replica": new, "leaving replica": leaving}.get(
                victim, cluster.leader_node(BUCKET)
            )
            cluster.kill9(killed)
            cluster.restart()  # the node comes back (with its data) as an operator would
        command.wait(180)  # it may finish or fail: either way, running it again completes
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "sevendb.cluster.ops.cli",
                "status",
                "--data",
                str(cluster.data_dir),
            ],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        if command.returncode != 0:
            assert "UNFINISHED MIGRATION" in status, status
        summary = migrate_bucket(cluster.admin(), BUCKET, target, progress=print)
        attempted = load.stop()
        collector.wait_keys(set(attempted))
        collector.stop()
        check_delivery(collector.events, committed(client, attempted), 2, prefix="r/")
    check_moved(cluster, target, summary.epoch)
    assert summary.epoch == 2


def test_a_migration_rolled_back_returns_the_bucket_and_loses_nothing(
    cluster: LocalCluster,
) -> None:
    new = add_node(cluster.data_dir).node_id
    original = cluster.spec.buckets[BUCKET].nodes
    target = target_without_leader(cluster, new)
    with cluster.client() as client:
        collector = Collector(client.subscribe("prefix:b/"))
        load = Load(client, "b/")
        command = start_migration(cluster, target)
        command.kill()
        command.wait()
        summary = migrate_bucket(cluster.admin(), BUCKET, None, rollback=True, progress=print)
        attempted = load.stop()
        collector.wait_keys(set(attempted))
        collector.stop()
        check_delivery(collector.events, committed(client, attempted), 2, prefix="b/")
    assert summary.rolled_back and set(summary.to_nodes) == set(original)
    check_moved(cluster, original, 2)


def test_rebalance_after_adding_a_node_moves_only_what_rendezvous_says(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster.start(tmp_path / "data", buckets=6)
    try:
        before = cluster.spec
        add_node(cluster.data_dir)
        spec = cluster.spec
        expected = {b.bucket: tuple(spec.placement(b.bucket_uuid)) for b in spec.buckets}
        moves = plan_rebalance(spec)
        assert {m.bucket for m in moves} == {
            b for b, nodes in expected.items() if set(nodes) != set(before.buckets[b].nodes)
        }
        assert moves
        with cluster.client() as client:
            for i in range(30):
                client.put(f"x/{i}", b"v")
            done = rebalance(cluster.admin())
            assert sorted(s.bucket for s in done) == sorted(m.bucket for m in moves)
            after = cluster.spec
            moved = {m.bucket for m in moves}
            for b in after.buckets:
                assert set(b.nodes) == set(expected[b.bucket])

                want = {2 if b.bucket in moved else 1}

                def settled(bucket: int = b.bucket, want: set[int] = want) -> bool:
                    return {r.epoch_counter for r in replicas_of(cluster, bucket).values()} == want

                wait_for(settled, 30, f"bucket {b.bucket} in epoch {want}")
            for i in range(30):
                record = client.get(f"x/{i}")
                assert record is not None and record.value == b"v"
    finally:
        cluster.stop()
