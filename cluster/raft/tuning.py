"""`RaftTuning`: pysyncobj's timing, batching and compaction settings, with the
measured defaults (docs/raft.md, "Tuning"), and `compaction_due`, the trigger of a
snapshot. A node reads overrides from `SEVENDB_RAFT_<FIELD>`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sevendb.outbox import limits

__all__ = ["RaftTuning", "SnapshotTurn", "compaction_due", "snapshot_wait_s"]


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
    follower_entries_in_flight_max: int = 8192
    """A leader sends a follower nothing new while this many entries it sent are not
    acknowledged (flow control: a follower catching up does not take the leader's
    memory and sending time from the others; docs/raft.md)."""
    follower_bytes_buffered_max: int = 16 * 1024 * 1024
    """... or while this many bytes for it wait in the leader's send buffer."""
    follower_stalled_warn_s: float = 10.0
    """A leader logs a WARNING (at most this often per follower) when a follower that
    lacks entries has acknowledged nothing for this long, with what the leader knows
    of it (docs/raft.md, "Flow control")."""
    cold_replica_window_ms: int = 60_000
    """A follower heard from within this long keeps the leader's log from being
    compacted past what it holds (the cold replica checkpoint of docs/contract.md
    §8), so that it catches up from the log; one silent longer gets a snapshot."""
    compaction_min_entries: int = 5000
    compaction_min_log_bytes: int = 16 * 1024 * 1024
    """... or this many bytes (0: entries only). An entry can carry hundreds of
    batched writes, up to `limits.ENTRY_BYTES_MAX`: counted by entries alone, 5,000 of
    them may hold gigabytes of log, which a replica keeps in memory (in
    side_by_side.py's workload 1 they held ~40 MB while the last snapshot was 1.4 MB)."""
    compaction_log_ratio: float = 1.0
    """A snapshot is due once the log holds more than `compaction_min_entries` entries
    or `compaction_min_log_bytes` bytes, *and* at least this many times the last
    snapshot's bytes (0: entries alone, as pysyncobj does). A snapshot costs CPU in
    proportion to the state; counting entries alone, a large state is rewritten every
    few seconds under load (300k keys: ~50 MB, 0.5-0.9 s of CPU per replica every
    5,000 entries), this way only after as many bytes were written. The log then
    holds at most about the state's size again."""
    compaction_min_time_s: float = 300.0
    compaction_recheck_s: float = 1.0
    """After the archive could not publish what a snapshot would cover, wait this long
    before the next snapshot."""
    snapshot_stagger_s: float = 1.0
    """A replica whose snapshot is due starts it this long times its rank among the
    group's members (sorted addresses) later. The replicas of a group reach the same
    log index together, so they all found their snapshot due at once: three threads
    packing a large state in three processes (0.5-1 s of CPU each at 37 MB) took
    both cores of a 2-core host, and writes on every node waited for them (p99 141-179 ms
    at 500 writes/s; docs/performance.md, "Writes stalled behind snapshots"). One
    at a time, a majority of the group is never slowed by its own snapshot. 0: all
    at once, as pysyncobj does."""
    snapshot_chunk_bytes: int = 64 * 1024
    journal_preallocate_bytes: int = 1024 * 1024
    """The journal grows by this many zero bytes at a time instead of with each
    append, so that the fdatasync of a batch writes its records only, not the file's
    new size too (docs/raft.md, "Files"). 0: it grows with each append."""
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
        if self.compaction_min_log_bytes < 0:
            raise ValueError("compaction_min_log_bytes must be >= 0")
        if not self.snapshot_stagger_s >= 0:
            raise ValueError("snapshot_stagger_s must be >= 0")
        if not self.compaction_log_ratio >= 0:
            raise ValueError("compaction_log_ratio must be >= 0")
        if self.cold_replica_window_ms < 0:
            raise ValueError("cold_replica_window_ms must be >= 0")
        if self.follower_entries_in_flight_max < 1 or self.follower_bytes_buffered_max < 1:
            raise ValueError("follower flow-control bounds must be positive")
        if not self.follower_stalled_warn_s > 0:
            raise ValueError("follower_stalled_warn_s must be positive")
        if self.append_batch_bytes <= 0 or self.snapshot_chunk_bytes <= 0:
            raise ValueError("batch sizes must be positive")
        if self.journal_preallocate_bytes < 0:
            raise ValueError("journal_preallocate_bytes must be >= 0")
        if self.bind_retries < 1 or self.bind_retry_s <= 0:
            raise ValueError("bind_retries >= 1 and bind_retry_s > 0")


def compaction_due(
    tuning: RaftTuning, *, entries: int, log_bytes: int, snapshot_bytes: int, since_last_s: float
) -> bool:
    """Whether a replica should start a snapshot (and then drop its log up to it):
    after `compaction_min_time_s`, or once the log has more than
    `compaction_min_entries` entries or `compaction_min_log_bytes` bytes, and at least
    `compaction_log_ratio` times the last snapshot's bytes."""
    if since_last_s > tuning.compaction_min_time_s:
        return True
    grown = entries > tuning.compaction_min_entries or (
        0 < tuning.compaction_min_log_bytes <= log_bytes
    )
    return grown and log_bytes >= tuning.compaction_log_ratio * snapshot_bytes


def snapshot_wait_s(tuning: RaftTuning, members: Sequence[str], me: str) -> float:
    """How long a replica waits, once its snapshot is due, before it starts it:
    `snapshot_stagger_s` times its rank among the sorted `members` (0 for the first,
    or when `me` is not among them)."""
    ranked = sorted(members)
    return tuning.snapshot_stagger_s * (ranked.index(me) if me in ranked else 0)


class SnapshotTurn:
    """A replica's turn to start a snapshot that is due: once its wait since the
    snapshot became due (`snapshot_wait_s`) is over, so that the group's replicas,
    which find it due at the same log index, write their snapshots one after
    another rather than all at once."""

    __slots__ = ("due_s",)

    def __init__(self) -> None:
        self.due_s: float | None = None
        """When a snapshot was first found due and not yet started."""

    def come(self, tuning: RaftTuning, members: Sequence[str], me: str, now: float) -> bool:
        if self.due_s is None:
            self.due_s = now
        return now - self.due_s >= snapshot_wait_s(tuning, members, me)

    def reset(self) -> None:
        """None is due (any more), or one started."""
        self.due_s = None
