"""The replica contract (`sevendb.outbox.replica.Replica`) over a simulated Raft
member, as `cluster/raft` offers it over pysyncobj, so the production notifier host
runs unchanged against the simulated group.

`submit` appends through the leader the member knows and returns a future that
settles when this member applies that index: with the outcome if the entry there
is the one proposed, failed if another entry took the index. `read` refuses on a
member that is down, quarantined, damaged (it must not serve what it may have
lost) or in a group that refuses with DATA_LOSS. `is_leader` holds only while a
majority answered the leader recently (check-quorum), so a deposed leader stops
emitting before a successor is elected; a broken variant turns that off. Another,
`SpeculativeReplica`, lets `read` see entries appended and not yet committed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Final, TypeVar

from sevendb.outbox.errors import EntryError, ReplicaDivergence
from sevendb.outbox.replica import ApplyOutcome, Connectivity, ReplicaUnavailable
from sevendb.outbox.state import BucketStateMachine

from .raft import NOOP, Member, RaftGroup, Role

T = TypeVar("T")

CONFIRM_MS: Final = 140
"""A Raft view confirmed this recently is current (below the smallest election
timeout, 150 ms)."""


class SimReplica:
    """One member, as the notifier host and the simulated service use it."""

    bucket: Final = 0

    def __init__(
        self,
        member: Member,
        group: RaftGroup,
        clock_ms: Callable[[], int],
        reachable: Callable[[str, str], bool],
        *,
        fenced: bool = True,
        on_propose: Callable[[str, int, bytes], None] | None = None,
    ) -> None:
        """`on_propose(member, index, entry)` sees every proposal the leader took;
        `fenced=False` is a broken variant (no check-quorum)."""
        self.member = member
        self._group = group
        self._clock_ms, self._reachable = clock_ms, reachable
        self._fenced = fenced
        """False: a broken variant that trusts its role without check-quorum."""
        self._on_propose = on_propose
        self._pending: dict[int, list[tuple[int, bytes, Future[ApplyOutcome]]]] = {}
        """Index -> (term, entry, future) of this member's proposals not applied yet."""

    @property
    def bucket_uuid(self) -> str:
        return self.member.bucket_uuid

    @property
    def self_addr(self) -> str:
        return self.member.name

    @property
    def is_leader(self) -> bool:
        member = self.member
        if member.role is not Role.LEADER or not member.usable:
            return False
        return not self._fenced or self._group.confirmed(member, self._clock_ms(), CONFIRM_MS)

    @property
    def quarantined(self) -> str | None:
        return self.member.quarantine_reason if self.member.quarantined else None

    def connectivity(self) -> Connectivity:
        """The leader it knows, whether its view is current (a damaged member counts
        towards no quorum), and the members its transport reaches."""
        member, group = self.member, self._group
        now = self._clock_ms()
        leader = member.leader_hint or None
        quorum = not member.damaged and (
            not self._fenced or group.confirmed(member, now, CONFIRM_MS)
        )
        connected = tuple(
            name
            for name, other in group.members.items()
            if other is not member and other.alive and self._reachable(member.name, name)
        )
        return Connectivity(leader, quorum, connected)

    def _refuse_if_unavailable(self) -> None:
        member = self.member
        lost = self._group.data_loss()
        if lost:
            raise ReplicaUnavailable(f"bucket {self.bucket_uuid}: {lost}", reason="DATA_LOSS")
        if not member.alive:
            raise ReplicaUnavailable(f"{member.name} is down", reason="closed")
        if member.quarantined:
            raise ReplicaUnavailable(
                f"{member.name} is quarantined ({member.quarantine_reason})", reason="quarantined"
            )
        if member.damaged:
            raise ReplicaUnavailable(
                f"{member.name} lost acknowledged entries through {member.repair_through}; "
                "it serves nothing until a leader repairs it",
                leader_hint=member.leader_hint or None,
                reason="damaged",
            )

    def read(self, fn: Callable[[BucketStateMachine], T]) -> T:
        self._refuse_if_unavailable()
        return fn(self.member.sm)

    def submit(self, entry: bytes) -> Future[ApplyOutcome]:
        """Replicate `entry` through the leader this member knows; the future settles
        when this member applies its index."""
        if self._group.data_loss() or not self.member.alive or self.member.quarantined:
            self._refuse_if_unavailable()
        placed = self._group.propose(self.member, entry, self._reachable, self._clock_ms())
        if placed is None:
            raise ReplicaUnavailable(
                f"{self.member.name}: no leader reachable",
                leader_hint=self.member.leader_hint or None,
                reason="MISSING_LEADER",
            )
        index, term = placed
        future: Future[ApplyOutcome] = Future()
        self._pending.setdefault(index, []).append((term, entry, future))
        if self._on_propose is not None:
            self._on_propose(self.member.name, index, entry)
        return future

    def on_apply(self, index: int, outcome: ApplyOutcome | None) -> None:
        """This member applied `index` (or installed a snapshot through it): settle
        the proposals waiting for it, and fail those it skipped."""
        if not self._pending:
            return
        found = self.member.entry_at(index)
        for waited in sorted(i for i in self._pending if i <= index):
            for term, entry, future in self._pending.pop(waited):
                if waited == index and found == (term, entry) and outcome is not None:
                    future.set_result(outcome)
                elif waited == index and found is not None:
                    future.set_exception(
                        ReplicaUnavailable("another entry took the index", reason="LEADER_CHANGED")
                    )
                else:  # a snapshot install skipped it
                    future.set_exception(
                        ReplicaUnavailable("outcome unknown", reason="UNKNOWN_OUTCOME")
                    )


class SpeculativeReplica(SimReplica):
    """A broken variant (`Bugs.send_before_commit`): `read` shows the state as it will
    be once the member's whole log applies, entries not yet committed included, as a
    holder that computed and sent rows ahead of commit would see it."""

    _ahead: tuple[tuple[int, int, int, int], BucketStateMachine] | None = None
    """The speculative state, and the member's (state, applied, last index, last term)
    it was built from."""

    def read(self, fn: Callable[[BucketStateMachine], T]) -> T:
        self._refuse_if_unavailable()
        return fn(self._speculative())

    def _speculative(self) -> BucketStateMachine:
        member = self.member
        if member.last_index <= member.applied:
            return member.sm
        key = (id(member.sm), member.applied, member.last_index, member.last_term)
        if self._ahead is not None and self._ahead[0] == key:
            return self._ahead[1]
        sm = BucketStateMachine.restore(member.sm.snapshot(), planner=member.planner)
        for index in range(member.applied + 1, member.last_index + 1):
            data = member.entry(index).data
            if data != NOOP:
                try:
                    sm.apply(index, data)
                except (EntryError, ReplicaDivergence):
                    break
        self._ahead = (key, sm)
        return sm
