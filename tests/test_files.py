"""`cluster/common/files.py`: files written durably."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

import pytest

from sevendb.cluster.common.files import WRITEBACK_BYTES, write_synced

_CACHESTAT: int = 451  # Linux 6.5+, x86_64 and arm64 alike


def _dirty_pages(fd: int) -> int:
    """Pages of the file still dirty in the page cache (`cachestat(2)`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    span = (ctypes.c_uint64 * 2)(0, 0)  # offset 0, length 0: the whole file
    stat = (ctypes.c_uint64 * 5)()  # cache, dirty, writeback, evicted, recently evicted
    if libc.syscall(_CACHESTAT, fd, span, stat, 0) != 0:
        pytest.skip(f"cachestat(2): {os.strerror(ctypes.get_errno())}")
    return int(stat[1])


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"),
    reason="sync_file_range and cachestat are Linux's",
)
def test_a_large_file_is_written_back_before_its_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot of tens of megabytes left dirty until one fsync held every other
    fsync of the disk back behind it (the node's journal fsyncs: 15-22 ms instead of
    0.1-0.3). `write_synced` has the kernel write it back a MiB at a time as it
    goes, so the fsync finds at most the last MiB left to write."""
    data = os.urandom(3 * WRITEBACK_BYTES + 5)
    dirty_at_fsync: list[int] = []
    fsync = os.fsync

    def noted(fd: int) -> None:
        dirty_at_fsync.append(_dirty_pages(fd))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", noted)
    write_synced(tmp_path / "f", data[:100], data[100:])  # pieces cut across the MiBs
    assert len(dirty_at_fsync) == 1 and dirty_at_fsync[0] <= 1  # the last 5 bytes' page
    assert (tmp_path / "f").read_bytes() == data


def test_a_small_file_is_written_and_fsynced_whole(tmp_path: Path) -> None:
    write_synced(tmp_path / "f", b"ab", b"", b"cd")
    assert (tmp_path / "f").read_bytes() == b"abcd"
    write_synced(tmp_path / "f", b"e")  # truncated, not overwritten in place
    assert (tmp_path / "f").read_bytes() == b"e"
