"""A bucket's retained history: the change sets it keeps so that a subscription may
start in the past and a reader may page through what changed (docs/core.md,
"Retained history"). Pure: part of the state machine's state."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from . import limits
from .emitseq import EmitSeq
from .entries import OP_KIND_OF, OpKind, Start, StartKind
from .errors import ErrorCode, InvalidArgument, Rejection, StaleSequence
from .model import Change, HistoryPage, HistoryTrimResult, RetainedChange, delta_bytes
from .query import Plan

_Change = tuple[str, int, bytes, int]
"""A change as the history keeps it: `(key, op, value, version)`, a tuple of atomic
values, which the garbage collector stops tracking at its first collection (a
`Change` named tuple is tracked for as long as it lives, and the history holds up
to 10,000 change sets of its bucket's recent writes: ~125k objects after
side_by_side.py's workload 1, walked by every collection of the generation they sat
in. A node's longest middle-generation collection over workloads 1 and 2 took 41-84
ms, 24-47 ms with these; docs/performance.md)."""


class _Kept(NamedTuple):
    """A change set as the history keeps it (`RetainedChange` with `_Change`s)."""

    emit_seq: EmitSeq
    commit_time_ms: int
    changes: tuple[_Change, ...]
    size_bytes: int


def _changes(kept: Iterable[_Change]) -> tuple[Change, ...]:
    return tuple([Change(k, OP_KIND_OF[op], v, ver) for k, op, v, ver in kept])


def _narrowed(kept: _Kept, matches: Callable[[str], bool]) -> RetainedChange | None:
    """`kept` with only the changes whose key `matches` (None: none does)."""
    mine = _changes([c for c in kept.changes if matches(c[0])])
    if not mine:
        return None
    return RetainedChange(kept.emit_seq, kept.commit_time_ms, mine, delta_bytes(mine))


class History:
    """Every change set committed after `after`, oldest first; HISTORY_TRIM drops its
    head."""

    __slots__ = ("_after", "_after_ms", "_bytes", "_kept")

    def __init__(self, after: EmitSeq, after_ms: int = 0) -> None:
        self._kept: deque[_Kept] = deque()
        self._bytes = 0
        """Its keys' and values' bytes (derived)."""
        self._after = after
        """The oldest position it reaches back to: everything after it is retained."""
        self._after_ms = after_ms
        """Commit time of the newest change set dropped (0: none ever was)."""

    @property
    def after(self) -> EmitSeq:
        """The oldest position the retained history reaches back to."""
        return self._after

    def __iter__(self) -> Iterator[RetainedChange]:
        """The retained change sets, oldest first."""
        for kept in self._kept:
            yield RetainedChange(
                kept.emit_seq, kept.commit_time_ms, _changes(kept.changes), kept.size_bytes
            )

    def marks(self) -> Iterator[tuple[EmitSeq, int, int]]:
        """Each retained change set's position, commit time and bytes, oldest first
        (without building its changes)."""
        for kept in self._kept:
            yield kept.emit_seq, kept.commit_time_ms, kept.size_bytes

    def __len__(self) -> int:
        return len(self._kept)

    def size(self) -> tuple[int, int]:
        """(change sets, bytes) retained."""
        return len(self._kept), self._bytes

    def record(self, kept: RetainedChange) -> None:
        """A change set just committed joins the history."""
        changes = tuple([(c[0], int(c[1]), c[2], c[3]) for c in kept.changes])
        self._keep(_Kept(kept.emit_seq, kept.commit_time_ms, changes, kept.size_bytes))

    def _keep(self, kept: _Kept) -> None:
        self._kept.append(kept)
        self._bytes += kept.size_bytes

    def trim(self, through_index: int) -> HistoryTrimResult:
        """Drop every change set at or below log index `through_index`."""
        dropped = 0
        while self._kept and self._kept[0].emit_seq.commit_index <= through_index:
            gone = self._kept.popleft()
            self._bytes -= gone.size_bytes
            self._after, self._after_ms = gone.emit_seq, gone.commit_time_ms
            dropped += 1
        return HistoryTrimResult(dropped, self._after)

    def since(self, start: EmitSeq, matches: Callable[[str], bool]) -> Iterator[RetainedChange]:
        """Each change set after `start`, narrowed to the changes `matches` (skipping
        those left empty): a subscription starting in the past replays these."""
        for kept in self._kept:
            if kept.emit_seq <= start:
                continue
            mine = _narrowed(kept, matches)
            if mine is not None:
                yield mine

    def start(self, start: Start, at: EmitSeq, applied: int) -> EmitSeq | Rejection:
        """Where a stream subscribed at `at` (applied through `applied`) starts
        (docs/core.md, "Start positions"), or why it cannot."""
        if start.kind is StartKind.LATEST:
            return at
        if start.kind is StartKind.EARLIEST:
            return self._after
        if start.kind is StartKind.TIME:
            return self._position_at(start.time_ms)
        after = start.after
        assert after is not None
        if after.bucket_uuid != at.bucket_uuid or after >= at:
            return Rejection(
                ErrorCode.INVALID_ARGUMENT,
                f"start position {after} is not one of this bucket's log "
                f"({at.bucket_uuid}, applied through {applied})",
            )
        if after < self._after:
            return Rejection(
                ErrorCode.STALE_SEQUENCE,
                f"start position {after} is older than the retained history (it reaches "
                f"back to {self._after})",
            )
        return after

    def _position_at(self, time_ms: int) -> EmitSeq | Rejection:
        """The position just before the first change set committed at or after
        `time_ms`, or why the history no longer reaches back that far."""
        if self._after.commit_index and time_ms <= self._after_ms:
            return Rejection(
                ErrorCode.STALE_SEQUENCE,
                f"changes from {time_ms} ms on are no longer retained (the history "
                f"reaches back to {self._after}, committed at {self._after_ms} ms)",
            )
        before = self._after
        for kept in self._kept:
            if kept.commit_time_ms >= time_ms:
                break
            before = kept.emit_seq
        return before

    def page(
        self, plan: Plan, after: EmitSeq | None, through: int | None, limit: int
    ) -> HistoryPage:
        """Up to `limit` (clamped as Sync's) retained change sets after `after` (None:
        the oldest retained) and at or below log index `through` (None: all), each
        with the changes `plan` matches. Raises `StaleSequence` for a position older
        than the history reaches, `InvalidArgument` for one not of this bucket."""
        limit = min(limit if limit > 0 else limits.SYNC_LIMIT_DEFAULT, limits.SYNC_LIMIT_MAX)
        start = self._after if after is None else after
        if start.bucket_uuid != self._after.bucket_uuid:
            raise InvalidArgument(f"{start} is not a position of bucket {self._after.bucket_uuid}")
        if start < self._after:
            raise StaleSequence(
                f"{start} is older than the retained history (it reaches back to "
                f"{self._after}); read the current state with Sync instead"
            )
        events: list[RetainedChange] = []
        last, more = start, False
        for kept in self._kept:
            if kept.emit_seq <= start:
                continue
            if through is not None and kept.emit_seq.commit_index > through:
                break
            if len(events) == limit:
                more = True
                break
            last = kept.emit_seq
            mine = _narrowed(kept, plan.matches)
            if mine is not None:
                events.append(mine)
        return HistoryPage(tuple(events), more, last, self._after)

    # ---- snapshots (format 3's thirteenth and fourteenth fields) -------------------

    def pack_kept(self) -> Iterator[list[Any]]:
        """Each change set as a snapshot item (iterate a `copy()` in another thread). The
        changes go as they are kept: msgpack packs each as the array `Change.pack`
        makes, in half the time."""
        for kept in self._kept:
            yield [kept.emit_seq.pack(), kept.commit_time_ms, kept.changes]

    def pack_reach(self) -> list[Any]:
        return [self._after.pack(), self._after_ms]

    def copy(self) -> History:
        """A shallow copy (its change sets are immutable): for snapshots taken later."""
        other = History(self._after, self._after_ms)
        other._kept = self._kept.copy()
        other._bytes = self._bytes
        return other

    @classmethod
    def unpack(cls, kept: list[Any], reach: list[Any]) -> History:
        after, after_ms = reach
        history = cls(EmitSeq(*after), after_ms)
        for emit, when, changes in kept:
            made = tuple([(k, int(OpKind(op)), v, ver) for k, op, v, ver in changes])
            history._keep(_Kept(EmitSeq(*emit), when, made, delta_bytes(made)))
        return history
