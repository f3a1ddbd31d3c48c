"""Consumer groups in the core (outbox/groups.py, docs/core.md "Consumer groups"):
membership, the deterministic owner of a bucket, its generation, expiry by the
entries' own time, and the group table in snapshots and entries."""

from __future__ import annotations

import msgpack
import pytest

from sevendb.outbox.entries import decode_entry, encode_entry
from sevendb.outbox.errors import ErrorCode, InvalidArgument, MalformedEntry
from sevendb.outbox.groups import (
    MEMBERS_PER_GROUP_MAX,
    GroupBeat,
    GroupResult,
    GroupTable,
)
from sevendb.outbox.state import BucketStateMachine
from sevendb.sdk import Client, RetryPolicy


def beat(
    member: str, now: int, slot: int = 0, *, leaving: bool = False, timeout: int = 1000
) -> GroupBeat:
    return GroupBeat("alice", "workers", member, slot, timeout, leaving, now)


class Bucket:
    """One bucket's state machine fed GROUP_BEAT entries through the log's bytes."""

    def __init__(self) -> None:
        self.sm = BucketStateMachine("uuid-0")
        self.index = 0

    def apply(self, entry: GroupBeat) -> GroupResult:
        self.index += 1
        result = self.sm.apply(self.index, encode_entry(entry)).result
        assert isinstance(result, GroupResult)
        return result


def test_the_buckets_are_dealt_round_robin_over_the_sorted_members() -> None:
    owners = {}
    for slot in range(4):
        table = GroupTable()
        for member in ("m2", "m0", "m1"):
            last = table.apply(beat(member, 10, slot))
        owners[slot] = last.owner
        assert last.members == ("m0", "m1", "m2")
    assert owners == {0: "m0", 1: "m1", 2: "m2", 3: "m0"}


def test_the_generation_grows_only_when_the_owner_changes() -> None:
    b = Bucket()
    assert (b.apply(beat("m1", 0)).owner, b.sm.groups.owner("alice", "workers")) == (
        "m1",
        ("m1", 1),
    )
    assert b.apply(beat("m1", 100)).generation == 1  # a heartbeat changes nothing
    joined = b.apply(beat("m0", 200))  # m0 sorts first: slot 0 is now its
    assert (joined.owner, joined.generation) == ("m0", 2)
    assert b.apply(beat("m1", 300)).generation == 2
    left = b.apply(beat("m0", 400, leaving=True))
    assert (left.owner, left.generation, left.members) == ("m1", 3, ("m1",))
    gone = b.apply(beat("m1", 500, leaving=True))
    assert (gone.owner, gone.generation, gone.members) == ("", 4, ())
    back = b.apply(beat("m0", 600))  # generations never repeat: an old term stays fenced
    assert (back.owner, back.generation) == ("m0", 5)


def test_a_member_that_stops_beating_expires_by_the_time_in_the_next_entry() -> None:
    b = Bucket()
    b.apply(beat("m0", 0, timeout=1000))
    b.apply(beat("m1", 10, timeout=5000))
    assert b.sm.groups.owner("alice", "workers") == ("m0", 1)
    still = b.apply(beat("m1", 999))  # m0's last beat + its timeout not yet reached
    assert still.owner == "m0" and still.members == ("m0", "m1")
    after = b.apply(beat("m1", 1000))
    assert (after.owner, after.generation, after.members) == ("m1", 2, ("m1",))


def test_a_deposed_members_term_is_fenced() -> None:
    b = Bucket()
    b.apply(beat("m1", 0))
    groups = b.sm.groups
    assert groups.fenced("alice", "workers", "m1", 1) is None
    b.apply(beat("m0", 1))  # m0 takes slot 0: m1's generation 1 is over
    reason = groups.fenced("alice", "workers", "m1", 1)
    assert reason is not None and "does not own" in reason
    assert groups.fenced("alice", "workers", "m0", 1) is not None  # the right member, old term
    assert groups.fenced("alice", "workers", "m0", 2) is None
    assert groups.fenced("bob", "workers", "m0", 2) is not None  # groups are per principal
    assert not groups.is_group("bob", "workers") and groups.is_group("alice", "workers")


def test_replicas_that_apply_the_same_beats_agree_and_snapshots_keep_the_groups() -> None:
    entries = [beat(m, t, slot=1) for t, m in enumerate(["a", "b", "c", "a", "b"])]
    entries.append(beat("c", 9, slot=1, leaving=True))
    one, two = Bucket(), Bucket()
    for entry in entries:
        one.apply(entry)
        two.apply(entry)
    assert one.sm.snapshot() == two.sm.snapshot()
    restored = BucketStateMachine.restore(one.sm.snapshot())
    assert restored.snapshot() == one.sm.snapshot()
    assert restored.groups.owner("alice", "workers") == one.sm.groups.owner("alice", "workers")
    # A bucket without groups snapshots as before (no fifteenth field).
    assert len(msgpack.unpackb(BucketStateMachine("u").snapshot())) == 14
    assert len(msgpack.unpackb(one.sm.snapshot())) == 15


def test_a_group_is_bounded_and_refuses_one_member_too_many() -> None:
    table = GroupTable()
    for i in range(MEMBERS_PER_GROUP_MAX):
        assert table.apply(beat(f"m{i:05}", 0)).error is None
    refused = table.apply(beat("late", 0))
    assert refused.error is not None and refused.error.code is ErrorCode.LIMIT_EXCEEDED
    assert "late" not in refused.members and len(refused.members) == MEMBERS_PER_GROUP_MAX


def test_group_beats_round_trip_and_bad_ones_are_refused() -> None:
    entry = beat("m0", 42, slot=3, leaving=True)
    assert decode_entry(encode_entry(entry)) == entry
    for bad in (
        dict(member=""),
        dict(slot=-1),
        dict(session_timeout_ms=5),
        dict(session_timeout_ms=10**9),
        dict(leaving=1),
        dict(group="g" * 200),
    ):
        fields = dict(
            principal="alice",
            group="workers",
            member="m",
            slot=0,
            session_timeout_ms=1000,
            leaving=False,
            now_ms=0,
        )
        fields.update(bad)
        with pytest.raises(InvalidArgument):
            GroupBeat(**fields)  # type: ignore[arg-type]
        raw = msgpack.packb([1, 16, *fields.values()])
        with pytest.raises(MalformedEntry):
            decode_entry(raw)
    with pytest.raises(MalformedEntry):
        decode_entry(msgpack.packb([1, 16, "alice", "workers"]))


def test_bad_group_arguments_are_refused_before_anything_is_sent() -> None:
    with Client(["127.0.0.1:1"], tls=None, retry=RetryPolicy(deadline_s=60)) as client:
        for bad in (dict(session_timeout_s=0.01), dict(session_timeout_s=10**6), dict()):
            with pytest.raises(InvalidArgument):
                client.subscribe("all", group="" if not bad else "g", **bad)  # type: ignore[call-overload]
        with pytest.raises(InvalidArgument):
            client.subscribe("all", group="g", durable="d")  # type: ignore[call-overload]
