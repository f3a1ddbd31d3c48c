"""What the SDK acknowledges, and what closing a subscription leaves on the server,
against a real cluster (docs/emission.md, "Processed" and "Ending").

Processing failures are not acks: an event whose handler raised is delivered again
on resume (sync and async), `AckMode.EXPLICIT` acks only what `ack` was called for,
and `nak` redelivers. `close` ends a subscription on the server unless a cursor keeps
it for a resume (`detach`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import LocalCluster, wait_for
from sdk_facade import KINDS

from sevendb.sdk import (
    AckMode,
    Client,
    Event,
    InvalidArgument,
    SubscribeOptions,
    Subscription,
)

pytestmark = pytest.mark.slow


class HandlerFailed(Exception):
    pass


@pytest.fixture
def cluster(shared_cluster: LocalCluster) -> LocalCluster:
    return shared_cluster


@pytest.fixture(params=KINDS)
def client(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[Client]:
    """A `Client`, and an `AsyncClient` behind the same calls (tests/sdk_facade.py)."""
    with cluster.client(kind=request.param) as c:
        yield c


@pytest.fixture
def sync_client(cluster: LocalCluster) -> Iterator[Client]:
    with cluster.client() as c:
        yield c


def values(events: list[Event]) -> list[bytes]:
    return [c.value for e in events for c in e.changes]


def write(client: Client, key: str, count: int) -> None:
    for i in range(1, count + 1):
        client.put(key, str(i).encode())


def take(sub: Subscription, count: int) -> list[Event]:
    events: list[Event] = []
    for _ in range(count):
        event = sub.poll(30)
        assert event is not None, f"only {len(events)} of {count} events"
        events.append(event)
    return events


def resumed(client: Client, key: str, cursor: Path, count: int) -> list[bytes]:
    """The next `count` events a resumed subscription delivers, then nothing more."""
    with client.subscribe(f"key:{key}", cursor=cursor) as sub:
        events = take(sub, count)
        assert sub.poll(0.3) is None, "more events than expected"
    return values(events)


# ---- item 1: processing failures are not acks -------------------------------------------


@pytest.mark.parametrize("leave", ["with block", "close in finally"])
def test_an_event_whose_handler_raised_is_delivered_again_on_resume(
    client: Client, tmp_path: Path, leave: str
) -> None:
    """Events 1, 2, 3; the handler raises on 2. Leaving the loop acked 2 (it was in
    hand), so a resume delivered only 3."""
    key, cursor = f"fail-{leave[:4]}", tmp_path / "c.cursor"
    sub = client.subscribe(f"key:{key}", cursor=cursor)
    write(client, key, 3)
    handled: list[bytes] = []

    def consume() -> None:
        for event in sub:
            if event.changes[0].value == b"2":
                raise HandlerFailed
            handled.extend(values([event]))

    with pytest.raises(HandlerFailed):
        if leave == "with block":
            with sub:
                consume()
        else:
            try:
                consume()
            finally:
                sub.close()
    assert handled == [b"1"]
    assert resumed(client, key, cursor, 2) == [b"2", b"3"]


def test_leaving_the_loop_normally_processes_the_event_in_hand(
    client: Client, tmp_path: Path
) -> None:
    """The other half of the definition: a `break` out of a ``with`` block is a
    normal exit, and the event in hand counts as processed."""
    key, cursor = "brk", tmp_path / "c.cursor"
    write(client, key, 3)  # before subscribing: nothing to see
    with client.subscribe(f"key:{key}", cursor=cursor) as sub:
        write(client, key, 3)
        for event in sub:
            if event.changes[0].value == b"2":
                break
    assert resumed(client, key, cursor, 1) == [b"3"]


@pytest.mark.parametrize("leave", ["async with", "close in finally"])
def test_an_async_handler_that_raised_leaves_its_event_unacked(
    sync_client: Client, tmp_path: Path, leave: str
) -> None:
    """A `Client`'s subscription read with ``async for`` on the application's own
    loop (`AsyncClient` on that loop: test_sdk_async.py)."""
    client = sync_client
    key, cursor = f"afail-{leave[:5]}", tmp_path / "c.cursor"
    sub = client.subscribe(f"key:{key}", cursor=cursor)
    write(client, key, 3)

    async def consume() -> None:
        async for event in sub:
            if event.changes[0].value == b"2":
                raise HandlerFailed

    async def run() -> None:
        if leave == "async with":
            async with sub:
                await consume()
        else:
            try:
                await consume()
            finally:
                sub.close()

    with pytest.raises(HandlerFailed):
        asyncio.run(run())
    assert resumed(client, key, cursor, 2) == [b"2", b"3"]


# ---- on_event: a callable instead of a loop ----------------------------------------------


def test_on_event_gets_each_event_in_order_and_processes_it_once_it_returns(
    client: Client, tmp_path: Path
) -> None:
    """The callable is handed 1, 2, 3; closing acks all three, so a resume delivers
    only what was written after. Such a subscription cannot also be iterated."""
    key, cursor = "cb-ok", tmp_path / "c.cursor"
    seen: list[bytes] = []
    sub = client.subscribe(
        f"key:{key}", cursor=cursor, on_event=lambda event: seen.extend(values([event]))
    )
    write(client, key, 3)
    wait_for(lambda: len(seen) == 3, 30, "three events")
    with pytest.raises(InvalidArgument, match="on_event"):
        next(sub)
    assert sub.wait_closed(0) is False  # still open
    sub.close()
    assert sub.wait_closed(30) is True
    assert seen == [b"1", b"2", b"3"]
    client.put(key, b"4")
    assert resumed(client, key, cursor, 1) == [b"4"]


def test_on_event_that_raises_closes_its_subscription_and_leaves_the_event_unacked(
    client: Client, tmp_path: Path
) -> None:
    """Events 1, 2, 3; the callable raises on 2. The subscription closes at once (3
    is never handed over), `wait_closed` raises the error, and a resume delivers 2
    and 3: what an exception out of a loop over the subscription does."""
    key, cursor = "cb-fail", tmp_path / "c.cursor"
    seen: list[bytes] = []

    def handle(event: Event) -> None:
        if event.changes[0].value == b"2":
            raise HandlerFailed
        seen.extend(values([event]))

    sub = client.subscribe(f"key:{key}", cursor=cursor, on_event=handle)
    write(client, key, 3)
    with pytest.raises(HandlerFailed):
        sub.wait_closed(30)
    assert seen == [b"1"]
    assert resumed(client, key, cursor, 2) == [b"2", b"3"]


def test_a_group_subscription_takes_no_on_event(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="on_event"):
        client.subscribe("prefix:cb/", group="g", on_event=print)  # type: ignore[call-overload]


def test_explicit_acks_cover_only_what_was_acked_and_a_nak_redelivers(
    client: Client, tmp_path: Path
) -> None:
    """`AckMode.EXPLICIT`: asking for the next event acks nothing; acks in any order
    move the position only over the acked prefix; a nak'd event comes again."""
    key, cursor = "explicit", tmp_path / "c.cursor"
    options = SubscribeOptions(ack=AckMode.EXPLICIT, ack_interval_s=0.01)
    sub = client.subscribe(f"key:{key}", cursor=cursor, options=options)
    write(client, key, 5)
    one, two, three, four, _five = take(sub, 5)
    sub.ack(three)
    sub.ack(one)
    sub.ack(four)
    sub.nak(two, 0.1)
    again = sub.poll(10)
    assert again == two  # the same event, delivered again by the SDK
    with pytest.raises(InvalidArgument, match="not awaiting an ack"):
        sub.nak(one)
    sub.detach()  # 2 and 5 unacked: the position stays at 1

    with client.subscribe(f"key:{key}", cursor=cursor, options=options) as sub:
        events = take(sub, 4)
        assert values(events) == [b"2", b"3", b"4", b"5"]
        for event in events[:3]:  # 2, 3, 4; not 5
            sub.ack(event)
    assert resumed(client, key, cursor, 1) == [b"5"]


