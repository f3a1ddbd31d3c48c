"""Overload protection at the node's edge (issue 27, item 4), in process: the
per-principal rates and the bounded write batcher. The real-process tests are in
tests/test_overload_cluster.py."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import grpc
import pytest

from sevendb.cluster.server.batcher import BatcherFull, WriteBatcher
from sevendb.cluster.server.errors import Failure
from sevendb.cluster.server.overload import PRINCIPALS_TRACKED_MAX, RateLimiter, ServerLimits
from sevendb.outbox.entries import Op, OpKind, Write
from sevendb.proto import codec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limiter(**settings: Any) -> tuple[RateLimiter, Clock]:
    clock = Clock()
    return RateLimiter(ServerLimits(**settings), clock), clock


def refusal(fn: Any) -> Failure:
    with pytest.raises(Failure) as caught:
        fn()
    return caught.value


def test_a_principal_over_its_write_rate_is_told_when_to_retry() -> None:
    rates, clock = limiter(principal_writes_per_s=10, principal_write_bytes_per_s=0)
    for _ in range(10):  # a full second's burst
        rates.charge_writes("alice", 1, 10)
    failure = refusal(lambda: rates.charge_writes("alice", 1, 10))
    assert failure.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert failure.error == codec.RATE_LIMITED and failure.retry_after_ms == 100
    assert codec.trailers(failure.leader, failure.error, failure.retry_after_ms)[-1] == (
        codec.RETRY_AFTER_KEY,
        "100",
    )
    rates.charge_writes("bob", 1, 10)  # another principal has its own allowance
    clock.now += 0.1
    rates.charge_writes("alice", 1, 10)  # refilled by then


def test_bytes_are_limited_too_and_a_refusal_takes_nothing() -> None:
    rates, _ = limiter(principal_writes_per_s=1_000, principal_write_bytes_per_s=1_000)
    rates.charge_writes("alice", 1, 900)
    failure = refusal(lambda: rates.charge_writes("alice", 1, 200))
    assert failure.retry_after_ms == 100  # 100 bytes short at 1,000 bytes/s
    rates.charge_writes("alice", 1, 100)  # the refused write took nothing


def test_a_write_larger_than_the_burst_waits_for_a_full_allowance() -> None:
    rates, clock = limiter(principal_writes_per_s=0, principal_write_bytes_per_s=100)
    rates.charge_writes("alice", 1, 500)  # full: taken, and owed
    failure = refusal(lambda: rates.charge_writes("alice", 1, 50))
    assert failure.retry_after_ms == 4_500  # pays back 400 owed, then 50
    clock.now += 4.5
    rates.charge_writes("alice", 1, 50)


def test_zero_is_no_limit() -> None:
    rates, _ = limiter(principal_writes_per_s=0, principal_write_bytes_per_s=0)
    for _ in range(1_000):
        rates.charge_writes("alice", 1_000, 10**9)
    assert rates.tracked() == 0


def test_idle_principals_are_forgotten_past_the_bound() -> None:
    rates, clock = limiter(principal_writes_per_s=10, principal_write_bytes_per_s=0)
    for i in range(PRINCIPALS_TRACKED_MAX):
        rates.charge_writes(f"p{i}", 1, 1)
    clock.now += 1.0  # every allowance is full again
    rates.charge_writes("newcomer", 1, 1)
    assert rates.tracked() == 1


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        ServerLimits(principal_writes_per_s=-1)
    with pytest.raises(ValueError):
        ServerLimits(principal_subscriptions_max=0)
    with pytest.raises(ValueError):
        ServerLimits(batcher_writes_max=0)


class StuckReplica:
    """A replica whose proposals never commit."""

    bucket = 3
    leader = None

    def __init__(self) -> None:
        self.proposed = 0

    def submit(self, data: bytes, entry: object = None) -> Future[object]:
        self.proposed += 1
        return Future()


def a_write(value: bytes = b"v") -> Write:
    return Write((Op(OpKind.SET, "k", value),))


def test_the_write_batcher_refuses_rather_than_queue_without_bound() -> None:
    async def run() -> None:
        replica = StuckReplica()
        batcher = WriteBatcher(
            replica,  # type: ignore[arg-type]
            asyncio.get_running_loop(),
            entries_in_flight=1,
            writes_max=4,
            bytes_max=10_000,
            retry_after_ms=50,
        )
        batcher.submit([a_write()])
        await asyncio.sleep(0)  # proposed: one entry in flight, the pipeline is full
        batcher.submit([a_write(), a_write()])
        batcher.submit([a_write(), a_write()])
        assert batcher.queued == 4
        with pytest.raises(BatcherFull) as full:
            batcher.submit([a_write()])
        assert full.value.retry_after_ms == 50 and batcher.queued == 4
        small = WriteBatcher(  # the byte bound too
            replica,  # type: ignore[arg-type]
            asyncio.get_running_loop(),
            entries_in_flight=1,
            bytes_max=100,
        )
        small.submit([a_write(b"x" * 80)])
        await asyncio.sleep(0)
        small.submit([a_write(b"x" * 200)])  # an empty queue takes anything
        assert small.queued == 1
        with pytest.raises(BatcherFull):
            small.submit([a_write(b"x")])
        batcher.close()
        small.close()

    asyncio.run(run())
