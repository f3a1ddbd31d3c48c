"""Consumer groups, decided by each bucket's state machine (docs/core.md, "Consumer
groups").

A consumer group is a principal's durable subscription name shared by several
processes (members). Each bucket keeps, per (principal, group), its live members and
the owner of the bucket's stream: `(member, generation)`. A member joins, stays and
leaves by `GROUP_BEAT` entries; the state machine decides from the log alone:

* a beat makes its member live until `now_ms + session_timeout_ms` (or removes it,
  `leaving`); members whose time ran out by the beat's `now_ms` are removed first;
* the owner is ``sorted(live members)[slot % len(members)]``, `slot` being the
  bucket's number: so the buckets of a query are dealt round-robin over the sorted
  members, the same on every replica and in every bucket;
* the generation grows by one whenever the owner changes (to nobody, too), never
  otherwise: a `(member, generation)` pair names one term of ownership, so a deposed
  member's subscribe, reconnect or ack, which carries its old pair, is refused
  (`GROUP_FENCED`).

Time is an argument (the proposer's clock, in the entry): nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from . import limits
from .errors import ErrorCode, InvalidArgument, LimitExceeded, Rejection

SESSION_TIMEOUT_MS_DEFAULT: Final = 10_000
"""How long a member stays a member after its last beat, unless it says otherwise
(Kafka's `session.timeout.ms` is 45 s; ours is shorter: a rebalance here is a few
Raft entries)."""
SESSION_TIMEOUT_MS_MIN: Final = 100
SESSION_TIMEOUT_MS_MAX: Final = 300_000
MEMBERS_PER_GROUP_MAX: Final = 1024
"""Most live members of one group in one bucket; a join beyond it is refused."""


def _str(value: object, name: str, max_bytes: int) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty string")
    if len(value.encode()) > max_bytes:
        raise LimitExceeded(f"{name} is over {max_bytes} bytes")
    return value


def _int(value: object, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{name} must be an integer in [{lo}, {hi}], not {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class GroupBeat:
    """A member of `group` (a durable name of `principal`) joins or stays (or, with
    `leaving`, leaves) in this bucket; `slot` is the bucket's number."""

    principal: str
    group: str
    member: str
    slot: int
    session_timeout_ms: int = SESSION_TIMEOUT_MS_DEFAULT
    leaving: bool = False
    now_ms: int = 0

    def __post_init__(self) -> None:
        _str(self.principal, "principal", limits.PRINCIPAL_BYTES_MAX)
        _str(self.group, "group name", limits.ID_BYTES_MAX)
        _str(self.member, "member id", limits.ID_BYTES_MAX)
        _int(self.slot, "slot", 0, 2**32 - 1)
        _int(
            self.session_timeout_ms,
            "session_timeout_ms",
            SESSION_TIMEOUT_MS_MIN,
            SESSION_TIMEOUT_MS_MAX,
        )
        if not isinstance(self.leaving, bool):
            raise InvalidArgument("leaving must be a bool")
        _int(self.now_ms, "now_ms", 0, 2**64 - 1)

    def fields(self) -> list[object]:
        return [
            self.principal,
            self.group,
            self.member,
            self.slot,
            self.session_timeout_ms,
            self.leaving,
            self.now_ms,
        ]

    @classmethod
    def from_fields(cls, f: list[object]) -> GroupBeat:
        if len(f) != 7:
            raise InvalidArgument(f"GROUP_BEAT has {len(f)} fields, expected 7")
        return cls(*f)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class GroupResult:
    """What a beat decided: the bucket's owner (`""`: none) and its generation, and
    the live members (sorted). `error` when the beat was refused (its member was not
    added)."""

    owner: str
    generation: int
    members: tuple[str, ...]
    error: Rejection | None = None


@dataclass(slots=True)
class _Group:
    until: dict[str, int] = field(default_factory=dict)
    """member -> the time its membership runs out (its last beat + its timeout)."""
    owner: str = ""
    generation: int = 0


class GroupTable:
    """The consumer groups of one bucket (part of the replicated state)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], _Group] = {}

    def __bool__(self) -> bool:
        return bool(self._groups)

    def apply(self, beat: GroupBeat) -> GroupResult:
        key = (beat.principal, beat.group)
        group = self._groups.setdefault(key, _Group())
        for member, until in list(group.until.items()):
            if until <= beat.now_ms:
                del group.until[member]
        if beat.leaving:
            group.until.pop(beat.member, None)
        elif beat.member in group.until or len(group.until) < MEMBERS_PER_GROUP_MAX:
            group.until[beat.member] = beat.now_ms + beat.session_timeout_ms
        else:
            self._decide(group, beat.slot)
            return GroupResult(
                group.owner,
                group.generation,
                tuple(sorted(group.until)),
                Rejection(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"group {beat.group!r} has {MEMBERS_PER_GROUP_MAX} members, its most",
                ),
            )
        self._decide(group, beat.slot)
        return GroupResult(group.owner, group.generation, tuple(sorted(group.until)))

    @staticmethod
    def _decide(group: _Group, slot: int) -> None:
        members = sorted(group.until)
        owner = members[slot % len(members)] if members else ""
        if owner != group.owner:
            group.owner = owner
            group.generation += 1

    def is_group(self, principal: str, name: str) -> bool:
        """Is `name` a consumer group of `principal` here (has any member ever beaten)?"""
        return (principal, name) in self._groups

    def owner(self, principal: str, name: str) -> tuple[str, int] | None:
        """The group's `(owner, generation)` here (None: no such group)."""
        group = self._groups.get((principal, name))
        return None if group is None else (group.owner, group.generation)

    def fenced(self, principal: str, name: str, member: str, generation: int) -> str | None:
        """Why `(member, generation)` may not consume the group's stream here (None:
        it is the current owner's term)."""
        current = self.owner(principal, name)
        if current is None:
            return f"{name!r} is no consumer group of {principal!r} here"
        if current != (member, generation) or not member:
            owner, gen = current
            return (
                f"group {name!r}: member {member or '(none)'!r} at generation {generation} "
                f"does not own this bucket (owner {owner or '(none)'!r}, generation {gen})"
            )
        return None

    def refuses(self, principal: str, name: str, fence: tuple[str, int] | None) -> str | None:
        """Why a use of `principal`'s durable subscription `name` - a Subscribe,
        Reconnect or ack carrying `fence` (member, generation; None: none) - is refused
        here; None when it may go on. A name that is no group here needs no fence (and
        refuses one); a group's needs its current owner's term."""
        if not self.is_group(principal, name):
            if fence is None:
                return None
            return f"{name!r} is no consumer group of {principal!r} in this bucket"
        if fence is None:
            return f"{name!r} is a consumer group: subscribe with group={name!r}"
        return self.fenced(principal, name, *fence)

    def pack(self) -> list[Any]:
        return [
            [p, n, g.owner, g.generation, sorted(g.until.items())]
            for (p, n), g in sorted(self._groups.items())
        ]

    @classmethod
    def unpack(cls, raw: list[Any]) -> GroupTable:
        table = cls()
        for principal, name, owner, generation, until in raw:
            table._groups[principal, name] = _Group({m: t for m, t in until}, owner, generation)
        return table


__all__ = [
    "MEMBERS_PER_GROUP_MAX",
    "SESSION_TIMEOUT_MS_DEFAULT",
    "SESSION_TIMEOUT_MS_MAX",
    "SESSION_TIMEOUT_MS_MIN",
    "GroupBeat",
    "GroupResult",
    "GroupTable",
]
