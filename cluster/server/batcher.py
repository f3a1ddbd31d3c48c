"""Server-side batching on the event loop: concurrent client writes to one bucket
share a Raft entry (`WriteBatcher`: a WRITE_BATCH), and so do concurrent SUBSCRIBEs
(`SubscribeBatcher`: a SUBSCRIBE_BATCH, docs/core.md). Both work alike (`EntryBatcher`);
what follows says "writes" for either.

Writes wait in a queue; whenever fewer than `entries_in_flight` entries of this
bucket are being replicated, everything waiting (up to a count and byte budget)
is proposed as one WRITE_BATCH entry without blocking (`BucketReplica.submit`).
A submitted write does not propose at once but at the end of the loop iteration
(`call_soon`), so the writes of one `WriteMany` call - and of every call handled in
the same iteration - share an entry instead of the first few taking a free slot
each (measured: 7.5 writes per entry at 18 per call before this).
When an entry is applied, pysyncobj's tick thread hands the whole entry's outcome
back to the loop in one call, which settles its writes and proposes the next
entry. So batching never waits for a timer - at one write in flight nothing is
delayed, under load batches grow by themselves - and no thread is woken per write
(measured: thread hand-offs per write cost more than replicating it).

Writes are submitted as groups (one `WriteMany` call's writes to one bucket), and
a group has one future, settled when all its writes are: no asyncio future,
callback and loop turn per write.

The queue is bounded (`writes_max`, `bytes_max`): a group that would overfill it is
refused at once (`BatcherFull`, which the node answers RESOURCE_EXHAUSTED with a
retry-after) instead of waiting in memory while the bucket cannot keep up.

Each item of an entry gets its own result: a write or SUBSCRIBE the state machine
refuses is refused alone, the others of its entry commit. Only what fails the whole
entry (not committed in time, the replica quarantined, e.g. by a plan mismatch)
fails every item in it.
"""

from __future__ import annotations

import asyncio
import collections
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from sevendb.cluster.raft.replica import ApplyOutcome, BucketReplica, ReplicaUnavailable
from sevendb.outbox import limits
from sevendb.outbox.entries import Subscribe, SubscribeBatch, Write, WriteBatch, encode_entry
from sevendb.outbox.errors import SevenDBError
from sevendb.outbox.model import (
    SubscribeBatchResult,
    SubscribeResult,
    WriteBatchResult,
    WriteResult,
)

ENTRIES_IN_FLIGHT: Final = 4
BATCH_BYTES_MAX: Final = limits.ENTRY_BYTES_MAX - 64 * 1024
"""Headroom below the entry limit for encoding overhead."""
OP_OVERHEAD_BYTES: Final = 24


def write_size(write: Write) -> int:
    return 32 + sum(len(op.key.encode()) + len(op.value) + OP_OVERHEAD_BYTES for op in write.ops)


def subscribe_size(subscribe: Subscribe) -> int:
    """A SUBSCRIBE's encoded size, from above."""
    text = subscribe.sub_id + subscribe.principal + subscribe.durable + subscribe.query.arg
    return 64 + 4 * len(text)


Item = TypeVar("Item", Write, Subscribe)
"""What a batcher queues: writes or SUBSCRIBEs."""
Res = TypeVar("Res", WriteResult, SubscribeResult)
"""What each of them gets back when its entry is applied."""


class BatcherFull(Exception):
    """The bucket's write queue is full: nothing of the group was queued."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


Outcome = WriteResult | BaseException
"""A submitted write's outcome: its result, or why it failed."""
SubscribeOutcome = SubscribeResult | BaseException
"""A submitted SUBSCRIBE's outcome: its result, or why it failed."""


@dataclass(eq=False, slots=True)
class _Group(Generic[Res]):
    """Items submitted together; `future` holds their outcomes, in order."""

    future: asyncio.Future[list[Res | BaseException]]
    outcomes: list[Res | BaseException | None]
    unsettled: int

    def settle(self, slot: int, outcome: Res | BaseException) -> None:
        if self.outcomes[slot] is not None:
            return
        self.outcomes[slot] = outcome
        self.unsettled -= 1
        if not self.unsettled and not self.future.done():
            self.future.set_result(self.outcomes)  # type: ignore[arg-type]  # all set now


@dataclass(eq=False, slots=True)
class _Waiting(Generic[Item, Res]):
    write: Item
    size: int
    group: _Group[Res]
    slot: int


