"""The node's SUBSCRIBE batching (cluster/server/batcher.py, `SubscribeBatcher`): the
Subscribe calls waiting for a bucket share one SUBSCRIBE_BATCH entry, each gets its
own result, a refused one is refused alone, and a lone one is proposed at once.

Against a real one-replica pysyncobj group in this process (test_replica's
`Cluster`); the real-process test is in tests/test_subscribe_batch_cluster.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_overload import StuckReplica
from test_replica import Cluster

from sevendb.cluster.raft.replica import BucketReplica, ReplicaUnavailable
from sevendb.cluster.server.batcher import SubscribeBatcher
from sevendb.outbox import limits
from sevendb.outbox.entries import Subscribe
from sevendb.outbox.errors import ErrorCode
from sevendb.outbox.model import Applied, SubscribeBatchResult, SubscribeResult
from sevendb.outbox.query import Query, plan_query


@pytest.fixture
def solo(tmp_path: Path) -> Iterator[tuple[BucketReplica, list[Applied]]]:
    cluster = Cluster(tmp_path, n=1).start_all()
    try:
        yield cluster.leader(), cluster.applied[0]
    finally:
        cluster.close()


def subscribe(sub_id: str, principal: str = "alice", *, plan_hash: int | None = None) -> Subscribe:
    query = Query.parse(f"prefix:{sub_id}/")
    planned = plan_query(query).plan_hash
    return Subscribe(sub_id, principal, query, planned if plan_hash is None else plan_hash, 1_000)


def subscribe_entries(applied: list[Applied]) -> list[int]:
    """How many SUBSCRIBEs each applied SUBSCRIBE or SUBSCRIBE_BATCH entry carried."""
    sizes: list[int] = []
    for one in applied:
        if isinstance(one.result, SubscribeBatchResult):
            sizes.append(len(one.result.results))
        elif isinstance(one.result, SubscribeResult):
            sizes.append(1)
    return sizes


def test_the_subscribes_waiting_share_an_entry_and_each_gets_its_own_result(
    solo: tuple[BucketReplica, list[Applied]],
) -> None:
    replica, applied = solo

    async def run() -> None:
        loop = asyncio.get_running_loop()
        batcher = SubscribeBatcher(replica, loop, entries_in_flight=1)
        (taken,) = await batcher.submit([subscribe("taken")])
        assert isinstance(taken, SubscribeResult) and taken.error is None
        first = batcher.submit([subscribe("s0")])
        await asyncio.sleep(0)  # proposed at once: nothing else was in flight
        assert batcher.entries == 2
        # Arriving while s0 is in flight, one call at a time: they wait, then share.
        rest = [batcher.submit([subscribe(f"s{i}")]) for i in range(1, 6)]
        thief = batcher.submit([subscribe("taken", "mallory")])
        more = batcher.submit([subscribe("s6"), subscribe("s7")])  # one call, two
        outcomes = [*await first, *[o for f in rest for o in await f], *await more]
        (stolen,) = await thief
        for outcome, sub_id in zip(outcomes, [f"s{i}" for i in range(8)], strict=True):
            assert isinstance(outcome, SubscribeResult), outcome
            assert outcome.error is None and outcome.sub_id == sub_id and not outcome.existing
        # Refused alone: the others of its entry committed.
        assert isinstance(stolen, SubscribeResult) and stolen.error is not None
        assert stolen.error.code is ErrorCode.NOT_OWNER and stolen.sub_id == "taken"
        assert batcher.entries == 3 and batcher.writes == 10
        # The batch's new subscriptions start together, at its entry.
        starts = {o.start for o in outcomes[1:] if isinstance(o, SubscribeResult)}
        assert len(starts) == 1 and outcomes[0].start not in starts  # type: ignore[union-attr]
        batcher.close()

    asyncio.run(run())
    assert subscribe_entries(applied) == [1, 1, 8]
    owners = replica.read(lambda sm: {s: sm.subs.get(s).principal for s in ("taken", "s7")})  # type: ignore[union-attr]
    assert owners == {"taken": "alice", "s7": "alice"}


def test_a_divergent_plan_fails_its_whole_entry_as_a_quarantine(
    solo: tuple[BucketReplica, list[Applied]],
) -> None:
    """A PlanMismatch is a replica divergence, not one SUBSCRIBE's refusal: the replica
    quarantines itself and every SUBSCRIBE of the entry fails UNAVAILABLE."""
    replica, _ = solo

    async def run() -> list[SubscribeResult | BaseException]:
        batcher = SubscribeBatcher(replica, asyncio.get_running_loop())
        futures = [
            batcher.submit([subscribe("fine")]),
            batcher.submit([subscribe("odd", plan_hash=12345)]),
        ]
        return [o for f in futures for o in await f]

    outcomes = asyncio.run(run())
    assert len(outcomes) == 2
    for outcome in outcomes:
        assert isinstance(outcome, ReplicaUnavailable) and outcome.reason == "quarantined"
    assert replica.status()["quarantined"]


def test_an_entry_carries_at_most_the_core_s_limit() -> None:
    async def run() -> StuckReplica:
        replica, loop = StuckReplica(), asyncio.get_running_loop()
        batcher = SubscribeBatcher(replica, loop, entries_in_flight=2)  # type: ignore[arg-type]
        many = limits.SUBSCRIBES_PER_BATCH_MAX + 100
        batcher.submit([subscribe(f"s{i}") for i in range(many)])
        await asyncio.sleep(0)
        assert batcher.entries == 2 and batcher.queued == 0
        assert batcher.writes == many
        batcher.close()
        return replica

    assert asyncio.run(run()).proposed == 2
