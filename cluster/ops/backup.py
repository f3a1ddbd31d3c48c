"""`sevendb backup create` and `sevendb backup restore` (docs/operations.md).

    sevendb --config client.toml backup create --out backups/2026-11-25
    sevendb backup restore backups/2026-11-25 --out bundles --node n1=10.0.1.1 ...
    sevendb backup restore backups/2026-11-25 --data .sevendb-restored   # one machine

**create** reads the cluster's metadata, then asks, bucket after bucket, a node
holding a replica of it for its state (`BackupBucket`: a read barrier, then the
core's snapshot taken under the apply lock at a recorded index). Writes go on
meanwhile; each bucket's snapshot holds every write acknowledged before it was
asked for. The files are written and fsynced, the manifest last
(`sevendb.cluster.common.backup`).

**restore** builds a new cluster from a backup: a new cluster id and new secrets,
the same buckets (their uuids, so subscriptions keep their positions), each
bucket's state as backed up with its epoch advanced by one (an EPOCH_CREATE
applied to it at the next log index). Every event the new cluster emits is in the
new epoch, so no position of an event the old cluster emitted after the backup can
be mistaken for one of the new stream: a subscriber that resumes from such a
position is answered INVALID_SEQUENCE (it resets), one whose position the backup
holds resumes (docs/emission.md). Each node's bundle gets the seeds of its buckets
(``restore/``) and ``[node] restore`` naming them; a node starts each bucket from
its seed the first time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

import grpc
import xxhash

from sevendb.cluster.common.backup import (
    METADATA_FILE,
    BackupManifest,
    BucketImage,
    read_image,
    read_manifest,
    write_image,
    write_manifest,
)
from sevendb.cluster.common.layout import node_dir
from sevendb.cluster.common.topology import ClusterSpec, ConfigError
from sevendb.cluster.ops.admin import ClusterAdmin
from sevendb.cluster.ops.deploy import PortPlan, cluster_init
from sevendb.cluster.ops.local import create_local_cluster
from sevendb.outbox.entries import EpochCreate
from sevendb.outbox.model import EpochResult
from sevendb.outbox.state import BucketStateMachine
from sevendb.proto import sevendb_pb2 as pb

__all__ = [
    "SEEDS_DIR",
    "create_backup",
    "load_backup",
    "restore_bundles",
    "restore_local",
    "restored_images",
    "write_seeds",
]

SEEDS_DIR: Final = "restore"
"""A restored node's seeds, in its bundle (``[node] restore``)."""
BUCKET_TIMEOUT_S: Final = 300.0
Progress = Callable[[str], None]


