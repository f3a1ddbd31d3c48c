"""A simulated Raft group for one bucket, with its storage: simple, but honest about
what matters here (docs/sim.md has the details).

Members keep a log of `(term, bytes)` with a durable prefix, a snapshot, and apart
from the log the index they acknowledged; a leader counts only durable entries, votes
go to up-to-date logs, a crash loses the unflushed tail. A member that restarts with
less than it acknowledged (`Damage`: a corrupt record, a lost tail, a lost snapshot)
neither votes nor stands nor counts until a leader repaired it; a group that can no
longer elect a leader holding every committed entry refuses (`RaftGroup.data_loss`).
Message passing is collapsed into steps the simulation schedules from its seed
(`replicate`, `flush`, `campaign`): delay and loss are "not yet", partitions "cannot".
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Final

from sevendb.outbox.errors import EntryError, PlanMismatch, ReplicaDivergence, SnapshotError
from sevendb.outbox.query import Planner, plan_query
from sevendb.outbox.replica import ApplyOutcome
from sevendb.outbox.state import BucketStateMachine

NOOP: Final = b""
REPLICATE_CHUNK_MAX: Final = 8
"""Most entries one AppendEntries step carries."""
LOST_TAIL_MAX: Final = 12
"""Most acknowledged records a `Damage.LOST_TAIL` takes."""


class Role(Enum):
    FOLLOWER = "follower"
    LEADER = "leader"


class Damage(Enum):
    """What a member finds wrong with its storage when it restarts."""

    CORRUPT_RECORD = "corrupt_log"
    """A record of the acknowledged log fails its checksum (valid ones may follow):
    the member keeps the log before it."""
    LOST_TAIL = "lose_log_tail"
    """The last acknowledged records are gone (a truncated journal)."""
    LOST_SNAPSHOT = "lose_snapshot"
    """The snapshot is missing or fails its checksum. With a log that starts after
    it, the state cannot be rebuilt: the member starts empty."""


class RaftSafetyError(AssertionError):
    """The simulated Raft broke one of its own guarantees (a simulator bug)."""


@dataclass(slots=True)
class LogEntry:
    term: int
    data: bytes


ApplyHook = Callable[["Member", int, bytes, "ApplyOutcome | None"], None]
"""(member, raft index, entry bytes, outcome): None for a no-op or an installed snapshot."""


class Member:
    """One member of the bucket's group: log, durable prefix, snapshot, state machine."""

    def __init__(
        self,
        name: str,
        bucket_uuid: str,
        planner: Planner = plan_query,
        sm_class: type[BucketStateMachine] = BucketStateMachine,
    ) -> None:
        self.name = name
        self.sm_class = sm_class
        """The state machine's class (a broken variant's, `Bugs.deliver_before_marker`)."""
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
        self.acked_mark = 0
        """The highest index this member acknowledged, kept apart from the log."""
        self.repair_through = 0
        """Damaged: it acknowledged entries through here and lost some (0: intact)."""
        self.snap_index = 0
        self.snap_term = 0
        self.snap_data: bytes | None = None
        # Volatile.
        self.role = Role.FOLLOWER
        self.commit = 0
        self.applied = 0
        self.sm = sm_class(bucket_uuid, planner=planner)
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

    def entry_at(self, index: int) -> tuple[int, bytes] | None:
        """(term, data) at `index` if the log holds it."""
        if self.base < index <= self.last_index:
            found = self.entry(index)
            return found.term, found.data
        return None

    @property
    def usable(self) -> bool:
        """Alive, not quarantined (a paused member is usable but does nothing)."""
        return self.alive and not self.quarantined

    @property
    def damaged(self) -> bool:
        return self.repair_through > 0

    def active(self, now_ms: int) -> bool:
        return self.usable and now_ms >= self.paused_until_ms

    # ---- local operations --------------------------------------------------------

    def append(self, data: bytes) -> int:
        assert self.role is Role.LEADER
        self.entries.append(LogEntry(self.term, data))
        return self.last_index

    def _set_durable(self, index: int) -> None:
        self.durable = index
        if not self.damaged:
            self.acked_mark = index

    def flush(self) -> None:
        self._set_durable(self.last_index)
        self.durable_commit = max(self.durable_commit, min(self.commit, self.durable))

    def truncate_after(self, index: int) -> None:
        """Drop entries after `index` (a divergent, uncommitted suffix)."""
        if index < self.commit:
            raise RaftSafetyError(
                f"{self.name}: truncating after {index} would drop committed {self.commit}"
            )
        del self.entries[max(0, index - self.base) :]
        self._set_durable(min(self.durable, index))

    def apply_committed(self, hook: ApplyHook) -> None:
        """Apply every committed entry not applied yet, in order, as `cluster/raft`
        applies them: an entry the core cannot apply is an error outcome (every
        member rejects it alike), a divergence quarantines this member."""
        while self.applied < self.commit and self.alive and not self.quarantined:
            index = self.applied + 1
            data = self.entry(index).data
            outcome: ApplyOutcome | None = None
            if data != NOOP:
                try:
                    outcome = ApplyOutcome(index, self.sm.apply(index, data), None)
                except EntryError as exc:
                    outcome = ApplyOutcome(index, None, f"{type(exc).__name__}: {exc}")
                except ReplicaDivergence as exc:
                    self.quarantine(f"log index {index}: {type(exc).__name__}: {exc}")
                    return
            self.applied = index
            hook(self, index, data, outcome)

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

    def restart(
        self, now_ms: int, rng: random.Random, hook: ApplyHook, damage: Damage | None = None
    ) -> str:
        """Rebuild the state machine from the snapshot plus the durable committed log,
        after `damage` to the storage if any. Returns what the damage did ('' if
        nothing: there was nothing of that kind to damage)."""
        self.alive = True
        self.paused_until_ms = 0
        self.leader_hint = ""
        self.last_heard_ms = now_ms
        self.election_timeout_ms = rng.randint(150, 300)
        found = "" if damage is None else self._damage(damage, rng)
        if self.last_index < self.acked_mark:
            self.repair_through = self.acked_mark  # it lost what it acknowledged
        self.durable = min(self.durable, self.last_index)
        self.commit = min(max(self.durable_commit, self.snap_index), self.last_index)
        self._load_snapshot()
        if not self.quarantined:
            self.apply_committed(hook)
        return found

    def _damage(self, damage: Damage, rng: random.Random) -> str:
        acked = self.durable
        if damage is Damage.LOST_SNAPSHOT:
            if self.snap_data is None:
                return ""
            lost = f"snapshot at {self.snap_index} lost"
            self.snap_index = self.snap_term = 0
            self.snap_data = None
            if self.base == 0:
                return lost + "; the log from index 1 rebuilds the state"
            self.base, self.entries = 0, []
            return lost + f"; the log starts after it: the state is gone ({acked} acknowledged)"
        low = max(self.base, self.snap_index)  # the snapshot covers what is below
        if acked <= low:
            return ""
        if damage is Damage.CORRUPT_RECORD:
            bad = rng.randint(low + 1, acked)
            del self.entries[bad - 1 - self.base :]
            return f"record {bad} of {acked} acknowledged fails its checksum"
        keep = acked - rng.randint(1, min(LOST_TAIL_MAX, acked - low))
        del self.entries[keep - self.base :]
        return f"records {keep + 1}..{acked} (acknowledged) lost"

    def _load_snapshot(self) -> None:
        self.applied = self.snap_index
        if self.snap_data is None:
            self.sm = self.sm_class(self.bucket_uuid, planner=self.planner)
            return
        try:
            self.sm = self.sm_class.restore(self.snap_data, planner=self.planner)
        except (PlanMismatch, SnapshotError) as exc:
            self.quarantine(f"restoring snapshot at {self.snap_index}: {exc}")

    def compact(self, now_ms: int, stall_window_ms: int) -> int | None:
        """Snapshot the applied state; truncate the log prefix, never past the safety
        point (docs/core.md). Returns the new log start, or None if nothing changed."""
        if self.applied <= self.snap_index:
            return None
        term = self.term_at(self.applied)
        assert term is not None
        self.snap_index, self.snap_term = self.applied, term
        self.snap_data = self.sm.snapshot()
        # The snapshot is written and fsynced: what it covers is durable.
        self._set_durable(max(self.durable, self.snap_index))
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
        self._set_durable(index)
        self.durable_commit = index
        self.commit = max(self.commit, index)
        self._load_snapshot()
        if not self.quarantined:
            hook(self, index, b"", None)


