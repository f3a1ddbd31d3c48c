"""Durable file helpers: write a file so it survives power loss, and make a rename
durable. Every file a node keeps (journals, snapshots, cluster spec, archive
segments) is written through these."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "pwrite_all", "write_synced"]


def fsync_dir(directory: Path) -> None:
    """Make a rename/create in ``directory`` durable. A renamed-in file whose directory
    entry is not fsynced can vanish on power loss even though its data was synced."""
    if os.name != "posix":  # pragma: no cover - Windows cannot open directories
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, *pieces: bytes) -> None:
    """Create (or truncate) ``path`` holding the pieces one after the other, fsynced
    before returning. The caller renames it into place and fsyncs the directory
    (`fsync_dir`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        for piece in pieces:
            pwrite_all(fd, piece, offset)
            offset += len(piece)
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """pwrite that retries short writes, so a record is never silently half written."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:  # pragma: no cover - pwrite raises OSError on real failures
            raise OSError(f"pwrite wrote {written} bytes")
        view = view[written:]
        offset += written