def test_acks_out_of_place_are_refused(client: Client) -> None:
    with client.subscribe("key:modes") as auto:
        client.put("modes", b"1")
        [event] = take(auto, 1)
        with pytest.raises(InvalidArgument, match=r"AckMode\.EXPLICIT"):
            auto.ack(event)
        with pytest.raises(InvalidArgument, match=r"AckMode\.EXPLICIT"):
            auto.nak(event)
    options = SubscribeOptions(ack=AckMode.EXPLICIT)
    with client.subscribe("key:modes", name="explicit", options=options) as explicit:
        with pytest.raises(InvalidArgument, match="was handed out"):
            explicit.ack(event)  # another subscription's event
        with pytest.raises(InvalidArgument, match="delay_s must be >= 0"):
            explicit.nak(event, -1)


# ---- item 2: the subscription's lifecycle on the server ---------------------------------


def subscriptions(cluster: LocalCluster, bucket: int) -> set[int]:
    """How many subscriptions each replica of `bucket` holds (one value once they agree)."""
    counts: set[int] = set()
    for node in cluster.spec.nodes:
        status = cluster.status(node.node_id)
        assert status is not None
        counts.update(r.subscriptions for r in status.replicas if r.bucket == bucket)
    return counts


def settled(cluster: LocalCluster, bucket: int) -> int:
    """The number of subscriptions in `bucket`, once every replica agrees on it."""

    def agreed() -> set[int] | None:
        counts = subscriptions(cluster, bucket)
        return counts if len(counts) == 1 else None

    (count,) = wait_for(agreed, 30, "the replicas to agree")
    return count


