"""Consumer groups against real node processes (docs/sdk.md, "Consumer groups"): the
query's buckets are spread over the live members, move when one joins, leaves or
stops beating, and a deposed member's acks are refused with a typed error."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import grpc
import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk import (
    AckMode,
    AsyncClient,
    Event,
    GroupFenced,
    GroupSubscription,
    PermissionDenied,
    SubscribeOptions,
    SubscriptionBroken,
)

pytestmark = pytest.mark.slow

BUCKETS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path_factory.mktemp("groups") / "data", buckets=BUCKETS)
    try:
        yield c
    finally:
        c.stop()


def drain(members: list[GroupSubscription], want: int, timeout_s: float = 30) -> list[Event]:
    got: list[Event] = []
    deadline = time.monotonic() + timeout_s
    while sum(len(e.changes) for e in got) < want and time.monotonic() < deadline:
        for member in members:
            event = member.poll(0.05)
            if event is not None:
                got.append(event)
    return got


def test_members_split_the_buckets_and_take_over_when_one_leaves(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        a = client.subscribe("prefix:split/", group="split", session_timeout_s=5)
        # alone: every bucket (one the first beat could not take, the next beat does)
        wait_for(lambda: set(a.stats.owned) == set(range(BUCKETS)), 30, "a takes every bucket")
        b = client.subscribe("prefix:split/", group="split", session_timeout_s=5)
        wait_for(lambda: len(a.stats.owned) == len(b.stats.owned) == 2, 30, "a rebalance")
        assert set(a.stats.owned).isdisjoint(b.stats.owned)
        for i in range(40):
            client.put(f"split/{i}", b"x")
        got = drain([a, b], 40)
        keys = [c.key for e in got for c in e.changes]
        assert sorted(keys) == sorted(f"split/{i}" for i in range(40))  # each once
        b.close()  # leaves: its buckets come to a, after what b processed
        wait_for(lambda: len(a.stats.owned) == BUCKETS, 30, "a takes every bucket")
        for i in range(40, 60):
            client.put(f"split/{i}", b"x")
        later = [c.key for e in drain([a], 20) for c in e.changes]
        assert sorted(later) == sorted(f"split/{i}" for i in range(40, 60))
        assert a.poll(0.5) is None  # nothing of the first 40 again
        a.close()


class _Interrupted(Exception):
    """What this module's SIGINT handler raises (pytest takes KeyboardInterrupt for
    the user's)."""


def _interrupted(_signum: int, _frame: FrameType | None) -> None:
    raise _Interrupted


def test_a_poll_interrupted_by_ctrl_c_hands_out_nothing_so_nothing_is_lost(
    cluster: LocalCluster,
) -> None:
    """Ctrl-C while a member waits in `poll` (as `sevendb subscribe --group` does),
    then an event: the member must not count it processed. It did: the wait went on
    on the client's loop, took the event as the one in hand, and closing acked it, so
    that the next member never got it."""
    previous = signal.signal(signal.SIGINT, _interrupted)
    try:
        with cluster.client() as client:
            a = client.subscribe("prefix:intr/", group="intr", session_timeout_s=5)
            wait_for(lambda: set(a.stats.owned) == set(range(BUCKETS)), 30, "a owns all")

            def interrupt() -> None:
                wait_for(lambda: bool(a._queue._getters), 10, "a poll waiting")  # type: ignore[attr-defined]
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

            interrupter = threading.Thread(target=interrupt)
            interrupter.start()
            with pytest.raises(_Interrupted):
                a.poll(30)
            interrupter.join()
            client.put("intr/1", b"x")
            wait_for(lambda: a._last is not None or a._queue.qsize() > 0, 10, "the event at a")
            a.close()
            b = client.subscribe("prefix:intr/", group="intr", session_timeout_s=5)
            assert [c.key for e in drain([b], 1) for c in e.changes] == ["intr/1"]
            b.close()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_member_that_stops_beating_loses_its_buckets_after_the_session_timeout(
    cluster: LocalCluster,
) -> None:
    with cluster.client() as client, cluster.client() as other:
        a = client.subscribe("prefix:beat/", group="beat", session_timeout_s=1.5)
        b = other.subscribe("prefix:beat/", group="beat", session_timeout_s=1.5)
        wait_for(lambda: len(a.stats.owned) == len(b.stats.owned) == 2, 30, "a rebalance")
        silent = time.monotonic()
        assert b._beats is not None
        other._core._loop().loop.call_soon_threadsafe(b._beats.cancel)  # b goes quiet
        wait_for(lambda: len(a.stats.owned) == BUCKETS, 30, "a takes b's buckets")
        assert time.monotonic() - silent >= 1.5  # not before b's session ran out
        for i in range(10):
            client.put(f"beat/{i}", b"x")
        keys = [c.key for e in drain([a], 10) for c in e.changes]
        assert sorted(keys) == sorted(f"beat/{i}" for i in range(10))
        a.close()


