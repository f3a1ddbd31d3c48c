"""`DurableJournal`: a durable, group-committed Raft log for pysyncobj, in place of
its ``FileJournal``, which never fsyncs (so replicas acked entries a power cut could
erase). Appends are written at once and made durable by one ``fdatasync`` per batch
(`sync`), before a follower acks or a leader counts them; removals are durable before
they return; records are CRC'd. The header remembers what was acknowledged, so that
opening the log tells a torn tail (cut off, as a crash leaves it) from lost or
damaged acknowledged entries (reported in `problems` and `need`, never silently
cut). Format and contract: docs/raft.md ("Files", "Disk faults"). Not thread-safe:
pysyncobj calls it from one thread.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Final, overload

from sevendb.cluster.common.files import fsync_dir, pwrite_all, write_synced

from .records import (
    FORMAT_VERSION,
    HEADER_V1,
    HEADER_V2,
    MAGIC,
    SLOT_OFFSETS,
    Entry,
    JournalFormatError,
    LogImage,
    Slot,
    empty_log,
    encode_record,
    encode_slot,
    in_sequence,
    read_log,
)
from .sidecars import (
    LOST_VOTE,
    NOTHING,
    STATE_FORMAT_VERSION,
    STATE_MAGIC,
    JournalError,
    JournalMeta,
    JournalStateError,
    Position,
    VoteId,
)

__all__ = [
    "FORMAT_VERSION",
    "FSYNC_BUCKETS_S",
    "MAGIC",
    "STATE_FORMAT_VERSION",
    "STATE_MAGIC",
    "DiskStats",
    "DurableJournal",
    "Durations",
    "Entry",
    "FailStopJournal",
    "JournalError",
    "JournalFormatError",
    "JournalStateError",
    "Position",
    "VoteId",
]

logger = logging.getLogger(__name__)

_MAX_U64 = 0xFFFFFFFFFFFFFFFF
_TMP_SUFFIX = ".tmp"


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


def _remove_stale_tmp_files(*paths: Path) -> None:
    """Leftovers of a crash during an atomic replace are never the source of truth:
    the rename that would have published them did not happen."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            Path(str(path) + _TMP_SUFFIX).unlink()


def _position(entry: Entry | None) -> Position:
    return NOTHING if entry is None else (entry[2], entry[1])


FSYNC_BUCKETS_S: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Upper bounds of the journal's fsync duration histogram (`/metrics`)."""


