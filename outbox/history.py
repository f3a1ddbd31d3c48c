"""A bucket's retained history: the change sets it keeps so that a subscription may
start in the past and a reader may page through what changed (docs/core.md,
"Retained history"). Pure: part of the state machine's state."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from . import limits
from .emitseq import EmitSeq
from .entries import OpKind, Start, StartKind
from .errors import ErrorCode, InvalidArgument, Rejection, StaleSequence
from .model import Change, HistoryPage, HistoryTrimResult, RetainedChange, delta_bytes
from .query import Plan


class History:
    """Every change set committed after `after`, oldest first; HISTORY_TRIM drops its
    head."""

    __slots__ = ("_after", "_after_ms", "_bytes", "_kept")

    def __init__(self, after: EmitSeq, after_ms: int = 0) -> None:
        self._kept: deque[RetainedChange] = deque()
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
        return iter(self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def size(self) -> tuple[int, int]:
        """(change sets, bytes) retained."""
        return len(self._kept), self._bytes

    def record(self, kept: RetainedChange) -> None:
        """A change set just committed joins the history."""
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
            mine = tuple(c for c in kept.changes if matches(c.key))
            if mine:
                yield kept._replace(changes=mine, size_bytes=delta_bytes(mine))

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
            mine = tuple(c for c in kept.changes if plan.matches(c.key))
            if mine:
                events.append(kept._replace(changes=mine, size_bytes=delta_bytes(mine)))
        return HistoryPage(tuple(events), more, last, self._after)

    # ---- snapshots (format 3's thirteenth and fourteenth fields) -------------------

    def pack_kept(self) -> Iterator[list[Any]]:
        """Each change set as a snapshot item (iterate a `copy()` in another thread). The
        changes go as they are: msgpack packs each `Change` (a named tuple) as the
        array `Change.pack` makes, in half the time."""
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
            made = tuple(Change(k, OpKind(op), v, ver) for k, op, v, ver in changes)
            history.record(RetainedChange(EmitSeq(*emit), when, made, delta_bytes(made)))
        return history
