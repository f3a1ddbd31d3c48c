"""Lifecycles in the core (issue 27, items 2 and 3): an idle subscription is expired
*and deleted* by a replicated entry (rows dropped, slot freed), a closed one is
deleted with its rows, keep-alives hold attached quiet subscriptions, idle producers
are forgotten, all decided from the times entries carry; and the compaction safety
point of docs/contract.md §8."""

from __future__ import annotations

import msgpack
import pytest
from helpers import BUCKET, Driver, replay, version_1_snapshot

from sevendb.outbox import limits
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    Ack,
    InitProducer,
    OutboxPurge,
    ProducerRef,
    decode_entry,
    encode_entry,
)
from sevendb.outbox.errors import ErrorCode, MalformedEntry
from sevendb.outbox.lifecycle import (
    cold_replica_checkpoint,
    expirable_subscriptions,
    subscription_info,
    subscription_page,
)
from sevendb.outbox.model import (
    AckStatus,
    CloseReason,
    PurgeResult,
    ReconnectStatus,
    SubscribeResult,
    SubscriptionClosed,
    WriteResult,
)
from sevendb.outbox.state import BucketStateMachine

WINDOW = 1_000
IDLE = 5_000


def expire(d: Driver, *sub_ids: str, at: int, window: int = WINDOW) -> PurgeResult:
    applied = d.apply(OutboxPurge(d.sm.lease_index, (), sub_ids, window, at))
    assert isinstance(applied.result, PurgeResult)
    return applied.result


def with_rows(d: Driver, sub_id: str = "s", key: str = "k") -> EmitSeq:
    """`sub_id` subscribed to `key` with one outboxed row; its row's position."""
    d.subscribe(sub_id, f"key:{key}")
    d.set(key)
    d.outbox()
    return d.rows(sub_id)[-1].emit_seq


def holder() -> Driver:
    d = Driver()
    d.lease()
    return d


# ---- subscriptions -------------------------------------------------------------------


def test_an_expired_subscription_is_deleted_and_frees_its_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(limits, "SUBSCRIPTIONS_PER_BUCKET_MAX", 2)
    d = holder()
    with_rows(d, "a")
    d.subscribe("b", "all")
    full = d.subscribe("c", "all").result
    assert isinstance(full, SubscribeResult) and full.error is not None
    assert full.error.code is ErrorCode.LIMIT_EXCEEDED
    result = expire(d, "a", at=d.now_ms + WINDOW + 1)
    assert result.expired == ("a",)
    # Deleted (not kept as a stale entry): no rows, no subscription, one slot free.
    assert d.sm.subs.get("a") is None and d.sm.subs.outbox_size() == 0
    assert d.sm.subs.count() == 1
    taken = d.subscribe("c", "all").result
    assert isinstance(taken, SubscribeResult) and taken.error is None


def test_a_subscription_with_nothing_to_acknowledge_expires_too() -> None:
    d = holder()
    d.subscribe("quiet", "key:never-written")
    d.subscribe("watched", "key:never-written-either")
    at = d.now_ms + WINDOW + 1
    # Before, only a subscription with rows could expire: one whose client vanished
    # before anything matched held its slot for ever.
    assert expire(d, "quiet", at=at).expired == ("quiet",)
    assert d.sm.subs.count() == 1
    # What the holder proposes: every idle one, except those whose client is attached
    # (it keeps them alive instead).
    assert expirable_subscriptions(d.sm, at, WINDOW) == ("watched",)
    assert expirable_subscriptions(d.sm, at, WINDOW, attached={"watched"}) == ()


def test_an_expired_subscription_answers_stale_then_can_start_again() -> None:
    d = holder()
    first = with_rows(d)
    expire(d, "s", at=d.now_ms + WINDOW + 1)
    assert d.sm.decide_reconnect("s", "alice", first).status is ReconnectStatus.STALE_SEQUENCE
    assert d.ack("s", first).acks[0].status is AckStatus.STALE
    other = d.sm.decide_reconnect("s", "mallory", first)
    assert other.status is ReconnectStatus.SUBSCRIPTION_NOT_FOUND and other.not_owner
    # Subscribing again with the same id is a new subscription from here, fed again.
    again = d.subscribe("s", "key:k").result
    assert isinstance(again, SubscribeResult) and not again.existing and again.start is not None
    assert again.start > first
    d.set("k")
    d.outbox()
    assert [r.prev_emit_seq for r in d.rows("s")] == [again.start]