def test_close_without_a_cursor_ends_the_subscription_on_the_server(
    cluster: LocalCluster, client: Client
) -> None:
    """`close()` only acked: the subscription stayed, collecting rows and holding
    compaction back until its stall window (a day) ran out."""
    bucket = client.layout().bucket_of("gone")
    before = settled(cluster, bucket)
    sub = client.subscribe("key:gone")
    wait_for(lambda: subscriptions(cluster, bucket) == {before + 1}, 30, "the subscription")
    sub.close()
    wait_for(lambda: subscriptions(cluster, bucket) == {before}, 30, "the unsubscribe")


@pytest.mark.parametrize("kind", KINDS)
def test_closing_the_client_ends_its_subscriptions(cluster: LocalCluster, kind: str) -> None:
    with cluster.client() as probe:
        bucket = probe.layout().bucket_of("gone-too")
    client = cluster.client(kind=kind)
    before = settled(cluster, bucket)
    client.subscribe("key:gone-too")
    client.subscribe("key:gone-too", name="second")
    wait_for(lambda: subscriptions(cluster, bucket) == {before + 2}, 30, "two subscriptions")
    client.close()
    wait_for(lambda: subscriptions(cluster, bucket) == {before}, 30, "both unsubscribed")


def test_a_cursor_keeps_the_subscription_for_a_resume_until_unsubscribe(
    cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    key, cursor = "kept", tmp_path / "c.cursor"
    bucket = client.layout().bucket_of(key)
    before = settled(cluster, bucket)
    sub = client.subscribe(f"key:{key}", cursor=cursor)
    [sub_id] = sub.sub_ids.values()
    sub.close()  # with a cursor: detached
    assert settled(cluster, bucket) == before + 1
    client.put(key, b"while away")
    again = client.subscribe(f"key:{key}", cursor=cursor)
    assert again.sub_ids == {bucket: sub_id}  # resumed, not subscribed afresh
    assert values(take(again, 1)) == [b"while away"]
    again.unsubscribe()
    wait_for(lambda: subscriptions(cluster, bucket) == {before}, 30, "the unsubscribe")
    assert sub_id not in cursor.read_text()  # its cursor is forgotten too


def test_detach_without_a_cursor_is_refused_and_changes_nothing(
    cluster: LocalCluster, client: Client
) -> None:
    """Nothing could resume it: it would only hold rows until the node expired it."""
    bucket = client.layout().bucket_of("nodetach")
    with client.subscribe("key:nodetach") as sub:
        count = settled(cluster, bucket)
        with pytest.raises(InvalidArgument, match="needs its cursor"):
            sub.detach()
        client.put("nodetach", b"still open")
        assert values(take(sub, 1)) == [b"still open"]
        assert settled(cluster, bucket) == count
