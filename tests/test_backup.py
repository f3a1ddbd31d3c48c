"""Backup and restore (cluster/ops/backup.py, docs/operations.md): a backup of a live
cluster taken while writes go on, restored as a new cluster with the state at backup
time, the same subscriptions, and epochs advanced so that a position past the backup
is refused (INVALID_SEQUENCE) rather than mistaken for the restored stream's."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import xxhash
from cluster_harness import LocalCluster, wait_for
from helpers import Driver
from test_replica import BUCKET_UUID, Cluster, state, wait_until, write

from sevendb.cluster.common.backup import (
    METADATA_FILE,
    BackupManifest,
    BucketImage,
    read_image,
    read_manifest,
    write_image,
    write_manifest,
)
from sevendb.cluster.common.topology import ClusterSpec, ConfigError, NodeSpec, new_cluster
from sevendb.cluster.ops import cli
from sevendb.cluster.ops.backup import restore_local, restored_images
from sevendb.cluster.raft.snapshots import seed_replica
from sevendb.cluster.server.config import load_node_config
from sevendb.outbox.entries import EpochCreate
from sevendb.outbox.state import BucketStateMachine
from sevendb.sdk import Recovery, StreamReset, StreamResetReason, SubscribeOptions, Subscription


def _offline_backup(directory: Path) -> tuple[BackupManifest, list[BucketStateMachine]]:
    """A backup made without a cluster: two buckets' cores and their metadata."""
    spec = new_cluster(
        nodes=[NodeSpec("n1", "127.0.0.1", 7001, 7100, 9101, meta_port=7000)],
        buckets=2,
        replicas=1,
        meta_voters=1,
    )
    images, machines = [], []
    for bucket in spec.buckets:
        d = Driver(BucketStateMachine(bucket.bucket_uuid))
        d.lease()
        d.subscribe("s", "prefix:k/")
        for i in range(5):
            d.set(f"k/{bucket.bucket}/{i}", b"v%d" % i)
        d.outbox()
        data = d.sm.snapshot()
        image = BucketImage(
            bucket.bucket,
            bucket.bucket_uuid,
            d.sm.applied_index,
            d.sm.epoch.epoch_counter,
            len(data),
            xxhash.xxh64_hexdigest(data),
        )
        write_image(directory, image, data)
        images.append(image)
        machines.append(d.sm)
    (directory / METADATA_FILE).write_text(spec.to_json() + "\n")
    manifest = BackupManifest(spec.cluster_id, 1, tuple(images))
    write_manifest(directory, manifest)
    return manifest, machines


def test_restored_images_keep_the_state_and_advance_the_epoch(tmp_path: Path) -> None:
    manifest, machines = _offline_backup(tmp_path)
    images = restored_images(tmp_path, read_manifest(tmp_path), now_ms=5_000)
    for image, before in zip(manifest.buckets, machines, strict=True):
        restored, data = images[image.bucket]
        after = BucketStateMachine.restore(data)
        assert restored.epoch_counter == after.epoch.epoch_counter == image.epoch_counter + 1
        assert restored.index == after.applied_index == image.index + 1
        assert after.bucket_uuid == before.bucket_uuid
        assert after.sync_page(limit=1000).items == before.sync_page(limit=1000).items
        sub, was = after.subs.get("s"), before.subs.get("s")
        assert sub is not None and was is not None
        assert (sub.head, sub.acked, sub.start) == (was.head, was.acked, was.start)
        assert after.subs.outbox_rows("s") == before.subs.outbox_rows("s")