def _empty(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty: a backup goes into a new directory")
    out.mkdir(parents=True, exist_ok=True)


def _fetch(admin: ClusterAdmin, address: str, bucket: int) -> tuple[pb.BackupChunk, bytes]:
    """One bucket's snapshot from the node at `address`: (its first chunk, the bytes)."""
    first: pb.BackupChunk | None = None
    parts: list[bytes] = []
    for chunk in admin.stub(address).BackupBucket(
        pb.BackupRequest(bucket=bucket), metadata=admin.metadata, timeout=BUCKET_TIMEOUT_S
    ):
        first = first or chunk
        parts.append(chunk.data)
    if first is None:
        raise ConfigError(f"bucket {bucket}: {address} sent nothing")
    data = b"".join(parts)
    if len(data) != first.total_bytes or xxhash.xxh64_hexdigest(data) != first.digest:
        raise ConfigError(f"bucket {bucket}: the snapshot from {address} arrived damaged")
    return first, data


def _backup_bucket(admin: ClusterAdmin, spec: ClusterSpec, bucket: int, out: Path) -> BucketImage:
    """A bucket's snapshot from the first of its nodes that serves it."""
    errors = []
    for node_id in spec.buckets[bucket].nodes:
        address = spec.node(node_id).grpc_address
        try:
            first, data = _fetch(admin, address, bucket)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                raise ConfigError(f"bucket {bucket}: {exc.details()}") from None
            errors.append(f"{node_id}: {exc.code().name}: {exc.details()}")
            continue
        image = BucketImage(
            bucket,
            first.bucket_uuid,
            first.applied_index,
            first.epoch_counter,
            len(data),
            first.digest,
        )
        if image.bucket_uuid != spec.buckets[bucket].bucket_uuid:
            raise ConfigError(f"bucket {bucket}: {node_id} answered for another bucket")
        write_image(out, image, data)
        return image
    raise ConfigError(f"bucket {bucket}: no replica could be backed up: " + "; ".join(errors))


def create_backup(admin: ClusterAdmin, out: Path, progress: Progress) -> BackupManifest:
    """Back up every bucket of the cluster and its metadata into `out` (new or empty)."""
    meta = admin.read()
    spec = meta.spec
    if spec.migrations:
        moving = ", ".join(str(m.bucket) for m in spec.migrations)
        raise ConfigError(
            f"bucket(s) {moving} are migrating: finish (`sevendb bucket migrate`) or roll "
            "back the migration before a backup"
        )
    _empty(out)
    images = []
    for bucket in range(len(spec.buckets)):
        image = _backup_bucket(admin, spec, bucket, out)
        progress(
            f"bucket {bucket}: log index {image.index}, epoch {image.epoch_counter}, "
            f"{image.size} bytes"
        )
        images.append(image)
    (out / METADATA_FILE).write_text(spec.to_json() + "\n")
    manifest = BackupManifest(spec.cluster_id, time.time_ns() // 1_000_000, tuple(images))
    write_manifest(out, manifest)
    return manifest


def load_backup(directory: Path) -> tuple[BackupManifest, ClusterSpec]:
    """A backup's manifest and the metadata it holds (checked against each other)."""
    manifest = read_manifest(directory)
    try:
        text = (directory / METADATA_FILE).read_text()
    except OSError as exc:
        raise ConfigError(f"{directory / METADATA_FILE}: unreadable ({exc})") from None
    spec = ClusterSpec.from_json(text, str(directory / METADATA_FILE))
    uuids = [b.bucket_uuid for b in spec.buckets]
    if [b.bucket_uuid for b in sorted(manifest.buckets, key=lambda b: b.bucket)] != uuids:
        raise ConfigError(f"{directory}: the snapshots are not of the buckets its metadata has")
    return manifest, spec


def restored_images(
    directory: Path, manifest: BackupManifest, now_ms: int
) -> dict[int, tuple[BucketImage, bytes]]:
    """Each bucket's state as the restored cluster starts it: the backed-up state,
    checked, with its epoch advanced by an EPOCH_CREATE at the next log index."""
    out = {}
    for image in manifest.buckets:
        sm = BucketStateMachine.restore(read_image(directory, image))
        if sm.bucket_uuid != image.bucket_uuid or sm.applied_index != image.index:
            raise ConfigError(f"bucket {image.bucket}: its snapshot is not what the manifest says")
        index = max(image.index, 1) + 1
        epoch = sm.epoch.epoch_counter + 1
        result = sm.apply_entry(index, EpochCreate(epoch, now_ms)).result
        assert isinstance(result, EpochResult) and result.error is None, result
        data = sm.snapshot()
        restored = dataclasses.replace(
            image,
            index=index,
            epoch_counter=epoch,
            size=len(data),
            digest=xxhash.xxh64_hexdigest(data),
        )
        out[image.bucket] = (restored, data)
    return out


def write_seeds(
    directory: Path,
    spec: ClusterSpec,
    node_id: str,
    images: dict[int, tuple[BucketImage, bytes]],
) -> Iterable[int]:
    """The seeds of the buckets `spec` places on `node_id` into `directory`; returns
    those buckets."""
    directory.mkdir(parents=True, exist_ok=True)
    mine = [b.bucket for b in spec.buckets if node_id in b.nodes]
    for bucket in mine:
        image, data = images[bucket]
        write_image(directory, image, data)
    manifest = BackupManifest(
        spec.cluster_id, time.time_ns() // 1_000_000, tuple(images[b][0] for b in mine)
    )
    write_manifest(directory, manifest)
    return mine


def _restore(
    directory: Path,
    make: Callable[[ClusterSpec, list[str], str], tuple[ClusterSpec, Callable[[str], Path]]],
    progress: Progress,
) -> ClusterSpec:
    """Check the backup, make the new cluster's bundles with `make(old spec, bucket
    uuids, node.toml lines)` -> (new spec, each node's bundle dir), then give each
    node the seeds of its buckets."""
    manifest, old = load_backup(directory)
    images = restored_images(directory, manifest, time.time_ns() // 1_000_000)
    uuids = [images[b][0].bucket_uuid for b in range(len(images))]
    spec, bundle_of = make(old, uuids, f'restore = "{SEEDS_DIR}"\n')
    for node in spec.nodes:
        buckets = write_seeds(bundle_of(node.node_id) / SEEDS_DIR, spec, node.node_id, images)
        progress(f"{node.node_id}: seeds of buckets {', '.join(map(str, buckets)) or 'none'}")
    return spec


def restore_bundles(
    directory: Path,
    out: Path,
    nodes: list[str],
    *,
    replicas: int | None,
    meta_voters: int,
    ports: PortPlan,
    listen_host: str | None,
    progress: Progress,
) -> ClusterSpec:
    """A new cluster across machines from a backup: `cluster init`'s bundles in
    `out`, each node's with its seeds."""

    def make(
        old: ClusterSpec, uuids: list[str], extra: str
    ) -> tuple[ClusterSpec, Callable[[str], Path]]:
        spec = cluster_init(
            out,
            nodes,
            buckets=len(uuids),
            replicas=replicas or min(old.replicas, len(nodes)),
            meta_voters=meta_voters,
            ports=ports,
            listen_host=listen_host,
            progress=progress,
            bucket_uuids=uuids,
            node_extra=extra,
        )
        return spec, lambda node_id: out / node_id

    return _restore(directory, make, progress)


def restore_local(
    directory: Path, data_dir: Path, *, nodes: int, replicas: int | None, progress: Progress
) -> ClusterSpec:
    """A new local cluster (`sevendb cluster up --data DATA_DIR` starts it) from a
    backup."""
    if (data_dir / "nodes").exists():
        raise ConfigError(f"{data_dir} holds a cluster already: restore into a new directory")

    def make(
        old: ClusterSpec, uuids: list[str], extra: str
    ) -> tuple[ClusterSpec, Callable[[str], Path]]:
        spec = create_local_cluster(
            data_dir,
            nodes=nodes,
            buckets=len(uuids),
            replicas=replicas or min(old.replicas, nodes),
            bucket_uuids=uuids,
            node_extra=extra,
        )
        return spec, lambda node_id: node_dir(data_dir, node_id)

    return _restore(directory, make, progress)
