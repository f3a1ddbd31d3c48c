"""The snapshot file of a replica and the thread that writes it.

A snapshot is one file: the core's deterministic snapshot plus pysyncobj's
``(lastEntry, prevEntry, cluster)``, encoded with msgpack (no pickle) and
checksummed (docs/raft.md, hazard 4). It is packed, written and fsynced by a child
process forked in the tick thread, which a thread of its own waits for
(`BackgroundSerializer`, installed by `patches`; `SnapshotFiles.start`), then
renamed into place, and verified when read back (`SnapshotFiles`).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import msgpack
import xxhash
from pysyncobj.atomic_replace import atomicReplace as atomic_replace
from pysyncobj.config import SERIALIZER_STATE
from pysyncobj.serializer import Serializer

from sevendb.cluster.common.files import fsync_dir, write_synced
from sevendb.proto.threads import ForkedChild, start_forked

from .journal import DurableJournal

__all__ = [
    "SNAPSHOT_FILE",
    "SNAPSHOT_FORMAT_VERSION",
    "SNAPSHOT_MAGIC",
    "BackgroundSerializer",
    "Snapshot",
    "SnapshotFiles",
    "SnapshotWrite",
    "decode_snapshot",
    "encode_snapshot",
    "seed_replica",
]

logger = logging.getLogger(__name__)

SNAPSHOT_FILE: Final = "snapshot.bin"
SNAPSHOT_MAGIC: Final = b"7DBSNAP\x00"
SNAPSHOT_FORMAT_VERSION: Final = 1
_SNAPSHOT_CHECKSUM = struct.Struct("<Q")

LogEntry = tuple[bytes, int, int]
"""One pysyncobj log entry: ``(command, idx, term)``."""


@dataclass(frozen=True)
class Snapshot:
    bucket_uuid: str
    core: bytes
    last: tuple[bytes, int, int]
    prev: tuple[bytes, int, int]
    cluster: tuple[str, ...]


def _bin_header(size: int) -> bytes:
    """msgpack's header of a bin of `size` bytes (the Packer writes none on its own)."""
    if size < 1 << 8:
        return bytes((0xC4, size))
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def encode_snapshot(snap: Snapshot) -> list[bytes]:
    """The snapshot file's bytes, in pieces (written one after the other): the magic,
    the msgpack body, an xxh64 of both. The core's bytes (tens of MB with a large
    state) are one piece as they are, never copied into a larger buffer: each copy
    held the GIL ~10-30 ms in the snapshot thread, stalling the tick thread."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack_array_header(6)
    packer.pack(SNAPSHOT_FORMAT_VERSION)
    packer.pack(snap.bucket_uuid)
    head = SNAPSHOT_MAGIC + packer.bytes() + _bin_header(len(snap.core))
    packer.reset()
    packer.pack(snap.last)
    packer.pack(snap.prev)
    packer.pack(snap.cluster)
    tail = packer.bytes()
    digest = xxhash.xxh64(head)
    digest.update(snap.core)
    digest.update(tail)
    return [head, snap.core, tail + _SNAPSHOT_CHECKSUM.pack(digest.intdigest())]


def _entry(raw: object) -> tuple[bytes, int, int]:
    if not (isinstance(raw, list) and len(raw) == 3):
        raise ValueError("log entry must be [command, idx, term]")
    command, idx, term = raw
    if not (isinstance(command, bytes) and type(idx) is int and type(term) is int):
        raise ValueError("log entry fields have the wrong types")
    return command, idx, term


def decode_snapshot(data: bytes) -> Snapshot:
    """Parse and verify a snapshot file; raises ValueError on anything unexpected."""
    if len(data) < len(SNAPSHOT_MAGIC) + _SNAPSHOT_CHECKSUM.size:
        raise ValueError(f"snapshot is {len(data)} bytes: truncated")
    payload, tail = data[: -_SNAPSHOT_CHECKSUM.size], data[-_SNAPSHOT_CHECKSUM.size :]
    if not payload.startswith(SNAPSHOT_MAGIC):
        raise ValueError("not a sevendb snapshot (bad magic)")
    if _SNAPSHOT_CHECKSUM.unpack(tail)[0] != xxhash.xxh64_intdigest(payload):
        raise ValueError("snapshot checksum mismatch")
    raw = msgpack.unpackb(payload[len(SNAPSHOT_MAGIC) :], raw=False, use_list=True)
    if not (isinstance(raw, list) and len(raw) == 6):
        raise ValueError("snapshot body has the wrong shape")
    version, bucket_uuid, core, last, prev, cluster = raw
    if version != SNAPSHOT_FORMAT_VERSION:
        raise ValueError(f"snapshot format {version!r}; this build reads {SNAPSHOT_FORMAT_VERSION}")
    if not (isinstance(bucket_uuid, str) and isinstance(core, bytes)):
        raise ValueError("snapshot header fields have the wrong types")
    if not (isinstance(cluster, list) and all(isinstance(a, str) for a in cluster)):
        raise ValueError("snapshot cluster must be a list of addresses")
    return Snapshot(bucket_uuid, core, _entry(last), _entry(prev), tuple(cluster))


_NO_OP: Final = b"\x01"
"""pysyncobj's NO_OP command (syncobj.py:58)."""