class Durations:
    """How long the journal's fsyncs took: a count per bucket of `FSYNC_BUCKETS_S`
    (the last one: longer) and their sum, read by `/metrics` as a histogram. Kept
    here, without a metrics library, so the Raft room needs none; one bisect per
    fsync."""

    def __init__(self, bounds: tuple[float, ...] = FSYNC_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds

    def snapshot(self) -> tuple[tuple[float, ...], tuple[int, ...], float]:
        """(bounds, count per bucket, sum of seconds), a consistent enough copy."""
        return self.bounds, tuple(self.counts), self.sum_s


class DiskStats:
    """What a journal did to its disk, for `/metrics`: how long its fsyncs took and
    how many bytes it wrote (records, rewrites, sidecars) since it was opened."""

    def __init__(self) -> None:
        self.fsync_durations = Durations()
        self.bytes_written = 0


class _Disk:
    """The journal's fsyncs, counted and timed (`FailStopJournal` uses a stricter one)."""

    def __init__(self) -> None:
        self.fsyncs = 0
        self.failure: str | None = None
        self.stats = DiskStats()

    def fsync(self, fd: int) -> None:
        started = time.perf_counter()
        _fdatasync(fd)
        self.stats.fsync_durations.observe(time.perf_counter() - started)
        self.fsyncs += 1

    def fsync_dir(self, directory: Path) -> None:
        fsync_dir(directory)
        self.fsyncs += 1

    def atomic_write(self, target: Path, payload: bytes) -> None:
        """Replace ``target`` so that after a crash it holds either the old or the new
        content in full: write a tmp file, fsync it, rename over, fsync the directory."""
        tmp = Path(str(target) + _TMP_SUFFIX)
        write_synced(tmp, payload)
        self.fsyncs += 1
        self.stats.bytes_written += len(payload)
        os.replace(tmp, target)
        self.fsync_dir(target.parent)


class DurableJournal:
    """A crash-safe, group-committed replacement for pysyncobj's ``FileJournal``.

    All entries are also kept in memory (as pysyncobj's own journals do), so reads
    never touch the disk; the file is only appended to, truncated, or rewritten.

    :param path: the log file. The term/vote record is ``<path>.state``, the
        commit-index hint ``<path>.commit``.
    :param preallocate_bytes: when appends reach the end of the file, extend it by
        this many zero bytes at once (0: the file grows with each append). An
        ``fdatasync`` of records written over zeros already on disk writes the data
        only, not the file's size and block map as well (docs/raft.md, "Files").
    """

    _disk_class: type[_Disk] = _Disk

    def __init__(self, path: str | os.PathLike[str], *, preallocate_bytes: int = 0) -> None:
        if preallocate_bytes < 0:
            raise ValueError(f"preallocate_bytes must be >= 0, not {preallocate_bytes}")
        self.path = Path(path)
        self._preallocate = preallocate_bytes
        self._disk = self._disk_class()
        self.disk_stats = self._disk.stats
        """Its fsync durations and bytes written (`DiskStats`)."""
        self._meta = JournalMeta(self.path, self._disk.atomic_write)
        self._entries: list[Entry] = []
        # File offset at which each entry's record starts, so deleteEntriesFrom can
        # truncate without re-reading the file.
        self._offsets: array[int] = array("Q")
        self._end = HEADER_V2
        self._allocated = HEADER_V2
        """The file's size: zeros from `_end` on (preallocated)."""
        self.durable_len = 0
        """How many of the entries (counted from position 0) are known to be on disk."""
        self.pending = False
        """True if some appended entries are not yet durable."""
        self.closed = False
        """Set by `close()`: nothing more is read or written."""
        #: Group commits: calls to :meth:`sync` that actually flushed appended entries.
        self.sync_count = 0
        self.problems: list[str] = []
        """Damage found when the journal was opened (empty: none). A torn tail is not
        damage: it is cut off with a WARNING, as before."""
        self.need: Position | None = None
        """The last position this replica had acknowledged, when the log no longer holds
        it (damage): until `release_need`, every header keeps claiming it."""
        self._slot = Slot(0, NOTHING, 0, None)
        """The newest slot on disk."""

        _remove_stale_tmp_files(self.path, self._meta.state.path)
        self._meta.load()
        self.problems += self._meta.problems
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _open_log(self)
        except BaseException:
            os.close(self._fd)
            raise

    # --------------------------------------------------------------- low level

    @property
    def fsync_count(self) -> int:
        """Every fsync/fdatasync this journal issued (log, sidecars and directories)."""
        return self._disk.fsyncs

    def _check_open(self) -> None:
        if self.closed:
            raise JournalError(f"{self.path}: journal is closed")

    def _write_slot(self, acked: Position) -> None:
        """Write the next header slot (not synced: the caller's fdatasync covers it).
        `acked` never falls below `need` while that is held."""
        if self.need is not None:
            acked = max(acked, self.need)
        slot = Slot(self._slot.seq + 1, acked, self._meta.term, self._meta.vote)
        if slot.acked == self._slot.acked and (slot.term, slot.vote) == (
            self._slot.term,
            self._slot.vote,
        ):
            return
        pwrite_all(self._fd, encode_slot(slot), SLOT_OFFSETS[slot.seq % 2])
        self._slot = slot

    def _truncate_durably(self, keep: int) -> None:
        """Keep the first `keep` entries. The header first stops claiming what goes
        (durably), then the file is cut and fsynced: no later append can land on disk
        while the cut-off records survive, and no header claims records that are gone."""
        durable = min(keep, self.durable_len)
        self._write_slot(_position(self._entries[durable - 1] if durable else None))
        self._disk.fsync(self._fd)
        offset = self._offsets[keep] if keep < len(self._entries) else self._end
        os.ftruncate(self._fd, offset)
        self._disk.fsync(self._fd)
        del self._entries[keep:]
        del self._offsets[keep:]
        self._end = self._allocated = offset
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
        if not in_sequence(self._entries, idx, term):
            _, last_idx, last_term = self._entries[-1]
            raise ValueError(
                f"non-contiguous journal append: idx={idx} term={term} after "
                f"idx={last_idx} term={last_term}"
            )
        record = encode_record(data, idx, term)
        try:
            if self._end + len(record) > self._allocated and self._preallocate:
                self._extend(self._end + len(record) + self._preallocate)
            pwrite_all(self._fd, record, self._end)
        except OSError:
            # Do not leave a partial record for the next append to land behind.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._end)
            self._allocated = self._end
            raise
        self._entries.append((data, idx, term))
        self._offsets.append(self._end)
        self._end += len(record)
        self.disk_stats.bytes_written += len(record)
        self.pending = True

    def _extend(self, size: int) -> None:
        """Zero-fill the file up to `size` (made durable by the next `sync`)."""
        zeros = bytes(size - self._allocated)
        pwrite_all(self._fd, zeros, self._allocated)
        self.disk_stats.bytes_written += len(zeros)
        self._allocated = size

    def clear(self) -> None:
        """Drop every entry (pysyncobj does this before installing a snapshot)."""
        self._check_open()
        self._truncate_durably(0)

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        """Drop entries at positions ``>= entryFrom`` (list semantics, like
        ``del entries[entryFrom:]``): a follower discarding a conflicting suffix."""
        self._check_open()
        keep = len(range(len(self._entries))[:entryFrom])
        if keep == len(self._entries):
            return
        self._truncate_durably(keep)

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
        self._disk.fsync_dir(self.path.parent)
        self._rewrite(kept, self._slot.acked)

    def _rewrite(self, kept: list[Entry], acked: Position) -> None:
        """Replace the file atomically by a version 2 log of `kept` whose header claims
        `acked` (at least `need`)."""
        acked = max(acked, self.need or NOTHING)
        slot = Slot(self._slot.seq + 1, acked, self._meta.term, self._meta.vote)
        chunks = [empty_log(slot)]
        offsets: array[int] = array("Q")
        pos = HEADER_V2
        for command, idx, term in kept:
            record = encode_record(command, idx, term)
            offsets.append(pos)
            chunks.append(record)
            pos += len(record)
        self._disk.atomic_write(self.path, b"".join(chunks))
        new_fd = os.open(self.path, os.O_RDWR)
        os.close(self._fd)
        self._fd = new_fd
        self._slot = slot
        self._entries = kept
        self._offsets = offsets
        self._end = self._allocated = pos
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
        are flushed, and the header and the hint then record exactly what is durable.
        Idempotent."""
        if self.closed:
            return
        try:
            self.onOneSecondTimer()
        finally:
            self.closed = True
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
        (or acts on the new term) right after this call. Both copies are written: the
        state file, then the header's slot."""
        self._check_open()
        if not 0 <= term <= _MAX_U64:
            raise ValueError(f"term out of range: {term}")
        self._meta.set_term(term, votedForNodeId)
        self._write_slot(self._slot.acked)
        self._disk.fsync(self._fd)

    def getCurrentTerm(self) -> int:
        return self._meta.term

    def getVotedForNodeId(self) -> VoteId:
        return self._meta.vote

    def onOneSecondTimer(self) -> None:
        """Called by SyncObj once a second: sync any appends a caller forgot to sync
        (which bounds their exposure to a second), bring the header's record of what
        was acknowledged up to date (one more fdatasync, only if it lags), and write a
        changed commit-index hint (no fsync)."""
        self._check_open()
        self.sync()
        durable = _position(self._entries[self.durable_len - 1] if self.durable_len else None)
        if max(durable, self.need or NOTHING) != self._slot.acked:
            self._write_slot(durable)
            self._disk.fsync(self._fd)
        self._meta.store_hint(self._slot.acked)

    def flush(self) -> None:
        """``FileJournal.flush`` equivalent; here it means :meth:`sync`."""
        self.sync()

    # ------------------------------------------------------------ group commit

    def sync(self) -> bool:
        """Make every entry appended so far durable with one fdatasync. The header's
        slot is brought up to the entries that were durable *before* this call, in
        the same fdatasync: it never claims entries a crash could still take away.

        :returns: True if an fsync was issued, False if nothing was pending (so the
            replica adapter can call this on every ack/commit check for free).
        """
        self._check_open()
        if not self.pending:
            return False
        self._write_slot(
            _position(self._entries[self.durable_len - 1] if self.durable_len else None)
        )
        self._disk.fsync(self._fd)
        self.pending = False
        self.durable_len = len(self._entries)
        self.sync_count += 1
        return True

    # ------------------------------------------------------------ disk faults

    def release_need(self) -> None:
        """The lost entries are back (or an operator accepted their loss): the header
        claims what the log holds again, durably at once."""
        self._check_open()
        self.need = None
        self._write_slot(
            _position(self._entries[self.durable_len - 1] if self.durable_len else None)
        )
        self._disk.fsync(self._fd)

    def discard_all(self, need: Position) -> None:
        """Drop every entry, claiming `need` until `release_need` (the replica found
        its snapshot damaged and must be repaired from its leader)."""
        self._check_open()
        self.need = max(need, self.need or NOTHING)
        self._truncate_durably(0)

    @property
    def last_durable_index(self) -> int:
        """Raft index of the last durable entry, or 0 if none: the most a leader may
        count as its own match index."""
        if self.durable_len == 0:
            return 0
        return self._entries[self.durable_len - 1][1]

    def size_bytes(self, after_index: int = 0) -> int:
        """Bytes of the records of entries past `after_index` (all of them: 0)."""
        if not self._entries:
            return 0
        position = max(0, min(len(self._entries), after_index + 1 - self._entries[0][1]))
        start = self._offsets[position] if position < len(self._entries) else self._end
        return self._end - start

    def close(self) -> None:
        """Alias of :meth:`_destroy` for use outside pysyncobj."""
        self._destroy()

    def __repr__(self) -> str:
        return (
            f"DurableJournal({str(self.path)!r}, entries={len(self._entries)}, "
            f"durable={self.durable_len})"
        )


def _open_log(journal: DurableJournal) -> None:
    """Read the journal's file into it (creating an empty one), and judge what it
    finds: a torn tail is cut with a WARNING; a file that is gone or cut short while
    the replica has lived before, records damaged in the middle or missing below what
    was acknowledged, and a lost term/vote record are `problems` (`need` set when
    acknowledged entries are gone). A foreign file raises JournalFormatError."""
    meta, path = journal._meta, journal.path
    data = _read_all(journal._fd)
    lived = meta.state_found or meta.hint_found
    if len(data) < HEADER_V1:
        image = LogImage(FORMAT_VERSION, None)
        if lived:
            state = "missing" if not data else f"cut to {len(data)} bytes"
            journal.problems.append(f"journal {path} {state}")
    else:
        image = read_log(data, path)
        if image.version == 2 and image.slot is None:
            journal.problems.append(f"journal {path}: both header slots unreadable")
    claimed = _claimed(journal, image)
    _restore_term_and_vote(journal, image)
    last = image.last
    if claimed > last:
        journal.need = claimed
        journal.problems.append(_loss(last, claimed, image))
    elif image.stop is not None and image.valid_after is not None:
        journal.problems.append(
            f"journal {path}: damaged record at offset {image.end} ({image.stop}) with "
            f"good records after it, all past what was acknowledged; they are dropped"
        )
    elif image.stop is not None:
        logger.warning(
            "journal %s: torn tail at offset %d (%s); dropping %d bytes",
            path,
            image.end,
            image.stop,
            len(data) - image.end,
        )
    journal._entries, journal._offsets = image.entries, image.offsets
    journal.durable_len = len(image.entries)
    if image.version == FORMAT_VERSION and image.slot is not None and len(data) >= HEADER_V2:
        journal._slot, journal._end = image.slot, image.end
        journal._allocated = len(data)  # a torn tail's cut below lowers it
        # What the page cache held from before a crash is on disk before the header
        # claims it.
        journal._disk.fsync(journal._fd)
        if image.stop is not None:
            journal._truncate_durably(len(image.entries))
        else:
            journal._write_slot(last)
            journal._disk.fsync(journal._fd)
    else:  # a version 1 file, or one whose header is written again: atomically
        journal._slot = Slot(image.slot.seq if image.slot else 0, NOTHING, 0, None)
        journal._rewrite(list(image.entries), last)


def _loss(last: Position, claimed: Position, image: LogImage) -> str:
    what = (
        "an unknown number of entries (the record of them is lost too)"
        if claimed[1] == _MAX_U64
        else f"through index {claimed[1]} (term {claimed[0]})"
    )
    where = f" ({image.stop} at offset {image.end})" if image.stop else ""
    return (
        f"lost acknowledged entries: the journal's records end at index {last[1]} "
        f"(term {last[0]}) but it had acknowledged {what}{where}"
    )


def _claimed(journal: DurableJournal, image: LogImage) -> Position:
    """What this replica may have acknowledged: the newest header slot; without one,
    the hint's mirror of it (written lazily, it may still claim what a durable
    truncation took back: only the header is trusted when it is there). With
    neither, a replica that has lived before (a term or a hint) claims more than
    anything it knows of (so it waits for a leader with a newer term to repair it), a
    fresh one nothing; a version 1 log kept no claim: it is trusted."""
    meta = journal._meta
    if image.slot is not None:
        return image.slot.acked
    if meta.hint_acked is not None:
        return meta.hint_acked
    if image.version == 1:
        return image.last
    if journal.problems and (meta.state_found or meta.hint_found):
        return (max(meta.term, image.last[0]), _MAX_U64)
    return NOTHING


def _restore_term_and_vote(journal: DurableJournal, image: LogImage) -> None:
    """Raft's term and vote have two copies (the state file and the header's slot);
    use the newer when both are readable, the other when one is lost, and when both
    are lost, the newest term known with a vote for no one (`LOST_VOTE`)."""
    meta, slot = journal._meta, image.slot
    if slot is not None and (slot.term, slot.vote is not None) > (meta.term, meta.vote is not None):
        if not meta.state_lost:
            logger.info("journal %s: the header's term/vote copy is newer", journal.path)
        meta.term, meta.vote = slot.term, slot.vote
    # Entries of a term > 0 mean a term was set (a state file written) before them;
    # a readable slot knows better: it has a copy of every term set.
    lived = slot.term > 0 if slot is not None else image.last[0] > 0
    if not meta.state_lost or not lived:
        return
    if slot is None:
        meta.term = max(meta.term, image.last[0])
        meta.vote = LOST_VOTE
        journal.problems.append(
            f"term and vote lost (both copies): restarting in term {meta.term} without voting in it"
        )
    else:
        journal.problems.append(
            "term and vote record missing or unreadable: restored from the journal header"
        )
    meta.set_term(meta.term, meta.vote)


class FailStopJournal(DurableJournal):
    """A DurableJournal that never claims durability again after an fsync failed.

    After a failed fsync the kernel may have dropped the dirty pages and a retry can
    "succeed" without the data being on disk, so retrying is not safe. The replica
    treats the first failure as a crash: it stops acking, counting and applying."""

    class _FailStopDisk(_Disk):
        def fsync(self, fd: int) -> None:
            try:
                super().fsync(fd)
            except OSError as exc:
                self.failure = self.failure or f"{type(exc).__name__}: {exc}"
                raise

    _disk_class = _FailStopDisk

    @property
    def failure(self) -> str | None:
        """Why an fsync failed, or None."""
        return self._disk.failure

    def _destroy(self) -> None:
        if self.failure is not None and not self.closed:
            self.closed = True  # nothing more can be made durable: just let go
            os.close(self._fd)
            return
        super()._destroy()

    def sync(self) -> bool:
        if self.failure is not None:
            raise JournalError(f"{self.path}: an earlier fsync failed ({self.failure})")
        return super().sync()