class RaftGroup:
    """The members of one bucket's group and the Raft steps between them."""

    def __init__(
        self,
        bucket_uuid: str,
        names: tuple[str, ...],
        rng: random.Random,
        planners: dict[str, Planner] | None = None,
        *,
        damaged_votes: bool = False,
        sm_class: type[BucketStateMachine] = BucketStateMachine,
    ) -> None:
        planners = planners or {}
        self.rng = rng
        self.members: dict[str, Member] = {
            name: Member(name, bucket_uuid, planners.get(name, plan_query), sm_class)
            for name in names
        }
        for member in self.members.values():
            member.election_timeout_ms = rng.randint(150, 300)
        self.majority = len(names) // 2 + 1
        self.damaged_votes = damaged_votes
        """A broken variant: damaged members vote (with the log they have left)."""
        self.elections = 0
        self.truncations = 0
        self.snapshot_installs = 0
        self.repairs = 0

    def names(self) -> tuple[str, ...]:
        return tuple(self.members)

    def leaders(self) -> list[Member]:
        return [m for m in self.members.values() if m.usable and m.role is Role.LEADER]

    def data_loss(self) -> str:
        """Why the group must refuse (DATA_LOSS), or '': no leader is up and the intact
        members (damaged ones do not vote) are no majority, so no leader holding every
        committed entry can be elected again. Only an operator can decide then."""
        damaged = sorted(m.name for m in self.members.values() if m.damaged)
        if not damaged or self.leaders():
            return ""
        intact = sorted(m.name for m in self.members.values() if not m.damaged)
        if len(intact) >= self.majority:
            return ""
        return (
            f"DATA_LOSS: no majority of replicas can show it holds every committed entry "
            f"(damaged: {', '.join(damaged)}; intact: {', '.join(intact) or 'none'})"
        )

    # ---- elections ---------------------------------------------------------------

    def campaign(
        self, candidate: Member, now_ms: int, reachable: Callable[[str, str], bool]
    ) -> bool:
        """`candidate` timed out: it asks every reachable member for a vote. A damaged
        member does not stand (it lost entries it acknowledged)."""
        candidate.last_heard_ms = now_ms
        candidate.election_timeout_ms = self.rng.randint(150, 300)
        if candidate.damaged:
            return False
        candidate.term += 1
        candidate.voted_for = candidate.name
        candidate.role = Role.FOLLOWER
        votes = 1
        for voter in self.members.values():
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
            if voter.damaged and not self.damaged_votes:
                continue  # no vote until repaired: its log no longer shows what it acked
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

    def replicate(self, leader: Member, follower: Member, now_ms: int, hook: ApplyHook) -> None:
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
        self._check_repaired(leader, follower, end)
        # The follower's reply: only what it made durable counts.
        acked = min(follower.durable, follower.last_index)
        leader.match[follower.name] = max(leader.match.get(follower.name, 0), acked)
        new_commit = min(leader.commit, follower.last_index)
        if new_commit > follower.commit:
            follower.commit = new_commit
        follower.apply_committed(hook)

    def _check_repaired(self, leader: Member, follower: Member, end: int) -> None:
        """A damaged follower is repaired once it durably holds the leader's log
        through what it had acknowledged (or through the leader's whole log: entries
        it acked beyond that were never committed)."""
        if follower.damaged and min(follower.durable, end) >= min(
            follower.repair_through, leader.last_index
        ):
            follower.repair_through = 0
            follower.acked_mark = follower.durable
            self.repairs += 1

    def _match_point(self, leader: Member, follower: Member) -> int:
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

    def advance_commit(self, leader: Member) -> int:
        """Move the leader's commit index to what a majority holds durably; a damaged
        follower does not count."""
        for index in range(leader.last_index, leader.commit, -1):
            if leader.term_at(index) != leader.term:
                break
            holders = 1 if leader.durable >= index else 0
            holders += sum(
                1
                for name, m in leader.match.items()
                if m >= index and name != leader.name and not self.members[name].damaged
            )
            if holders >= self.majority:
                leader.commit = index
                break
        return leader.commit

    def confirmed(self, member: Member, now_ms: int, window_ms: int) -> bool:
        """Does `member` know its Raft view is current? A leader: a majority answered
        it within the window (check-quorum). A follower: it heard from a leader
        within the window. Shorter than any election timeout, so a deposed leader
        stops trusting its view before a successor can be elected."""
        if member.role is Role.LEADER:
            recent = sum(1 for t in member.contact_ms.values() if now_ms - t < window_ms)
            return recent + 1 >= self.majority
        return now_ms - member.last_heard_ms < window_ms and bool(member.leader_hint)

    def propose(
        self, via: Member, data: bytes, reachable: Callable[[str, str], bool], now_ms: int
    ) -> tuple[int, int] | None:
        """A request arrives at `via`; it goes to the leader `via` knows of. Returns
        the (index, term) it was appended at (not yet committed), or None."""
        if not via.active(now_ms):
            return None
        if via.role is Role.LEADER:
            return via.append(data), via.term
        leader = self.members.get(via.leader_hint)
        if (
            leader is None
            or not leader.active(now_ms)
            or leader.role is not Role.LEADER
            or not reachable(via.name, leader.name)
        ):
            return None
        return leader.append(data), leader.term
