"""Idempotent writes: a producer id, and per bucket an epoch and a sequence.

Every `Client` write carries a `ProducerRef` (docs/core.md, entries WRITE and
INIT_PRODUCER): the client's producer id, the epoch InitProducer granted in that
bucket, and the next sequence number. A bucket applies a producer's writes only in
sequence order, and answers a retried sequence with the result it committed the
first time (`duplicate`), so a write retried after a lost answer, a timeout or a
failover never applies twice.

The write pipeline (`sevendb.sdk.writer`) sends a bucket's writes in sequence order
and retries a bucket's failed writes together, in that order. What it does with an
answer about the producer itself (this module decides, the pipeline acts):

* OUT_OF_ORDER_SEQUENCE: an earlier sequence has not reached the log yet (it is
  being retried): retry this one after it.
* A gap that will never fill - a write given up on (its outcome unknown) or refused
  before the log (a hole in the sequence) - starts a new *generation* of the bucket:
  the next write asks InitProducer for a higher epoch, which fences every write of
  the old one. A write of the old generation refused since (FENCED, OUT_OF_ORDER,
  UNKNOWN_PRODUCER: never applied) is given a sequence of the new generation, unless
  an attempt of it may have reached the log (then its outcome is unknown, and it
  fails with `Unavailable` rather than risk a second commit).
* UNKNOWN_PRODUCER / INVALID_PRODUCER_EPOCH: the bucket forgot the producer (its
  state expired): a new generation, as above.

At most `SEQUENCES_IN_FLIGHT_MAX` (1,024) sequences of a bucket are unanswered at
once (in a generation: from the oldest unanswered one, a write may take a sequence
fewer than that many ahead; later writes wait in the pipeline). A bucket keeps the
results of that many sequences per producer (`limits.PRODUCER_RESULTS_CACHED`), so
every retry is answered with its original result: when a sequence is retried, no
write more than that many sequences after it can have committed. Each write tells
the bucket its oldest unanswered sequence (`ProducerRef.answered_below`), and the
bucket forgets the results before it: a producer keeps about as many results as it
has writes in flight, not the bound. (Kafka bounds an idempotent producer to 5
batches in flight per partition, and a broker keeps 5, likewise; a sevendb write is
one record, not a batch.)

Loop only (the SDK's asyncio loop), apart from `new_producer_id`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import grpc
from grpc import aio

from sevendb.outbox import limits
from sevendb.outbox.errors import ErrorCode
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk.engine import ERROR_CODE_KEY, RETRY_AFTER_KEY, Engine, leader_hint, trailer
from sevendb.sdk.errors import ResourceExhausted, Unavailable, domain_error, retry_after_s

RESET_CODES: Final = frozenset(
    {ErrorCode.UNKNOWN_PRODUCER, ErrorCode.INVALID_PRODUCER_EPOCH, ErrorCode.PRODUCER_FENCED}
)
"""Answers saying the bucket no longer takes this generation's writes (never applied)."""
IN_LOG_CODES: Final = (
    frozenset({ErrorCode.PRECONDITION_FAILED})
    | RESET_CODES
    | {
        ErrorCode.OUT_OF_ORDER_SEQUENCE,
        ErrorCode.DUPLICATE_SEQUENCE,
    }
)
"""Refusals reached by applying the write: its sequence is used up (or never was)
without leaving a hole. Any other refusal happens before the log: a hole."""
SEQUENCES_IN_FLIGHT_MAX: Final = limits.PRODUCER_RESULTS_CACHED
"""Unanswered sequences per bucket (see the module docstring): no more than a node
keeps the results of."""


def new_producer_id() -> int:
    """A random producer id (odd, 62 bits: as a node mints them)."""
    return secrets.randbits(62) | 1


@dataclass(slots=True)
class BucketState:
    """One bucket's view of the producer."""

    epoch: int = -1
    """The epoch InitProducer granted (-1: none yet in this generation)."""
    next_seq: int = 0
    generation: int = 0
    """Bumped whenever the sequence can no longer continue (see the module docstring)."""
    last_epoch: int = -1
    """The highest epoch ever granted here: a new generation needs a higher one."""
    initialising: bool = False
    """An InitProducer is under way (the write pipeline holds the writes meanwhile)."""
    unanswered: collections.deque[int] = field(default_factory=collections.deque)
    """The sequences of this generation taken and not answered yet, ascending (those
    answered out of order leave when everything before them was answered)."""
    answered: set[int] = field(default_factory=set)
    """Answered sequences still behind an unanswered one in `unanswered`."""

    @property
    def answered_below(self) -> int:
        """The oldest sequence still unanswered (or the next one): every sequence
        before it was answered for good."""
        return self.unanswered[0] if self.unanswered else self.next_seq

    def forget_sequences(self) -> None:
        self.next_seq = 0
        self.unanswered.clear()
        self.answered.clear()


