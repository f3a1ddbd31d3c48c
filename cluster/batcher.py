"""Server-side write batching: concurrent client writes to one bucket share a Raft entry.

Each proposer thread takes the oldest waiting write plus whatever else is waiting
(up to a count and byte budget) and proposes them as one WRITE_BATCH entry; a few
proposers keep several entries in flight, so batching never waits for a timer —
under load batches grow by themselves, at one write in flight nothing is delayed.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Final

from sevendb.cluster.replica import ApplyOutcome, BucketReplica, ReplicaUnavailable
from sevendb.outbox import limits
from sevendb.outbox.entries import Write, WriteBatch, encode_entry
from sevendb.outbox.model import WriteBatchResult, WriteResult

PROPOSERS: Final = 4
BATCH_BYTES_MAX: Final = limits.ENTRY_BYTES_MAX - 64 * 1024
"""Headroom below the entry limit for encoding overhead."""
OP_OVERHEAD_BYTES: Final = 24


def write_size(write: Write) -> int:
    return 32 + sum(len(op.key.encode()) + len(op.value) + OP_OVERHEAD_BYTES for op in write.ops)


@dataclass(eq=False)
class _Waiting:
    write: Write
    size: int
    future: Future[WriteResult] = field(default_factory=Future)


class WriteBatcher:
    """Coalesces one bucket's concurrent writes into WRITE_BATCH entries."""

    def __init__(
        self, replica: BucketReplica, *, proposers: int = PROPOSERS, timeout_s: float = 5.0
    ) -> None:
        self._replica = replica
        self._timeout_s = timeout_s
        self._queue: queue.SimpleQueue[_Waiting | None] = queue.SimpleQueue()
        self._closed = False
        self.entries = 0
        self.writes = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"batcher-{replica}-{i}", daemon=True)
            for i in range(proposers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, write: Write) -> Future[WriteResult]:
        """Commit `write` (possibly with others). The future fails with
        ReplicaUnavailable if it cannot be committed; callers bound the wait."""
        if self._closed:
            raise ReplicaUnavailable("node is shutting down")
        waiting = _Waiting(write, write_size(write))
        self._queue.put(waiting)
        return waiting.future

    def close(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(self._timeout_s)

    def _take(self) -> list[_Waiting] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch, size = [first], first.size
        while len(batch) < limits.WRITES_PER_BATCH_MAX:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)  # leave the stop marker for this or another thread
                break
            if size + nxt.size > BATCH_BYTES_MAX:
                self._propose([nxt])  # never let a big write wait behind a full batch
                continue
            batch.append(nxt)
            size += nxt.size
        return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            self._propose(batch)

    def _propose(self, batch: list[_Waiting]) -> None:
        try:
            if len(batch) == 1:
                outcome = self._replica.propose(encode_entry(batch[0].write), self._timeout_s)
            else:
                entry = WriteBatch(tuple(w.write for w in batch))
                outcome = self._replica.propose(encode_entry(entry), self._timeout_s)
            results = self._results(outcome, len(batch))
        except Exception as exc:  # every waiter learns why, none hangs
            for waiting in batch:
                waiting.future.set_exception(exc)
        else:
            for waiting, result in zip(batch, results, strict=True):
                waiting.future.set_result(result)
        finally:
            self.entries += 1
            self.writes += len(batch)

    @staticmethod
    def _results(outcome: ApplyOutcome, count: int) -> list[WriteResult]:
        if outcome.error is not None or outcome.applied is None:
            raise ReplicaUnavailable(f"the write could not be applied: {outcome.error}")
        result = outcome.applied.result
        if isinstance(result, WriteBatchResult) and len(result.results) == count:
            return list(result.results)
        if isinstance(result, WriteResult) and count == 1:
            return [result]
        raise ReplicaUnavailable(f"unexpected result {type(result).__name__} for a write")
