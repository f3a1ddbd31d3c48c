"""Durable file helpers: write a file so it survives power loss, and make a rename
durable. Every file a node keeps (journals, snapshots, cluster spec, archive
segments) is written through these."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path
from typing import Final

__all__ = ["WRITEBACK_BYTES", "fsync_dir", "pwrite_all", "write_synced"]

WRITEBACK_BYTES: Final = 1 << 20
"""`write_synced` has the kernel write a file back this many bytes at a time."""

_SYNC_FILE_RANGE_ALL: Final = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER
_libc = (
    ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None
)


def _write_back(fd: int, offset: int, size: int) -> None:
    """Write the range back to the disk now and wait for it (Linux `sync_file_range`:
    data only, no metadata and no cache flush; the closing fsync still does those).
    Elsewhere, or if the call fails, nothing: it only paces the writeback."""
    if _libc is not None:
        _libc.sync_file_range(
            fd, ctypes.c_int64(offset), ctypes.c_int64(size), _SYNC_FILE_RANGE_ALL
        )


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
    (`fsync_dir`).

    The file is written back `WRITEBACK_BYTES` at a time as it is written, so the
    closing fsync finds little left to write. An fsync of tens of megabytes at once
    (a snapshot) held every other fsync of the disk back behind it: the journal
    fsyncs of the node and of its neighbours took 15-22 ms instead of 0.1-0.3, and
    each of them holds a Raft round (docs/performance.md, "thirteenth session")."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = written_back = 0
        for piece in pieces:
            view = memoryview(piece)
            while view:
                part = view[: WRITEBACK_BYTES - (offset - written_back)]
                pwrite_all(fd, part, offset)
                offset += len(part)
                view = view[len(part) :]
                if offset - written_back == WRITEBACK_BYTES:
                    _write_back(fd, written_back, WRITEBACK_BYTES)
                    written_back = offset
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite that retries short writes, so a record is never silently half written."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:  # pragma: no cover - pwrite raises OSError on real failures
            raise OSError(f"pwrite wrote {written} bytes")
        view = view[written:]
        offset += written
