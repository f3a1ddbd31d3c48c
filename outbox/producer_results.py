"""The results a bucket keeps per idempotent producer, so that a retried sequence is
answered with the result it committed the first time (docs/core.md, WRITE).

A bucket keeps the results of a producer's last `limits.PRODUCER_RESULTS_CACHED`
sequences: no fewer than the SDK has unanswered in a bucket, so every retry it can
make finds its result (docs/emission.md, "Writes from the SDK"). Up to 65,536
producers per bucket, for a day each: kept compactly. A result is packed without
what a retry of the write brings again (the bucket, and the keys: its ops), as
msgpack `[epoch_counter, commit_index, [version per op], error or nil]` (~10 bytes
for a one-key write), and a producer's results share one buffer.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgpack

from . import limits
from .emitseq import EmitSeq
from .entries import Write
from .errors import ErrorCode, Rejection
from .model import WriteResult


class ProducerResults:
    """The packed results of a producer's last sequences in a bucket, oldest first:
    one buffer, and where each result ends in it. Those evicted stay in the buffer
    until a quarter of the bound has, then are cut off together."""

    __slots__ = ("_data", "_ends", "_first")

    def __init__(self) -> None:
        self._data = bytearray()
        self._ends = array("I")
        """The end offset of each result in `_data`."""
        self._first = 0
        """Results before this one are evicted."""

    def __len__(self) -> int:
        return len(self._ends) - self._first

    def add(self, result: WriteResult) -> None:
        """Keep the result of the producer's next sequence (evicting the oldest one
        beyond `limits.PRODUCER_RESULTS_CACHED`)."""
        self._data += pack_result(result)
        self._ends.append(len(self._data))
        if len(self) > limits.PRODUCER_RESULTS_CACHED:
            self._evict(1)

    def forget_before(self, sequence: int, last_seq: int) -> None:
        """Forget the results of the sequences before `sequence`, the last one kept
        being `last_seq`'s: the producer had their answers and sends them no more
        (`ProducerRef.answered_below`)."""
        drop = min(len(self), sequence - (last_seq - len(self) + 1))
        if drop > 0:
            self._evict(drop)

    def _evict(self, count: int) -> None:
        """Drop the oldest `count` results; their bytes go once a quarter of the bound
        (or everything) is dropped."""
        self._first += count
        if self._first * 4 >= limits.PRODUCER_RESULTS_CACHED or not len(self):
            cut = self._ends[self._first - 1]
            del self._data[:cut]
            self._ends = array("I", [end - cut for end in self._ends[self._first :]])
            self._first = 0

    def original(self, back: int, bucket_uuid: str, retry: Write) -> WriteResult | None:
        """The result of the sequence `back` before the last one, as the answer to
        `retry` (a duplicate: the same ops, whose keys name the versions); None if
        it is no longer kept."""
        if not 0 <= back < len(self):
            return None
        i = len(self._ends) - 1 - back
        start = self._ends[i - 1] if i else 0
        epoch_counter, commit_index, versions, error = _decode(self._data[start : self._ends[i]])
        return WriteResult(
            EmitSeq(bucket_uuid, epoch_counter, commit_index),
            tuple(zip((op.key for op in retry.ops), versions, strict=False)),
            duplicate=True,
            error=error,
        )

    def packed(self) -> bytes:
        """The kept results, packed one after the other (a snapshot's form)."""
        start = self._ends[self._first - 1] if self._first else 0
        return bytes(self._data[start:])

    @classmethod
    def restore(cls, raw: Any, last_seq: int) -> ProducerResults:
        """From `packed()` (each result checked), or from a snapshot of a build that
        kept 5 whole results, as `[[sequence, [commit, [[key, version], ...], error]],
        ...]` up to `last_seq`. Raises ValueError (or TypeError) if malformed."""
        results = cls()
        if isinstance(raw, list):
            for i, (seq, (commit, versions, error)) in enumerate(raw):
                if seq != last_seq - len(raw) + 1 + i:
                    raise ValueError(f"kept results {[r[0] for r in raw]} do not end at {last_seq}")
                rejection = None if error is None else Rejection(ErrorCode(error[0]), error[1])
                results.add(WriteResult(EmitSeq(*commit), tuple(versions), error=rejection))
            return results
        if not isinstance(raw, bytes):
            raise TypeError(f"kept results are {type(raw).__name__}, not bytes")
        unpacker = msgpack.Unpacker(raw=False, use_list=True, strict_map_key=True)
        unpacker.feed(raw)
        for fields in unpacker:
            _checked(fields)
            results._ends.append(unpacker.tell())
        end = results._ends[-1] if results._ends else 0
        if end != len(raw):
            raise ValueError(f"kept results end in {len(raw) - end} stray bytes")
        results._data[:] = raw
        if len(results) > limits.PRODUCER_RESULTS_CACHED:  # kept by a build that kept more
            results._first = len(results) - limits.PRODUCER_RESULTS_CACHED
        return results


def pack_result(result: WriteResult) -> bytes:
    error = None if result.error is None else [str(result.error.code), result.error.message]
    versions = [version for _, version in result.versions]
    return msgpack.packb([result.commit.epoch_counter, result.commit.commit_index, versions, error])


def _decode(packed: bytes | bytearray) -> tuple[int, int, list[int], Rejection | None]:
    return _checked(msgpack.unpackb(packed, raw=False, use_list=True))


def _checked(fields: Any) -> tuple[int, int, list[int], Rejection | None]:
    """A result's fields, checked (an explicit loop: a restore checks every one)."""
    epoch_counter, commit_index, versions, error = fields
    if type(epoch_counter) is not int or type(commit_index) is not int:
        raise ValueError(f"a kept result is malformed: {fields!r}")
    for version in versions:
        if type(version) is not int:
            raise ValueError(f"a kept result is malformed: {fields!r}")
    rejection = None if error is None else Rejection(ErrorCode(error[0]), str(error[1]))
    return epoch_counter, commit_index, versions, rejection


__all__ = ["ProducerResults", "pack_result"]
