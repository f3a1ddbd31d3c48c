"""A simulated Raft group for one bucket: simple, but honest about what matters here.

* Each replica has a log of `(term, bytes)` (`b""` is a Raft no-op) and a durable
  prefix; a flush makes the tail durable. A crash loses the non-durable tail and
  rebuilds the state machine from the replica's last snapshot plus its durable,
  committed log.
* A leader counts a follower only for entries the follower made durable (seed 004);
  an entry commits when a majority holds it durably and it is from the leader's
  term (or precedes such an entry).
* Elections grant votes only to candidates whose log is at least as up to date, so
  a new leader holds every committed entry; it truncates followers' divergent,
  uncommitted suffixes. Truncating a committed entry is asserted impossible.
* Replicas snapshot their state machine and truncate their log prefix (never past
  the bucket's safety point); a follower that fell behind the leader's log start
  gets the snapshot installed.

Message passing is collapsed into steps the simulation schedules from its seed
(`replicate(leader, follower)`, `flush`, `campaign`), so delays, losses and
partitions become "this step did not happen yet" or "this pair cannot talk".
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Final

from sevendb.outbox.errors import EntryError, PlanMismatch, SnapshotError
from sevendb.outbox.model import Applied
from sevendb.outbox.query import Planner, plan_query
from sevendb.outbox.state import BucketStateMachine

NOOP: Final = b""
REPLICATE_CHUNK_MAX: Final = 8
"""Most entries one AppendEntries step carries."""


class Role(Enum):
    FOLLOWER = "follower"
    LEADER = "leader"


class RaftSafetyError(AssertionError):
    """The simulated Raft broke one of its own guarantees (a simulator bug)."""


@dataclass(slots=True)
class LogEntry:
    term: int
    data: bytes


ApplyHook = Callable[["Replica", int, bytes, "Applied | None"], None]


class Replica:
    """One replica of the bucket: log, durable prefix, snapshot, state machine."""

    def __init__(self, name: str, bucket_uuid: str, planner: Planner = plan_query) -> None:
        self.name = name
        self.bucket_uuid = bucket_uuid
        self.planner = planner
        self.alive = True
        self.paused_until_ms = 0
        self.quarantined = False
        self.quarantine_reason = ""
        # Persistent (survive crashes).
        self.term = 0
        self.voted_for = ""
        self.base = 0
        """Index just before entries[0] (the log prefix up to it was compacted)."""
        self.entries: list[LogEntry] = []
        self.durable = 0
        self.durable_commit = 0
        self.snap_index = 0
        self.snap_term = 0
        self.snap_data: bytes | None = None
        # Volatile.
        self.role = Role.FOLLOWER
        self.commit = 0
        self.applied = 0
        self.sm = BucketStateMachine(bucket_uuid, planner=planner)
        self.match: dict[str, int] = {}
        self.contact_ms: dict[str, int] = {}
        """Leader: when each follower last answered it."""
        self.last_heard_ms = 0
        self.election_timeout_ms = 0
        self.leader_hint = ""

    # ---- log geometry ----------------------------------------------------------

    @property
    def last_index(self) -> int:
        return self.base + len(self.entries)

    def term_at(self, index: int) -> int | None:
        if index == 0:
            return 0
        if self.base < index <= self.last_index:
            return self.entries[index - self.base - 1].term
        if index == self.snap_index:
            return self.snap_term
        return None

    @property
    def last_term(self) -> int:
        term = self.term_at(self.last_index)
        assert term is not None
        return term

    def entry(self, index: int) -> LogEntry:
        return self.entries[index - self.base - 1]

    @property
    def usable(self) -> bool:
        """Alive, not quarantined (a paused replica is usable but does nothing)."""
        return self.alive and not self.quarantined

    def active(self, now_ms: int) -> bool:
        return self.usable and now_ms >= self.paused_until_ms

    # ---- local operations --------------------------------------------------------

    def append(self, data: bytes) -> int:
        assert self.role is Role.LEADER
        self.entries.append(LogEntry(self.term, data))
        return self.last_index

    def flush(self) -> None:
        self.durable = self.last_index
        self.durable_commit = max(self.durable_commit, min(self.commit, self.durable))

    def truncate_after(self, index: int) -> None:
        """Drop entries after `index` (a divergent, uncommitted suffix)."""
        if index < self.commit:
            raise RaftSafetyError(
                f"{self.name}: truncating after {index} would drop committed {self.commit}"
            )
        del self.entries[max(0, index - self.base) :]
        self.durable = min(self.durable, index)

    def apply_committed(self, hook: ApplyHook) -> None:
        """Apply every committed entry not applied yet, in order."""
        while self.applied < self.commit and self.alive and not self.quarantined:
            index = self.applied + 1
            data = self.entry(index).data
            applied: Applied | None = None
            if data != NOOP:
                try:
                    applied = self.sm.apply(index, data)
                except PlanMismatch as exc:
                    self.quarantine(str(exc))
                    return
                except EntryError:
                    applied = None
            self.applied = index
            hook(self, index, data, applied)

    def quarantine(self, reason: str) -> None:
        self.quarantined = True
        self.quarantine_reason = reason
        self.role = Role.FOLLOWER

    def crash(self) -> None:
        """Lose the volatile state and the non-durable log tail."""
        self.alive = False
        self.role = Role.FOLLOWER
        self.match = {}
        keep = max(self.durable, self.base)
        del self.entries[keep - self.base :]
        self.durable = keep

    def restart(self, now_ms: int, rng: random.Random, hook: ApplyHook) -> None:
        """Rebuild the state machine from the snapshot plus the durable committed log."""
        self.alive = True
        self.paused_until_ms = 0
        self.leader_hint = ""
        self.last_heard_ms = now_ms
        self.election_timeout_ms = rng.randint(150, 300)
        self.commit = max(self.durable_commit, self.snap_index)
        self._load_snapshot()
        if not self.quarantined:
            self.apply_committed(hook)

    def _load_snapshot(self) -> None:
        self.applied = self.snap_index
        if self.snap_data is None:
            self.sm = BucketStateMachine(self.bucket_uuid, planner=self.planner)
            return
        try:
            self.sm = BucketStateMachine.restore(self.snap_data, planner=self.planner)
        except (PlanMismatch, SnapshotError) as exc:
            self.quarantine(f"restoring snapshot at {self.snap_index}: {exc}")

    def compact(self, now_ms: int, stall_window_ms: int) -> int | None:
        """Snapshot the applied state; truncate the log prefix, never past the safety
        point (seed 000 §8). Returns the new log start, or None if nothing changed."""
        if self.applied <= self.snap_index:
            return None
        term = self.term_at(self.applied)
        assert term is not None
        self.snap_index, self.snap_term = self.applied, term
        self.snap_data = self.sm.snapshot()
        # The snapshot is written and fsynced: what it covers is durable.
        self.durable = max(self.durable, self.snap_index)
        self.durable_commit = max(self.durable_commit, self.snap_index)
        bound = min(self.applied, self.sm.safety_point(now_ms, stall_window_ms))
        if bound <= self.base:
            return None
        del self.entries[: bound - self.base]
        self.base = bound
        return bound

    def install_snapshot(self, index: int, term: int, data: bytes | None, hook: ApplyHook) -> None:
        """Replace log and state with a leader's snapshot (the follower fell behind)."""
        self.entries = []
        self.base = self.snap_index = index
        self.snap_term = term
        self.snap_data = data
        self.durable = self.durable_commit = index
        self.commit = max(self.commit, index)
        self._load_snapshot()
        if not self.quarantined:
            hook(self, index, b"", None)