def test_expired_subscriptions_are_remembered_within_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(limits, "EXPIRED_REMEMBERED_MAX", 2)
    d = holder()
    starts = {}
    for sub_id in ("a", "b", "c"):
        d.subscribe(sub_id, "all")
        starts[sub_id] = d.sm.subs.get(sub_id).start  # type: ignore[union-attr]
    expire(d, "a", "b", "c", at=d.now_ms + WINDOW + 1)
    answers = {s: d.sm.decide_reconnect(s, "alice", starts[s]).status for s in starts}
    assert answers == {
        "a": ReconnectStatus.SUBSCRIPTION_NOT_FOUND,  # forgotten: the oldest
        "b": ReconnectStatus.STALE_SEQUENCE,
        "c": ReconnectStatus.STALE_SEQUENCE,
    }


def test_expiry_is_judged_on_the_entrys_time_and_window() -> None:
    d = holder()
    with_rows(d)
    last = d.sm.subs.get("s").last_active_ms  # type: ignore[union-attr]
    assert expire(d, "s", at=last + WINDOW).expired == ()  # not yet past it
    assert d.sm.subs.get("s") is not None and len(d.rows("s")) == 1
    assert expire(d, "s", at=last + WINDOW + 1).expired == ("s",)


def test_an_unsubscribe_deletes_the_subscription_and_its_rows() -> None:
    d = holder()
    with_rows(d)
    d.set("k")  # a second row, still pending
    applied = d.unsubscribe("s")
    assert SubscriptionClosed("s", CloseReason.UNSUBSCRIBED) in applied.effects
    assert d.sm.subs.get("s") is None and d.sm.subs.count("alice") == 0
    d.outbox()  # the pending row is dropped, not attached to anything
    assert d.sm.subs.outbox_size() == 0


def test_keep_alives_hold_only_subscriptions_with_nothing_to_acknowledge() -> None:
    d = holder()
    d.subscribe("quiet", "key:never-written")
    with_rows(d, "busy")
    later = d.now_ms + WINDOW + 1
    d.apply(OutboxPurge(d.sm.lease_index, touch=("quiet", "busy", "gone"), now_ms=later))
    assert d.sm.subs.get("quiet").last_active_ms == later  # type: ignore[union-attr]
    # A subscriber that acknowledges nothing is not kept alive by being attached.
    assert expirable_subscriptions(d.sm, later + 1, WINDOW, attached={"busy"}) == ("busy",)
    assert expire(d, "quiet", "busy", at=later + 1).expired == ("busy",)


def test_subscriptions_are_counted_per_principal() -> None:
    d = holder()
    d.subscribe("a1", "all", principal="alice")
    d.subscribe("a2", "all", principal="alice")
    d.subscribe("b1", "all", principal="bob")
    assert (d.sm.subs.count("alice"), d.sm.subs.count("bob")) == (2, 1)
    d.unsubscribe("a1")
    expire(d, "b1", at=d.now_ms + WINDOW + 1)
    assert d.sm.subs.count("alice") == 1 and d.sm.subs.count("bob") == 0
    restored = BucketStateMachine.restore(d.sm.snapshot())
    assert restored.subs.count("alice") == 1


def test_subscription_info_for_operators() -> None:
    d = holder()
    with_rows(d)
    d.set("k", b"abc")  # pending
    info = subscription_info(d.sm, "s")
    assert info is not None
    assert (info.principal, str(info.query), info.rows, info.pending_rows) == (
        "alice",
        "key:k",
        1,
        1,
    )
    assert info.row_bytes == len("k") + len("v")
    assert info.lag == info.head.commit_index - info.acked.commit_index > 0
    assert subscription_info(d.sm, "nope") is None
    for i in range(5):
        d.subscribe(f"t{i}", "all", principal="bob")
    assert subscription_page(d.sm, "t1", 2, "bob") == (("t2", "t3"), True)
    assert subscription_page(d.sm, "", 0, "alice") == (("s",), False)


# ---- the safety point ------------------------------------------------------------------


