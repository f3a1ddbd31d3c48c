"""Snapshot-then-stream handover: a query's current state, then the changes after it,
with no gap and no duplicate in between (docs/emission.md, "Start positions and
history"). For a subscription that cannot start where it wanted (older than the
retained history: STALE_SEQUENCE), or that wants the state first.

The order makes it exact. The subscription is made first: its stream starts right
after its SUBSCRIBE (position S) and carries every change committed after S. Then the
state is read with paged Syncs: each key as it was at some point at or after S (a
key changed while paging moves to a later page, ordered by modification, and is read
again there). So every change after S reaches the application, either in the state
read or as an event, and a change of key K committed at log index E is in the state
read exactly when the record read for K was last changed at E or later. `fresh`
keeps the changes of an event that are not: apply the state read, then each event's
fresh changes, and the application's state is the bucket's, each change taken once.
Pure: no I/O (tests/test_purity.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sevendb.outbox.model import Change


class Handover:
    """Which changes of a stream the state read already holds (see the module
    docstring). `synced` is `(key, mod_commit_index)` of every record read."""

    def __init__(self, synced: Iterable[tuple[str, int]], *, stale_start: bool = False) -> None:
        self._read: dict[str, int] = dict(synced)
        self.stale_start = stale_start
        """`sync_then_subscribe(query, start=...)` only: the start was older than the
        retained history, so the state was read instead of the history replayed."""

    def fresh(self, commit_index: int, changes: Sequence[Change]) -> tuple[Change, ...]:
        """The changes of an event committed at `commit_index` that the state read does
        not hold yet (all of them for a key it did not read)."""
        read = self._read
        return tuple(c for c in changes if commit_index > read.get(c.key, -1))


__all__ = ["Handover"]
