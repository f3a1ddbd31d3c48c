"""`AsyncClient` against a real cluster (TLS, token), and the same calls of `Client`:
writes, reads, deletes, conditions, sync, status, producers and their errors are
one behaviour behind two faces (tests/sdk_facade.py). And what only the coroutines
do: run on the application's own loop with no thread of the SDK's, many writes in
flight from one task, a full write queue awaited rather than blocking the loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import LocalCluster
from sdk_facade import KINDS, make_client

from sevendb.sdk import (
    AsyncClient,
    Client,
    InvalidArgument,
    PreconditionFailed,
    ResourceExhausted,
    Unauthenticated,
    WriteQueue,
    delete_op,
    set_op,
)

pytestmark = pytest.mark.slow


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """`Client`, or `AsyncClient` behind the same calls (tests/sdk_facade.py)."""
    return str(request.param)


@pytest.fixture
def client(shared_cluster: LocalCluster, kind: str) -> Iterator[Client]:
    with shared_cluster.client(kind=kind) as c:
        yield c


def endpoints(cluster: LocalCluster) -> list[str]:
    return [n.grpc_address for n in cluster.spec.nodes]


# ---- one behaviour, two faces ----------------------------------------------------------


def test_put_get_delete_and_their_conditions(client: Client, kind: str) -> None:
    key = f"both/{kind}/k"
    first = client.put(key, b"1")
    assert first.versions == {key: 1} and not first.duplicate
    assert client.put(key, b"2", expected_version=1).versions == {key: 2}
    with pytest.raises(PreconditionFailed):
        client.put(key, b"3", expected_version=1)
    with pytest.raises(PreconditionFailed):
        client.put(key, b"3", must_not_exist=True)
    record = client.get(key)
    assert record is not None and (record.value, record.version) == (b"2", 2)
    assert record.mod_commit_index > first.committed.commit_index
    with pytest.raises(PreconditionFailed):
        client.delete(key, expected_version=1)
    client.delete(key, expected_version=2)
    assert client.get(key) is None
    assert client.get(f"both/{kind}/missing") is None


def test_an_atomic_write_and_its_bad_input(client: Client, kind: str) -> None:
    layout = client.layout()
    keys = [k for k in (f"atom/{kind}/{i}" for i in range(1000)) if layout.bucket_of(k) == 0][:2]
    result = client.write([set_op(keys[0], b"a"), set_op(keys[1], b"b")])
    assert result.bucket == 0 and set(result.versions) == set(keys)
    assert client.write([delete_op(keys[0]), set_op(keys[1], b"c")]).versions[keys[1]] == 2
    with pytest.raises(InvalidArgument, match="at least one op"):
        client.write([])
    other = next(k for k in (f"atom/{kind}/x{i}" for i in range(1000)) if layout.bucket_of(k))
    with pytest.raises(InvalidArgument, match="atomic within one bucket"):
        client.write([set_op(keys[0], b"a"), set_op(other, b"b")])
    with pytest.raises(InvalidArgument, match="each key at most once"):
        client.write([set_op(keys[0], b"a"), set_op(keys[0], b"b")])
    assert client.get(other) is None  # nothing of the refused writes was applied


def test_sync_pages_a_bucket_s_keys(client: Client, kind: str) -> None:
    layout = client.layout()
    keys = [k for k in (f"page/{kind}/{i}" for i in range(1000)) if layout.bucket_of(k) == 1][:5]
    for key in keys:
        client.put(key, key.encode())
    records = {r.key: r for r in client.sync_bucket(1, page_size=2)}
    assert {k: records[k].value for k in keys} == {k: k.encode() for k in keys}


def test_status_layout_and_a_producer_of_its_own(
    client: Client, kind: str, shared_cluster: LocalCluster
) -> None:
    layout = client.layout()
    assert layout.buckets == 2 and len(layout.nodes) == 3
    status = client.status(endpoints(shared_cluster)[0])
    assert {r.bucket for r in status.replicas} == {0, 1}
    producer = client.producer()
    assert producer.producer_id != 0
    assert producer.put(f"prod/{kind}", b"v").versions == {f"prod/{kind}": 1}


def test_a_bad_token_is_unauthenticated(shared_cluster: LocalCluster, kind: str) -> None:
    with make_client(
        kind, endpoints(shared_cluster), token="not-a-token", tls=shared_cluster.tls
    ) as client:
        with pytest.raises(Unauthenticated):
            client.get("k")
        with pytest.raises(Unauthenticated):
            client.put("k", b"v")


# ---- only the coroutines -----------------------------------------------------------------


def test_an_async_client_runs_on_the_caller_s_loop_with_no_thread_of_its_own(
    shared_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Writes, reads and a subscription with a cursor, all awaited in one
    `asyncio.run`: the SDK starts no loop thread (a `Client` starts `sevendb-sdk`),
    and a resumed subscription carries on after what the first processed."""
    cursor = tmp_path / "c.cursor"

    async def main() -> tuple[list[bytes], list[bytes], set[str]]:
        async with AsyncClient(
            endpoints(shared_cluster), token=shared_cluster.token(), tls=shared_cluster.tls
        ) as client:
            async with await client.subscribe("key:native", cursor=cursor) as sub:
                with pytest.raises(InvalidArgument, match="async for"):
                    sub.poll(1)  # blocking on the loop it waits for: refused, not hung
                await asyncio.gather(*(client.put("native", b"%d" % i) for i in range(3)))
                first: list[bytes] = []
                while len(first) < 3:  # concurrent writes may share an entry, so an event
                    event = await asyncio.wait_for(anext(sub), 30)
                    first.extend(c.value for c in event.changes)
            await client.put("native", b"after")
            async with await client.subscribe("key:native", cursor=cursor) as again:
                event = await asyncio.wait_for(anext(again), 30)
            names = {t.name for t in threading.enumerate()}
        return first, [c.value for c in event.changes], names

    first, resumed, threads = asyncio.run(main())
    assert sorted(first) == [b"0", b"1", b"2"]  # concurrent puts: in any order, once each
    assert resumed == [b"after"]
    assert "sevendb-sdk" not in threads