@dataclass(eq=False, slots=True)
class _Entry(Generic[Item, Res]):
    batch: list[_Waiting[Item, Res]]
    finished: bool = False
    timer: asyncio.TimerHandle | None = None


class EntryBatcher(ABC, Generic[Item, Res]):
    """Coalesces one bucket's concurrent items into entries (see the module docstring).
    Loop only. A subclass says what an item weighs, which entry carries a batch of
    them and how its result splits into theirs."""

    noun = "writes"
    per_entry_max = limits.WRITES_PER_BATCH_MAX

    def __init__(
        self,
        replica: BucketReplica,
        loop: asyncio.AbstractEventLoop,
        *,
        timeout_s: float = 5.0,
        entries_in_flight: int = ENTRIES_IN_FLIGHT,
        writes_max: int = 65_536,
        bytes_max: int = 64 * 1024 * 1024,
        retry_after_ms: int = 100,
    ) -> None:
        self.replica = replica
        self._loop = loop
        self._timeout_s = timeout_s
        self._in_flight_max = entries_in_flight
        self._writes_max = writes_max
        self._bytes_max = bytes_max
        self._retry_after_ms = retry_after_ms
        self._queue: collections.deque[_Waiting[Item, Res]] = collections.deque()
        self._queued_bytes = 0
        self._in_flight = 0
        self._propose_scheduled = False
        self._closed = False
        self.entries = 0
        self.writes = 0

    @staticmethod
    @abstractmethod
    def size(item: Item) -> int:
        """`item`'s share of an entry's bytes, from above."""

    @staticmethod
    @abstractmethod
    def entry(items: tuple[Item, ...]) -> Write | WriteBatch | Subscribe | SubscribeBatch:
        """The entry carrying `items` (more than one)."""

    @staticmethod
    @abstractmethod
    def unpack(result: object) -> Sequence[Res] | None:
        """The results of an entry's items, in order (None: not such an entry's)."""

    def submit(self, writes: Sequence[Item]) -> asyncio.Future[list[Res | BaseException]]:
        """Commit `writes` (each on its own, possibly in one entry with others). The
        future holds one outcome per write, in order: its result, or the
        `ReplicaUnavailable` saying why it was not committed. Callers bound the wait."""
        if self._closed:
            raise ReplicaUnavailable("node is shutting down", reason="closed")
        sizes = [self.size(write) for write in writes]
        size = sum(sizes)
        if self._queue and (
            len(self._queue) + len(writes) > self._writes_max
            or self._queued_bytes + size > self._bytes_max
        ):
            raise BatcherFull(
                f"bucket {self.replica.bucket}: {len(self._queue)} {self.noun} "
                f"({self._queued_bytes} bytes) wait to be proposed, the most this node "
                f"queues is {self._writes_max} ({self._bytes_max} bytes); retry in "
                f"{self._retry_after_ms} ms",
                self._retry_after_ms,
            )
        group: _Group[Res] = _Group(self._loop.create_future(), [None] * len(writes), len(writes))
        self._queue.extend(
            _Waiting(write, sizes[slot], group, slot) for slot, write in enumerate(writes)
        )
        self._queued_bytes += size
        if not self._propose_scheduled:
            self._propose_scheduled = True
            self._loop.call_soon(self._propose)
        return group.future

    def close(self) -> None:
        self._closed = True
        closed = ReplicaUnavailable("node is shutting down", reason="closed")
        self._fail(list(self._queue), closed)
        self._queue.clear()
        self._queued_bytes = 0

    @property
    def queued(self) -> int:
        """Writes waiting to be proposed."""
        return len(self._queue)

    def _propose(self) -> None:
        self._propose_scheduled = False
        while self._queue and self._in_flight < self._in_flight_max:
            batch = [self._queue.popleft()]
            size = batch[0].size
            while (
                self._queue
                and len(batch) < self.per_entry_max
                and size + self._queue[0].size <= BATCH_BYTES_MAX
            ):
                waiting = self._queue.popleft()
                batch.append(waiting)
                size += waiting.size
            self._queued_bytes -= size
            writes = tuple(w.write for w in batch)
            entry = writes[0] if len(writes) == 1 else self.entry(writes)
            try:
                submitted = self.replica.submit(encode_entry(entry), entry)
            except (ReplicaUnavailable, SevenDBError) as exc:
                self._fail(batch, exc)
                continue
            self._in_flight += 1
            self.entries += 1
            self.writes += len(batch)
            pending: _Entry[Item, Res] = _Entry(batch)
            pending.timer = self._loop.call_later(self._timeout_s, self._expired, pending)
            submitted.add_done_callback(
                lambda done, pending=pending: self._loop.call_soon_threadsafe(  # type: ignore[misc]
                    self._applied, pending, done
                )
            )

    def _finish(self, entry: _Entry[Item, Res]) -> bool:
        """Mark `entry` answered (once: by its outcome or by the timeout)."""
        if entry.finished:
            return False
        entry.finished = True
        if entry.timer is not None:
            entry.timer.cancel()
        self._in_flight -= 1
        return True

    def _applied(self, entry: _Entry[Item, Res], done: Future[ApplyOutcome]) -> None:
        if not self._finish(entry):
            return
        error = done.exception()
        if error is not None:
            self._fail(entry.batch, error)
        else:
            outcome = done.result()
            results = None
            if outcome.error is None and outcome.applied is not None:
                results = self.unpack(outcome.applied.result)
            if results is None or len(results) != len(entry.batch):
                self._fail(entry.batch, _not_applied(outcome))
            else:
                for waiting, result in zip(entry.batch, results, strict=True):
                    waiting.group.settle(waiting.slot, result)
        self._propose()

    def _expired(self, entry: _Entry[Item, Res]) -> None:
        if not self._finish(entry):
            return
        self._fail(
            entry.batch,
            ReplicaUnavailable(
                f"bucket {self.replica.bucket}: not committed within {self._timeout_s} s "
                "(outcome unknown)",
                leader_hint=self.replica.leader,
                reason="timeout",
            ),
        )
        self._propose()

    @staticmethod
    def _fail(batch: list[_Waiting[Item, Res]], error: BaseException) -> None:
        for waiting in batch:
            waiting.group.settle(waiting.slot, error)