def test_an_idle_subscription_stops_holding_the_safety_point_at_its_window() -> None:
    d = holder()
    with_rows(d)
    for i in range(5):
        d.set(f"other{i}")
    acked = d.sm.subs.get("s").acked.commit_index  # type: ignore[union-attr]
    last = d.sm.subs.get("s").last_active_ms  # type: ignore[union-attr]
    assert d.sm.safety_point(last + WINDOW, WINDOW) == acked
    assert d.sm.safety_point(last + WINDOW + 1, WINDOW) == d.sm.applied_index
    expire(d, "s", at=last + WINDOW + 1)
    assert d.sm.safety_point(last, WINDOW) == d.sm.applied_index  # deleted: holds nothing


def test_the_cold_replica_checkpoint_holds_only_replicas_heard_within_the_window() -> None:
    assert cold_replica_checkpoint([], 10_000, WINDOW) is None
    now = 10_000
    replicas = [(40, now - 10), (25, now - WINDOW), (7, now - WINDOW - 1)]
    assert cold_replica_checkpoint(replicas, now, WINDOW) == 25  # the third is gone too long
    d = holder()
    for i in range(50):
        d.set(f"k{i}")
    cold = cold_replica_checkpoint(replicas, now, WINDOW)
    assert d.sm.safety_point(now, WINDOW, cold_replica_checkpoint=cold) == 25


# ---- producers ---------------------------------------------------------------------------


def test_an_idle_producer_is_forgotten_and_frees_its_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "PRODUCERS_PER_BUCKET_MAX", 1)
    d = holder()
    d.init_producer(7)
    d.set("k", producer=ProducerRef(7, 0, 0))
    last = d.now_ms  # its last write
    refused = d.init_producer(8).result
    assert refused.error is not None and refused.error.code is ErrorCode.LIMIT_EXCEEDED  # type: ignore[union-attr]
    assert d.sm.producers.idle(last + IDLE, IDLE) == ()
    assert d.sm.producers.idle(last + IDLE + 1, IDLE) == (7,)
    early = OutboxPurge(
        d.sm.lease_index, now_ms=last + IDLE, expire_producers=(7,), producer_idle_ms=IDLE
    )
    assert d.apply(early).result == PurgeResult()  # not idle long enough: nothing changes
    late = OutboxPurge(
        d.sm.lease_index, now_ms=last + IDLE + 1, expire_producers=(7, 99), producer_idle_ms=IDLE
    )
    assert d.apply(late).result == PurgeResult(expired_producers=(7,))
    assert len(d.sm.producers) == 0
    gone = d.set("k", producer=ProducerRef(7, 0, 1)).result
    assert isinstance(gone, WriteResult) and gone.error is not None
    assert gone.error.code is ErrorCode.UNKNOWN_PRODUCER
    taken = d.init_producer(8).result
    assert taken.error is None  # type: ignore[union-attr]


def test_a_producers_writes_and_retries_keep_it_alive() -> None:
    d = holder()
    d.apply(InitProducer(7, 1_000))
    d.now_ms = 1_000 + IDLE
    d.set("k", producer=ProducerRef(7, 0, 0))  # a write at IDLE after the init
    assert d.sm.producers.idle(1_000 + IDLE + 1, IDLE) == ()
    d.now_ms = 1_000 + 2 * IDLE
    again = d.set("k", producer=ProducerRef(7, 0, 0)).result  # a retry: a duplicate
    assert isinstance(again, WriteResult) and again.duplicate
    assert d.sm.producers.idle(1_000 + 2 * IDLE + 2, IDLE) == ()


def test_producer_expiry_is_deterministic_across_replays_and_snapshots() -> None:
    d = holder()
    d.init_producer(7)
    d.init_producer(9)
    d.set("k", producer=ProducerRef(9, 0, 0))
    at = d.now_ms + IDLE
    d.apply(
        OutboxPurge(d.sm.lease_index, now_ms=at, expire_producers=(7, 9), producer_idle_ms=IDLE)
    )
    assert len(d.sm.producers) == 1  # 9 wrote more recently
    assert replay(d.log).digest() == d.sm.digest()
    restored = BucketStateMachine.restore(d.sm.snapshot())
    assert restored.digest() == d.sm.digest() and restored.producers.idle(at + IDLE, IDLE) == (9,)


