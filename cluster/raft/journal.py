"""A durable, group-committed Raft journal for pysyncobj.

Why this exists: pysyncobj 0.3.17's ``FileJournal`` keeps its log in an mmap that is
never flushed or fsynced, and writes ``currentTerm``/``votedFor`` with tmp+rename but no
fsync. A follower therefore acks AppendEntries for entries that only live in the page
cache, and a leader counts itself towards a majority for entries that a power cut can
erase. Raft's safety argument assumes the opposite, so committed entries can be lost.

:class:`DurableJournal` is a drop-in replacement, duck-typed to pysyncobj's journal
interface (this module deliberately does not import pysyncobj; only the replica
adapter does). Its contract:

* ``add()`` writes the record to the file (an OS write into the page cache) but does
  not fsync. :meth:`DurableJournal.sync` makes everything appended so far durable
  with a single ``fdatasync``; the replica adapter calls it once per batch - on a
  follower just before it acks an AppendEntries, on the leader before it counts its
  own entries. That is group commit: N appends cost one fsync.
* Removing entries (``deleteEntriesFrom``/``deleteEntriesTo``/``clear``) is made
  durable before it returns, so appends that follow can never be interleaved with
  resurrected stale records after a crash. These calls are rare (conflicts, snapshot
  compaction), so their fsyncs do not matter for throughput.
* ``currentTerm``/``votedFor`` live in a small sidecar file that is replaced
  atomically and fsynced (tmp, fsync, rename, fsync directory) before
  ``setCurrentTerm`` returns, because Raft requires them to be durable before a vote
  is granted or a higher term is acted upon.
* The commit index is only a hint (it is volatile state in Raft), so it is persisted
  lazily from ``onOneSecondTimer`` into its own small file (``<log>.commit``), written
  in place and never fsynced, and clamped to the end of the log on read. A lost,
  torn or stale hint only means a restarted replica waits for its leader to tell it
  what is committed. (Persisting it with the term and vote cost an atomic replace,
  two fsyncs, every second on the tick thread: a 5-25 ms stall of every write.)

On-disk log format (little endian)::

    header:  magic (8 bytes, b"7DBJRNL\\x00") | format version (u32) | flags (u32, 0)
    record:  length (u32) | body (length bytes) | crc32(body) (u32)
    body:    idx (u64) | term (u64) | command bytes

When the log is opened, records are scanned until the first short read, CRC mismatch
or out-of-sequence record; everything from there on is a torn or corrupt tail (e.g. a
crash in the middle of an append that was never synced, so never acked) and is
truncated, with a WARNING naming the file, offset and number of bytes dropped. A bad
magic number or unknown format version is *not* a torn tail: it means the file is not
ours (for example an old pysyncobj ``FileJournal``), so opening raises
:class:`JournalFormatError` and leaves the file untouched.

The journal is not thread-safe. pysyncobj calls it from a single thread (its tick
thread, or the constructing thread before that starts), and so must the adapter.
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

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "STATE_FORMAT_VERSION",
    "STATE_MAGIC",
    "DurableJournal",
    "Entry",
    "JournalError",
    "JournalFormatError",
    "JournalStateError",
    "VoteId",
]

logger = logging.getLogger(__name__)

#: One pysyncobj log entry: ``(command, idx, term)``. pysyncobj 0.3.17 builds commands
#: as bytes (``struct.pack('B', type) + pickled payload``) and stores the tuple as is.
Entry = tuple[bytes, int, int]

#: What pysyncobj passes as ``votedForNodeId``: ``Node.id`` (a ``"host:port"`` string for
#: TCP nodes, but any hashable in principle) or None. We persist the common, safely
#: encodable types and refuse the rest rather than pickle arbitrary objects.
VoteId = str | bytes | int | None

MAGIC = b"7DBJRNL\x00"
FORMAT_VERSION = 1
STATE_MAGIC = b"7DBSTAT\x00"
STATE_FORMAT_VERSION = 1

_HEADER = struct.Struct("<8sII")  # magic, format version, flags
_LEN = struct.Struct("<I")
_IDX_TERM = struct.Struct("<QQ")
_CRC = struct.Struct("<I")
_RECORD_OVERHEAD = _LEN.size + _CRC.size
_MAX_BODY = 0xFFFFFFFF
_MAX_U64 = 0xFFFFFFFFFFFFFFFF

# State sidecar: magic, version, term, commit index, vote tag, vote length, vote bytes,
# then crc32 of everything before it.
_STATE_FIXED = struct.Struct("<8sIQQBI")
_VOTE_NONE, _VOTE_STR, _VOTE_BYTES, _VOTE_INT = 0, 1, 2, 3

_STATE_SUFFIX = ".state"
_COMMIT_SUFFIX = ".commit"
# Commit-index hint: magic, commit index, then crc32 of both.
COMMIT_MAGIC = b"7DBCMIT\x00"
_COMMIT_HINT = struct.Struct("<8sQ")
_TMP_SUFFIX = ".tmp"


class JournalError(Exception):
    """Base class for errors raised by :class:`DurableJournal`."""


class JournalFormatError(JournalError):
    """The log file is not a journal this code can read (bad magic, unknown version,
    truncated header). Raised instead of wiping the file, because the file may hold
    acked entries written by something else or by a newer release."""


class JournalStateError(JournalError):
    """The term/vote sidecar is unreadable. Raised instead of defaulting to term 0 and
    no vote, because forgetting a vote lets a node vote twice in one term."""


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


def _encode_vote(vote: VoteId) -> tuple[int, bytes]:
    if vote is None:
        return _VOTE_NONE, b""
    if isinstance(vote, str):
        return _VOTE_STR, vote.encode("utf-8")
    if isinstance(vote, bytes):
        return _VOTE_BYTES, vote
    if type(vote) is int:  # not bool: True would come back as 1
        return _VOTE_INT, str(vote).encode("ascii")
    raise TypeError(f"votedForNodeId must be str, bytes, int or None, got {type(vote).__name__}")


def _decode_vote(tag: int, raw: bytes) -> VoteId:
    if tag == _VOTE_NONE:
        return None
    if tag == _VOTE_STR:
        return raw.decode("utf-8")
    if tag == _VOTE_BYTES:
        return raw
    if tag == _VOTE_INT:
        return int(raw.decode("ascii"))
    raise ValueError(f"unknown vote tag {tag}")


class DurableJournal:
    """A crash-safe, group-committed replacement for pysyncobj's ``FileJournal``.

    All entries are also kept in memory (as pysyncobj's own journals do), so reads
    never touch the disk; the file is only appended to, truncated, or rewritten.

    :param path: the log file. The term/vote sidecar is ``<path>.state``, the
        commit-index hint ``<path>.commit``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._state_path = Path(str(self._path) + _STATE_SUFFIX)
        self._entries: list[Entry] = []
        # File offset at which each entry's record starts, so deleteEntriesFrom can
        # truncate without re-reading the file.
        self._offsets: array[int] = array("Q")
        self._end = _HEADER.size
        self._durable_count = 0
        self._pending = False
        self._closed = False
        #: Every fsync/fdatasync this journal issued (log, sidecar and directories).
        self.fsync_count = 0
        #: Group commits: calls to :meth:`sync` that actually flushed appended entries.
        self.sync_count = 0

        self._current_term = 0
        self._voted_for: VoteId = None
        self._commit_index = 1  # pysyncobj's FileJournal default
        self._commit_index_dirty = False
        self._commit_path = Path(str(self._path) + _COMMIT_SUFFIX)
        self._commit_fd: int | None = None

        self._remove_stale_tmp_files()
        self._load_state()
        self._load_commit_hint()
        if not self._path.exists():
            self._create_empty_log()
        self._fd = os.open(self._path, os.O_RDWR)
        try:
            self._load_log()
        except BaseException:
            os.close(self._fd)
            raise

    # ------------------------------------------------------------------ opening

    def _remove_stale_tmp_files(self) -> None:
        """Leftovers of a crash during an atomic replace are never the source of truth:
        the rename that would have published them did not happen."""
        for tmp in (Path(str(self._path) + _TMP_SUFFIX), Path(str(self._state_path) + _TMP_SUFFIX)):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _create_empty_log(self) -> None:
        """Publish a header-only log atomically, so a crash during creation can never
        leave a half-written header that would later look like a foreign file."""
        self._atomic_write(self._path, _HEADER.pack(MAGIC, FORMAT_VERSION, 0))

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

        view = memoryview(data)
        pos = _HEADER.size
        reason: str | None = None
        while pos < len(data):
            if len(data) - pos < _LEN.size:
                reason = "short length prefix"
                break
            (body_len,) = _LEN.unpack_from(data, pos)
            if body_len < _IDX_TERM.size:
                reason = f"impossible record length {body_len}"
                break
            end = pos + _LEN.size + body_len + _CRC.size
            if end > len(data):
                reason = "short record"
                break
            body = view[pos + _LEN.size : pos + _LEN.size + body_len]
            (crc,) = _CRC.unpack_from(data, end - _CRC.size)
            if zlib.crc32(body) != crc:
                reason = "crc mismatch"
                break
            idx, term = _IDX_TERM.unpack_from(body, 0)
            if not self._in_sequence(idx, term):
                # A CRC-valid record that breaks the log's shape cannot be trusted
                # either; keep the longest well-formed prefix.
                reason = f"out-of-sequence record idx={idx} term={term}"
                break
            self._entries.append((bytes(body[_IDX_TERM.size :]), idx, term))
            self._offsets.append(pos)
            pos = end

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
        self._durable_count = len(self._entries)

    def _in_sequence(self, idx: int, term: int) -> bool:
        """Raft logs are contiguous in idx and non-decreasing in term; pysyncobj
        addresses entries by ``idx - first_idx``, so it relies on the former too."""
        if not self._entries:
            return True
        _, last_idx, last_term = self._entries[-1]
        return idx == last_idx + 1 and term >= last_term

    def _load_state(self) -> None:
        try:
            raw = self._state_path.read_bytes()
        except FileNotFoundError:
            return  # fresh node, or crashed before the first term change: term 0
        fixed = _STATE_FIXED.size
        if len(raw) < fixed + _CRC.size:
            raise JournalStateError(f"{self._state_path}: truncated ({len(raw)} bytes)")
        magic, version, term, commit, tag, vote_len = _STATE_FIXED.unpack_from(raw, 0)
        if magic != STATE_MAGIC:
            raise JournalStateError(f"{self._state_path}: bad magic {magic!r}")
        if version != STATE_FORMAT_VERSION:
            raise JournalStateError(f"{self._state_path}: unknown state format version {version}")
        if len(raw) != fixed + vote_len + _CRC.size:
            raise JournalStateError(f"{self._state_path}: length mismatch")
        (crc,) = _CRC.unpack_from(raw, fixed + vote_len)
        if zlib.crc32(raw[: fixed + vote_len]) != crc:
            raise JournalStateError(f"{self._state_path}: crc mismatch")
        try:
            vote = _decode_vote(tag, raw[fixed : fixed + vote_len])
        except ValueError as exc:
            raise JournalStateError(f"{self._state_path}: {exc}") from exc
        self._current_term = term
        self._commit_index = commit
        self._voted_for = vote

    def _load_commit_hint(self) -> None:
        try:
            raw = self._commit_path.read_bytes()
        except FileNotFoundError:
            return
        size = _COMMIT_HINT.size
        if len(raw) == size + _CRC.size and _CRC.unpack_from(raw, size)[0] == zlib.crc32(
            raw[:size]
        ):
            magic, commit = _COMMIT_HINT.unpack_from(raw, 0)
            if magic == COMMIT_MAGIC:
                self._commit_index = max(self._commit_index, commit)
                return
        logger.warning(
            "%s: unreadable commit-index hint ignored (%d bytes); the leader will "
            "resend the commit index",
            self._commit_path,
            len(raw),
        )

    def _store_commit_hint(self) -> None:
        """Overwrite a changed hint in place, without fsync: see the module docstring."""
        if not self._commit_index_dirty:
            return
        if self._commit_fd is None:
            self._commit_fd = os.open(self._commit_path, os.O_WRONLY | os.O_CREAT, 0o644)
        payload = _COMMIT_HINT.pack(COMMIT_MAGIC, self._commit_index)
        pwrite_all(self._commit_fd, payload + _CRC.pack(zlib.crc32(payload)), 0)
        self._commit_index_dirty = False

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

    def _store_state(self) -> None:
        tag, vote = _encode_vote(self._voted_for)
        head = _STATE_FIXED.pack(
            STATE_MAGIC,
            STATE_FORMAT_VERSION,
            self._current_term,
            self._commit_index,
            tag,
            len(vote),
        )
        payload = head + vote
        self._atomic_write(self._state_path, payload + _CRC.pack(zlib.crc32(payload)))
        self._commit_index_dirty = False

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
        self._durable_count = len(self._entries)
        self._pending = False

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
        if not self._in_sequence(idx, term):
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
        self._pending = True

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
        self._durable_count = len(kept)
        self._pending = False

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
            self._store_commit_hint()
        finally:
            self._closed = True
            os.close(self._fd)
            if self._commit_fd is not None:
                os.close(self._commit_fd)

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        """Remember the commit index; persisted lazily because it is only a hint."""
        if raftCommitIndex != self._commit_index:
            self._commit_index = raftCommitIndex
            self._commit_index_dirty = True

    def getRaftCommitIndex(self) -> int:
        """The persisted commit index, clamped to the last entry: the commit index can
        never exceed the log, and a lower hint is always safe (the leader re-sends it)."""
        if self._entries:
            return min(self._commit_index, self._entries[-1][1])
        return self._commit_index

    def setCurrentTerm(self, term: int, votedForNodeId: VoteId) -> None:
        """Persist term and vote durably before returning: pysyncobj sends the vote
        (or acts on the new term) right after this call."""
        self._check_open()
        if not 0 <= term <= _MAX_U64:
            raise ValueError(f"term out of range: {term}")
        _encode_vote(votedForNodeId)  # validate before changing anything
        self._current_term = term
        self._voted_for = votedForNodeId
        self._store_state()

    def getCurrentTerm(self) -> int:
        return self._current_term

    def getVotedForNodeId(self) -> VoteId:
        return self._voted_for

    def onOneSecondTimer(self) -> None:
        """Called by SyncObj once a second: write a changed commit-index hint (no
        fsync), and sync any appends a caller forgot to sync, which bounds their
        exposure to a second."""
        self._check_open()
        self.sync()
        self._store_commit_hint()

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
        if not self._pending:
            return False
        self._fsync(self._fd)
        self._pending = False
        self._durable_count = len(self._entries)
        self.sync_count += 1
        return True

    @property
    def durable_len(self) -> int:
        """How many of the entries (counted from position 0) are known to be on disk."""
        return self._durable_count

    @property
    def last_durable_index(self) -> int:
        """Raft index of the last durable entry, or 0 if none: the most a leader may
        count as its own match index."""
        if self._durable_count == 0:
            return 0
        return self._entries[self._durable_count - 1][1]

    @property
    def size_bytes(self) -> int:
        """Bytes of records in the log file (the header not counted)."""
        return self._end - _HEADER.size

    @property
    def pending(self) -> bool:
        """True if some appended entries are not yet durable."""
        return self._pending

    @property
    def path(self) -> Path:
        return self._path

    def close(self) -> None:
        """Alias of :meth:`_destroy` for use outside pysyncobj."""
        self._destroy()

    def __repr__(self) -> str:
        return (
            f"DurableJournal({str(self._path)!r}, entries={len(self._entries)}, "
            f"durable={self._durable_count})"
        )