def test_a_deposed_members_ack_is_refused_with_a_typed_error(cluster: LocalCluster) -> None:
    explicit = SubscribeOptions(ack=AckMode.EXPLICIT)
    with cluster.client() as client:
        a = client.subscribe("prefix:fence/", group="fence", options=explicit, session_timeout_s=5)
        layout = client.layout()
        keys = {layout.bucket_of(f"fence/{i}"): f"fence/{i}" for i in range(200)}
        for key in keys.values():  # one event in every bucket
            client.put(key, b"x")
        held = [e for e in (a.poll(10) for _ in range(BUCKETS)) if e is not None]
        assert sorted(e.bucket for e in held) == list(range(BUCKETS))
        terms = dict(a.stats.owned)
        b = client.subscribe("prefix:fence/", group="fence", session_timeout_s=5)
        wait_for(lambda: len(a.stats.owned) == 2, 30, "a rebalance")
        lost = [e for e in held if e.bucket not in a.stats.owned]
        assert len(lost) == 2
        for event in held:
            if event in lost:
                with pytest.raises(GroupFenced):
                    a.ack(event)
            else:
                a.ack(event)  # still a's: acknowledged
        # The node refuses the old term itself, whatever the SDK does.
        md = (("authorization", f"Bearer {cluster.token()}"),)
        for event in lost:
            stub = cluster.stub(cluster.spec.node(cluster.holder_node(event.bucket)).grpc_address)
            old = pb.GroupFence(member=a.member, generation=terms[event.bucket])
            seq = codec.seq_to_pb(event.emit_seq)
            for fence in (old, None):
                ack = pb.ClientAck(sub_id=event.sub_id, up_to_emit_seq=seq, group=fence)
                answer = stub.Ack(pb.AckBatch(acks=[ack]), metadata=md, timeout=10)
                assert answer.results[0].status == pb.AckResult.GROUP_FENCED
        # ... and the new owner gets those events again (they were never acked).
        again = [e for e in (b.poll(10) for _ in lost) if e is not None]
        assert sorted(e.emit_seq for e in again) == sorted(e.emit_seq for e in lost)
        # A plain durable consumer of the group's name is refused, not let in.
        with pytest.raises(SubscriptionBroken, match=r"GROUP_FENCED|consumer group"):
            client.subscribe("prefix:fence/", durable="fence")
        a.close()
        b.close()


def test_async_members_share_a_query(cluster: LocalCluster) -> None:
    spec = cluster.spec
    endpoints = [n.grpc_address for n in spec.nodes]

    async def main() -> list[str]:
        async with AsyncClient(endpoints, token=cluster.token(), tls=cluster.tls) as client:
            a = await client.subscribe("prefix:aio/", group="aio", session_timeout_s=5)
            b = await client.subscribe("prefix:aio/", group="aio", session_timeout_s=5)
            while not (len(a.stats.owned) == len(b.stats.owned) == 2):
                await asyncio.sleep(0.05)
            await asyncio.gather(*(client.put(f"aio/{i}", b"x") for i in range(20)))
            keys: list[str] = []
            deadline = time.monotonic() + 30
            while len(keys) < 20 and time.monotonic() < deadline:
                for member in (a, b):
                    event = await member.apoll(0.05)
                    if event is not None:
                        keys += [c.key for c in event.changes]
            async with a, b:
                pass
            return keys

    keys = asyncio.run(main())
    assert sorted(keys) == sorted(f"aio/{i}" for i in range(20))


def test_a_member_must_be_able_to_read_its_query(cluster: LocalCluster) -> None:
    # carol has no grant: she may read nothing
    with cluster.client(principal="carol") as carol, pytest.raises(PermissionDenied):
        carol.subscribe("prefix:secret/", group="spies")
    stub = cluster.stub(cluster.spec.nodes[0].grpc_address)
    md = (("authorization", f"Bearer {cluster.token()}"),)
    with pytest.raises(grpc.RpcError) as bare:  # a beat that names no query
        stub.GroupBeat(pb.GroupBeatRequest(bucket=0, group="g", member="m"), metadata=md)
    assert bare.value.code() is grpc.StatusCode.INVALID_ARGUMENT
