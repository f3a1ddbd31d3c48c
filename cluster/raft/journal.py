"""`DurableJournal`: a durable, group-committed Raft log for pysyncobj, in place of
its ``FileJournal``, which never fsyncs (so replicas acked entries a power cut could
erase). Appends are written at once and made durable by one ``fdatasync`` per batch
(`sync`), before a follower acks or a leader counts them; removals are durable before
they return; records are CRC'd, and a torn tail is cut off at open. The file format
and the contract: docs/raft.md ("Files"). Not thread-safe: pysyncobj calls it from
one thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import overload

from sevendb.cluster.common.files import fsync_dir, pwrite_all, write_synced

from .sidecars import (
    STATE_FORMAT_VERSION,
    STATE_MAGIC,
    JournalError,
    JournalMeta,
    JournalStateError,
    VoteId,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "STATE_FORMAT_VERSION",
    "STATE_MAGIC",
    "DurableJournal",
    "Entry",
    "FailStopJournal",
    "JournalError",
    "JournalFormatError",
    "JournalStateError",
    "VoteId",
]

logger = logging.getLogger(__name__)

#: One pysyncobj log entry: ``(command, idx, term)``. pysyncobj 0.3.17 builds commands
#: as bytes (``struct.pack('B', type) + pickled payload``) and stores the tuple as is.
Entry = tuple[bytes, int, int]

MAGIC = b"7DBJRNL\x00"
FORMAT_VERSION = 1

_HEADER = struct.Struct("<8sII")  # magic, format version, flags
_LEN = struct.Struct("<I")
_IDX_TERM = struct.Struct("<QQ")
_CRC = struct.Struct("<I")
_RECORD_OVERHEAD = _LEN.size + _CRC.size
_MAX_BODY = 0xFFFFFFFF
_MAX_U64 = 0xFFFFFFFFFFFFFFFF

_TMP_SUFFIX = ".tmp"


class JournalFormatError(JournalError):
    """The log file is not a journal this code can read (bad magic, unknown version,
    truncated header). Raised instead of wiping the file, because the file may hold
    acked entries written by something else or by a newer release."""


def _fdatasync(fd: int) -> None:
    """fdatasync where available (Linux): it skips flushing timestamps, which recovery
    does not need, but still flushes the file size that appends change."""
    sync = getattr(os, "fdatasync", os.fsync)
    sync(fd)


def _read_all(fd: int) -> bytes:
    """Read a whole file; a single pread is capped (about 2 GiB on Linux)."""
    size = os.fstat(fd).st_size
    chunks: list[bytes] = []
    offset = 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _as_command_bytes(command: object) -> bytes:
    """Normalise a command to bytes. pysyncobj 0.3.17 only hands us bytes; str is
    accepted with the same UTF-8 rule as pysyncobj's ``to_bytes`` so we stay a drop-in
    replacement, and anything else is refused instead of being pickled."""
    if isinstance(command, bytes):
        return command
    if isinstance(command, bytearray | memoryview):
        return bytes(command)
    if isinstance(command, str):
        return command.encode("utf-8")
    raise TypeError(f"journal command must be bytes, got {type(command).__name__}")


def _encode_record(command: bytes, idx: int, term: int) -> bytes:
    body_len = _IDX_TERM.size + len(command)
    if body_len > _MAX_BODY:
        raise ValueError(f"journal command of {len(command)} bytes is too large")
    idx_term = _IDX_TERM.pack(idx, term)
    crc = zlib.crc32(command, zlib.crc32(idx_term))
    return b"".join((_LEN.pack(body_len), idx_term, command, _CRC.pack(crc)))


def _in_sequence(entries: list[Entry], idx: int, term: int) -> bool:
    """Raft logs are contiguous in idx and non-decreasing in term; pysyncobj
    addresses entries by ``idx - first_idx``, so it relies on the former too."""
    if not entries:
        return True
    _, last_idx, last_term = entries[-1]
    return idx == last_idx + 1 and term >= last_term


def _scan_records(
    data: bytes, pos: int, entries: list[Entry], offsets: array[int]
) -> tuple[int, str | None]:
    """Read the records of `data` from offset `pos` into `entries` and `offsets`, up to
    the first short read, CRC mismatch or out-of-sequence record. Returns where
    reading stopped and why (None: at the end of `data`)."""
    view = memoryview(data)
    while pos < len(data):
        if len(data) - pos < _LEN.size:
            return pos, "short length prefix"
        (body_len,) = _LEN.unpack_from(data, pos)
        if body_len < _IDX_TERM.size:
            return pos, f"impossible record length {body_len}"
        end = pos + _LEN.size + body_len + _CRC.size
        if end > len(data):
            return pos, "short record"
        body = view[pos + _LEN.size : pos + _LEN.size + body_len]
        (crc,) = _CRC.unpack_from(data, end - _CRC.size)
        if zlib.crc32(body) != crc:
            return pos, "crc mismatch"
        idx, term = _IDX_TERM.unpack_from(body, 0)
        if not _in_sequence(entries, idx, term):
            # A CRC-valid record that breaks the log's shape cannot be trusted
            # either; keep the longest well-formed prefix.
            return pos, f"out-of-sequence record idx={idx} term={term}"
        entries.append((bytes(body[_IDX_TERM.size :]), idx, term))
        offsets.append(pos)
        pos = end
    return pos, None


def _remove_stale_tmp_files(*paths: Path) -> None:
    """Leftovers of a crash during an atomic replace are never the source of truth:
    the rename that would have published them did not happen."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            Path(str(path) + _TMP_SUFFIX).unlink()


