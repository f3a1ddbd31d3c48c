"""A bucket's idempotent producers: each one's epoch, last sequence and recent
results, which make a retried write apply once (docs/core.md, producers). Pure:
part of the state machine's state (outbox/state.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from . import limits
from .entries import InitProducer, Write
from .errors import ErrorCode, Rejection
from .model import InitProducerResult, WriteResult
from .producer_results import ProducerResults


@dataclass(slots=True)
class Producer:
    epoch: int
    last_active_ms: int
    """Log time of its INIT_PRODUCER or of its last write taken (or answered as a
    duplicate)."""
    last_seq: int = -1
    results: ProducerResults = field(default_factory=ProducerResults)
    """The results of its last sequences, `last_seq` last (a producer's sequences
    apply only in order, so these are consecutive)."""
    owner: str = ""
    """The principal whose INIT_PRODUCER made it (empty: made by an older build)."""


def not_owner(producer_id: int, principal: str) -> Rejection:
    return Rejection(
        ErrorCode.PERMISSION_DENIED,
        f"producer {producer_id} belongs to another principal: {principal or 'this caller'} "
        "lacks ownership of it (init a producer id of your own)",
    )


class ProducerTable:
    """The producers initialised in a bucket, by producer id."""

    __slots__ = ("_producers",)

    def __init__(self) -> None:
        self._producers: dict[int, Producer] = {}

    def __len__(self) -> int:
        return len(self._producers)

    def __getitem__(self, producer_id: int) -> Producer:
        return self._producers[producer_id]

    def init(self, entry: InitProducer) -> InitProducerResult:
        """INIT_PRODUCER: a new producer at epoch 0, or the next epoch of one (which
        fences its previous instance)."""
        producer = self._producers.get(entry.producer_id)
        if producer is not None and producer.owner and entry.principal != producer.owner:
            # Someone else's producer: re-initialising it would fence its owner.
            return InitProducerResult(
                entry.producer_id, producer.epoch, not_owner(entry.producer_id, entry.principal)
            )
        if producer is None:
            if len(self._producers) >= limits.PRODUCERS_PER_BUCKET_MAX:
                return InitProducerResult(
                    entry.producer_id,
                    error=Rejection(
                        ErrorCode.LIMIT_EXCEEDED,
                        f"bucket already tracks {limits.PRODUCERS_PER_BUCKET_MAX} producers",
                    ),
                )
            self._producers[entry.producer_id] = Producer(0, entry.now_ms, owner=entry.principal)
            return InitProducerResult(entry.producer_id, 0)
        self._producers[entry.producer_id] = Producer(
            producer.epoch + 1, entry.now_ms, owner=entry.principal
        )
        return InitProducerResult(entry.producer_id, producer.epoch + 1)

    def admit(self, entry: Write, bucket_uuid: str) -> Producer | WriteResult | Rejection:
        """May this producer write go ahead? Its producer if so; else the original
        result of a retried sequence (answered again, nothing applied), or why not."""
        ref = entry.producer
        assert ref is not None
        producer = self._producers.get(ref.producer_id)
        if producer is None:
            return Rejection(
                ErrorCode.UNKNOWN_PRODUCER,
                f"producer {ref.producer_id} is not initialised in this bucket",
            )
        if producer.owner and entry.principal != producer.owner:
            return not_owner(ref.producer_id, entry.principal)
        if ref.epoch < producer.epoch:
            return Rejection(
                ErrorCode.PRODUCER_FENCED,
                f"producer {ref.producer_id} epoch {ref.epoch} is fenced by epoch {producer.epoch}",
            )
        if ref.epoch > producer.epoch:
            return Rejection(
                ErrorCode.INVALID_PRODUCER_EPOCH,
                f"producer {ref.producer_id} epoch {ref.epoch} was never granted "
                f"(current {producer.epoch})",
            )
        if ref.sequence <= producer.last_seq:
            back = producer.last_seq - ref.sequence
            original = producer.results.original(back, bucket_uuid, entry)
            if original is not None:
                producer.last_active_ms = max(producer.last_active_ms, entry.now_ms)
                return original
            return Rejection(
                ErrorCode.DUPLICATE_SEQUENCE,
                f"sequence {ref.sequence} was committed before and is older than the "
                f"last {limits.PRODUCER_RESULTS_CACHED} results kept",
            )
        if ref.sequence != producer.last_seq + 1:
            return Rejection(
                ErrorCode.OUT_OF_ORDER_SEQUENCE,
                f"sequence {ref.sequence} skips ahead; expected {producer.last_seq + 1}",
            )
        return producer

    def idle(self, now_ms: int, idle_ms: int) -> tuple[int, ...]:
        """Producers that wrote nothing for longer than `idle_ms` (in id order): what
        an OUTBOX_PURGE may forget (`expire_producers`)."""
        return tuple(
            sorted(pid for pid, p in self._producers.items() if now_ms - p.last_active_ms > idle_ms)
        )

    def expire(self, producer_ids: tuple[int, ...], now_ms: int, idle_ms: int) -> tuple[int, ...]:
        """Forget each named producer still idle past `idle_ms`; those forgotten."""
        forgotten = []
        for pid in producer_ids:
            producer = self._producers.get(pid)
            if producer is not None and now_ms - producer.last_active_ms > idle_ms:
                del self._producers[pid]
                forgotten.append(pid)
        return tuple(forgotten)

    def pack(self) -> list[tuple[Any, ...]]:
        """Snapshot items, in id order: an owner is a sixth field, absent for none."""
        return [
            (pid, p.epoch, p.last_seq, p.results.packed(), p.last_active_ms)
            + ((p.owner,) if p.owner else ())
            for pid, p in sorted(self._producers.items())
        ]

    @classmethod
    def unpack(cls, items: Iterator[list[Any]] | list[list[Any]]) -> ProducerTable:
        table = cls()
        for pid, epoch, last_seq, results, active, *owner in items:
            producer = Producer(epoch, active, last_seq, owner=_owner(owner))
            producer.results = ProducerResults.restore(results, last_seq)
            table._producers[pid] = producer
        return table


def _owner(rest: list[Any]) -> str:
    """A snapshot's producer owner: a sixth field, absent for an unowned producer."""
    if not rest:
        return ""
    (owner,) = rest
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"producer owner {owner!r}")
    return owner
