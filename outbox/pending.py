"""Rows computed and not yet checkpointed: each source entry's rows wait here until
an OUTBOX_WRITE covering them commits with their count and digest (docs/emission.md).
Pure: part of the state machine's state (outbox/state.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import xxhash

from .emitseq import EmitSeq
from .entries import OutboxWrite
from .errors import ErrorCode, PlanMismatch, Rejection
from .model import Delta, OutboxRow
from .subscriptions import SubscriptionTable, unpack_row

_DIGESTS_KEPT: Final = 16
"""Ranges a replica remembers the digest of: more than a holder pipelines."""

_ROW_HEADER: Final = b"\x94"
"""msgpack's header of a 4-element array (an `OutboxRow.pack()`)."""


def rows_digest(rows: Iterator[OutboxRow] | tuple[OutboxRow, ...]) -> tuple[int, int]:
    """(row count, xxh64 over the canonical encoding of `rows`), as OUTBOX_WRITE carries."""
    hasher = xxhash.xxh64()
    count = 0
    # The rows of one source entry share its EmitSeq and usually its Delta: each is
    # encoded once (the object is kept with its encoding, so its id is not reused).
    encoded: dict[int, tuple[object, bytes]] = {}

    def encode(part: EmitSeq | Delta) -> bytes:
        hit = encoded.get(id(part))
        if hit is None or hit[0] is not part:
            hit = encoded[id(part)] = (part, msgpack.packb(part.pack(), use_bin_type=True))
        return hit[1]

    for row in rows:
        # Exactly the bytes of packb(row.pack()): a 4-array header, then its items.
        hasher.update(_ROW_HEADER)
        hasher.update(msgpack.packb(row.sub_id, use_bin_type=True))
        hasher.update(encode(row.emit_seq))
        hasher.update(encode(row.prev_emit_seq))
        hasher.update(encode(row.delta))
        count += 1
    return count, hasher.intdigest()


@dataclass(frozen=True, slots=True)
class PendingBatch:
    """The rows of one source entry not yet checkpointed by an OUTBOX_WRITE (the same
    row objects the subscriptions keep: an OUTBOX_WRITE's digest covers them even
    after an ack, an unsubscribe or an expiry removed them from a subscription)."""

    commit_index: int
    rows: tuple[OutboxRow, ...]


class PendingRows:
    """The pending batches, oldest first, and how far OUTBOX_WRITEs have checkpointed."""

    __slots__ = ("_batches", "_digests", "through")

    def __init__(self, through: int = 0) -> None:
        self._batches: deque[PendingBatch] = deque()
        self.through = through
        """Every source entry at or below this index has had its rows outboxed."""
        self._digests: dict[tuple[int, int], tuple[int, int]] = {}
        """(from, through) -> (count, digest) of the ranges this replica proposed, so
        that applying its own OUTBOX_WRITE does not compute the digest again: the rows
        of a range cannot change between the two (only an OUTBOX_WRITE removes pending
        rows, and one for another range makes this one STALE_RANGE or a no-op). Not
        state: never in a snapshot or a digest."""

    def add(self, commit_index: int, rows: tuple[OutboxRow, ...]) -> None:
        """The rows the entry at `commit_index` made."""
        self._batches.append(PendingBatch(commit_index, rows))

    def rows(self, through_index: int | None = None, after: int = 0) -> tuple[OutboxRow, ...]:
        """Rows computed and not yet checkpointed (acknowledged or not), optionally
        only those of source indexes in (after, through_index]."""
        return tuple(
            row
            for batch in self._batches
            if batch.commit_index > after
            and (through_index is None or batch.commit_index <= through_index)
            for row in batch.rows
        )

    def propose(
        self, lease_index: int, applied: int, now_ms: int, after: int = 0
    ) -> OutboxWrite | None:
        """The OUTBOX_WRITE of every row computed since the last one (and after
        `after`), or None if nothing waits (`BucketStateMachine.propose_outbox_write`)."""
        start = max(after, self.through)
        if not self._batches or self._batches[-1].commit_index <= start:
            return None
        count, digest = rows_digest(self.rows(after=start))
        if len(self._digests) >= _DIGESTS_KEPT:
            self._digests.pop(next(iter(self._digests)))
        self._digests[(start, applied)] = (count, digest)
        return OutboxWrite(lease_index, start, applied, count, digest, now_ms)

    def checkpoint(
        self, index: int, entry: OutboxWrite, subs: SubscriptionTable
    ) -> tuple[OutboxRow, ...] | Rejection | None:
        """Apply an OUTBOX_WRITE committed at `index` (its lease already checked): the
        rows it checkpoints for live subscriptions, None if an earlier one covered
        its range, or why it cannot apply. Raises PlanMismatch if its count or digest
        is not this replica's."""
        if entry.through_index <= self.through:
            return None
        if entry.from_index != self.through:
            return Rejection(
                ErrorCode.STALE_RANGE,
                f"range starts after {entry.from_index}; outboxed through {self.through}",
            )
        if entry.through_index >= index:
            return Rejection(
                ErrorCode.INVALID_ARGUMENT,
                f"range ends at {entry.through_index}, not before its own index {index}",
            )
        known = self._digests.pop((entry.from_index, entry.through_index), None)
        count, digest = rows_digest(self.rows(entry.through_index)) if known is None else known
        if (count, digest) != (entry.row_count, entry.digest):
            raise PlanMismatch(
                f"OUTBOX_WRITE at {index} for ({entry.from_index}, {entry.through_index}]: "
                f"committed {entry.row_count} rows digest {entry.digest:#x}, this replica "
                f"computed {count} rows digest {digest:#x}"
            )
        live = []
        while self._batches and self._batches[0].commit_index <= entry.through_index:
            batch = self._batches.popleft()
            for row in batch.rows:
                sub = subs.get(row.sub_id)
                # A row computed before the subscription's SUBSCRIBE applied was an
                # earlier incarnation's of a reused sub_id (UNSUBSCRIBE, then SUBSCRIBE
                # again): it is not on this stream's chain.
                if sub is not None and batch.commit_index >= sub.born:
                    live.append(row)
        self.through = entry.through_index
        return tuple(live)

    def pack_later(self) -> list[tuple[int, tuple[OutboxRow, ...]]]:
        """References to the batches, packed later by `pack_item`."""
        return [(b.commit_index, b.rows) for b in self._batches]

    @staticmethod
    def pack_item(commit_index: int, rows: tuple[OutboxRow, ...]) -> list[Any]:
        return [commit_index, [row.pack() for row in rows]]

    @classmethod
    def unpack(cls, items: list[Any], through: int) -> PendingRows:
        pending = cls(through)
        for index, rows in items:
            pending.add(index, tuple(unpack_row(r) for r in rows))
        return pending

    def __iter__(self) -> Iterator[PendingBatch]:
        return iter(self._batches)