# ---- the entry and the snapshot ----------------------------------------------------------


def test_a_purge_without_lifecycle_fields_keeps_its_five_fields() -> None:
    plain = OutboxPurge(3, (Ack("s", "alice", EmitSeq(BUCKET, 1, 4)),), ("x",), 10, 20)
    raw = msgpack.unpackb(encode_entry(plain))
    assert len(raw) == 2 + 5
    assert decode_entry(encode_entry(plain)) == plain
    full = OutboxPurge(3, (), (), 10, 20, ("t",), (5,), 30)
    assert len(msgpack.unpackb(encode_entry(full))) == 2 + 8
    assert decode_entry(encode_entry(full)) == full
    # Eight fields whose lifecycle part is empty are not canonical: refused.
    padded = msgpack.packb([*raw, [], [], limits.PRODUCER_IDLE_MS_DEFAULT])
    with pytest.raises(MalformedEntry):
        decode_entry(padded)
    with pytest.raises(MalformedEntry):
        decode_entry(msgpack.packb([*raw, [], []]))


def test_a_snapshot_keeps_lifecycles() -> None:
    d = holder()
    with_rows(d, "gone")
    with_rows(d, "kept", "k2")
    d.init_producer(7)
    expire(d, "gone", at=d.now_ms + WINDOW + 1)
    restored = BucketStateMachine.restore(d.sm.snapshot())
    assert restored.digest() == d.sm.digest()
    assert restored.decide_reconnect("gone", "alice", EmitSeq(BUCKET, 1, 5)).status is (
        ReconnectStatus.STALE_SEQUENCE
    )
    assert restored.producers.idle(d.now_ms + IDLE, IDLE) == ()


def test_a_snapshot_keeps_rows_not_yet_checkpointed_beside_the_lifecycles() -> None:
    """Format 2 carries both: a live subscription's rows computed since the last
    checkpoint, and the expired subscriptions remembered (an expired one's rows not
    yet checkpointed only in the pending batches, for the next checkpoint's digest)."""
    d = holder()
    d.subscribe("live", "key:k")
    d.subscribe("gone", "key:k")
    d.init_producer(7)
    d.set("k")  # a row for each, not checkpointed
    expire(d, "gone", at=d.now_ms + WINDOW + 1)
    snap = d.sm.snapshot()
    restored = BucketStateMachine.restore(snap)
    assert restored.snapshot() == snap
    assert restored.subs.outbox_rows("live") == d.rows("live") and len(d.rows("live")) == 1
    assert restored.subs.get("gone") is None and len(restored.pending.rows()) == 2
    assert restored.decide_reconnect("gone", "alice", EmitSeq(BUCKET, 1, 1)).status is (
        ReconnectStatus.STALE_SEQUENCE
    )
    for at in (d.now_ms, d.now_ms + IDLE + 1):
        assert restored.producers.idle(at, IDLE) == d.sm.producers.idle(at, IDLE)
    assert d.outbox() is not None
    restored.apply(*d.log[-1])  # the checkpoint's digest holds on the restored replica
    assert restored.digest() == d.sm.digest() and restored.pending.rows() == ()


def _version_1(sm: BucketStateMachine) -> bytes:
    """`sm`'s snapshot in format 1, with a stale subscription "old" besides."""
    sub = msgpack.unpackb(sm.snapshot(), raw=False)[9][0]
    return version_1_snapshot(sm, (["old", "alice", 2, "", sub[4], sub[5], sub[5], sub[5], 1, []],))


def test_a_format_1_snapshot_is_still_read() -> None:
    d = holder()
    with_rows(d)
    d.init_producer(7)
    latest = d.sm.subs.get("s").rows[-1].delta.commit_time_ms  # type: ignore[union-attr]
    old = BucketStateMachine.restore(_version_1(d.sm))
    assert old.subs.get("s") is not None and old.subs.get("old") is None
    assert old.decide_reconnect("old", "alice", EmitSeq(BUCKET, 1, 1)).status is (
        ReconnectStatus.STALE_SEQUENCE
    )
    # Producers are taken as active at the snapshot's latest time: not forgotten at once.
    assert old.producers.idle(latest + IDLE, IDLE) == ()
    assert old.producers.idle(latest + IDLE + 1, IDLE) == (7,)
