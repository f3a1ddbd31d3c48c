"""One bucket's Raft replica: a pysyncobj 0.3.17 group applying the pure bucket core.

This is the only module in sevendb that imports pysyncobj. Every measured hazard of
pysyncobj (``/work/shared/notes/stack-facts.md`` §2, syncobj.py line numbers below) is
fixed here, by configuration, by overriding name-mangled ``SyncObj`` methods in a
subclass, or by a small patch applied once at import:

* **durability** - the log lives in :class:`~sevendb.cluster.raft.journal.DurableJournal`
  (patched into ``createJournal``, syncobj.py:166). A follower fsyncs before every
  positive ack (``__sendNextNodeIdx``, 1098); the leader fsyncs its batch before it
  sends it and before every commit computation (the ``count = 1`` self-vote, 660), so
  every replica only reports progress it made durable itself (seed 004).
* **snapshots** - one file, the core's deterministic snapshot plus pysyncobj's
  ``(lastEntry, prevEntry, cluster)`` encoded explicitly with msgpack (no pickle),
  checksummed, fsynced, renamed, directory fsynced. Compaction never passes the
  core's safety point (seed 000 §8). A crash between the snapshot rename and the
  journal compaction no longer wipes the journal on restart (1489-1495).
* **nextIndex never moves backwards** on a success ack (1079-1082); acks carry the
  follower's term and acks from another term are ignored; a follower only truncates
  from the first *conflicting* entry (Raft §5.3) instead of deleting matching,
  already-applied entries (991-1004).
* **apply never raises** - malformed entries become error outcomes; a diverged
  replica (``ReplicaDivergence``) or any unexpected failure quarantines this replica
  loudly while the rest of the group goes on (an exception in a ``@replicated``
  method otherwise wedges the group: 714-729).
* **transport** - bound only to the configured address (``bindAddress``; the default
  is 0.0.0.0, transport.py:264-273) and always encrypted/authenticated with the
  cluster password (AES-256-GCM); without one pysyncobj unpickles whatever reaches the
  port (tcp_connection.py:291).
* **membership** - one change at a time, enforced on the leader (pysyncobj's own guard
  at 1356-1369 is dead code) and locally.
* **latency** - see :class:`RaftTuning`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import queue
import select
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, TypeVar

import msgpack
import pysyncobj.pickle as _pysyncobj_pickle
import pysyncobj.syncobj as _pysyncobj
import pysyncobj.tcp_connection as _pysyncobj_tcp
import pysyncobj.transport as _pysyncobj_transport
import xxhash
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.pbkdf2 import PBKDF2HMAC
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjException, replicated
from pysyncobj.atomic_replace import atomicReplace as atomic_replace
from pysyncobj.config import SERIALIZER_STATE
from pysyncobj.monotonic import monotonic as _monotonic
from pysyncobj.node import TCPNode
from pysyncobj.syncobj import SyncObjExceptionWrongVer

from sevendb.cluster.common.files import fsync_dir, write_synced
from sevendb.outbox import limits
from sevendb.outbox.entries import Entry
from sevendb.outbox.errors import (
    EntryError,
    LimitExceeded,
    MalformedEntry,
    PlanMismatch,
    ReplicaDivergence,
)
from sevendb.outbox.model import Applied
from sevendb.outbox.replica import (
    ApplyOutcome,
    Connectivity,
    MembershipChangeInProgress,
    ReplicaUnavailable,
)
from sevendb.outbox.state import BucketStateMachine
from sevendb.proto.threads import name_os_thread

from .journal import DurableJournal, JournalError

__all__ = [
    "ApplyOutcome",
    "BucketReplica",
    "Connectivity",
    "MembershipChangeInProgress",
    "RaftLoop",
    "RaftTuning",
    "ReplicaUnavailable",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

JOURNAL_FILE: Final = "raft.journal"
SNAPSHOT_FILE: Final = "snapshot.bin"
LOCK_FILE: Final = "LOCK"

SNAPSHOT_MAGIC: Final = b"7DBSNAP\x00"
SNAPSHOT_FORMAT_VERSION: Final = 1
_SNAPSHOT_CHECKSUM = struct.Struct("<Q")

TRANSFER_PAUSE_LAG: Final = 64
"""A leadership transfer pauses new commands only once the target trails by this few."""
TRANSFER_PAUSE_S: Final = 0.5
"""The longest a transfer holds new commands back before letting them through again."""

_PROPOSED_KEPT: Final = 1024
"""Decoded proposals kept for their apply (see `BucketReplica.submit`); ones that
never commit here (a lost leadership) are dropped once this many wait."""

_KEEP_ALIVE: Final = {"type": "sevendb_keep_alive"}
"""Sent between members so that idle links stay up (see `_RaftNode._keep_alive`)."""

# pysyncobj internals we mirror (syncobj.py:51-60).
_FOLLOWER: Final = 0
_LEADER: Final = 2
_CMD_MEMBERSHIP: Final = 2

_FAIL_NAMES: Final = {
    getattr(FAIL_REASON, name): name
    for name in dir(FAIL_REASON)
    if name.isupper() and isinstance(getattr(FAIL_REASON, name), int)
}


# ---------------------------------------------------------------- import-time patches


_KDF_SALT: Final = b"sevendb-raft-transport/v1"
_TIMESTAMP = struct.Struct(">Q")
_NONCE_BYTES: Final = 12


class _AeadEncryptor:
    """pysyncobj's transport encryptor (the three methods tcp_connection.py uses),
    as AES-256-GCM: ``timestamp (8) | nonce (12) | ciphertext+tag``, the timestamp
    authenticated as associated data. pysyncobj checks timestamps never go
    backwards per connection and prefixes each message with the connection's random
    key (replay protection), as with Fernet."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def encrypt_at_time(self, data: bytes, timestamp: int) -> bytes:
        header = _TIMESTAMP.pack(timestamp)
        nonce = os.urandom(_NONCE_BYTES)
        return header + nonce + self._aead.encrypt(nonce, data, header)

    def extract_timestamp(self, token: bytes) -> int:
        # Authenticated by decrypt() right after (a forged header fails there).
        return int(_TIMESTAMP.unpack_from(token)[0])

    def decrypt(self, token: bytes) -> bytes:
        header = token[: _TIMESTAMP.size]
        nonce = token[_TIMESTAMP.size : _TIMESTAMP.size + _NONCE_BYTES]
        return self._aead.decrypt(nonce, token[_TIMESTAMP.size + _NONCE_BYTES :], header)


def _aead_encryptor(password: str | bytes) -> _AeadEncryptor:
    secret = password if isinstance(password, bytes) else password.encode()
    kdf = PBKDF2HMAC(algorithm=hashes.SHA256(), length=32, salt=_KDF_SALT, iterations=200_000)
    return _AeadEncryptor(kdf.derive(secret))


class _StoredZlib:
    """Stands in for the ``zlib`` module in pysyncobj's transport, which deflates
    every message at level 3 before encrypting it (tcp_connection.py:144, 291).

    Deflate sets up ~256 KiB of state per call: 42-56 µs for a message of 100 bytes to
    3 KB on this VM, against 1-2 µs here, and in a loaded leader one such call per
    message sent. Messages are now zlib streams of stored (uncompressed) blocks
    with the smallest window and memory level. Any zlib reads them, so nodes on
    either side of an upgrade understand each other; what arrives is inflated by
    zlib as before, deflated or not. Raft messages travel between the nodes of one
    cluster, where bytes are cheaper than the tick thread's CPU."""

    @staticmethod
    def compress(data: bytes, level: int = -1) -> bytes:
        stored = zlib.compressobj(0, zlib.DEFLATED, 9, 1)
        return stored.compress(data) + stored.flush()

    decompress = staticmethod(zlib.decompress)


class _BackgroundSerializer(_pysyncobj.Serializer):  # type: ignore[misc]
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


def _install_patches() -> None:
    """Five small, idempotent patches of pysyncobj module globals.

    1. ``createJournal`` (syncobj.py:166) returns a :class:`DurableJournal` passed as
       ``conf.journalFile`` as is, so the adapter owns the journal object.
    2. pysyncobj pickles commands and messages with protocol 2 (pickle.py), which
       stores ``bytes`` as latin-1 text: up to 2x larger and slower. Every node runs
       this module, and any protocol unpickles, so we use the interpreter's default.
    3. ``getEncryptor`` runs PBKDF2 (100k iterations, ~30 ms) for every SyncObj; one
       node hosts a replica per bucket with the same password, so derive once. And
       the encryptor is AES-256-GCM (:class:`_AeadEncryptor`) instead of Fernet:
       Fernet (AES-CBC + HMAC + base64 in several Python-level steps) cost ~16% of a
       loaded leader's GIL time, one AEAD call costs a few microseconds.
    4. ``Serializer`` (syncobj.py:198) is :class:`_BackgroundSerializer`: snapshots
       are written outside the tick thread.
    5. The transport's ``zlib`` (tcp_connection.py:4) is :class:`_StoredZlib`:
       messages are no longer deflated.
    """
    if getattr(_pysyncobj, "_sevendb_patched", False):
        return
    original_create = _pysyncobj.createJournal

    def create_journal(journal_file: object) -> object:
        if isinstance(journal_file, DurableJournal):
            return journal_file
        return original_create(journal_file)

    _pysyncobj.createJournal = create_journal
    vars(_pysyncobj_pickle)["__protocol"] = _pysyncobj_pickle.pickle.DEFAULT_PROTOCOL
    _pysyncobj.getEncryptor = functools.lru_cache(maxsize=8)(_aead_encryptor)
    _pysyncobj.Serializer = _BackgroundSerializer
    _pysyncobj_tcp.zlib = _StoredZlib
    _pysyncobj._sevendb_patched = True