def seed_replica(
    data_dir: Path, bucket_uuid: str, core: bytes, index: int, members: Sequence[str]
) -> None:
    """Make `data_dir` (which must not exist) a replica that starts from `core` at
    log index `index`, in a group of `members`: a restored bucket
    (`sevendb backup restore`). The snapshot's last two entries are NO_OPs of term
    0 at `index - 1` and `index`, the same on every member, so the group's logs
    agree from there and its first leader's entries follow (term 1 and later, index
    `index + 1`). The directory is written aside and renamed into place: a crash
    leaves no half-seeded replica."""
    if index < 2:
        raise ValueError(f"a seeded replica starts at log index 2 or later, not {index}")
    tmp = data_dir.with_name(data_dir.name + ".seeding")
    if tmp.exists():
        for leftover in tmp.iterdir():
            leftover.unlink()
        tmp.rmdir()
    tmp.mkdir(parents=True)
    snap = Snapshot(
        bucket_uuid, core, (_NO_OP, index, 0), (_NO_OP, index - 1, 0), tuple(sorted(members))
    )
    write_synced(tmp / SNAPSHOT_FILE, *encode_snapshot(snap))
    tmp.rename(data_dir)
    fsync_dir(data_dir.parent)


class BackgroundSerializer(Serializer):  # type: ignore[misc]
    """pysyncobj's Serializer (serializer.py), but the snapshot is written in a
    thread of its own. The custom serializer (`BucketReplica._write_snapshot`) runs
    in the tick thread and returns the function that writes the file; this class
    runs that function, then renames the file into place, in a thread, and reports
    SERIALIZING until it is done. pysyncobj compacts its log only once
    `checkSerializing` says SUCCESS, and sends no snapshot to a follower while one
    is being written (`getTransmissionData` waits for ``__pid == 0``).

    Written in the tick thread, a snapshot of ~300k keys held a leader's heartbeats
    back for 0.3-1.1 s (docs/performance.md): long enough for elections.
    """

    _WRITING: Final = -3
    """``__pid`` while the thread runs (pysyncobj: 0 idle, -1 done, -2 failed)."""
    # The base class's (name-mangled) attributes this class uses.
    _Serializer__pid: int
    _Serializer__currentID: Any
    _Serializer__fileName: str | None
    _Serializer__serializer: Callable[[str, Any], Callable[[], None]] | None
    _Serializer__incomingTransmissionFile: IO[bytes] | None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._thread: threading.Thread | None = None
        self._result = -2

    def serialize(self, data: Any, id: Any) -> None:
        if self._Serializer__serializer is None or self._Serializer__fileName is None:
            super().serialize(data, id)  # a stock SyncObj (tests of the "before")
            return
        if self._Serializer__pid != 0:
            return
        self._Serializer__currentID = id
        tmp = self._Serializer__fileName + ".tmp"
        try:
            write = self._Serializer__serializer(tmp, data[1:])
        except Exception as exc:  # pysyncobj then logs "Failed to store full dump"
            logger.warning("snapshot not taken: %s", exc)
            self._Serializer__pid = -2
            return

        def run() -> None:
            try:
                write()
                atomic_replace(tmp, self._Serializer__fileName)
                self._result = -1
            except Exception:
                logger.exception("snapshot not written")
                self._result = -2

        self._result = -2
        self._Serializer__pid = self._WRITING
        self._thread = threading.Thread(target=run, name="sevendb-snapshot", daemon=True)
        self._thread.start()

    def checkSerializing(self) -> tuple[int, Any]:
        if self._Serializer__pid == self._WRITING:
            thread = self._thread
            if thread is not None and thread.is_alive():
                return SERIALIZER_STATE.SERIALIZING, self._Serializer__currentID
            self._Serializer__pid = self._result
        return super().checkSerializing()

    def setTransmissionData(self, data: Any) -> bool:
        """A chunk of the leader's snapshot for this follower (syncobj.py:1023: the
        last one renames it into place, then the journal is cleared for it). Refused
        while this replica's own snapshot is being written: that thread's rename
        would put the older snapshot back over the installed one, and a restart
        would find a gap between it and the journal. The transmission in progress is
        dropped; the leader sends it again once its next AppendEntries is refused."""
        if self._Serializer__pid == self._WRITING:
            incoming = self._Serializer__incomingTransmissionFile
            if incoming is not None:
                incoming.close()
                self._Serializer__incomingTransmissionFile = None
            return False
        return bool(super().setTransmissionData(data))

    def join(self) -> None:
        """Wait for a snapshot being written (before the data dir is let go)."""
        thread = self._thread
        if thread is not None:
            thread.join()


