"""The replica contract: what one member of a bucket's Raft group offers the layers
above it (the notifier host, the gRPC service, the simulator), the outcome of
applying an entry, and why a replica refused a request.

`sevendb.cluster.raft` implements it over pysyncobj; the simulator implements it
over a simulated log. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from .model import Applied
from .state import BucketStateMachine

if TYPE_CHECKING:
    from concurrent.futures import Future

__all__ = [
    "ApplyOutcome",
    "Connectivity",
    "MembershipChangeInProgress",
    "Replica",
    "ReplicaUnavailable",
]

T = TypeVar("T")


@dataclass(frozen=True)
class ApplyOutcome:
    """What applying one committed entry produced on this replica.

    ``error`` is set (and ``applied`` is None) when the entry was malformed: every
    replica rejected it identically, nothing changed, and the group moved on.
    """

    commit_index: int
    applied: Applied | None
    error: str | None


@dataclass(frozen=True)
class Connectivity:
    leader: str | None
    quorum: bool
    connected: tuple[str, ...]


class ReplicaUnavailable(Exception):
    """This replica cannot serve the request now: not leader, no quorum, quarantined,
    closed, or the proposal timed out. ``leader_hint`` names the last known leader.

    ``reason`` is a short machine-readable tag: ``timeout`` (the outcome is unknown: the
    entry may still commit), ``quarantined``, ``closed``, or a pysyncobj failure name
    (``MISSING_LEADER``, ``NOT_LEADER``, ``LEADER_CHANGED``, ``DISCARDED``,
    ``QUEUE_FULL``, ``REQUEST_DENIED``, ``UNKNOWN_OUTCOME``).
    """

    def __init__(self, message: str, *, leader_hint: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.leader_hint = leader_hint
        self.reason = reason


class MembershipChangeInProgress(ReplicaUnavailable):
    """Another membership change is still uncommitted; retry when it has committed."""


class Replica(Protocol):
    """One member of a bucket's Raft group, as the notifier host uses it."""

    @property
    def bucket(self) -> int: ...

    @property
    def bucket_uuid(self) -> str: ...

    @property
    def self_addr(self) -> str:
        """This member's Raft address: its name in lease entries."""
        ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def quarantined(self) -> str | None:
        """Why this replica stopped applying, or None."""
        ...

    def connectivity(self) -> Connectivity: ...

    def read(self, fn: Callable[[BucketStateMachine], T]) -> T:
        """Run `fn` on the applied state, consistently (under the apply lock)."""
        ...

    def submit(self, entry: bytes) -> Future[ApplyOutcome]:
        """Replicate `entry` without blocking; the future resolves once it is committed
        and applied here, or fails with `ReplicaUnavailable`."""
        ...