_install_patches()


# ------------------------------------------------------------------------ public types


@dataclass(frozen=True)
class RaftTuning:
    """pysyncobj timing, batching and compaction settings, with measured defaults.

    Latency: pysyncobj's default ``appendEntriesUseBatch=True`` only sends new entries
    every ``appendEntriesPeriod`` (0.1 s), so one write costs ~100 ms (200 ms from a
    follower). Batching is therefore off (fixed, not a field): a proposal wakes the tick
    thread at once (a pipe) and an apply sends the new commit index at once. The
    adapter keeps the throughput of batching itself: it drains every queued proposal
    into the log, sends one AppendEntries per follower, then fsyncs once (group
    commit; followers fsync once per message). Measured on the 2-core dev VM, 3
    replicas, encrypted, fsync on: p50 ~2 ms at 1 write in flight, ~3-5k writes/s at
    32 in flight (docs/raft.md has the table and the conditions).

    ``heartbeat_s`` is then only the idle heartbeat, and ``tick_s`` the idle poll
    timeout; both cost CPU per replica when idle (30 idle replicas: 18% of a core at
    0.05 s, 9% at 0.1 s), neither affects latency. Elections need
    ``election_min_s > 3 * heartbeat_s`` (pysyncobj asserts it); the window is etcd's,
    wider than pysyncobj's 0.4-1.4 s, because a node's groups share one GIL and a busy
    process must not trigger spurious elections.
    """

    heartbeat_s: float = 0.1
    """appendEntriesPeriod: the idle heartbeat (entries and commits are sent at once)."""
    tick_s: float = 0.1
    """autoTickPeriod: poll timeout of the tick thread when nothing happens."""
    commit_notify_s: float = 0.01
    """A leader tells followers about new commits with its next AppendEntries, at the
    latest this long after (instead of one extra message per follower per commit)."""
    election_min_s: float = 1.0
    election_max_s: float = 2.0
    """etcd's defaults. With 0.6-1.2 s, snapshots of a large state (0.5-1 s in the
    tick thread, measured with 10,000 subscriptions and ~300k keys) stopped a leader's
    heartbeats long enough for elections, each of which moved every stream."""
    leader_fallback_s: float = 3.0
    """A leader without majority responses this long steps down (pysyncobj: 30 s)."""
    connection_timeout_s: float = 3.5
    connection_retry_s: float = 0.5
    """Reconnect interval to a lost peer (pysyncobj: 5 s, which slows restarts)."""
    append_batch_bytes: int = 4 * 1024 * 1024
    """Max bytes per AppendEntries. Above the largest entry (2 MiB + framing), so the
    chunked single-entry path of pysyncobj (whose last-chunk test compares against
    the command length, not the pickled length: syncobj.py:1281) is never used."""
    compaction_min_entries: int = 5000
    compaction_log_ratio: float = 1.0
    """A snapshot is due once the log holds more than `compaction_min_entries` entries
    *and* at least this many times the last snapshot's bytes (0: entries alone, as
    pysyncobj does). A snapshot costs CPU in proportion to the state; counting entries
    alone, a large state is rewritten every few seconds under load (300k keys: ~50 MB,
    0.5-0.9 s of CPU per replica every 5,000 entries), this way only after as many
    bytes were written. The log then holds at most about the state's size again."""
    compaction_min_time_s: float = 300.0
    compaction_recheck_s: float = 1.0
    """After the safety point held compaction back, wait this long before asking again."""
    snapshot_chunk_bytes: int = 64 * 1024
    commands_queue_size: int = 100_000
    stall_window_ms: int = limits.STALL_WINDOW_MS_DEFAULT
    """Passed to ``safety_point``: subscribers silent longer no longer hold compaction."""
    leader_balance_s: float = 2.0
    """How often a node hands the leadership of buckets it leads to their preferred
    replica (`ClusterSpec.preferred_leaders`) when that one is connected and caught
    up; 0 turns balancing off."""
    leader_balance_backoff_max_s: float = 300.0
    """A bucket this node keeps getting back is handed over again only after a wait
    that doubles with each hand-over (from `leader_balance_s`) up to this; it resets
    once a hand-over has held this long. Stops a preferred replica that loses every
    election it is handed (a starved process) from being handed the bucket forever."""
    bind_retries: int = 10
    bind_retry_s: float = 0.2

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0 or self.tick_s <= 0:
            raise ValueError("heartbeat_s and tick_s must be positive")
        if not self.election_min_s > 3 * self.heartbeat_s:
            raise ValueError("election_min_s must exceed 3 * heartbeat_s")
        if not self.election_max_s > self.election_min_s:
            raise ValueError("election_max_s must exceed election_min_s")
        if not self.leader_fallback_s > self.heartbeat_s:
            raise ValueError("leader_fallback_s must exceed heartbeat_s")
        if not self.connection_timeout_s >= self.election_max_s:
            raise ValueError("connection_timeout_s must be at least election_max_s")
        if self.leader_balance_s < 0 or self.leader_balance_backoff_max_s < self.leader_balance_s:
            raise ValueError("0 <= leader_balance_s <= leader_balance_backoff_max_s")
        if self.compaction_min_entries < 2 or self.compaction_min_time_s <= 0:
            raise ValueError("compaction_min_entries >= 2 and compaction_min_time_s > 0")
        if not self.compaction_log_ratio >= 0:
            raise ValueError("compaction_log_ratio must be >= 0")
        if self.append_batch_bytes <= 0 or self.snapshot_chunk_bytes <= 0:
            raise ValueError("batch sizes must be positive")
        if self.bind_retries < 1 or self.bind_retry_s <= 0:
            raise ValueError("bind_retries >= 1 and bind_retry_s > 0")


def compaction_due(
    tuning: RaftTuning, *, entries: int, log_bytes: int, snapshot_bytes: int, since_last_s: float
) -> bool:
    """Whether a replica should start a snapshot (and then drop its log up to it):
    after `compaction_min_time_s`, or once the log has more than
    `compaction_min_entries` entries and at least `compaction_log_ratio` times the
    last snapshot's bytes."""
    if since_last_s > tuning.compaction_min_time_s:
        return True
    return (
        entries > tuning.compaction_min_entries
        and log_bytes >= tuning.compaction_log_ratio * snapshot_bytes
    )


# ----------------------------------------------------------------------- internals


@dataclass
class _Counters:
    entry_errors: int = 0
    plan_mismatches: int = 0
    follower_regressions: int = 0
    snapshots_written: int = 0
    snapshots_loaded: int = 0
    compactions_deferred: int = 0
    stale_term_acks: int = 0
    rewinds_prevented: int = 0
    matching_entries_kept: int = 0
    journal_trims_at_startup: int = 0
    transfer_pauses: int = 0
    late_leader_ticks: int = 0


@dataclass(eq=False)
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: int | str = FAIL_REASON.SUCCESS

    def done(self, result: object, error: int | str) -> None:
        self.result, self.error = result, error
        self.event.set()


@dataclass(frozen=True)
class _Snapshot:
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


def _encode_snapshot(snap: _Snapshot) -> list[bytes]:
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


def _decode_snapshot(data: bytes) -> _Snapshot:
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
    return _Snapshot(bucket_uuid, core, _entry(last), _entry(prev), tuple(cluster))


