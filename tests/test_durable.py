"""Durable named subscriptions in the core (docs/core.md, "Durable names"): the name
maps to one subscription per principal, in the replicated state and its snapshots."""

from __future__ import annotations

import msgpack
import pytest

from sevendb.outbox.entries import Subscribe, decode_entry, encode_entry
from sevendb.outbox.errors import ErrorCode, MalformedEntry
from sevendb.outbox.model import ReconnectStatus, SubscribeResult
from sevendb.outbox.query import Query, plan_query
from sevendb.outbox.state import BucketStateMachine
from tests.helpers import Driver, version_2_snapshot

IDLE = 60_000


def subscribed(d: Driver, sub_id: str, query: str = "prefix:o/", **kw: str) -> SubscribeResult:
    result = d.subscribe(sub_id, query, **kw).result
    assert isinstance(result, SubscribeResult)
    return result


def test_a_durable_name_resumes_its_subscription_at_the_acknowledged_point() -> None:
    d = Driver()
    d.lease()
    first = subscribed(d, "s1", durable="billing")
    assert first.error is None and not first.existing and first.acked == first.start
    for key in ("o/1", "o/2", "o/3"):
        d.set(key)
    rows = d.rows("s1")
    assert d.ack("s1", rows[0].emit_seq).error is None  # one processed and purged
    # A fresh process (no cursor, another sub_id) names the subscription.
    again = subscribed(d, "fresh", durable="billing")
    assert again.error is None and again.existing
    assert again.sub_id == "s1" and again.start == first.start
    assert again.acked == rows[0].emit_seq  # its stream resumes right after the ack
    assert d.sm.subs.get("fresh") is None and d.sm.subs.count("alice") == 1
    decision = d.sm.decide_reconnect("s1", "alice", again.acked)
    assert decision.status is ReconnectStatus.OK and decision.resume == rows[1:]


def test_a_name_is_per_principal() -> None:
    d = Driver()
    alice = subscribed(d, "a1", durable="billing")
    bob = subscribed(d, "b1", principal="bob", durable="billing")
    assert bob.error is None and not bob.existing and bob.sub_id == "b1"
    assert d.sm.subs.durable_id("alice", "billing") == "a1"
    assert d.sm.subs.durable_id("bob", "billing") == "b1"
    # Bob cannot reach Alice's by naming her sub_id either.
    stolen = subscribed(d, alice.sub_id, principal="bob", durable="other")
    assert stolen.error is not None and stolen.error.code is ErrorCode.NOT_OWNER


def test_a_name_with_another_query_or_an_unnamed_sub_id_is_refused() -> None:
    d = Driver()
    subscribed(d, "s1", durable="billing")
    subscribed(d, "plain")
    before = d.sm.snapshot()
    other = subscribed(d, "s2", "prefix:x/", durable="billing")
    assert other.error is not None and other.error.code is ErrorCode.SUBSCRIPTION_EXISTS
    assert "'billing'" in other.error.message and "prefix:x/" not in other.error.message
    naming = subscribed(d, "plain", durable="audit")  # an unnamed sub_id given a name
    assert naming.error is not None and naming.error.code is ErrorCode.SUBSCRIPTION_EXISTS
    unnamed = subscribed(d, "s1")  # the named one's sub_id without its name
    assert unnamed.error is not None and unnamed.error.code is ErrorCode.SUBSCRIPTION_EXISTS
    # Refusals change nothing but the applied index.
    after = BucketStateMachine.restore(d.sm.snapshot())
    assert after.subs.sorted() == BucketStateMachine.restore(before).subs.sorted()


def test_unsubscribing_or_expiring_frees_the_name() -> None:
    d = Driver()
    d.lease()
    subscribed(d, "s1", durable="billing")
    d.unsubscribe("s1")
    assert d.sm.subs.durable_id("alice", "billing") is None
    fresh = subscribed(d, "s2", durable="billing")
    assert not fresh.existing and fresh.sub_id == "s2"
    from sevendb.outbox.entries import OutboxPurge

    d.now_ms += IDLE + 1
    d.apply(OutboxPurge(d.sm.lease_index, (), ("s2",), IDLE, d.tick()))
    assert d.sm.subs.get("s2") is None and d.sm.subs.durable_id("alice", "billing") is None
    assert not subscribed(d, "s3", durable="billing").existing


def test_names_survive_a_snapshot_and_format_2_still_restores() -> None:
    d = Driver()
    d.lease()
    subscribed(d, "s1", durable="billing")
    d.set("o/1")
    restored = BucketStateMachine.restore(d.sm.snapshot())
    assert restored.digest() == d.sm.digest()
    assert restored.subs.durable_id("alice", "billing") == "s1"
    assert msgpack.unpackb(d.sm.snapshot(), raw=False)[0] == 3
    # A format-2 state (before names) restores with unnamed subscriptions, and
    # re-snapshots as format 3 with the same content otherwise.
    old = Driver()
    old.lease()
    subscribed(old, "s1")
    old.set("o/1")
    from_2 = BucketStateMachine.restore(version_2_snapshot(old.sm))
    # Everything but the history, which format 2 did not keep: it starts at the
    # snapshot's index.
    assert msgpack.unpackb(from_2.snapshot())[:12] == msgpack.unpackb(old.sm.snapshot())[:12]
    assert not from_2.history and from_2.history.after == old.sm.emit_seq(old.index)
    assert from_2.subs.get("s1") is not None and from_2.subs.get("s1").durable == ""  # type: ignore[union-attr]


def test_the_entry_carries_a_name_only_when_there_is_one() -> None:
    q = Query.parse("all")
    plain = Subscribe("s", "alice", q, plan_query(q).plan_hash, 5)
    named = Subscribe("s", "alice", q, plan_query(q).plan_hash, 5, "billing")
    assert len(msgpack.unpackb(encode_entry(plain))) == 2 + 6
    assert len(msgpack.unpackb(encode_entry(named))) == 2 + 7
    assert decode_entry(encode_entry(named)) == named
    assert decode_entry(encode_entry(plain)) == plain
    raw = msgpack.unpackb(encode_entry(plain))
    with pytest.raises(MalformedEntry, match="six fields"):
        decode_entry(msgpack.packb([*raw, ""]))
    with pytest.raises(MalformedEntry):
        decode_entry(msgpack.packb([*raw, 7]))
    with pytest.raises(MalformedEntry):
        decode_entry(msgpack.packb([*raw, "x" * 200]))