class DurableJournal:
    """A crash-safe, group-committed replacement for pysyncobj's ``FileJournal``.

    All entries are also kept in memory (as pysyncobj's own journals do), so reads
    never touch the disk; the file is only appended to, truncated, or rewritten.

    :param path: the log file. The term/vote sidecar is ``<path>.state``, the
        commit-index hint ``<path>.commit``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._meta = JournalMeta(self._path, self._atomic_write)
        self._entries: list[Entry] = []
        # File offset at which each entry's record starts, so deleteEntriesFrom can
        # truncate without re-reading the file.
        self._offsets: array[int] = array("Q")
        self._end = _HEADER.size
        self.durable_len = 0
        """How many of the entries (counted from position 0) are known to be on disk."""
        self.pending = False
        """True if some appended entries are not yet durable."""
        self._closed = False
        #: Every fsync/fdatasync this journal issued (log, sidecar and directories).
        self.fsync_count = 0
        #: Group commits: calls to :meth:`sync` that actually flushed appended entries.
        self.sync_count = 0

        _remove_stale_tmp_files(self._path, self._meta.state.path)
        self._meta.load()
        if not self._path.exists():
            # Published atomically, so a crash during creation can never leave a
            # half-written header that would later look like a foreign file.
            self._atomic_write(self._path, _HEADER.pack(MAGIC, FORMAT_VERSION, 0))
        self._fd = os.open(self._path, os.O_RDWR)
        try:
            self._load_log()
        except BaseException:
            os.close(self._fd)
            raise

    # ------------------------------------------------------------------ opening

    def _load_log(self) -> None:
        data = _read_all(self._fd)
        if len(data) < _HEADER.size:
            raise JournalFormatError(
                f"{self._path}: file is {len(data)} bytes, shorter than the "
                f"{_HEADER.size}-byte journal header; refusing to overwrite it"
            )
        magic, version, _flags = _HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            raise JournalFormatError(
                f"{self._path}: bad magic {magic!r} (expected {MAGIC!r}); not a sevendb "
                "journal (a pysyncobj FileJournal?), refusing to overwrite it"
            )
        if version != FORMAT_VERSION:
            raise JournalFormatError(
                f"{self._path}: unknown journal format version {version} (this build "
                f"reads version {FORMAT_VERSION}); refusing to overwrite it"
            )

        pos, reason = _scan_records(data, _HEADER.size, self._entries, self._offsets)
        if reason is not None:
            logger.warning(
                "journal %s: torn or corrupt tail at offset %d (%s); dropping %d bytes",
                self._path,
                pos,
                reason,
                len(data) - pos,
            )
            # Make the truncation durable before anything is appended on top of it.
            os.ftruncate(self._fd, pos)
            self._fsync(self._fd)
        self._end = pos
        self.durable_len = len(self._entries)

    # --------------------------------------------------------------- low level

    def _fsync(self, fd: int) -> None:
        _fdatasync(fd)
        self.fsync_count += 1

    def _fsync_parent(self) -> None:
        fsync_dir(self._path.parent)
        self.fsync_count += 1

    def _atomic_write(self, target: Path, payload: bytes) -> None:
        """Replace ``target`` so that after a crash it holds either the old or the new
        content in full: write a tmp file, fsync it, rename over, fsync the directory."""
        tmp = Path(str(target) + _TMP_SUFFIX)
        write_synced(tmp, payload)
        self.fsync_count += 1
        os.replace(tmp, target)
        self._fsync_parent()

    def _check_open(self) -> None:
        if self._closed:
            raise JournalError(f"{self._path}: journal is closed")

    def _truncate_durably(self, offset: int, keep: int) -> None:
        """Cut the file at ``offset`` (keeping ``keep`` entries) and fsync at once. The
        fsync also makes any still-pending appends durable, which is fine; what matters
        is that no later append can land on disk while the cut-off records survive."""
        os.ftruncate(self._fd, offset)
        self._fsync(self._fd)
        del self._entries[keep:]
        del self._offsets[keep:]
        self._end = offset
        self.durable_len = len(self._entries)
        self.pending = False

    # ------------------------------------------------------ pysyncobj interface

    def add(self, command: bytes, idx: int, term: int) -> None:
        """Append an entry. Written to the OS but not fsynced: call :meth:`sync`
        before acking it (follower) or counting it (leader).

        :raises ValueError: if ``idx`` does not follow the last entry or ``term`` goes
            backwards - a caller bug that would otherwise only surface on reopen.
        """
        self._check_open()
        data = _as_command_bytes(command)
        if not (0 <= idx <= _MAX_U64 and 0 <= term <= _MAX_U64):
            raise ValueError(f"idx/term out of range: idx={idx} term={term}")
        if not _in_sequence(self._entries, idx, term):
            _, last_idx, last_term = self._entries[-1]
            raise ValueError(
                f"non-contiguous journal append: idx={idx} term={term} after "
                f"idx={last_idx} term={last_term}"
            )
        record = _encode_record(data, idx, term)
        try:
            pwrite_all(self._fd, record, self._end)
        except OSError:
            # Do not leave a partial record for the next append to land behind.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._end)
            raise
        self._entries.append((data, idx, term))
        self._offsets.append(self._end)
        self._end += len(record)
        self.pending = True

    def clear(self) -> None:
        """Drop every entry (pysyncobj does this before installing a snapshot)."""
        self._check_open()
        self._truncate_durably(_HEADER.size, 0)

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        """Drop entries at positions ``>= entryFrom`` (list semantics, like
        ``del entries[entryFrom:]``): a follower discarding a conflicting suffix."""
        self._check_open()
        keep = len(range(len(self._entries))[:entryFrom])
        if keep == len(self._entries):
            return
        self._truncate_durably(self._offsets[keep], keep)

    def deleteEntriesTo(self, entryTo: int) -> None:
        """Drop entries at positions ``< entryTo`` (like ``entries = entries[entryTo:]``),
        after a snapshot made them redundant.

        The kept suffix is rewritten into a new file that atomically replaces the log,
        so a crash leaves either the old or the new log, never a mix. The directory is
        fsynced first: pysyncobj publishes its snapshot (``fullDumpFile``) with a bare
        rename, and if the snapshot lives next to the journal this makes that rename
        durable before we throw away the entries it replaces.
        """
        self._check_open()
        kept = self._entries[entryTo:]
        if len(kept) == len(self._entries):
            return
        self._fsync_parent()
        chunks = [_HEADER.pack(MAGIC, FORMAT_VERSION, 0)]
        offsets: array[int] = array("Q")
        pos = _HEADER.size
        for command, idx, term in kept:
            record = _encode_record(command, idx, term)
            offsets.append(pos)
            chunks.append(record)
            pos += len(record)
        self._atomic_write(self._path, b"".join(chunks))
        new_fd = os.open(self._path, os.O_RDWR)
        os.close(self._fd)
        self._fd = new_fd
        self._entries = kept
        self._offsets = offsets
        self._end = pos
        self.durable_len = len(kept)
        self.pending = False

    @overload
    def __getitem__(self, item: int) -> Entry: ...

    @overload
    def __getitem__(self, item: slice) -> list[Entry]: ...

    def __getitem__(self, item: int | slice) -> Entry | list[Entry]:
        """List indexing, including negative indexes and slices (pysyncobj uses
        ``log[-1]``, ``log[0]``, ``log[diff:]`` and ``log[diff:diff + count]``)."""
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def _destroy(self) -> None:
        """Close on SyncObj shutdown. A clean shutdown loses nothing: pending appends
        and a dirty commit index are flushed first. Idempotent."""
        if self._closed:
            return
        try:
            self.sync()
            self._meta.store_commit()
        finally:
            self._closed = True
            os.close(self._fd)
            self._meta.close()

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        """Remember the commit index; persisted lazily because it is only a hint."""
        self._meta.set_commit(raftCommitIndex)

    def getRaftCommitIndex(self) -> int:
        """The persisted commit index, clamped to the last entry: the commit index can
        never exceed the log, and a lower hint is always safe (the leader re-sends it)."""
        if self._entries:
            return min(self._meta.commit, self._entries[-1][1])
        return self._meta.commit

    def setCurrentTerm(self, term: int, votedForNodeId: VoteId) -> None:
        """Persist term and vote durably before returning: pysyncobj sends the vote
        (or acts on the new term) right after this call."""
        self._check_open()
        if not 0 <= term <= _MAX_U64:
            raise ValueError(f"term out of range: {term}")
        self._meta.set_term(term, votedForNodeId)

    def getCurrentTerm(self) -> int:
        return self._meta.term

    def getVotedForNodeId(self) -> VoteId:
        return self._meta.vote

    def onOneSecondTimer(self) -> None:
        """Called by SyncObj once a second: write a changed commit-index hint (no
        fsync), and sync any appends a caller forgot to sync, which bounds their
        exposure to a second."""
        self._check_open()
        self.sync()
        self._meta.store_commit()

    def flush(self) -> None:
        """``FileJournal.flush`` equivalent; here it means :meth:`sync`."""
        self.sync()

    # ------------------------------------------------------------ group commit

    def sync(self) -> bool:
        """Make every entry appended so far durable with one fdatasync.

        :returns: True if an fsync was issued, False if nothing was pending (so the
            replica adapter can call this on every ack/commit check for free).
        """
        self._check_open()
        if not self.pending:
            return False
        self._fsync(self._fd)
        self.pending = False
        self.durable_len = len(self._entries)
        self.sync_count += 1
        return True

    @property
    def last_durable_index(self) -> int:
        """Raft index of the last durable entry, or 0 if none: the most a leader may
        count as its own match index."""
        if self.durable_len == 0:
            return 0
        return self._entries[self.durable_len - 1][1]

    @property
    def size_bytes(self) -> int:
        """Bytes of records in the log file (the header not counted)."""
        return self._end - _HEADER.size

    @property
    def path(self) -> Path:
        return self._path

    def close(self) -> None:
        """Alias of :meth:`_destroy` for use outside pysyncobj."""
        self._destroy()

    def __repr__(self) -> str:
        return (
            f"DurableJournal({str(self._path)!r}, entries={len(self._entries)}, "
            f"durable={self.durable_len})"
        )


class FailStopJournal(DurableJournal):
    """A DurableJournal that never claims durability again after an fsync failed.

    After a failed fsync the kernel may have dropped the dirty pages and a retry can
    "succeed" without the data being on disk, so retrying is not safe. The replica
    treats the first failure as a crash: it stops acking, counting and applying."""

    failure: str | None = None

    def _fsync(self, fd: int) -> None:
        try:
            super()._fsync(fd)
        except OSError as exc:
            self.failure = self.failure or f"{type(exc).__name__}: {exc}"
            raise

    def _destroy(self) -> None:
        if self.failure is not None and not self._closed:
            self._closed = True  # nothing more can be made durable: just let go
            os.close(self._fd)
            return
        super()._destroy()

    def sync(self) -> bool:
        if self.failure is not None:
            raise JournalError(f"{self.path}: an earlier fsync failed ({self.failure})")
        try:
            return super().sync()
        except OSError as exc:
            self.failure = self.failure or f"{type(exc).__name__}: {exc}"
            raise