def queued(cluster: LocalCluster, queue: WriteQueue) -> AsyncClient:
    return AsyncClient(
        endpoints(cluster), token=cluster.token(), tls=cluster.tls, write_queue=queue
    )


def test_a_full_write_queue_is_awaited_then_refused_without_blocking_the_loop(
    shared_cluster: LocalCluster,
) -> None:
    """A `Client`'s write on its own loop raises at once when the queue is full; a
    coroutine awaits room instead (the loop keeps running meanwhile), then raises
    after `wait_s` having sent nothing, or goes out once there is room."""
    cluster = shared_cluster
    nodes = [n.node_id for n in cluster.spec.nodes]

    async def main() -> None:
        async with queued(cluster, WriteQueue(max_writes=2, wait_s=0.5)) as client:
            await client.put("queue/warm", b"w")
            with cluster.paused(nodes):
                held = [asyncio.create_task(client.put(f"queue/{i}", b"v")) for i in range(2)]
                await asyncio.sleep(0)  # they take the queue's room
                ticks = 0

                async def tick() -> None:
                    nonlocal ticks
                    while True:
                        await asyncio.sleep(0.01)
                        ticks += 1

                ticker = asyncio.create_task(tick())
                started = time.monotonic()
                with pytest.raises(ResourceExhausted, match="write queue is full"):
                    await client.put("queue/refused", b"x")
                assert time.monotonic() - started >= 0.5
                assert ticks >= 10  # the loop ran while the write waited
                waiting = asyncio.create_task(client.put("queue/later", b"v"))
                await asyncio.sleep(0.1)
                assert not waiting.done()
            results = await asyncio.wait_for(asyncio.gather(*held, waiting), 60)
            ticker.cancel()
            assert [len(r.versions) for r in results] == [1, 1, 1]
            assert await client.get("queue/refused") is None

    asyncio.run(main())


def test_a_cancelled_write_still_applies_once_and_gives_its_room_back(
    shared_cluster: LocalCluster,
) -> None:
    """A coroutine cancelled while its write is in flight: the write is not taken
    back (it may have reached the log), it applies once, and when it is answered its
    room in the queue comes back (a queue of one write takes the next write)."""
    cluster = shared_cluster
    nodes = [n.node_id for n in cluster.spec.nodes]

    async def main() -> None:
        async with queued(cluster, WriteQueue(max_writes=1, wait_s=30)) as client:
            await client.put("cancel/warm", b"w")
            with cluster.paused(nodes):
                cancelled = asyncio.create_task(client.put("cancel/a", b"v"))
                await asyncio.sleep(0.1)
                cancelled.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await cancelled
            after = await asyncio.wait_for(client.put("cancel/b", b"v"), 60)
            assert after.versions == {"cancel/b": 1}
            record = await client.get("cancel/a")
            assert record is not None and record.version == 1

    asyncio.run(main())