class SnapshotFiles:
    """One replica's snapshot file: read back verified (cached between the startup
    check and pysyncobj's load of the same file), written by a function the
    background serializer runs, and the journal trimmed to it at startup."""

    def __init__(self, bucket: int, bucket_uuid: str, path: Path) -> None:
        self.bucket = bucket
        self.bucket_uuid = bucket_uuid
        self.path = path
        self.index = 0
        """Raft index of the last snapshot written or loaded."""
        self.size = 0
        """Bytes of the last snapshot written or loaded (`compaction_due`)."""
        self.written = 0
        self.loaded = 0
        self._cache: tuple[tuple[int, int, int], Snapshot] | None = None

    def load(self, path: Path) -> Snapshot:
        """Read and verify a snapshot file; raises ValueError or OSError."""
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            key = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if self._cache is not None and self._cache[0] == key:
                return self._cache[1]
            data = f.read()
            # A snapshot installed from the leader (serializer.py:176-198) was written
            # and renamed without any fsync: make it durable before the journal is
            # cleared and the install is acked.
            os.fsync(f.fileno())
        fsync_dir(path.parent)
        snap = decode_snapshot(data)
        self._cache = (key, snap)
        return snap

    def forget(self) -> None:
        """Drop the cached copy (once pysyncobj loaded it)."""
        self._cache = None

    def note_loaded(self, snap: Snapshot, path: Path) -> None:
        self.index = snap.last[1]
        self.size = os.path.getsize(path)
        self.loaded += 1

    def start(
        self,
        tmp_path: Path,
        make_core: Callable[[], bytes],
        last: LogEntry,
        prev: LogEntry,
        members: Sequence[str],
    ) -> SnapshotWrite:
        """Fork now: a child process packs `make_core()` of the memory as it is at
        this instant and writes the snapshot to `tmp_path`, fsynced (`start_forked`).
        Called in the tick thread, so nothing of the state is copied before the fork
        (taking references to ~250k keys and their rows first held the tick thread
        and the GIL 5-17 ms; docs/performance.md, "thirteenth session"). Packing is
        hundreds of milliseconds of Python, which in this process held the Raft
        loop's and the gRPC loop's GIL back (docs/performance.md, "Snapshots packed
        in a child process"). The background serializer's thread then waits for the
        child (`SnapshotWrite.finish`) and renames the file into place."""

        def pack_and_write() -> None:  # the child
            snap = Snapshot(self.bucket_uuid, make_core(), last, prev, tuple(members))
            write_synced(tmp_path, *encode_snapshot(snap))

        started = time.monotonic()
        child = start_forked(pack_and_write, f"snapshot-b{self.bucket}")
        return SnapshotWrite(self, child, tmp_path, last[1], started)

    def check(self, journal_first: int | None) -> str | None:
        """Whether the snapshot is there and readable when the replica opens: None, or
        what is wrong. A damaged file is moved aside (``snapshot.bin.damaged``) so that
        pysyncobj does not load it; a missing one only matters when the journal starts
        after index 1 (the state before it lived in the snapshot)."""
        if self.path.exists():
            # A sound snapshot of another bucket is not damage: the deserializer
            # quarantines the replica (a misconfiguration), and the file stays.
            try:
                self.load(self.path)
                return None
            except (OSError, ValueError) as exc:
                self.forget()
                aside = self.path.with_name(self.path.name + ".damaged")
                self.path.replace(aside)
                return f"snapshot {self.path} unreadable ({exc}); moved to {aside.name}"
        if journal_first is not None and journal_first > 1:
            return f"snapshot {self.path} missing (the journal starts at index {journal_first})"
        return None

    def holds_point(self, log: DurableJournal) -> bool:
        """Whether the journal holds the snapshot's point (its prev and last entries,
        one after the other): then it is kept whole at startup, entries before the
        point included (the log kept for the safety point, docs/raft.md)."""
        try:
            snap = self.load(self.path)
        except (OSError, ValueError):
            return False
        if not len(log):
            return False
        position = snap.prev[1] - log[0][1]
        return (
            position >= 0
            and position + 1 < len(log)
            and log[position] == snap.prev
            and log[position + 1] == snap.last
        )


@dataclass(frozen=True, slots=True)
class SnapshotWrite:
    """A snapshot that a child process packs and writes (`SnapshotFiles.start`)."""

    files: SnapshotFiles
    child: ForkedChild
    tmp_path: Path
    index: int
    started: float

    def finish(self) -> None:
        """Wait for the child: the file at `tmp_path` is then written and fsynced
        (raises ChildProcessError if it was not)."""
        self.child.wait()
        files = self.files
        files.index = self.index
        files.size = self.tmp_path.stat().st_size
        files.written += 1
        logger.info(
            "bucket %d: snapshot at log index %d written (%d bytes in %.2f s)",
            files.bucket,
            self.index,
            files.size,
            time.monotonic() - self.started,
        )

    def abandon(self) -> None:
        """The snapshot is not taken: the child is killed and its file deleted."""
        self.child.kill()
        self.tmp_path.unlink(missing_ok=True)
