"""`BucketReplica`: one bucket's replica, a member of the bucket's Raft group (a
pysyncobj 0.3.17 `RaftNode`) that applies committed entries to the pure bucket core
(docs/core.md). What the adapter fixes in pysyncobj, and how: docs/raft.md."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from pysyncobj import FAIL_REASON, SyncObjConf, SyncObjException
from pysyncobj.node import TCPNode

from sevendb.outbox import limits
from sevendb.outbox.entries import Entry
from sevendb.outbox.errors import (
    EntryError,
    LimitExceeded,
    MalformedEntry,
    PlanMismatch,
    ReplicaDivergence,
)
from sevendb.outbox.lifecycle import cold_replica_checkpoint
from sevendb.outbox.model import Applied
from sevendb.outbox.replica import (
    ApplyOutcome,
    Connectivity,
    MembershipChangeInProgress,
    ReplicaUnavailable,
)
from sevendb.outbox.state import BucketStateMachine

from .journal import FailStopJournal
from .loop import RaftLoop
from .node import _LEADER as LEADER_STATE
from .node import FAIL_NAMES, RaftCounters, RaftNode, leader_view
from .recovery import ACCEPT_LOSS, UNKNOWN_INDEX, Recovery, write_decision
from .sidecars import NOTHING
from .snapshots import SNAPSHOT_FILE, SnapshotFiles
from .tuning import RaftTuning

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

_DEFAULT_TUNING: Final = RaftTuning()

JOURNAL_FILE: Final = "raft.journal"
LOCK_FILE: Final = "LOCK"

_PROPOSED_KEPT: Final = 1024
"""Decoded proposals kept for their apply (see `BucketReplica.submit`); ones that
never commit here (a lost leadership) are dropped once this many wait."""


@dataclass(eq=False)
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: int | str = FAIL_REASON.SUCCESS

    def done(self, result: object, error: int | str) -> None:
        self.result, self.error = result, error
        self.event.set()


def _check_addr(addr: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be 'host:port', got {addr!r}")


def _check_members(self_addr: str, partners: Sequence[str], password: str) -> list[str]:
    """The other members, once the addresses and the password are checked."""
    _check_addr(self_addr)
    others = [p for p in partners if p != self_addr]
    for partner in others:
        _check_addr(partner)
    if not password:
        raise ValueError(
            "a cluster password is required: without one pysyncobj "
            "unpickles whatever reaches its port"
        )
    return others


def _syncobj_conf(
    tuning: RaftTuning,
    password: str,
    self_addr: str,
    journal: FailStopJournal,
    snapshot: Path,
    serializer: Callable[[str, tuple[Any, Any, Any]], Callable[[], None]],
    deserializer: Callable[[str], tuple[Any, Any, Any]],
) -> SyncObjConf:
    """pysyncobj's configuration for a replica (the choices: docs/raft.md)."""
    return SyncObjConf(
        password=password,
        bindAddress=self_addr,
        journalFile=journal,
        fullDumpFile=str(snapshot),
        serializer=serializer,
        deserializer=deserializer,
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


def _archive_caught_up(
    bucket: int,
    archived_through: Callable[[], int] | None,
    publish: Callable[[], object] | None,
    index: int,
) -> bool:
    """Whether the archive has published every purge up to `index` (asking it to
    publish what it buffers if not): a snapshot must not cover a purge whose rows
    only a replay of the log could give the archive again."""
    if archived_through is None or archived_through() >= index:
        return True
    if publish is not None:
        try:
            publish()
        except Exception as exc:
            logger.warning("bucket %d: the archive could not publish: %s", bucket, exc)
    return archived_through() >= index


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
        tuning: RaftTuning = _DEFAULT_TUNING,
        on_applied: Callable[[Applied], None] | None = None,
        archived_through: Callable[[], int] | None = None,
        publish_archive: Callable[[], object] | None = None,
        loop: RaftLoop | None = None,
    ) -> None:
        """`loop` ticks this replica (a node shares one between its replicas);
        without one, the replica runs a loop of its own. `archived_through` says up
        to which log index the node's archive published the purged rows
        (cluster/archive/writer.py), `publish_archive` makes it publish what it
        buffers: a snapshot covers no purge the archive has not published, so that
        a crash can replay those purges from the log (None: no archive)."""
        others = _check_members(self_addr, partners, password)
        self.bucket = bucket
        self.bucket_uuid = bucket_uuid
        self.self_addr = self_addr
        self._tuning = tuning
        self.on_applied = on_applied
        """Called in the tick thread after each applied entry (outside the lock); must
        be quick. Exceptions are logged and ignored."""
        self.after_applies: Callable[[], None] | None = None
        """Called in the tick thread after each run of applies, before the same tick
        appends the entries proposed meanwhile (so a proposal made here leaves in
        this tick); must be quick. Exceptions are logged and ignored."""
        self._data_dir = Path(data_dir)
        self._lock = threading.RLock()
        self._sm = BucketStateMachine(bucket_uuid)
        self._quarantine: str | None = None
        self.retiring = False
        """Set by `retire`: this replica never takes leadership again."""
        self._counters = RaftCounters()
        self._snapshots = SnapshotFiles(bucket, bucket_uuid, self._data_dir / SNAPSHOT_FILE)
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
        self._archived_through = archived_through
        self._publish_archive = publish_archive
        self._archive_retry_s = 0.0
        self._cut_point = 0
        """How far the log may be cut once the snapshot being written is in place."""
        self._recovery = Recovery(bucket, self_addr, self._data_dir, 2 * tuning.election_max_s)

        self._data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock_data_dir()
        try:
            self._journal = self._open_journal()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._own_loop = loop is None
        self._loop = RaftLoop(f"raft-b{bucket}") if loop is None else loop
        self._node = self._start_node(others, password)
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
                self._counters.proposals_failed += 1
                reason = error if isinstance(error, str) else FAIL_NAMES.get(error, str(error))
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
                f"(outcome unknown; quorum connected: {self._node.quorum()})",
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
    def plan_mismatches(self) -> int:
        """Times this replica's own plan hash or outbox digest disagreed with a committed
        entry (each quarantined it)."""
        return self._counters.plan_mismatches

    def members(self) -> list[str]:
        """The Raft group's members as this replica sees them (sorted addresses)."""
        return self._node.member_addresses()

    def transfer_leadership(self, to: str, timeout_s: float = 2.0) -> None:
        """Ask this replica, if it leads, to hand leadership to member `to` within
        `timeout_s`: once `to` trails by at most `TRANSFER_PAUSE_LAG` entries, new
        commands wait (then go to the new leader) for up to `TRANSFER_PAUSE_S` while
        `to` takes the rest of the log, then it is sent TimeoutNow (tick thread)."""
        _check_addr(to)
        self._node.transfer.request(to, timeout_s)

    def retire(self) -> None:
        """From now on this replica never campaigns, ignores TimeoutNow and hands
        leadership away if it holds it; it still stores and acks the log. For a node
        that has drained and is about to exit: without it, another replica's leader
        balancing could hand the bucket straight back to it (seen in CI: the exiting
        node led bucket 0 and held its lease, its client port already closed)."""
        self.retiring = True

    def connectivity(self) -> Connectivity:
        """The leader this replica knows, whether it reaches a quorum, and which other
        members its transport is connected to (sorted)."""
        node = self._node
        for _ in range(3):
            with contextlib.suppress(RuntimeError):  # a set changed size under us
                connected = sorted(str(n.id) for n in node.otherNodes if node.isNodeConnected(n))
                return Connectivity(self.leader, self._node.quorum(), tuple(connected))
        return Connectivity(self.leader, False, ())

    def accept_loss(self) -> None:
        """An operator's decision after disk damage (`sevendb bucket recover
        --accept-loss`): the entries no reachable replica holds are gone; this replica
        goes on with what it holds. Taken at its next tick."""
        write_decision(self._data_dir, ACCEPT_LOSS)

    @property
    def quarantined(self) -> str | None:
        """Why this replica does not serve, or None: it stopped applying (quarantine),
        it is being repaired after disk damage, or its bucket is in DATA_LOSS."""
        return self._quarantine or self._recovery.not_serving()

    @property
    def data_loss(self) -> ReplicaUnavailable | None:
        """The DATA_LOSS refusal of this replica's bucket, as this replica sees it: no
        reachable replica holds every acknowledged entry (docs/raft.md)."""
        verdict = self._recovery.data_loss
        if verdict is None:
            return None
        return ReplicaUnavailable(verdict, reason="data_loss")

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
        has_leader, leader_commit = leader_view(node)
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
            "has_quorum": self._node.quorum(),
            "ready": self._node.ready_for_clients(),
            "epoch": epoch,
            "members": self._node.member_addresses(),
            "quarantined": self._quarantine,
            "fsyncs": journal.fsync_count,
            "group_commits": journal.sync_count,
            "snapshot_index": self._snapshots.index,
            "snapshot_bytes": self._snapshots.size,
            "log_bytes": journal.size_bytes(),
            "snapshots_written": self._snapshots.written,
            "snapshots_loaded": self._snapshots.loaded,
            "compactions_deferred": counters.compactions_deferred,
            "entry_errors": counters.entry_errors,
            "plan_mismatches": counters.plan_mismatches,
            "stale_term_acks": counters.stale_term_acks,
            "rewinds_prevented": counters.rewinds_prevented,
            "follower_regressions": counters.follower_regressions,
            "matching_entries_kept": counters.matching_entries_kept,
            "repairing": self._recovery.need is not None,
            "data_loss": self._recovery.data_loss,
            "disk_repairs": self._recovery.repairs,
            "votes_refused": self._recovery.votes_refused,
            "transfer_pauses": node.transfer.pauses,
            "late_leader_ticks": counters.late_leader_ticks,
            "followers_held": dict(node.flow.held),
            "stale_refusals": node.flow.stale_refusals,
            "has_leader": has_leader,
            "leader_commit_index": leader_commit,
            "leader_changes": counters.leader_changes,
            "proposals_failed": counters.proposals_failed,
            "compactions": counters.compactions,
            "journal_bytes_written": journal.disk_stats.bytes_written,
            # (bounds in seconds, count per bucket and one for longer, sum of seconds)
            "fsync_durations": journal.disk_stats.fsync_durations.snapshot(),
        }

    def wait_ready(self, timeout_s: float) -> bool:
        """True once a leader is known and this replica has applied what the leader
        had committed when it first heard from it (a leader: its own term's NO_OP).
        False on timeout, or at once if quarantined or closed."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._quarantine is not None or self._closed:
                return False
            if self._node.ready_for_clients():
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
        if self.on_applied is not None:
            try:
                self.on_applied(applied)
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

    def _compaction_allowed(self) -> bool:
        """May a new snapshot start? Not while quarantined or repairing (the state is
        not what the log says), nor for a while after the archive could not publish
        what the snapshot would cover (`_archive_caught_up`)."""
        return (
            self._quarantine is None
            and self._recovery.need is None
            and time.monotonic() >= self._archive_retry_s
        )

    def _write_snapshot(self, tmp_path: str, data: tuple[Any, Any, Any]) -> Callable[[], None]:
        """pysyncobj's custom serializer (serializer.py:87), called in the tick thread:
        forks a child that writes one file with the core's state as it is now and
        pysyncobj's (lastEntry, prevEntry, cluster), fsynced (`SnapshotFiles.start`).
        Returns the function `BackgroundSerializer` runs in a thread before it renames
        the file into place: it waits for the archive to have published the purges
        the snapshot covers, then for the child. The directory is fsynced before
        compaction drops log entries (RaftNode._SyncObj__deleteEntriesTo), which cuts
        the log at the core's safety point as it is now (docs/core.md: a subscriber's
        acknowledgements, the cold replica checkpoint, a migration hold point), not
        at the snapshot."""
        last, prev, cluster = data
        now_ms = int(time.time() * 1000)
        cold = cold_replica_checkpoint(
            self._node.flow.positions(self._node, now_ms, LEADER_STATE),
            now_ms,
            self._tuning.cold_replica_window_ms,
        )
        if self.cold_replica_checkpoint is not None:  # an operator's (or a test's) bound
            cold = min(self.cold_replica_checkpoint, cold or self.cold_replica_checkpoint)
        hold = self.migration_hold_point
        last_entry = (bytes(last[0]), int(last[1]), int(last[2]))
        prev_entry = (bytes(prev[0]), int(prev[1]), int(prev[2]))
        members = sorted(str(node.id) for node in cluster)
        with self._lock:
            if self._quarantine is not None:
                raise RuntimeError("quarantined replicas take no snapshots")
            core_applied = self._sm.applied_index
            if core_applied > last[1]:
                raise RuntimeError(f"core applied {core_applied} past the snapshot index {last[1]}")
            self._cut_point = self._sm.safety_point(
                now_ms, self._tuning.stall_window_ms, cold, hold
            )
            pending = self._snapshots.start(
                Path(tmp_path), self._sm.snapshot, last_entry, prev_entry, members
            )

        def after_the_archive() -> None:
            if not _archive_caught_up(
                self.bucket, self._archived_through, self._publish_archive, core_applied
            ):
                pending.abandon()
                self._archive_retry_s = time.monotonic() + self._tuning.compaction_recheck_s
                raise RuntimeError(f"the archive has not published the purges up to {core_applied}")
            pending.finish()

        return after_the_archive

    def _read_snapshot(self, path: str) -> tuple[Any, Any, Any]:
        """pysyncobj's custom deserializer (serializer.py:110): restore the core and
        return (lastEntry, prevEntry, cluster) for pysyncobj."""
        try:
            snap = self._snapshots.load(Path(path))
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
            self._snapshots.forget()
        with self._lock:
            self._sm = sm
        self._snapshots.note_loaded(snap, Path(path))
        return snap.last, snap.prev, {TCPNode(addr) for addr in snap.cluster}

    # -- helpers -----------------------------------------------------------------------

    def _start_node(self, others: list[str], password: str) -> RaftNode:
        """The pysyncobj node, bound (with retries) before it returns: it has no tick
        thread of its own. If that fails, what the constructor opened is let go."""
        conf = _syncobj_conf(
            self._tuning,
            password,
            self.self_addr,
            self._journal,
            self._snapshots.path,
            self._write_snapshot,
            self._read_snapshot,
        )
        try:
            return RaftNode(self, self.self_addr, others, conf, self._loop)
        except BaseException as exc:
            self._journal.close()
            os.close(self._lock_fd)
            if self._own_loop:
                self._loop.close()
            if isinstance(exc, SyncObjException):
                raise OSError(f"bucket {self.bucket}: cannot bind {self.self_addr}: {exc}") from exc
            raise

    def _open_journal(self) -> FailStopJournal:
        """Open the journal and judge, with the snapshot, what damage the files show
        (docs/raft.md, "Disk faults"): a snapshot the journal needs but cannot be read
        costs the whole log, which the leader then sends again."""
        journal = FailStopJournal(
            self._data_dir / JOURNAL_FILE, preallocate_bytes=self._tuning.journal_preallocate_bytes
        )
        problems, need = list(journal.problems), journal.need
        first = journal[0][1] if len(journal) else None
        last = (journal[-1][2], journal[-1][1]) if len(journal) else NOTHING
        trouble = self._snapshots.check(first)
        if trouble is not None:
            problems.append(trouble)
            if first != 1:  # the state before the journal lived in the snapshot
                claim = max(need or NOTHING, last)
                need = claim if claim != NOTHING else (journal.getCurrentTerm(), UNKNOWN_INDEX)
                journal.discard_all(need)
        self._recovery.found(problems, need, last)
        return journal

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
        data_loss = self.data_loss
        if data_loss is not None:
            raise data_loss
        repairing = self._recovery.not_serving()
        if repairing is not None:
            raise ReplicaUnavailable(
                f"bucket {self.bucket}: replica {self.self_addr} is {repairing}",
                leader_hint=self.leader,
                reason="repairing",
            )

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
            members = self._node.member_addresses()
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
                    else FAIL_NAMES.get(waiter.error, str(waiter.error))
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