class RaftGroup:
    """The replicas of one bucket and the Raft steps between them."""

    def __init__(
        self,
        bucket_uuid: str,
        names: tuple[str, ...],
        rng: random.Random,
        planners: dict[str, Planner] | None = None,
    ) -> None:
        planners = planners or {}
        self.rng = rng
        self.replicas: dict[str, Replica] = {
            name: Replica(name, bucket_uuid, planners.get(name, plan_query)) for name in names
        }
        for replica in self.replicas.values():
            replica.election_timeout_ms = rng.randint(150, 300)
        self.majority = len(names) // 2 + 1
        self.elections = 0
        self.truncations = 0
        self.snapshot_installs = 0

    def names(self) -> tuple[str, ...]:
        return tuple(self.replicas)

    def leaders(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.usable and r.role is Role.LEADER]

    # ---- elections ---------------------------------------------------------------

    def campaign(
        self, candidate: Replica, now_ms: int, reachable: Callable[[str, str], bool]
    ) -> bool:
        """`candidate` timed out: it asks every reachable replica for a vote."""
        candidate.term += 1
        candidate.voted_for = candidate.name
        candidate.role = Role.FOLLOWER
        candidate.last_heard_ms = now_ms
        candidate.election_timeout_ms = self.rng.randint(150, 300)
        votes = 1
        for voter in self.replicas.values():
            if voter is candidate or not voter.active(now_ms):
                continue
            if not reachable(candidate.name, voter.name):
                continue
            if voter.term > candidate.term:
                candidate.term = voter.term
                candidate.voted_for = ""
                return False
            if voter.term < candidate.term:
                voter.term, voter.voted_for = candidate.term, ""
                voter.role = Role.FOLLOWER
            up_to_date = (candidate.last_term, candidate.last_index) >= (
                voter.last_term,
                voter.last_index,
            )
            if up_to_date and voter.voted_for in ("", candidate.name):
                voter.voted_for = candidate.name
                voter.last_heard_ms = now_ms
                votes += 1
        if votes < self.majority:
            return False
        candidate.role = Role.LEADER
        candidate.match = {}
        candidate.contact_ms = {}
        candidate.leader_hint = candidate.name
        candidate.append(NOOP)  # commits the predecessors' entries (Raft §5.4.2)
        self.elections += 1
        return True

    # ---- replication -------------------------------------------------------------

    def replicate(self, leader: Replica, follower: Replica, now_ms: int, hook: ApplyHook) -> None:
        """One AppendEntries (or InstallSnapshot) exchange, with the follower's reply."""
        if follower.term > leader.term:
            leader.term, leader.voted_for = follower.term, ""
            leader.role = Role.FOLLOWER
            return
        if follower.term < leader.term:
            follower.term, follower.voted_for = leader.term, ""
        follower.role = Role.FOLLOWER
        follower.last_heard_ms = now_ms
        follower.leader_hint = leader.name
        leader.contact_ms[follower.name] = now_ms

        match = self._match_point(leader, follower)
        if match < leader.base:
            # The leader compacted what the follower needs next: install its snapshot.
            follower.install_snapshot(leader.snap_index, leader.snap_term, leader.snap_data, hook)
            self.snapshot_installs += 1
            if follower.quarantined:
                return
            match = leader.snap_index
        elif match < follower.last_index:
            follower.truncate_after(match)
            self.truncations += 1
        # Append a chunk of the leader's entries after the match point.
        end = min(leader.last_index, match + self.rng.randint(1, REPLICATE_CHUNK_MAX))
        for index in range(match + 1, end + 1):
            follower.entries.append(leader.entry(index))
        # The follower's reply: only what it made durable counts.
        acked = min(follower.durable, follower.last_index)
        leader.match[follower.name] = max(leader.match.get(follower.name, 0), acked)
        new_commit = min(leader.commit, follower.last_index)
        if new_commit > follower.commit:
            follower.commit = new_commit
        follower.apply_committed(hook)

    def _match_point(self, leader: Replica, follower: Replica) -> int:
        """The last index where both logs agree (Log Matching: same term, same prefix)."""
        index = min(leader.last_index, follower.last_index)
        while index > 0:
            mine = leader.term_at(index)
            theirs = follower.term_at(index)
            if theirs is None:
                # Compacted at the follower: covered by its snapshot, so committed.
                return index
            if mine is None:
                # Compacted at the leader and present at the follower: either it is
                # the committed entry or a divergent one; only the committed prefix
                # of the follower is known to match.
                return min(index, max(follower.commit, follower.snap_index))
            if mine == theirs:
                return index
            index -= 1
        return 0

    def advance_commit(self, leader: Replica) -> int:
        """Move the leader's commit index to what a majority holds durably."""
        for index in range(leader.last_index, leader.commit, -1):
            if leader.term_at(index) != leader.term:
                break
            holders = 1 if leader.durable >= index else 0
            holders += sum(
                1 for name, m in leader.match.items() if m >= index and name != leader.name
            )
            if holders >= self.majority:
                leader.commit = index
                break
        return leader.commit

    def confirmed(self, replica: Replica, now_ms: int, window_ms: int) -> bool:
        """Does `replica` know its Raft view is current? A leader: a majority answered
        it within the window (check-quorum). A follower: it heard from a leader
        within the window. Shorter than any election timeout, so a deposed leader
        stops trusting its view before a successor can be elected."""
        if replica.role is Role.LEADER:
            recent = sum(1 for t in replica.contact_ms.values() if now_ms - t < window_ms)
            return recent + 1 >= self.majority
        return now_ms - replica.last_heard_ms < window_ms and bool(replica.leader_hint)

    def propose(
        self, via: Replica, data: bytes, reachable: Callable[[str, str], bool], now_ms: int
    ) -> int | None:
        """A client request arrives at `via`; it goes to the leader `via` knows of.
        Returns the log index it was appended at (not yet committed), or None."""
        if not via.active(now_ms):
            return None
        if via.role is Role.LEADER:
            return via.append(data)
        leader = self.replicas.get(via.leader_hint)
        if (
            leader is None
            or not leader.active(now_ms)
            or leader.role is not Role.LEADER
            or not reachable(via.name, leader.name)
        ):
            return None
        return leader.append(data)
