"""The on-disk format of a backup (`sevendb backup create`) and of the restore seeds
a node starts a bucket from (`sevendb backup restore`): one directory holding

* ``backup.json``: the format, the cluster it came from, when, and per bucket its
  uuid, the log index and epoch its snapshot is at, its size and xxh64;
* ``bucket-<n>.snapshot``: the bucket core's snapshot (docs/core.md, `snapshot()`);
* ``metadata.json`` (a backup only): the cluster's metadata when it was taken.

A node's restore seeds are the same format without the metadata; the node reads
them through ``[node] restore`` (docs/operations.md, "Backup and restore").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import xxhash

from sevendb.cluster.common.files import write_synced
from sevendb.cluster.common.topology import ConfigError

__all__ = [
    "BACKUP_FORMAT",
    "MANIFEST_FILE",
    "METADATA_FILE",
    "BackupManifest",
    "BucketImage",
    "read_image",
    "read_manifest",
    "write_image",
    "write_manifest",
]

BACKUP_FORMAT: Final = 1
MANIFEST_FILE: Final = "backup.json"
METADATA_FILE: Final = "metadata.json"


@dataclass(frozen=True)
class BucketImage:
    """One bucket's snapshot in a backup."""

    bucket: int
    bucket_uuid: str
    index: int
    """The last log index the snapshot covers."""
    epoch_counter: int
    size: int
    digest: str
    """xxh64 of the snapshot bytes (hex)."""

    @property
    def file(self) -> str:
        return f"bucket-{self.bucket}.snapshot"


@dataclass(frozen=True)
class BackupManifest:
    cluster_id: str
    created_ms: int
    buckets: tuple[BucketImage, ...]
    format: int = BACKUP_FORMAT

    def image(self, bucket: int) -> BucketImage | None:
        return next((b for b in self.buckets if b.bucket == bucket), None)


def write_image(directory: Path, image: BucketImage, data: bytes) -> None:
    """Write one bucket's snapshot (fsynced) after checking it is what `image` says."""
    if len(data) != image.size or xxhash.xxh64_hexdigest(data) != image.digest:
        raise ConfigError(f"bucket {image.bucket}: the snapshot does not match its digest")
    write_synced(directory / image.file, data)


def read_image(directory: Path, image: BucketImage) -> bytes:
    """One bucket's snapshot, checked against its size and digest."""
    path = directory / image.file
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
    if len(data) != image.size or xxhash.xxh64_hexdigest(data) != image.digest:
        raise ConfigError(
            f"{path}: damaged (its size or digest is not the one {MANIFEST_FILE} has)"
        )
    return data


def write_manifest(directory: Path, manifest: BackupManifest) -> Path:
    """Written last, fsynced: a directory without one is no backup."""
    body = asdict(manifest)
    path = directory / MANIFEST_FILE
    write_synced(path, (json.dumps(body, indent=2, sort_keys=True) + "\n").encode())
    return path


def _image(raw: Any, where: str) -> BucketImage:
    try:
        image = BucketImage(**raw)
    except TypeError as exc:
        raise ConfigError(f"{where}: a bucket entry is malformed ({exc})") from None
    kinds: dict[str, type] = {"bucket_uuid": str, "digest": str}
    if not all(isinstance(getattr(image, name), kinds.get(name, int)) for name in asdict(image)):
        raise ConfigError(f"{where}: bucket entry {raw!r} has fields of the wrong type")
    return image


def read_manifest(directory: Path, *, complete: bool = True) -> BackupManifest:
    """The manifest of a backup (`complete`: every bucket of the cluster) or of a
    node's restore seeds; ConfigError if it is missing, malformed or of another
    format."""
    path = directory / MANIFEST_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{directory}: not a backup (no {MANIFEST_FILE})") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != BACKUP_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else None
        raise ConfigError(f"{path}: backup format {found!r}; this version reads {BACKUP_FORMAT}")
    buckets: Sequence[Any] = raw.get("buckets") or []
    images = tuple(_image(b, str(path)) for b in buckets)
    if complete and sorted(b.bucket for b in images) != list(range(len(images))):
        raise ConfigError(f"{path}: the buckets are not 0..{len(images) - 1}")
    cluster_id, created = raw.get("cluster_id"), raw.get("created_ms")
    if not isinstance(cluster_id, str) or not isinstance(created, int):
        raise ConfigError(f"{path}: cluster_id or created_ms missing")
    return BackupManifest(cluster_id, created, images)