def test_a_damaged_backup_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    backup = tmp_path / "backup"
    backup.mkdir()
    manifest, _ = _offline_backup(backup)
    snapshot = backup / manifest.buckets[1].file
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    target = tmp_path / "restored"
    with pytest.raises(ConfigError, match="damaged"):
        restore_local(backup, target, nodes=1, replicas=None, progress=lambda _: None)
    assert not target.exists()
    (backup / "backup.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ConfigError, match="backup format 99"):
        read_manifest(backup)
    with pytest.raises(ConfigError, match="not a backup"):
        read_manifest(tmp_path)


def test_restore_bundles_for_machines(tmp_path: Path) -> None:
    """`backup restore --out`: cluster init's bundles with the backup's buckets, a new
    cluster id, and each node's seeds of the buckets placed on it."""
    backup = tmp_path / "backup"
    backup.mkdir()
    manifest, _ = _offline_backup(backup)
    out = tmp_path / "bundles"
    nodes = ["n1=10.0.0.1", "n2=10.0.0.2", "n3=10.0.0.3"]
    args = ["backup", "restore", str(backup), "--out", str(out), "--replicas", "2"]
    assert cli.main([*args, *(f"--node={n}" for n in nodes)]) == 0
    genesis = ClusterSpec.load(out / "n1" / "genesis.json")
    assert genesis.cluster_id != manifest.cluster_id and genesis.replicas == 2
    assert [b.bucket_uuid for b in genesis.buckets] == [b.bucket_uuid for b in manifest.buckets]
    placed = 0
    for node in genesis.nodes:
        config = load_node_config(out / node.node_id / "node.toml", {})
        assert config.node.restore == out / node.node_id / "restore"
        seeds = read_manifest(config.node.restore, complete=False)
        mine = {b.bucket for b in genesis.buckets if node.node_id in b.nodes}
        assert {image.bucket for image in seeds.buckets} == mine
        for image in seeds.buckets:
            assert image.epoch_counter == manifest.buckets[image.bucket].epoch_counter + 1
            read_image(config.node.restore, image)  # there, and whole
        placed += len(mine)
    assert placed == 2 * len(manifest.buckets)


# ---- a real cluster ------------------------------------------------------------------


def _drain(sub: Subscription, keys: set[str], timeout_s: float = 30) -> dict[str, bytes]:
    """Poll `sub` until it delivered every key of `keys` (and nothing unexpected)."""
    seen: dict[str, bytes] = {}
    while not keys <= set(seen):
        event = sub.poll(timeout_s)
        assert event is not None, f"missing {sorted(keys - set(seen))}"
        for change in event.changes:
            seen[change.key] = change.value
    return seen


@pytest.mark.slow
def test_backup_under_writes_then_restore_a_new_cluster(tmp_path: Path) -> None:
    old = LocalCluster.start(tmp_path / "old", buckets=2)
    try:
        old.wait_settled()
        options = SubscribeOptions(ack_every_events=1, ack_interval_s=0.05)
        early, late = tmp_path / "early.cursor", tmp_path / "late.cursor"
        backup = tmp_path / "backup"
        with old.client() as client:
            first = {f"o/{i}": f"v{i}".encode() for i in range(10)}
            with (
                client.subscribe("prefix:o/", cursor=early, options=options) as sub_early,
                client.subscribe("prefix:o/", cursor=late, options=options) as sub_late,
            ):
                for key, value in first.items():
                    client.put(key, value)
                assert _drain(sub_early, set(first)) == first
                assert _drain(sub_late, set(first)) == first
                old_cluster_id = old.spec.cluster_id
                # The backup runs while another thread keeps writing other keys.
                stop = threading.Event()

                def writer() -> None:
                    i = 0
                    while not stop.is_set():
                        client.put(f"w/{i}", b"during")
                        i += 1

                thread = threading.Thread(target=writer)
                thread.start()
                try:
                    args = ["backup", "create", "--data", str(old.data_dir), "--out", str(backup)]
                    assert cli.main(args) == 0
                finally:
                    stop.set()
                    thread.join()
                later = {f"o/{i}": f"v{i}".encode() for i in range(10, 20)}
                for key, value in later.items():
                    client.put(key, value)
                assert _drain(sub_late, set(later)) == later
    finally:
        old.stop()
    manifest = read_manifest(backup)
    assert manifest.cluster_id == old_cluster_id and len(manifest.buckets) == 2

    assert cli.main(["backup", "restore", str(backup), "--local", str(tmp_path / "new")]) == 0
    new = LocalCluster.start(tmp_path / "new", buckets=2)
    try:
        assert new.spec.cluster_id != old_cluster_id
        assert [b.bucket_uuid for b in new.spec.buckets] == [
            b.bucket_uuid for b in manifest.buckets
        ]
        with new.client() as client:
            # The state at backup time: the first ten keys, none written after.
            for key, value in first.items():
                record = client.get(key)
                assert record is not None and record.value == value, key
            for key in later:
                assert client.get(key) is None, key
            for bucket, image in enumerate(manifest.buckets):
                status = new.status(new.leader_node(bucket))
                assert status is not None
                (replica,) = [r for r in status.replicas if r.bucket == bucket]
                assert replica.epoch_counter == image.epoch_counter + 1
            # Past the late subscriber's positions, so that they could coincide.
            more = {f"o/{i}": f"new{i}".encode() for i in range(20, 60)}
            for key, value in more.items():
                client.put(key, value)
            resets: list[StreamReset] = []
            resumed = SubscribeOptions(
                ack_every_events=1, on_invalid=Recovery.RESUBSCRIBE, on_reset=resets.append
            )
            with client.subscribe("prefix:o/", cursor=early, options=resumed) as sub:
                assert _drain(sub, set(more)) == more  # it resumed: nothing reset, nothing lost
            assert resets == []
            with client.subscribe("prefix:o/", cursor=late, options=resumed) as sub:
                wait_for(lambda: resets, 30, "the late subscriber's stream to be reset")
                client.put("o/after", b"x")
                assert _drain(sub, {"o/after"})["o/after"] == b"x"
            assert {r.reason for r in resets} == {StreamResetReason.INVALID_SEQUENCE}
    finally:
        new.stop()


def test_seeded_replicas_start_from_the_backup_and_go_on(tmp_path: Path) -> None:
    """Three replicas seeded with one restored state (`seed_replica`) elect a leader,
    hold that state at its index, and commit after it; a seeded data dir is used as
    it is the next time."""
    d = Driver(BucketStateMachine(BUCKET_UUID))
    d.lease()
    for i in range(5):
        d.set(f"k/{i}", b"v%d" % i)
    index = d.index + 1
    d.apply(EpochCreate(2, d.tick()))
    core, digest = d.sm.snapshot(), d.sm.digest()
    group = Cluster(tmp_path)
    for i in range(3):
        seed_replica(group.data_dir(i), BUCKET_UUID, core, index, group.addrs)
    with pytest.raises(ValueError, match="log index 2 or later"):
        seed_replica(tmp_path / "other", BUCKET_UUID, core, 1, group.addrs)
    try:
        group.start_all()
        for replica in group.live:  # loaded in its first tick
            wait_until(lambda r=replica: state(r) == (index, digest), 10, "the seeded state")
        wait_until(lambda: any(r.is_leader for r in group.live), 10, "a leader")
        leader = next(r for r in group.live if r.is_leader)
        outcome = leader.propose(write("k/after"))
        assert outcome.commit_index > index + 1  # after the new leader's NO_OP
        wait_until(lambda: len({state(r) for r in group.live}) == 1, 10, "convergence")
        record, epoch = leader.read(lambda sm: (sm.get("k/0"), sm.epoch.epoch_counter))
        assert record is not None and record.value == b"v0" and epoch == 2
        follower = next(i for i, r in enumerate(group.replicas) if r is not leader)
        group.stop(follower)
        leader.propose(write("k/while-down"))
        replica = group.start(follower)  # the data dir exists: no seed, its own state
        wait_until(lambda: state(replica) == state(leader), 10, "the restarted replica")
    finally:
        group.close()