class Producer:
    """An idempotent producer's state in every bucket it wrote to. Loop only."""

    def __init__(self, producer_id: int | None = None) -> None:
        self.producer_id = producer_id or new_producer_id()
        self.buckets: dict[int, BucketState] = {}

    def bucket(self, bucket: int) -> BucketState:
        state = self.buckets.get(bucket)
        if state is None:
            state = self.buckets[bucket] = BucketState()
        return state

    def ready(self, bucket: int) -> bool:
        """Can writes of `bucket` be sequenced now (an epoch is granted)?"""
        state = self.bucket(bucket)
        return state.epoch >= 0 and not state.initialising

    def has_room(self, bucket: int, window: int = SEQUENCES_IN_FLIGHT_MAX) -> bool:
        """May the bucket's next write go on: take a sequence fewer than `window`
        ahead of the oldest unanswered one, or wait for an InitProducer (which starts
        a generation: nothing unanswered in it)?"""
        state = self.bucket(bucket)
        if state.epoch < 0 or state.initialising:
            return True
        return state.next_seq - state.answered_below < window

    def take(self, bucket: int) -> tuple[int, int, int]:
        """(epoch, sequence, generation) for the next write of a ready bucket."""
        state = self.buckets[bucket]
        seq = state.next_seq
        state.next_seq += 1
        state.unanswered.append(seq)
        return state.epoch, seq, state.generation

    def answered(self, bucket: int, seq: int, generation: int) -> None:
        """The write of `seq` is answered for good (it will not be sent again)."""
        state = self.buckets.get(bucket)
        if state is None or state.generation != generation:
            return  # that generation is over: its sequences are forgotten
        unanswered = state.unanswered
        if not unanswered or seq < unanswered[0]:
            return
        state.answered.add(seq)
        while unanswered and unanswered[0] in state.answered:
            state.answered.discard(unanswered.popleft())

    def give_back(self, bucket: int, seq: int, generation: int) -> bool:
        """A write refused before the log returns its sequence: True if it was the
        last one taken (the next write reuses it); otherwise the sequence has a hole
        and the bucket starts a new generation."""
        state = self.buckets.get(bucket)
        if state is None or state.generation != generation:
            return True  # that generation is over already
        if state.next_seq == seq + 1:
            state.next_seq = seq
            if state.unanswered and state.unanswered[-1] == seq:
                state.unanswered.pop()
            return True
        self.new_generation(bucket, generation)
        return False

    def new_generation(self, bucket: int, generation: int) -> None:
        """The sequence of `generation` cannot continue: the next write asks for a
        higher epoch (a no-op if that generation is over already)."""
        state = self.buckets.get(bucket)
        if state is not None and state.generation == generation:
            state.generation += 1
            state.epoch = -1
            state.forget_sequences()

    def granted(self, bucket: int, epoch: int) -> bool:
        """InitProducer answered `epoch`; False if it is not above every epoch this
        bucket granted before (a producer the bucket had forgotten starts at 0 again):
        ask once more, so that the old generation's writes stay fenced."""
        state = self.buckets[bucket]
        if epoch <= state.last_epoch:
            return False
        state.epoch = state.last_epoch = epoch
        state.forget_sequences()
        return True


async def init_producer(
    engine: Engine,
    metadata: tuple[tuple[str, str], ...],
    request: pb.InitProducerRequest,
    *,
    first_target: Callable[[], str],
    deadline: float,
    call_timeout_s: float,
    backoff_initial_s: float,
    backoff_max_s: float,
) -> int:
    """InitProducer, retried (following the leader hint, and any retry-after a node
    asks for) until `deadline` (`time.monotonic()`): the epoch granted. Raises the
    typed refusal, or `Unavailable` / `ResourceExhausted` when time is up."""
    backoff = backoff_initial_s
    target = first_target()
    for attempt in itertools.count():
        left = deadline - time.monotonic()
        try:
            response: pb.InitProducerResponse = await engine.stub(target).InitProducer(
                request, metadata=metadata, timeout=max(0.05, min(call_timeout_s, left))
            )
            return response.producer_epoch
        except aio.AioRpcError as exc:
            after = retry_after_s(trailer(exc, RETRY_AFTER_KEY))
            error = trailer(exc, ERROR_CODE_KEY)
            typed = domain_error(exc.code(), exc.details() or "", error, after)
            if typed is not None:
                raise typed from None
            hint = leader_hint(exc)
            target = hint or engine.any_endpoint()
            if after is not None:  # a rate limit: the node named its wait
                delay = after
            else:
                delay = 0.0 if hint and attempt == 0 else backoff * (0.5 + random.random())
                backoff = min(backoff * 2, backoff_max_s)
            if time.monotonic() + delay >= deadline:
                detail = f"{exc.code().name}: {exc.details()}"
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise ResourceExhausted(f"InitProducer: {detail}", after) from None
                raise Unavailable(f"InitProducer not answered in time: {detail}") from None
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


__all__ = [
    "IN_LOG_CODES",
    "RESET_CODES",
    "SEQUENCES_IN_FLIGHT_MAX",
    "BucketState",
    "Producer",
    "init_producer",
    "new_producer_id",
]