def _not_applied(outcome: ApplyOutcome) -> ReplicaUnavailable:
    if outcome.error is not None or outcome.applied is None:
        return ReplicaUnavailable(f"the entry could not be applied: {outcome.error}")
    return ReplicaUnavailable(f"unexpected result {type(outcome.applied.result).__name__}")


class WriteBatcher(EntryBatcher[Write, WriteResult]):
    """Coalesces one bucket's concurrent writes into WRITE_BATCH entries. Loop only."""

    @staticmethod
    def size(item: Write) -> int:
        return write_size(item)

    @staticmethod
    def entry(items: tuple[Write, ...]) -> WriteBatch:
        return WriteBatch(items)

    @staticmethod
    def unpack(result: object) -> Sequence[WriteResult] | None:
        if isinstance(result, WriteBatchResult):
            return result.results
        return (result,) if isinstance(result, WriteResult) else None


class SubscribeBatcher(EntryBatcher[Subscribe, SubscribeResult]):
    """Coalesces one bucket's concurrent SUBSCRIBEs into SUBSCRIBE_BATCH entries (a
    lone one is proposed as a SUBSCRIBE). Loop only."""

    noun = "subscribes"
    per_entry_max = limits.SUBSCRIBES_PER_BATCH_MAX

    @staticmethod
    def size(item: Subscribe) -> int:
        return subscribe_size(item)

    @staticmethod
    def entry(items: tuple[Subscribe, ...]) -> SubscribeBatch:
        return SubscribeBatch(items)

    @staticmethod
    def unpack(result: object) -> Sequence[SubscribeResult] | None:
        if isinstance(result, SubscribeBatchResult):
            return result.results
        return (result,) if isinstance(result, SubscribeResult) else None


B = TypeVar("B", WriteBatcher, SubscribeBatcher)


class Batchers(Generic[B]):
    """The batchers of one kind of a node: one per bucket replica it has, made (by
    `make`) on first use and anew for a replica restarted since."""

    def __init__(self, make: Callable[[BucketReplica], B]) -> None:
        self._make: Callable[[BucketReplica], B] = make
        self._of: dict[int, B] = {}

    def of(self, replica: BucketReplica) -> B:
        """`replica`'s batcher."""
        batcher = self._of.get(replica.bucket)
        if batcher is None or batcher.replica is not replica:  # new, or restarted
            batcher = self._of[replica.bucket] = self._make(replica)
        return batcher

    def close(self) -> None:
        for batcher in self._of.values():
            batcher.close()


__all__ = [
    "BatcherFull",
    "Batchers",
    "EntryBatcher",
    "Outcome",
    "SubscribeBatcher",
    "SubscribeOutcome",
    "WriteBatcher",
    "subscribe_size",
    "write_size",
]