def _check_addr(addr: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be 'host:port', got {addr!r}")


class _FailStopJournal(DurableJournal):
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


# ------------------------------------------------------------ one tick thread a process

_LOOP_IDLE_S: Final = 0.1
"""The longest a `RaftLoop` polls with no replica due (it then checks that the
interpreter's main thread is alive, as pysyncobj's tick thread does)."""
_POLL_IN: Final = select.POLLIN
_POLL_OUT: Final = select.POLLOUT
_POLL_ERR: Final = select.POLLERR | select.POLLHUP | select.POLLNVAL


class RaftLoop:
    """One thread that ticks every Raft replica of a process.

    pysyncobj gives every SyncObj a tick thread of its own, which polls that
    replica's sockets and then runs its Raft step. A node hosts a replica per
    bucket, and those threads contend for one GIL: on the 2-core dev VM, stock
    pysyncobj with 4 groups in 3 processes made 6,405 writes/s (32 in flight)
    with a thread per group and 9,280 with one thread ticking all four
    (docs/performance.md, stop 25). Here the replicas
    of a process share one poll of all their sockets (pysyncobj's ``_poller`` of
    each is a `_LoopPoller` view of it), and each pass ticks the replicas whose
    sockets or wake-up pipe had an event, or whose own timeout is due: a replica
    is ticked exactly when its own thread would have woken.

    `BucketReplica` creates a loop of its own when none is given; a node passes
    one loop to all its replicas. Replicas are attached once built (`attach`: no
    callback of a replica runs before) and detached by `BucketReplica.close`,
    which destroys the SyncObj inside the loop. The thread ends after `close`, or
    when the interpreter's main thread has ended (as pysyncobj's does)."""

    def __init__(self, name: str = "raft") -> None:
        self.name = name
        self._poll = select.poll()
        self._fds: dict[int, tuple[_RaftNode, Callable[[int, int], None]]] = {}
        self._nodes: tuple[_RaftNode, ...] = ()
        self._ready: set[_RaftNode] = set()
        """Replicas with an event since their last tick (loop thread only)."""
        self._calls: list[Callable[[], None]] = []
        self._calls_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll.register(self._wake_r, _POLL_IN)
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

    # -- other threads -----------------------------------------------------------------

    def attach(self, node: _RaftNode) -> None:
        """Start ticking `node`, with the subscriptions its construction made."""
        if self._closing:
            raise RuntimeError(f"{self.name}: the Raft loop is closed")
        self._call(lambda: self._attach(node))

    def detach(self, node: _RaftNode) -> None:
        """Stop ticking `node` and destroy it (its transport's sockets, its journal's
        pysyncobj side) in the loop thread; returns once done."""
        done = threading.Event()

        def run() -> None:
            try:
                self._nodes = tuple(n for n in self._nodes if n is not node)
                self._ready.discard(node)
                node._doDestroy()
            finally:
                done.set()

        if not self._thread.is_alive() or threading.current_thread() is self._thread:
            run()
        else:
            self._call(run)
            while not done.wait(1.0) and self._thread.is_alive():
                pass
            if not done.is_set():  # the loop ended meanwhile
                run()

    def close(self) -> None:
        """End the thread; call it once every replica is detached. Idempotent."""
        with self._calls_lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        if threading.current_thread() is self._thread:
            return  # it ends after this pass; its pipe stays open
        self._thread.join()
        with self._calls_lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _call(self, fn: Callable[[], None]) -> None:
        with self._calls_lock:
            self._calls.append(fn)
        self._wake()

    def _wake(self) -> None:
        with self._calls_lock, contextlib.suppress(BlockingIOError):  # full: awake
            if not self._closed:
                os.write(self._wake_w, b"w")

    # -- the loop thread ---------------------------------------------------------------

    def _attach(self, node: _RaftNode) -> None:
        self._nodes = (*self._nodes, node)
        node._loop_poller.activate()
        self._ready.add(node)

    def subscribe(
        self, node: _RaftNode, fd: int, callback: Callable[[int, int], None], mask: int
    ) -> None:
        """pysyncobj's ``Poller.subscribe`` for `node`'s socket or pipe `fd` (its
        ``POLL_EVENT_TYPE`` mask: 1 read, 2 write, 4 error)."""
        events = (_POLL_IN if mask & 1 else 0) | (_POLL_OUT if mask & 2 else 0)
        if mask & 4:
            events |= _POLL_ERR
        self._fds[fd] = (node, callback)
        self._poll.register(fd, events)
        if threading.current_thread() is not self._thread:
            self._wake()  # a poll in progress does not watch the new fd

    def unsubscribe(self, fd: int) -> None:
        if self._fds.pop(fd, None) is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._poll.unregister(fd)

    def _run(self) -> None:
        name_os_thread(self.name)
        main = threading.main_thread()
        while not self._closing and main.is_alive():
            if self._calls:
                with self._calls_lock:
                    calls, self._calls = self._calls, []
                for call in calls:
                    try:
                        call()
                    except Exception:
                        logger.exception("%s: a call in the Raft loop failed", self.name)
            now = _monotonic()
            ready, self._ready = self._ready, set()
            wake_at = now + _LOOP_IDLE_S
            for node in self._nodes:
                if node in ready or node._poll_until <= now:
                    node.tick()
                wake_at = min(wake_at, node._poll_until)
            self._dispatch(self._poll.poll(max(0.0, wake_at - _monotonic()) * 1000))

    def _dispatch(self, events: list[tuple[int, int]]) -> None:
        fds = self._fds
        for fd, event in events:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(fd, 4096):
                        pass
                continue
            entry = fds.get(fd)
            if entry is None:
                continue  # unsubscribed by an earlier callback of this pass
            node, callback = entry
            self._ready.add(node)
            mask = (1 if event & _POLL_IN else 0) | (2 if event & _POLL_OUT else 0)
            if event & _POLL_ERR:
                mask |= 4
            try:
                callback(fd, mask)
            except Exception:
                # As pysyncobj's thread waited a tick period after an exception: the
                # replica's sockets are read again at its next tick, not at once.
                logger.exception("bucket %d: a Raft socket callback failed", node._owner.bucket)
                node._loop_poller.suspend()
                node._poll_until = _monotonic() + node._tick_s


class _LoopPoller:
    """What one replica's pysyncobj sees as its ``_poller``: subscriptions go to the
    `RaftLoop`'s poll while the replica is attached (held back before, so that none
    of its callbacks runs until it is whole; and after `suspend`), and ``poll``
    does nothing (the loop polls for every replica at once, after ticking them)."""

    def __init__(self, loop: RaftLoop, node: _RaftNode) -> None:
        self._loop = loop
        self._node = node
        self._subscribed: dict[int, tuple[Callable[[int, int], None], int]] = {}
        self._active = False

    def activate(self) -> None:
        """In the loop thread, once the replica is attached (and after `suspend`)."""
        if self._active:
            return
        self._active = True
        for fd, (callback, mask) in self._subscribed.items():
            self._loop.subscribe(self._node, fd, callback, mask)

    def suspend(self) -> None:
        """In the loop thread: nothing of this replica is read until `activate` (its
        next tick does, unless it is in fail-stop: then it behaves as a crashed
        replica, its sockets open and unread)."""
        if self._active:
            self._active = False
            for fd in self._subscribed:
                self._loop.unsubscribe(fd)

    def subscribe(self, fd: int, callback: Callable[[int, int], None], mask: int) -> None:
        self._subscribed[fd] = (callback, mask)
        if self._active:
            self._loop.subscribe(self._node, fd, callback, mask)

    def unsubscribe(self, fd: int) -> None:
        self._subscribed.pop(fd, None)
        if self._active:
            self._loop.unsubscribe(fd)

    def poll(self, timeout: float) -> None:
        """The end of pysyncobj's tick: the loop polls instead."""


# ------------------------------------------------------------------ the SyncObj subclass


class _Transport(_pysyncobj_transport.TCPTransport):  # type: ignore[misc]
    """pysyncobj's TCP transport, but a failed bind waits out ``bindRetryTime``
    before the next attempt: a SyncObj without a tick thread of its own binds in
    its constructor, in a loop that would otherwise spin (syncobj.py:289-294)."""

    _lastBindAttemptTime: float

    def tryGetReady(self) -> None:
        if not self.ready:
            wait = self._lastBindAttemptTime + self._syncObj.conf.bindRetryTime - _monotonic()
            if wait > 0:
                time.sleep(wait)
        super().tryGetReady()


class _RaftNode(SyncObj):  # type: ignore[misc]
    """pysyncobj SyncObj with the hazards fixed. Runs entirely in its `RaftLoop`'s
    thread (the "tick thread" below), except ``apply_entry(...)`` proposals and the
    read-only accessors."""

    # Set by SyncObj.__init__; annotated for mypy.
    _SyncObj__raftCommitIndex: int
    _SyncObj__newAppendEntriesTime: float
    _SyncObj__recvTransmission: bytes | str

    def __init__(
        self,
        owner: BucketReplica,
        self_addr: str,
        partners: list[str],
        conf: Any,
        loop: RaftLoop,
    ) -> None:
        # Set before SyncObj.__init__, which subscribes sockets and may call back.
        self._loop_poller = _LoopPoller(loop, self)
        self._owner = owner
        self._journal: _FailStopJournal = owner._journal
        self._counters: _Counters = owner._counters
        self._next_transfer_s = 0.0
        self._transfer_tried = False
        self._transfer_request: tuple[str, float] | None = None
        """(target, deadline): hand leadership over (see `_try_transfer`)."""
        self._transfer_pause_until: float | None = None
        """Set once the target is close: new commands wait until then at the latest."""
        self._timeout_now_sent = False
        self._transfer_next_try = 0.0
        """After a pause that did not move leadership, writes flow until then."""
        self._keep_alive_s = conf.connectionTimeout / 4
        self._next_keep_alive_s = 0.0
        self._gate_closed_until_s = 0.0
        self._poll_until = 0.0
        """When the current tick's final poll times out (see `_onTick`)."""
        self._last_tick_s = 0.0
        self._late_tick_s = conf.raftMinTimeout / 2
        self._next_late_warning_s = 0.0
        self._tick_s = float(conf.autoTickPeriod)
        super().__init__(self_addr, partners, conf, transportClass=_Transport)

    @property
    def _poller(self) -> _LoopPoller:
        """pysyncobj's poller of this SyncObj: the loop's, seen through a view."""
        return self._loop_poller

    @_poller.setter
    def _poller(self, _own: object) -> None:
        """SyncObj.__init__ makes a poller of its own (syncobj.py:205); unused."""

    def tick(self) -> None:
        """One tick, from the `RaftLoop` (pysyncobj's ``_autoTickThread`` body: an
        exception is logged and the replica waits a tick period before the next)."""
        try:
            if self._journal.failure is None:
                self._loop_poller.activate()  # after a failed socket callback
            self._onTick(self._tick_s)
        except Exception:
            logger.exception("bucket %d: a Raft tick failed", self._owner.bucket)
            self._poll_until = _monotonic() + self._tick_s

    # -- the replicated method -------------------------------------------------------

    @replicated  # type: ignore[untyped-decorator]
    def apply_entry(self, entry: bytes) -> ApplyOutcome | None:
        # raftLastApplied is incremented after the method returns (syncobj.py:725),
        # so the entry being applied has index raftLastApplied + 1.
        return self._owner._apply(int(self.raftLastApplied) + 1, entry)

    def _SyncObj__doApplyCommand(self, command: bytes) -> object:
        """Wraps syncobj.py:870 so that nothing raised while decoding or applying a
        committed command can wedge the tick (the same entry would be re-applied
        every tick forever: 714-729). A failure quarantines this replica."""
        try:
            return SyncObj._SyncObj__doApplyCommand(self, command)
        except SyncObjExceptionWrongVer:
            raise
        except Exception as exc:
            self._owner._enter_quarantine(
                int(self.raftLastApplied) + 1,
                f"applying a committed command failed: {type(exc).__name__}: {exc}",
                exc_info=True,
            )
            return None

    # -- durability ------------------------------------------------------------------

    def _onTick(self, timeToWait: float = 0.0) -> None:
        if self._journal.failure is not None:
            # Fail-stop: behave like a crashed replica (no acks, votes or applies,
            # nothing read); the rest of the group goes on without it.
            self._loop_poller.suspend()
            self._owner._enter_quarantine(
                int(self.raftLastApplied) + 1,
                f"journal fsync failed ({self._journal.failure}); replica stopped",
            )
            self._poll_until = _monotonic() + timeToWait
            return
        self._note_late_tick()
        # Everything appended so far is durable before this tick's commit computation
        # counts the leader itself (`count = 1`, syncobj.py:660). A no-op if nothing is
        # pending (group commit happens in _checkCommandsToApply).
        self._journal.sync()
        if self._owner._quarantine is not None:
            self._quarantined_tick()
        self._try_transfer()
        self._keep_alive()
        now = _monotonic()
        if self._SyncObj__raftState == _LEADER:
            # Wake for a commit notification due sooner than the idle poll timeout.
            timeToWait = max(0.0, min(timeToWait, self._SyncObj__newAppendEntriesTime - now))
        # The loop ticks this replica again at the latest then (or on an event of its
        # sockets); an apply that brings the next AppendEntries forward lowers it.
        self._poll_until = now + timeToWait
        SyncObj._onTick(self, timeToWait)

    def _note_late_tick(self) -> None:
        """A leader sends heartbeats from its tick thread only, and pysyncobj says
        nothing when that thread is held up (a snapshot, the GIL, no free core): its
        followers just start an election. Like etcd's "leader failed to send out
        heartbeat on time", warn when a leader's ticks are further apart than half the
        shortest election timeout (at most every 10 s), and count them in status()."""
        now = _monotonic()
        last, self._last_tick_s = self._last_tick_s, now
        if not last or now - last < self._late_tick_s or self._SyncObj__raftState != _LEADER:
            return
        self._counters.late_leader_ticks += 1
        if now >= self._next_late_warning_s:
            self._next_late_warning_s = now + 10.0
            logger.warning(
                "bucket %d: leader %s sent no heartbeat for %.0f ms (followers campaign "
                "after %.1f s): this process is overloaded (%d late ticks so far)",
                self._owner.bucket,
                self.selfNode.id,
                1000 * (now - last),
                2 * self._late_tick_s,
                self._counters.late_leader_ticks,
            )

    def _keep_alive(self) -> None:
        """pysyncobj drops a connection that has read nothing for `connectionTimeout`,
        and checks that only when it sends (tcp_connection.py:227-233). Followers never
        talk to each other, so the first vote request of an election after a leader
        fails (or a transfer) tore down the idle link and was lost, costing an election
        timeout (measured: migrations needed 2-6 transfer attempts, and each hand-over
        stalled writes about 1 s). Every member now sends a tiny message to every other
        member a few times per timeout, so each link always has something to read."""
        now = _monotonic()
        if now < self._next_keep_alive_s:
            return
        self._next_keep_alive_s = now + self._keep_alive_s
        transport = self._SyncObj__transport
        for node in list(self._SyncObj__otherNodes):
            transport.send(node, _KEEP_ALIVE)

    def _try_transfer(self) -> None:
        """Leadership transfer (Raft thesis §3.10). pysyncobj sends TimeoutNow only to
        a target holding the whole log, so while the target trails by more than
        `TRANSFER_PAUSE_LAG` entries it catches up with writes still flowing. Then
        the leader takes no new commands (they wait in the queue) for at most
        `TRANSFER_PAUSE_S`: the target takes the last entries and is sent TimeoutNow
        once (it holds the whole log; pysyncobj checks). If leadership has not moved
        when the pause ends (a lost vote, a slow target), writes flow again for
        `TRANSFER_PAUSE_S` before the next attempt, until the request's deadline.
        Once we are no longer leader, queued commands are forwarded to the new one."""
        request = self._transfer_request
        if request is None:
            return
        target, deadline = request
        now = _monotonic()
        if not self._isLeader() or now > deadline:
            self._transfer_request = self._transfer_pause_until = None
            return
        if self._transfer_pause_until is None:
            if now < self._transfer_next_try:
                return
            node = next((n for n in self._SyncObj__otherNodes if n.id == target), None)
            match = self._SyncObj__raftMatchIndex.get(node, 0) if node is not None else 0
            if self._SyncObj__getCurrentLogIndex() - match > TRANSFER_PAUSE_LAG:
                return
            self._transfer_pause_until = now + TRANSFER_PAUSE_S
            self._timeout_now_sent = False
            self._counters.transfer_pauses += 1
        if self._timeout_now_sent:
            return  # the target is running its election
        sent: list[int] = []
        self.transferLeadership(target, callback=lambda _r, err: sent.append(err))
        self._timeout_now_sent = bool(sent) and sent[0] == FAIL_REASON.SUCCESS

    def _transferring(self) -> bool:
        pause = self._transfer_pause_until
        if pause is None or not self._isLeader():
            return False
        now = _monotonic()
        if now > pause:
            # Leadership did not move in time: writes resume; the request retries later.
            self._transfer_pause_until = None
            self._transfer_next_try = now + TRANSFER_PAUSE_S
            return False
        return True

    def _quarantined_tick(self) -> None:
        """A quarantined replica keeps storing and acking the log (the group needs its
        vote) but never campaigns, and hands leadership away if it holds it: first by
        a leadership transfer (no election timeout), and if it still leads half a
        second later (the transfer went to another quarantined replica, or no follower
        was caught up) by stepping down, so that a healthy replica times out and wins."""
        now = _monotonic()
        self._SyncObj__raftElectionDeadline = now + 3600.0
        if not self._isLeader() or now < self._next_transfer_s:
            return
        self._next_transfer_s = now + 0.5
        if not self._transfer_tried:
            self._transfer_tried = True
            self.transferLeadership()
            return
        logger.warning("quarantined leader %s steps down", self.selfNode.id)
        self._SyncObj__setState(_FOLLOWER)
        self._SyncObj__raftLeader = None

    def _checkCommandsToApply(self) -> None:
        """Re-implements syncobj.py:503-574 for the leader's batch: drain every queued
        proposal into the log, send one AppendEntries per follower, then fsync once
        (group commit). The original sends after every single command when
        appendEntriesUseBatch is off, which costs a message and a follower fsync per
        entry. Followers' proposals are still forwarded one message each, as before."""
        conf = self._SyncObj__conf
        commands = self._SyncObj__commandsQueue
        transport = self._SyncObj__transport
        if self._transferring():
            self._journal.sync()
            return  # commands wait while leadership moves (see _try_transfer)
        start = _monotonic()
        appended = False
        while _monotonic() - start < conf.appendEntriesPeriod:
            if self._SyncObj__raftLeader is None and conf.commandsWaitLeader:
                break
            try:
                command, callback = commands.get_nowait()
            except queue.Empty:
                break
            request_node, request_id = None, None
            if isinstance(callback, tuple):
                request_node, request_id = callback
            if self._SyncObj__raftState == _LEADER:
                idx, term = self._journal[-1][1] + 1, self._SyncObj__raftCurrentTerm
                change = (
                    self._SyncObj__parseChangeClusterRequest(command)
                    if conf.dynamicMembershipChange
                    else None
                )
                if change is None or self._SyncObj__changeCluster(change):
                    self._journal.add(command, idx, term)
                    appended = True
                    if request_node is None:
                        if callback is not None:
                            self._SyncObj__commandsWaitingCommit[idx].append((term, callback))
                    else:
                        transport.send(
                            request_node,
                            {
                                "type": "apply_command_response",
                                "request_id": request_id,
                                "log_idx": idx,
                                "log_term": term,
                            },
                        )
                elif request_node is None:
                    if callback is not None:
                        callback(None, FAIL_REASON.REQUEST_DENIED)
                else:
                    transport.send(
                        request_node,
                        {
                            "type": "apply_command_response",
                            "request_id": request_id,
                            "error": FAIL_REASON.REQUEST_DENIED,
                        },
                    )
            elif self._SyncObj__raftLeader is not None:
                if request_node is None:
                    message: dict[str, object] = {"type": "apply_command", "command": command}
                    if callback is not None:
                        self._SyncObj__commandsLocalCounter += 1
                        counter = self._SyncObj__commandsLocalCounter
                        self._SyncObj__commandsWaitingReply[counter] = callback
                        message["request_id"] = counter
                    transport.send(self._SyncObj__raftLeader, message)
                else:
                    transport.send(
                        request_node,
                        {
                            "type": "apply_command_response",
                            "request_id": request_id,
                            "error": FAIL_REASON.NOT_LEADER,
                        },
                    )
            else:
                self._SyncObj__callErrCallback(FAIL_REASON.MISSING_LEADER, callback)
        if appended and self._SyncObj__raftState == _LEADER:
            # Send first, then fsync: the followers' appends and fsyncs overlap with
            # ours (Raft §10.2.1). Safe because the leader only counts itself for
            # entries already synced: this sync runs before the next commit loop.
            self._SyncObj__sendAppendEntries()
            if not self._SyncObj__otherNodes:
                # A one-replica group commits on its own at the next tick; no ack will
                # wake the loop for it, so tick it again at once.
                self._poll_until = 0.0
        self._journal.sync()

    def _SyncObj__applyLogEntries(self) -> bool:
        """syncobj.py:711-738, minus one message per follower per commit. With
        batching off, the original asks for an AppendEntries right after every apply,
        only to tell followers the new commit index - a message (and an ack back) per
        follower per committed entry. Followers only need it to apply (clients are
        answered and events emitted by the leader): the next AppendEntries carries
        it, and the heartbeat is brought forward to at most `commit_notify_s` away."""
        applied = SyncObj._SyncObj__applyLogEntries(self)
        if applied:
            self._owner._after_applies()
            due = _monotonic() + self._owner._tuning.commit_notify_s
            if due < self._SyncObj__newAppendEntriesTime:
                self._SyncObj__newAppendEntriesTime = due
                # Otherwise the loop's poll could sleep up to tick_s before this
                # replica's next tick (measured: a write forwarded by a follower
                # waited p50 15 ms, p90 105 ms, for the follower to learn the
                # commit; 10 ms is the design).
                self._poll_until = min(self._poll_until, due)
        return False

    def _SyncObj__onBecomeLeader(self) -> None:
        # The new term's NO_OP (syncobj.py:1227) is durable before anyone counts it.
        SyncObj._SyncObj__onBecomeLeader(self)
        self._journal.sync()

    def _SyncObj__sendNextNodeIdx(
        self,
        node: Any,
        reset: bool = False,
        nextNodeIdx: int | None = None,
        success: bool = False,
    ) -> None:
        """syncobj.py:1098 plus: fsync before any positive ack (the follower acks only
        entries it made durable), and the follower's term, so the leader can drop
        acks from another term (the original message carries none: 1101-1106)."""
        if success:
            self._journal.sync()
        if nextNodeIdx is None:
            nextNodeIdx = self._journal[-1][1] + 1
        self._SyncObj__transport.send(
            node,
            {
                "type": "next_node_idx",
                "next_node_idx": nextNodeIdx,
                "reset": reset,
                "success": success,
                "term": self._SyncObj__raftCurrentTerm,
            },
        )

    # -- message handling ------------------------------------------------------------

    def _SyncObj__onMessageReceived(self, node: Any, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == _KEEP_ALIVE["type"]:
            return  # reading it is the point (see _keep_alive)
        if kind == "append_entries" and "prevLogIdx" in message:
            self._on_append_entries(node, message)
        elif kind == "next_node_idx":
            self._on_next_node_idx(node, message)
        else:
            SyncObj._SyncObj__onMessageReceived(self, node, message)

    def _on_next_node_idx(self, node: Any, message: dict[str, Any]) -> None:
        """Leader side of syncobj.py:1070-1083, fixed: nextIndex/matchIndex only move
        forward on success (a late ack used to rewind a pipelined nextIndex, making
        the follower truncate matching entries) and responses from another term are
        ignored (Raft §5.1). A reset in this term is the follower's log end: trusted,
        even below matchIndex (the follower lost entries it had acked)."""
        if self._SyncObj__raftState != _LEADER:
            return
        term = message.get("term")
        if term is not None and term != self._SyncObj__raftCurrentTerm:
            self._counters.stale_term_acks += 1
            return
        match_index = self._SyncObj__raftMatchIndex
        next_index = self._SyncObj__raftNextIndex
        if node not in match_index or node not in next_index:
            return  # not (or no longer) a member
        next_idx = int(message["next_node_idx"])
        if message["success"]:
            if next_idx - 1 > match_index[node]:
                match_index[node] = next_idx - 1
                if next_idx < next_index[node]:
                    self._counters.rewinds_prevented += 1
            if next_idx > next_index[node]:
                next_index[node] = next_idx
        elif message["reset"]:
            if next_idx <= match_index[node]:
                # In this term the follower acked through matchIndex, so a reset below it
                # means its log really is shorter now: it lost acknowledged entries (a
                # corrupt or truncated journal). Repair it from where its log ends;
                # holding nextIndex above would leave it stuck forever.
                self._counters.follower_regressions += 1
                logger.warning(
                    "follower %s lost acknowledged entries (its log ends at %d, it had "
                    "acked %d); resending from there",
                    node,
                    next_idx - 1,
                    match_index[node],
                )
                match_index[node] = next_idx - 1
            next_index[node] = next_idx
        self._SyncObj__lastResponseTime[node] = _monotonic()

    def _on_append_entries(self, node: Any, message: dict[str, Any]) -> None:
        """Follower side of AppendEntries, re-implementing syncobj.py:945-1035 (the
        ``prevLogIdx`` branch; snapshot installs still go to the original).

        Differences: only entries that *conflict* (same index, other term) are
        deleted, with everything after them (Raft §5.3); entries that match are kept,
        so a stale or re-sent AppendEntries can no longer shorten a log below what was
        acked or applied (the original deleted everything after prevLogIdx: 991-1004).
        The commit index advances at most to the last entry this message verified,
        since entries past it may be stale ones from an older term."""
        term = message["term"]
        if term < self._SyncObj__raftCurrentTerm:
            return
        if term > self._SyncObj__raftCurrentTerm:
            self._SyncObj__transferInProgress = False
        if not self._SyncObj__transferInProgress:
            self._SyncObj__raftElectionDeadline = (
                _monotonic() + self._SyncObj__generateRaftTimeout()
            )
        if self._SyncObj__raftLeader != node:
            self._SyncObj__onLeaderChanged()
        self._SyncObj__raftLeader = node
        if term > self._SyncObj__raftCurrentTerm:
            self._SyncObj__setCurrentTerm(term, None)
        self._SyncObj__setState(_FOLLOWER)
        new_entries: list[tuple[bytes, int, int]] = message.get("entries", [])
        self._SyncObj__leaderCommitIndex = leader_commit = message["commit_index"]

        transmission = message.get("transmission")
        if transmission is not None:
            # One entry larger than the batch size, sent in chunks (never with our
            # default batch size, see RaftTuning.append_batch_bytes).
            received = self._SyncObj__recvTransmission
            if transmission == "start":
                self._SyncObj__recvTransmission = message["data"]
                self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
                return
            if transmission not in ("process", "finish") or not isinstance(received, bytes):
                self._SyncObj__recvTransmission = ""
                self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
                return
            if transmission == "process":
                self._SyncObj__recvTransmission = received + message["data"]
                self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
                return
            self._SyncObj__recvTransmission = ""
            try:
                new_entries = [_pysyncobj_pickle.loads(received + message["data"])]
            except Exception:
                logger.exception("bucket %d: unreadable chunked entry", self._owner.bucket)
                self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
                return

        log = self._journal
        prev_idx, prev_term = message["prevLogIdx"], message["prevLogTerm"]
        first_idx, last_idx = log[0][1], log[-1][1]
        if prev_idx is None or not first_idx <= prev_idx <= last_idx:
            self._SyncObj__sendNextNodeIdx(node, success=False, reset=True)
            return
        if log[prev_idx - first_idx][2] != prev_term:
            self._SyncObj__sendNextNodeIdx(node, nextNodeIdx=prev_idx, success=False, reset=True)
            return

        append_from = 0
        for position, entry in enumerate(new_entries):
            idx = entry[1]
            if idx > last_idx:
                break
            if log[idx - first_idx][2] == entry[2]:
                append_from = position + 1
                continue
            self._truncate_conflict(idx)
            break
        kept = append_from
        if kept:
            self._counters.matching_entries_kept += kept
        appended = new_entries[append_from:]
        for entry in appended:
            log.add(*entry)
        if self._SyncObj__conf.dynamicMembershipChange:
            for entry in appended:
                change = self._SyncObj__parseChangeClusterRequest(entry[0])
                if change is not None:
                    self._SyncObj__doChangeCluster(change)

        verified = new_entries[-1][1] if new_entries else prev_idx
        self._SyncObj__sendNextNodeIdx(node, nextNodeIdx=verified + 1, success=True)

        commit = int(self._SyncObj__raftCommitIndex)
        current = log[-1][1]
        if commit > current:
            commit = current
        if leader_commit > commit:
            commit = max(commit, min(leader_commit, verified))
        self._SyncObj__raftCommitIndex = commit
        log.setRaftCommitIndex(commit)

    def _truncate_conflict(self, idx: int) -> None:
        """Delete the log from ``idx`` (the first conflicting entry) on, rolling back
        membership changes it carried (as syncobj.py:991-997 does)."""
        log = self._journal
        first_idx = log[0][1]
        last_applied = int(self.raftLastApplied)
        if idx <= last_applied:
            # Committed entries never conflict in Raft; if they do, this replica's
            # applied state cannot be trusted any more.
            logger.critical(
                "truncating already-applied log entries from index %d (last applied: %d)"
                " - state machine may have diverged from other cluster members",
                idx,
                last_applied,
            )
            self._owner._enter_quarantine(idx, "the leader replaced an already-applied entry")
        if self._SyncObj__conf.dynamicMembershipChange:
            for entry in reversed(log[idx - first_idx :]):
                change = self._SyncObj__parseChangeClusterRequest(entry[0])
                if change is not None:
                    self._SyncObj__doChangeCluster(change, reverse=True)
        log.deleteEntriesFrom(idx - first_idx)

    # -- membership ----------------------------------------------------------------

    def _SyncObj__changeCluster(self, request: Any) -> bool:
        """syncobj.py:1356 with a working guard: refuse while an earlier membership
        entry is still uncommitted (`__changeClusterIDx` is never set upstream)."""
        log = self._journal
        commit = int(self._SyncObj__raftCommitIndex)
        first_idx = log[0][1]
        for command, _idx, _term in log[max(0, commit + 1 - first_idx) :]:
            if command[:1] == bytes([_CMD_MEMBERSHIP]):
                return False
        return bool(SyncObj._SyncObj__changeCluster(self, request))

    # -- snapshots and compaction ----------------------------------------------------

    def _SyncObj__tryLogCompaction(self) -> None:
        """syncobj.py:1421, gated: a new snapshot (which lets the log be dropped up to
        the last applied entry) only starts when it is due (`_compaction_due`) and
        the core's safety point allows it. Finishing a snapshot already taken is
        never held back."""
        serializer = self._SyncObj__serializer
        if serializer._Serializer__pid == 0:  # none being made: whether to start one
            if not self._compaction_due():
                return
            now = _monotonic()
            if now < self._gate_closed_until_s:
                return
            if not self._owner._compaction_allowed(int(self.raftLastApplied)):
                self._counters.compactions_deferred += 1
                self._gate_closed_until_s = now + self._owner._tuning.compaction_recheck_s
                return
        SyncObj._SyncObj__tryLogCompaction(self)

    def _compaction_due(self) -> bool:
        """The trigger of syncobj.py:1436-1439 with the log's size weighed against
        the last snapshot's (`compaction_due`); it implies the original's, which
        then starts the snapshot."""
        return compaction_due(
            self._owner._tuning,
            entries=len(self._journal),
            log_bytes=self._journal.size_bytes,
            snapshot_bytes=self._owner._snapshot_bytes,
            since_last_s=_monotonic() - self._SyncObj__lastSerializedTime,
        ) or bool(self._SyncObj__forceLogCompaction)

    def _SyncObj__deleteEntriesTo(self, toIDx: int) -> None:
        """Compaction (syncobj.py:1427). The snapshot was renamed into place without a
        directory fsync; make that durable before dropping the entries it replaces, and
        never drop the last entry (an empty log makes every tick raise IndexError at
        `self.__raftLog[0]`, 1146)."""
        fsync_dir(self._owner._data_dir)
        last_idx = self._journal[-1][1]
        if toIDx > last_idx:
            logger.error("compaction to %d past the log end %d; clamped", toIDx, last_idx)
            toIDx = last_idx
        SyncObj._SyncObj__deleteEntriesTo(self, toIDx)

    def _SyncObj__loadDumpFile(self, clearJournal: bool) -> None:
        """syncobj.py:1472. At startup (clearJournal=False) pysyncobj keeps the journal
        only if its first two entries are the snapshot's last two, and otherwise
        CLEARS it (1489-1495): a crash after the snapshot rename but before the
        compaction lost every acked entry after the snapshot. Trim the journal to the
        snapshot point instead, so the original check passes and nothing is lost."""
        if not clearJournal:
            self._owner._align_journal_to_snapshot()
        SyncObj._SyncObj__loadDumpFile(self, clearJournal)


# ------------------------------------------------------------------- the public class


class BucketReplica:
    """One bucket's replica: a Raft group member that applies committed entries to the
    bucket core. Thread-safe: the pysyncobj tick thread applies, other threads read,
    propose and query status."""

    def __init__(
        self,
        *,
        bucket: int,
        bucket_uuid: str,
        self_addr: str,
        partners: Sequence[str],
        data_dir: Path,
        password: str,
        tuning: RaftTuning = RaftTuning(),
        on_applied: Callable[[Applied], None] | None = None,
        archived_through: Callable[[], int] | None = None,
        loop: RaftLoop | None = None,
    ) -> None:
        """`loop` ticks this replica (a node shares one between its replicas);
        without one, the replica runs a loop of its own."""
        _check_addr(self_addr)
        others = [p for p in partners if p != self_addr]
        for partner in others:
            _check_addr(partner)
        if not password:
            raise ValueError(
                "a cluster password is required: without one pysyncobj "
                "unpickles whatever reaches its port"
            )
        self.bucket = bucket
        self.bucket_uuid = bucket_uuid
        self.self_addr = self_addr
        self._tuning = tuning
        self._on_applied = on_applied
        self.after_applies: Callable[[], None] | None = None
        """Called in the tick thread after each run of applies, before the same tick
        appends the entries proposed meanwhile (so a proposal made here leaves in
        this tick); must be quick. Exceptions are logged and ignored."""
        self._data_dir = Path(data_dir)
        self._lock = threading.RLock()
        self._sm = BucketStateMachine(bucket_uuid)
        self._quarantine: str | None = None
        self._counters = _Counters()
        self._snapshot_index = 0
        self._snapshot_bytes = 0
        """Size of the last snapshot written or loaded (`compaction_due`)."""
        self._snapshot_cache: tuple[tuple[int, int, int], _Snapshot] | None = None
        self._pending: set[Future[ApplyOutcome]] = set()
        self._pending_lock = threading.Lock()
        # Entries proposed here, already decoded, by their bytes (see `submit`).
        self._proposed: dict[bytes, Entry] = {}
        self._membership_lock = threading.Lock()
        self._closed = False
        #: Compaction holds: the oldest cold replica checkpoint and a migration hold
        #: point (log indexes), fed to `safety_point`; None means no hold.
        self.cold_replica_checkpoint: int | None = None
        self.migration_hold_point: int | None = None
        #: Asked at each compaction: the last core index whose purged rows the node's
        #: archive made durable (cluster/archive/writer.py). Compaction keeps later entries,
        #: so a crash can replay their purges into the archive. None means no archive.
        self._archived_through = archived_through

        self._data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock_data_dir()
        try:
            self._journal = _FailStopJournal(self._data_dir / JOURNAL_FILE)
        except BaseException:
            os.close(self._lock_fd)
            raise
        conf = SyncObjConf(
            password=password,
            bindAddress=self_addr,
            journalFile=self._journal,
            fullDumpFile=str(self._data_dir / SNAPSHOT_FILE),
            serializer=self._write_snapshot,
            deserializer=self._read_snapshot,
            useFork=False,
            dynamicMembershipChange=True,
            appendEntriesUseBatch=False,
            appendEntriesPeriod=tuning.heartbeat_s,
            autoTickPeriod=tuning.tick_s,
            raftMinTimeout=tuning.election_min_s,
            raftMaxTimeout=tuning.election_max_s,
            leaderFallbackTimeout=tuning.leader_fallback_s,
            connectionTimeout=tuning.connection_timeout_s,
            connectionRetryTime=tuning.connection_retry_s,
            appendEntriesBatchSizeBytes=tuning.append_batch_bytes,
            logCompactionMinEntries=tuning.compaction_min_entries,
            logCompactionMinTime=tuning.compaction_min_time_s,
            logCompactionBatchSize=tuning.snapshot_chunk_bytes,
            commandsQueueSize=tuning.commands_queue_size,
            maxBindRetries=tuning.bind_retries,
            bindRetryTime=tuning.bind_retry_s,
            autoTick=False,
        )
        self._own_loop = loop is None
        self._loop = RaftLoop(f"raft-b{bucket}") if loop is None else loop
        try:
            # Binds (with retries) before it returns: no tick thread of its own.
            self._node = _RaftNode(self, self_addr, others, conf, self._loop)
        except BaseException as exc:
            self._journal.close()
            os.close(self._lock_fd)
            if self._own_loop:
                self._loop.close()
            if isinstance(exc, SyncObjException):
                raise OSError(f"bucket {bucket}: cannot bind {self_addr}: {exc}") from exc
            raise
        self._loop.attach(self._node)

    # -- public API ----------------------------------------------------------------

    def submit(self, entry: bytes, decoded: Entry | None = None) -> Future[ApplyOutcome]:
        """Replicate ``entry`` without blocking: the future resolves with its
        :class:`ApplyOutcome` once it is committed (durable on a majority) and applied
        here, or fails with :class:`ReplicaUnavailable`. From a follower, pysyncobj
        forwards it to the leader. The caller bounds the wait (``propose`` does).

        ``decoded``, when given, is the entry ``entry`` encodes (``encode_entry``):
        this replica applies it when the same bytes commit instead of decoding them
        again (measured: decoding was half of applying a write). Entries
        are canonical and their round trip exact, so this changes nothing but time.

        :raises ReplicaUnavailable: quarantined or closed.
        :raises LimitExceeded: the entry is larger than the core accepts.
        """
        if not isinstance(entry, bytes):
            raise TypeError(f"entry must be bytes, got {type(entry).__name__}")
        if len(entry) > limits.ENTRY_BYTES_MAX:
            raise LimitExceeded(
                f"entry is {len(entry)} bytes; the limit is {limits.ENTRY_BYTES_MAX}"
            )
        self._refuse_if_unavailable()
        if decoded is not None:
            if len(self._proposed) >= _PROPOSED_KEPT:
                self._proposed.clear()  # proposals that never committed here
            self._proposed[entry] = decoded
        future: Future[ApplyOutcome] = Future()
        with self._pending_lock:
            self._pending.add(future)

        def done(result: object, error: int | str) -> None:  # the tick thread
            with self._pending_lock:
                self._pending.discard(future)
            with contextlib.suppress(InvalidStateError):  # close() failed it already
                settle(result, error)

        def settle(result: object, error: int | str) -> None:
            if error != FAIL_REASON.SUCCESS:
                reason = error if isinstance(error, str) else _FAIL_NAMES.get(error, str(error))
                future.set_exception(
                    ReplicaUnavailable(
                        f"bucket {self.bucket}: proposal failed: {reason}",
                        leader_hint=self.leader,
                        reason=reason,
                    )
                )
            elif not isinstance(result, ApplyOutcome):
                future.set_exception(
                    ReplicaUnavailable(
                        f"bucket {self.bucket}: committed but not applied here "
                        f"({self._quarantine or 'closed'})",
                        leader_hint=self.leader,
                        reason="quarantined",
                    )
                )
            else:
                future.set_result(result)

        # The command is queued before the tick is woken through a pipe; if that pipe
        # is full the tick is already busy and will drain the queue anyway.
        with contextlib.suppress(BlockingIOError):
            self._node.apply_entry(entry, callback=done)
        return future

    def propose(self, entry: bytes, timeout_s: float = 5.0) -> ApplyOutcome:
        """Replicate ``entry``; block until it is committed (durable on a majority) and
        applied here (see :meth:`submit`).

        :raises ReplicaUnavailable: no leader / quorum, quarantined, closed, timeout
            (``reason="timeout"``: the entry may still commit later).
        :raises LimitExceeded: the entry is larger than the core accepts.
        """
        future = self.submit(entry)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            with self._pending_lock:
                self._pending.discard(future)
            raise ReplicaUnavailable(
                f"bucket {self.bucket}: not committed within {timeout_s} s "
                f"(outcome unknown; quorum connected: {self._has_quorum()})",
                leader_hint=self.leader,
                reason="timeout",
            ) from None

    def read(self, fn: Callable[[BucketStateMachine], T]) -> T:
        """Run ``fn`` on the core under the apply lock (a consistent view). Reads on a
        follower may lag the leader."""
        with self._lock:
            self._refuse_if_unavailable()
            return fn(self._sm)

    @property
    def is_leader(self) -> bool:
        return bool(self._node._isLeader())

    @property
    def leader(self) -> str | None:
        node = self._node._getLeader()
        return None if node is None else str(node.id)

    @property
    def on_applied(self) -> Callable[[Applied], None] | None:
        """Called in the tick thread after each applied entry (outside the lock); must
        be quick. Exceptions are logged and ignored."""
        return self._on_applied

    @on_applied.setter
    def on_applied(self, callback: Callable[[Applied], None] | None) -> None:
        self._on_applied = callback

    @property
    def plan_mismatches(self) -> int:
        """Times this replica's own plan hash or outbox digest disagreed with a committed
        entry (each quarantined it)."""
        return self._counters.plan_mismatches

    def members(self) -> list[str]:
        """The Raft group's members as this replica sees them (sorted addresses)."""
        return self._members()

    def transfer_leadership(self, to: str, timeout_s: float = 2.0) -> None:
        """Ask this replica, if it leads, to hand leadership to member `to` within
        `timeout_s`: once `to` trails by at most `TRANSFER_PAUSE_LAG` entries, new
        commands wait (then go to the new leader) for up to `TRANSFER_PAUSE_S` while
        `to` takes the rest of the log, then it is sent TimeoutNow (tick thread)."""
        _check_addr(to)
        node = self._node
        node._transfer_pause_until = None
        node._transfer_next_try = 0.0
        node._transfer_request = (to, _monotonic() + timeout_s)

    def connectivity(self) -> Connectivity:
        """The leader this replica knows, whether it reaches a quorum, and which other
        members its transport is connected to (sorted)."""
        node = self._node
        for _ in range(3):
            with contextlib.suppress(RuntimeError):  # a set changed size under us
                connected = sorted(str(n.id) for n in node.otherNodes if node.isNodeConnected(n))
                return Connectivity(self.leader, self._has_quorum(), tuple(connected))
        return Connectivity(self.leader, False, ())

    @property
    def quarantined(self) -> str | None:
        """Why this replica stopped applying, or None."""
        return self._quarantine

    def status(self) -> dict[str, object]:
        node, journal = self._node, self._journal
        with self._lock:
            epoch = self._sm.epoch.epoch_counter
            core_applied = self._sm.applied_index
        try:
            first_idx, last_idx = journal[0][1], journal[-1][1]
        except IndexError:
            first_idx = last_idx = 0
        counters = self._counters
        return {
            "bucket": self.bucket,
            "bucket_uuid": self.bucket_uuid,
            "self": self.self_addr,
            "leader": self.leader,
            "is_leader": self.is_leader,
            "term": int(node.raftCurrentTerm),
            "commit_index": int(node.raftCommitIndex),
            "applied_index": int(node.raftLastApplied),
            "core_applied_index": core_applied,
            "log_len": len(journal),
            "log_first_index": first_idx,
            "log_last_index": last_idx,
            "durable_index": journal.last_durable_index,
            "has_quorum": self._has_quorum(),
            "ready": self._ready(),
            "epoch": epoch,
            "members": self._members(),
            "quarantined": self._quarantine,
            "fsyncs": journal.fsync_count,
            "group_commits": journal.sync_count,
            "snapshot_index": self._snapshot_index,
            "snapshot_bytes": self._snapshot_bytes,
            "log_bytes": journal.size_bytes,
            "snapshots_written": counters.snapshots_written,
            "snapshots_loaded": counters.snapshots_loaded,
            "compactions_deferred": counters.compactions_deferred,
            "entry_errors": counters.entry_errors,
            "plan_mismatches": counters.plan_mismatches,
            "stale_term_acks": counters.stale_term_acks,
            "rewinds_prevented": counters.rewinds_prevented,
            "follower_regressions": counters.follower_regressions,
            "matching_entries_kept": counters.matching_entries_kept,
            "journal_trims_at_startup": counters.journal_trims_at_startup,
            "transfer_pauses": counters.transfer_pauses,
            "late_leader_ticks": counters.late_leader_ticks,
        }

    def wait_ready(self, timeout_s: float) -> bool:
        """True once a leader is known and this replica has applied what the leader
        had committed when it first heard from it (a leader: its own term's NO_OP).
        False on timeout, or at once if quarantined or closed."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._quarantine is not None or self._closed:
                return False
            if self._ready():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def add_member(self, addr: str, timeout_s: float) -> None:
        """Add ``addr`` (started with the current members as partners) to the group.

        :raises MembershipChangeInProgress: another change is still uncommitted.
        :raises ValueError: ``addr`` is already a member.
        """
        self._change_membership("add", addr, timeout_s)

    def remove_member(self, addr: str, timeout_s: float) -> None:
        """Remove ``addr`` from the group (not the leader: transfer leadership first).

        :raises MembershipChangeInProgress: another change is still uncommitted.
        :raises ValueError: ``addr`` is not a member, is this replica or is the leader.
        """
        self._change_membership("remove", addr, timeout_s)

    def close(self) -> None:
        """Flush the journal and stop the SyncObj (threads and sockets). Idempotent."""
        with self._pending_lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        self._loop.detach(self._node)
        if self._own_loop:
            self._loop.close()
        self._node._SyncObj__serializer.join()  # no snapshot lands after we let go
        self._journal.close()
        for future in pending:
            with contextlib.suppress(InvalidStateError):
                future.set_exception(
                    ReplicaUnavailable(f"bucket {self.bucket}: replica is closed", reason="closed")
                )
        os.close(self._lock_fd)

    # -- apply (tick thread) ---------------------------------------------------------

    def _apply(self, index: int, entry: object) -> ApplyOutcome | None:
        """Apply one committed entry; never raises (see the module docstring)."""
        with self._lock:
            if self._quarantine is not None:
                return None
            try:
                if not isinstance(entry, bytes):
                    raise MalformedEntry(f"entry must be bytes, got {type(entry).__name__}")
                decoded = self._proposed.pop(entry, None) if self._proposed else None
                if decoded is None:
                    applied = self._sm.apply(index, entry)
                else:
                    applied = self._sm.apply_entry(index, decoded)
            except EntryError as exc:
                self._counters.entry_errors += 1
                logger.info("bucket %d: entry %d rejected: %s", self.bucket, index, exc)
                return ApplyOutcome(index, None, f"{type(exc).__name__}: {exc}")
            except ReplicaDivergence as exc:
                self._counters.plan_mismatches += isinstance(exc, PlanMismatch)
                self._enter_quarantine(index, f"{type(exc).__name__}: {exc}")
                return None
            except Exception as exc:
                self._enter_quarantine(
                    index, f"unexpected {type(exc).__name__}: {exc}", exc_info=True
                )
                return None
        if self._on_applied is not None:
            try:
                self._on_applied(applied)
            except Exception:
                logger.exception("bucket %d: on_applied failed at index %d", self.bucket, index)
        return ApplyOutcome(index, applied, None)

    def _after_applies(self) -> None:
        if self.after_applies is not None:
            try:
                self.after_applies()
            except Exception:
                logger.exception("bucket %d: after_applies failed", self.bucket)

    def _enter_quarantine(self, index: int, reason: str, *, exc_info: bool = False) -> None:
        with self._lock:
            if self._quarantine is not None:
                return
            self._quarantine = f"log index {index}: {reason}"
        logger.critical(
            "bucket %d replica %s QUARANTINED at log index %d: %s - it no longer applies "
            "entries, serves reads or accepts proposals; the rest of the group goes on",
            self.bucket,
            self.self_addr,
            index,
            reason,
            exc_info=exc_info,
        )

    # -- snapshots (tick thread) -----------------------------------------------------

    def _compaction_allowed(self, index: int) -> bool:
        """May a snapshot at raft index ``index`` (the last applied entry) replace the
        log before it? Only if the core's safety point (seed 000 §8) is not held back
        below what the core applied by an unacked client, and the cold replica
        checkpoint and migration hold point are not below ``index``. (Entries between
        the core's applied index and ``index`` are Raft no-ops, membership changes or
        rejected entries, which change nothing in the core.)"""
        cold, hold = self.cold_replica_checkpoint, self.migration_hold_point
        archived = None if self._archived_through is None else self._archived_through()
        with self._lock:
            if self._quarantine is not None:
                return False
            point = self._sm.safety_point(
                int(time.time() * 1000), self._tuning.stall_window_ms, cold, hold
            )
            applied = self._sm.applied_index
        return (
            point >= applied
            and (cold is None or cold >= index)
            and (hold is None or hold >= index)
            and (archived is None or archived >= applied)
        )

    def _write_snapshot(self, tmp_path: str, data: tuple[Any, Any, Any]) -> Callable[[], None]:
        """pysyncobj's custom serializer (serializer.py:87), called in the tick thread:
        takes the core's state now and returns the function that writes it
        (`_BackgroundSerializer` runs that in a thread): one file with the core
        snapshot and pysyncobj's (lastEntry, prevEntry, cluster), fsynced, then renamed
        into place; the directory is fsynced before compaction drops log entries
        (_RaftNode._SyncObj__deleteEntriesTo)."""
        last, prev, cluster = data
        with self._lock:
            if self._quarantine is not None:
                raise RuntimeError("quarantined replicas take no snapshots")
            make_core = self._sm.snapshot_later()
            core_applied = self._sm.applied_index
        if core_applied > last[1]:
            raise RuntimeError(f"core applied {core_applied} past the snapshot index {last[1]}")
        last_entry = (bytes(last[0]), int(last[1]), int(last[2]))
        prev_entry = (bytes(prev[0]), int(prev[1]), int(prev[2]))
        members = tuple(sorted(str(node.id) for node in cluster))

        def write() -> None:
            started = time.monotonic()
            snap = _Snapshot(self.bucket_uuid, make_core(), last_entry, prev_entry, members)
            data = _encode_snapshot(snap)
            write_synced(Path(tmp_path), *data)
            self._snapshot_index = snap.last[1]
            self._snapshot_bytes = sum(map(len, data))
            self._counters.snapshots_written += 1
            logger.info(
                "bucket %d: snapshot at log index %d written (%d bytes in %.2f s)",
                self.bucket,
                snap.last[1],
                self._snapshot_bytes,
                time.monotonic() - started,
            )

        return write

    def _load_snapshot(self, path: Path) -> _Snapshot:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            key = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if self._snapshot_cache is not None and self._snapshot_cache[0] == key:
                return self._snapshot_cache[1]
            data = f.read()
            # A snapshot installed from the leader (serializer.py:176-198) was written
            # and renamed without any fsync: make it durable before the journal is
            # cleared and the install is acked.
            os.fsync(f.fileno())
        fsync_dir(path.parent)
        snap = _decode_snapshot(data)
        self._snapshot_cache = (key, snap)
        return snap

    def _read_snapshot(self, path: str) -> tuple[Any, Any, Any]:
        """pysyncobj's custom deserializer (serializer.py:110): restore the core and
        return (lastEntry, prevEntry, cluster) for pysyncobj."""
        try:
            snap = self._load_snapshot(Path(path))
            if snap.bucket_uuid != self.bucket_uuid:
                raise ValueError(
                    f"snapshot belongs to bucket {snap.bucket_uuid!r}, not {self.bucket_uuid!r}"
                )
            sm = BucketStateMachine.restore(snap.core)
            if sm.bucket_uuid != self.bucket_uuid:
                raise ValueError(f"core snapshot is for bucket {sm.bucket_uuid!r}")
        except Exception as exc:
            self._enter_quarantine(
                int(self._node.raftLastApplied) + 1,
                f"cannot load snapshot {path}: {type(exc).__name__}: {exc}",
            )
            raise
        finally:
            self._snapshot_cache = None
        with self._lock:
            self._sm = sm
        self._snapshot_index = snap.last[1]
        self._snapshot_bytes = os.path.getsize(path)
        self._counters.snapshots_loaded += 1
        return snap.last, snap.prev, {TCPNode(addr) for addr in snap.cluster}

    def _align_journal_to_snapshot(self) -> None:
        """Drop journal entries before the snapshot point so that pysyncobj's startup
        check (journal[0:2] == snapshot's prev, last) keeps the journal."""
        path = self._data_dir / SNAPSHOT_FILE
        try:
            snap = self._load_snapshot(path)
        except Exception:
            logger.exception("bucket %d: snapshot %s unreadable", self.bucket, path)
            return  # the deserializer reports (and quarantines) when pysyncobj loads it
        log = self._journal
        if len(log) >= 2 and log[0] == snap.prev and log[1] == snap.last:
            return
        first_idx = log[0][1] if len(log) else 0
        position = snap.prev[1] - first_idx
        if (
            len(log)
            and position > 0
            and position + 1 < len(log)
            and log[position] == snap.prev
            and log[position + 1] == snap.last
        ):
            logger.warning(
                "bucket %d: journal holds %d entries before its snapshot at %d (a crash "
                "between the snapshot and the compaction); trimming them, not clearing",
                self.bucket,
                position,
                snap.last[1],
            )
            log.deleteEntriesTo(position)
            self._counters.journal_trims_at_startup += 1
        else:
            logger.warning(
                "bucket %d: journal (%d..%d) does not contain the snapshot point %d; "
                "pysyncobj resets the journal to the snapshot",
                self.bucket,
                first_idx,
                log[-1][1] if len(log) else 0,
                snap.last[1],
            )

    # -- helpers -----------------------------------------------------------------------

    def _lock_data_dir(self) -> int:
        fd = os.open(self._data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"{self._data_dir} is in use by another replica") from None
        return fd

    def _refuse_if_unavailable(self) -> None:
        if self._closed:
            raise ReplicaUnavailable(f"bucket {self.bucket}: replica is closed", reason="closed")
        if self._quarantine is not None:
            raise ReplicaUnavailable(
                f"bucket {self.bucket}: replica {self.self_addr} is quarantined "
                f"({self._quarantine})",
                leader_hint=self.leader,
                reason="quarantined",
            )

    def _has_quorum(self) -> bool:
        for _ in range(3):
            with contextlib.suppress(RuntimeError):  # a set changed size under us
                return bool(self._node.hasQuorum)
        return False

    def _members(self) -> list[str]:
        for _ in range(3):
            with contextlib.suppress(RuntimeError):
                return sorted([self.self_addr, *(str(n.id) for n in self._node.otherNodes)])
        return [self.self_addr]

    def _ready(self) -> bool:
        node = self._node
        leader = node._getLeader()
        if leader is None or not node.isReady():
            return False
        if node._isLeader():
            noop = node._SyncObj__noopIDx
            return noop is not None and int(node.raftLastApplied) >= int(noop)
        return True

    def _change_membership(self, op: str, addr: str, timeout_s: float) -> None:
        _check_addr(addr)
        self._refuse_if_unavailable()
        if not self._membership_lock.acquire(blocking=False):
            raise MembershipChangeInProgress(
                f"bucket {self.bucket}: another membership change from this replica is in flight",
                leader_hint=self.leader,
                reason="membership_in_flight",
            )
        try:
            members = self._members()
            if op == "add" and addr in members:
                raise ValueError(f"{addr} is already a member of bucket {self.bucket}")
            if op == "remove":
                if addr not in members:
                    raise ValueError(f"{addr} is not a member of bucket {self.bucket}")
                if addr == self.self_addr or addr == self.leader:
                    raise ValueError(
                        f"{addr} is this replica or the leader; remove it from another "
                        "replica after transferring leadership"
                    )
            waiter = _Waiter()
            if op == "add":
                self._node.addNodeToCluster(addr, callback=waiter.done)
            else:
                self._node.removeNodeFromCluster(addr, callback=waiter.done)
            if not waiter.event.wait(timeout_s):
                raise ReplicaUnavailable(
                    f"bucket {self.bucket}: membership change ({op} {addr}) not committed "
                    f"within {timeout_s} s (outcome unknown)",
                    leader_hint=self.leader,
                    reason="timeout",
                )
            if waiter.error == FAIL_REASON.REQUEST_DENIED:
                raise MembershipChangeInProgress(
                    f"bucket {self.bucket}: the leader refused {op} {addr}: an earlier "
                    "membership change (or the leader's first entry) is not committed yet",
                    leader_hint=self.leader,
                    reason="REQUEST_DENIED",
                )
            if waiter.error != FAIL_REASON.SUCCESS:
                reason = (
                    waiter.error
                    if isinstance(waiter.error, str)
                    else _FAIL_NAMES.get(waiter.error, str(waiter.error))
                )
                raise ReplicaUnavailable(
                    f"bucket {self.bucket}: membership change ({op} {addr}) failed: {reason}",
                    leader_hint=self.leader,
                    reason=reason,
                )
        finally:
            self._membership_lock.release()

    def __repr__(self) -> str:
        return (
            f"BucketReplica(bucket={self.bucket}, self={self.self_addr!r}, "
            f"leader={self.leader!r}, quarantined={self._quarantine is not None})"
        )
