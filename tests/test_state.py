"""Unit tests of the bucket state machine, one behaviour each."""

from __future__ import annotations

import msgpack
import pytest
import xxhash
from helpers import BUCKET, Driver, version_1_snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from sevendb.outbox import limits
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    ANY,
    NOT_EXISTS,
    Expected,
    InitProducer,
    Op,
    OpKind,
    OutboxPurge,
    OutboxWrite,
    ProducerRef,
    Subscribe,
    SubscribeBatch,
    Write,
    encode_entry,
)
from sevendb.outbox.errors import ApplyOrderError, ErrorCode, PlanMismatch
from sevendb.outbox.lifecycle import stalled_subscriptions
from sevendb.outbox.model import (
    AckStatus,
    Change,
    CloseReason,
    Delta,
    InitProducerResult,
    OutboxRow,
    OutboxWriteResult,
    PurgeResult,
    ReconnectStatus,
    RowsOutboxed,
    RowsPending,
    RowsPurged,
    SubscribeBatchResult,
    SubscribeResult,
    SubscriptionClosed,
    UnsubscribeResult,
    WriteResult,
    delta_bytes,
)
from sevendb.outbox.query import Plan, Query, QueryKind, plan_query
from sevendb.outbox.state import BucketStateMachine, rows_digest


def write_result(d: Driver, *args: object, **kw: object) -> WriteResult:
    result = d.set(*args, **kw).result  # type: ignore[arg-type]
    assert isinstance(result, WriteResult)
    return result


def seq(index: int, epoch: int = 1) -> EmitSeq:
    return EmitSeq(BUCKET, epoch, index)


# ---- data and preconditions ------------------------------------------------------------


def test_set_creates_then_bumps_version_and_records_mod_index() -> None:
    d = Driver()
    first = write_result(d, "k", b"1")
    second = write_result(d, "k", b"2")
    assert first.versions == (("k", 1),) and second.versions == (("k", 2),)
    record = d.sm.get("k")
    assert record is not None and record.value == b"2" and record.mod_index == d.index


def test_delete_removes_key_and_missing_delete_is_a_no_op() -> None:
    d = Driver()
    d.set("k")
    d.delete("k")
    assert d.sm.get("k") is None
    assert d.delete("k").result.error is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("existing", "expected", "ok"),
    [
        (False, NOT_EXISTS, True),
        (True, NOT_EXISTS, False),
        (True, Expected.exact(1), True),
        (True, Expected.exact(2), False),
        (False, Expected.exact(1), False),
    ],
)
def test_expected_version_semantics(existing: bool, expected: Expected, ok: bool) -> None:
    d = Driver()
    if existing:
        d.set("k", b"old")
    before = d.sm.get("k")
    result = write_result(d, "k", b"new", expected)
    if ok:
        assert result.error is None
    else:
        assert result.error is not None and result.error.code is ErrorCode.PRECONDITION_FAILED
        assert "'k'" in result.error.message
        assert d.sm.get("k") == before


def test_failed_precondition_applies_no_op_of_the_write() -> None:
    d = Driver()
    d.set("b", b"1")
    ops = (Op(OpKind.SET, "a", b"x"), Op(OpKind.SET, "b", b"y", NOT_EXISTS))
    result = d.apply(Write(ops, None, d.tick())).result
    assert isinstance(result, WriteResult) and result.error is not None
    assert d.sm.get("a") is None


# ---- idempotent producers ---------------------------------------------------------------


def test_producer_duplicate_returns_original_commit() -> None:
    d = Driver()
    d.init_producer(7)
    first = write_result(d, "k", b"1", producer=ProducerRef(7, 0, 0))
    again = write_result(d, "k", b"1", producer=ProducerRef(7, 0, 0))
    assert again.duplicate and again.commit == first.commit and again.versions == first.versions
    assert d.sm.get("k").version == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("ref", "code"),
    [
        (ProducerRef(7, 0, 5), ErrorCode.OUT_OF_ORDER_SEQUENCE),
        (ProducerRef(8, 0, 0), ErrorCode.UNKNOWN_PRODUCER),
        (ProducerRef(7, 3, 0), ErrorCode.INVALID_PRODUCER_EPOCH),
    ],
)
def test_producer_rejections(ref: ProducerRef, code: ErrorCode) -> None:
    d = Driver()
    d.init_producer(7)
    result = write_result(d, "k", producer=ref)
    assert result.error is not None and result.error.code is code
    assert d.sm.get("k") is None


def test_a_producer_belongs_to_the_principal_that_made_it() -> None:
    """Issue 29: another principal can neither re-init (fence) a producer id nor write
    with it (its write would use up the owner's sequence); the owner still can."""
    d = Driver()
    made = d.apply(InitProducer(7, d.tick(), "alice")).result
    assert made == InitProducerResult(7, 0)
    denied = d.apply(InitProducer(7, d.tick(), "mallory")).result
    assert isinstance(denied, InitProducerResult) and denied.error is not None
    assert denied.error.code is ErrorCode.PERMISSION_DENIED and "ownership" in denied.error.message
    op = (Op(OpKind.SET, "k", b"m"),)
    stolen = d.apply(Write(op, ProducerRef(7, 0, 0), d.tick(), "mallory")).result
    assert isinstance(stolen, WriteResult) and stolen.error is not None
    assert stolen.error.code is ErrorCode.PERMISSION_DENIED and d.sm.get("k") is None
    mine = d.apply(Write(op, ProducerRef(7, 0, 0), d.tick(), "alice")).result
    assert isinstance(mine, WriteResult) and mine.error is None and not mine.duplicate
    assert d.apply(InitProducer(7, d.tick(), "alice")).result == InitProducerResult(7, 1)


def test_producer_owners_survive_a_snapshot() -> None:
    d = Driver()
    d.apply(InitProducer(7, d.tick(), "alice"))
    d.init_producer(8)  # unowned (an older build's entry): snapshots as before
    restored = Driver(BucketStateMachine.restore(d.sm.snapshot()))
    assert restored.sm.snapshot() == d.sm.snapshot()
    denied = restored.apply(InitProducer(7, restored.tick(), "mallory")).result
    assert isinstance(denied, InitProducerResult) and denied.error is not None
    assert restored.apply(InitProducer(8, restored.tick(), "bob")).result == InitProducerResult(
        8, 1
    )


def test_reinit_bumps_epoch_and_fences_the_old_instance() -> None:
    d = Driver()
    assert d.init_producer(7).result == InitProducerResult(7, 0)
    write_result(d, "k", producer=ProducerRef(7, 0, 0))
    assert d.init_producer(7).result == InitProducerResult(7, 1)
    fenced = write_result(d, "k", producer=ProducerRef(7, 0, 1))
    assert fenced.error is not None and fenced.error.code is ErrorCode.PRODUCER_FENCED
    assert write_result(d, "k", producer=ProducerRef(7, 1, 0)).error is None


# ---- subscriptions and rows -------------------------------------------------------------


def test_rows_chain_per_subscription_and_match_queries() -> None:
    d = Driver()
    d.lease()
    start_key = d.subscribe("s-key", "key:a1").result
    start_pre = d.subscribe("s-pre", "prefix:a").result
    start_all = d.subscribe("s-all", "all").result
    d.set("a1")
    d.set("a2")
    d.set("b1")
    d.outbox()
    chains = {
        s: [(r.prev_emit_seq, r.emit_seq) for r in d.rows(s)] for s in ("s-key", "s-pre", "s-all")
    }
    w = [i for i, (_, data) in enumerate(d.log)]
    assert len(chains["s-key"]) == 1 and len(chains["s-pre"]) == 2 and len(chains["s-all"]) == 3
    for sub_id, start in (("s-key", start_key), ("s-pre", start_pre), ("s-all", start_all)):
        assert isinstance(start, SubscribeResult)
        chain = chains[sub_id]
        assert chain[0][0] == start.start
        assert all(chain[i][1] == chain[i + 1][0] for i in range(len(chain) - 1))
    assert w  # the log recorded every entry


def test_write_touching_several_matching_keys_gives_one_row_with_all_changes() -> None:
    d = Driver()
    d.lease()
    d.subscribe("s", "prefix:a")
    d.apply(
        Write(
            (Op(OpKind.SET, "a1", b"1"), Op(OpKind.SET, "b", b"2"), Op(OpKind.SET, "a2", b"3")),
            None,
            d.tick(),
        )
    )
    d.outbox()
    (row,) = d.rows("s")
    assert [c.key for c in row.delta.changes] == ["a1", "a2"]


def test_rows_join_the_outbox_when_their_source_applies_and_an_outbox_write_checkpoints_them() -> (
    None
):
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    applied = d.set("k")
    (pending,) = [e for e in applied.effects if isinstance(e, RowsPending)]
    # Kept at once (a function of the committed entry), and pending a checkpoint.
    assert d.rows("s") == pending.rows and d.sm.pending.rows() == pending.rows
    assert d.sm.outboxed_through == 0
    # The literal emission mode sends only what an OUTBOX_WRITE covered:
    assert d.sm.subs.outbox_rows("s", through_index=d.sm.outboxed_through) == ()
    outboxed = d.outbox()
    assert outboxed is not None
    assert [e for e in outboxed.effects if isinstance(e, RowsOutboxed)] == [
        RowsOutboxed(pending.rows)
    ]
    assert d.rows("s") == pending.rows and d.sm.pending.rows() == ()
    assert d.sm.outboxed_through == pending.rows[0].emit_seq.commit_index
    assert d.sm.subs.outbox_rows("s", through_index=d.sm.outboxed_through) == pending.rows


def test_subscribe_is_idempotent_for_the_same_principal_and_query() -> None:
    d = Driver()
    first = d.subscribe("s", "all").result
    again = d.subscribe("s", "all").result
    assert isinstance(again, SubscribeResult) and again.existing
    assert isinstance(first, SubscribeResult) and again.start == first.start
    other = d.subscribe("s", "prefix:x").result
    assert other.error is not None and other.error.code is ErrorCode.SUBSCRIPTION_EXISTS  # type: ignore[union-attr]
    foreign = d.subscribe("s", "all", principal="mallory").result
    assert foreign.error is not None and foreign.error.code is ErrorCode.NOT_OWNER  # type: ignore[union-attr]


def test_plan_mismatch_raises_and_changes_nothing() -> None:
    d = Driver()
    before = d.sm.digest()
    q = Query(QueryKind.ALL)
    with pytest.raises(PlanMismatch):
        d.sm.apply(1, encode_entry(Subscribe("s", "alice", q, plan_query(q).plan_hash ^ 1, 0)))
    assert d.sm.digest() == before and d.sm.subs.get("s") is None


def _subscribe(sub_id: str, query: str, principal: str = "alice") -> Subscribe:
    q = Query.parse(query)
    return Subscribe(sub_id, principal, q, plan_query(q).plan_hash, 0)


def test_a_subscribe_batch_applies_each_subscribe_as_its_own_entry_would() -> None:
    d = Driver()
    d.lease()
    d.subscribe("old", "all")
    batch = SubscribeBatch(
        (
            _subscribe("a", "prefix:a/"),
            _subscribe("old", "all"),  # the same again: idempotent
            _subscribe("old", "key:k"),  # another query under its id
            _subscribe("b", "key:k", principal="bob"),
            _subscribe("b", "key:k"),  # bob's, asked for by alice
        )
    )
    result = d.apply(batch).result
    assert isinstance(result, SubscribeBatchResult)
    at = seq(d.index)
    old = d.sm.subs.get("old")
    assert old is not None
    assert [(r.sub_id, r.start, r.existing) for r in result.results[:2]] == [
        ("a", at, False),
        ("old", old.start, True),
    ]
    assert [r.error.code for r in result.results[2:] if r.error is not None] == [
        ErrorCode.SUBSCRIPTION_EXISTS,
        ErrorCode.NOT_OWNER,
    ]
    assert result.results[3].start == at  # bob's, made in this entry
    d.set("a/1")
    d.set("k")
    assert [r.sub_id for r in d.sm.subs.outbox_rows("a")] == ["a"]
    assert [r.prev_emit_seq for r in d.sm.subs.outbox_rows("b")] == [at]


def test_a_diverging_plan_anywhere_in_a_subscribe_batch_changes_nothing() -> None:
    def broken(query: Query) -> Plan:
        plan = plan_query(query)
        hashed = plan.plan_hash + (query.kind is QueryKind.KEY)
        return Plan(plan.kind, plan.arg, hashed)

    d = Driver(BucketStateMachine(BUCKET, planner=broken))
    d.lease()
    before = d.sm.digest()
    batch = SubscribeBatch((_subscribe("a", "prefix:a/"), _subscribe("b", "key:k")))
    with pytest.raises(PlanMismatch):
        d.sm.apply(d.index + 1, encode_entry(batch))
    assert d.sm.digest() == before and d.sm.subs.get("a") is None


def test_a_subscribe_batch_plans_each_query_once() -> None:
    planned: list[Query] = []

    def counting(query: Query) -> Plan:
        planned.append(query)
        return plan_query(query)

    d = Driver(BucketStateMachine(BUCKET, planner=counting))
    d.lease()
    batch = SubscribeBatch(tuple(_subscribe(f"s{i}", "prefix:a/") for i in range(5)))
    result = d.apply(batch).result
    assert isinstance(result, SubscribeBatchResult)
    assert all(r.error is None for r in result.results) and len(d.sm.subs) == 5
    assert planned == [Query.parse("prefix:a/")]


def test_divergent_planner_is_detected_on_subscribe() -> None:
    def broken(query: Query) -> Plan:
        plan = plan_query(query)
        return Plan(plan.kind, plan.arg, plan.plan_hash + 1)

    honest, divergent = Driver(), Driver(BucketStateMachine(BUCKET, planner=broken))
    q = Query.parse("prefix:a")
    entry = encode_entry(Subscribe("s", "alice", q, plan_query(q).plan_hash, 0))
    honest.sm.apply(1, entry)
    with pytest.raises(PlanMismatch):
        divergent.sm.apply(1, entry)


def test_outbox_write_digest_mismatch_is_divergence() -> None:
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    d.set("k")
    proposal = d.sm.propose_outbox_write(d.sm.lease_index, 0)
    assert proposal is not None
    bad = OutboxWrite(
        proposal.lease_index,
        proposal.from_index,
        proposal.through_index,
        proposal.row_count,
        proposal.digest ^ 1,
    )
    before = d.sm.digest()
    with pytest.raises(PlanMismatch):
        d.sm.apply(d.index + 1, encode_entry(bad))
    assert d.sm.digest() == before


def test_the_proposer_does_not_compute_its_own_digest_again_and_the_others_still_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sevendb.outbox import pending

    calls: list[int] = []

    def counting(rows: tuple[OutboxRow, ...]) -> tuple[int, int]:
        calls.append(len(rows))
        return rows_digest(rows)

    monkeypatch.setattr(pending, "rows_digest", counting)
    holder, follower = Driver(), Driver()
    for d in (holder, follower):
        d.lease()
        d.subscribe("s", "all")
        d.set("k1")
        d.set("k2")
    proposal = holder.sm.propose_outbox_write(holder.sm.lease_index, 0)
    assert proposal is not None and calls == [2]
    assert holder.apply(proposal).result == OutboxWriteResult(rows=2)
    assert calls == [2]  # the proposer's apply reused what it proposed
    assert follower.apply(proposal).result == OutboxWriteResult(rows=2)
    assert calls == [2, 2]  # every other replica computes and checks
    assert holder.sm.digest() == follower.sm.digest()
    # A replica that computed other rows is still caught, at its own apply.
    diverged = Driver()
    diverged.lease()
    diverged.subscribe("s", "all")
    diverged.set("k1")
    diverged.set("other")
    with pytest.raises(PlanMismatch):
        diverged.sm.apply(diverged.index + 1, encode_entry(proposal))


def test_outbox_write_is_idempotent_and_stale_ranges_are_refused() -> None:
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    d.set("k1")
    first = d.sm.propose_outbox_write(d.sm.lease_index, 0)
    d.set("k2")
    second = d.sm.propose_outbox_write(d.sm.lease_index, 0)
    assert first is not None and second is not None
    assert d.apply(first).result == OutboxWriteResult(rows=1)
    again = d.apply(first).result
    assert again == OutboxWriteResult(already=True)
    stale = d.apply(second).result  # starts where nothing starts any more
    assert isinstance(stale, OutboxWriteResult) and stale.error is not None
    assert stale.error.code is ErrorCode.STALE_RANGE
    d.outbox()
    assert [r.emit_seq.commit_index for r in d.rows("s")] == [3, 4]


def test_pipelined_outbox_writes_apply_in_order_and_only_in_order() -> None:
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    d.set("k1")
    first = d.sm.propose_outbox_write(d.sm.lease_index, 0)
    assert first is not None
    assert d.sm.propose_outbox_write(d.sm.lease_index, 0, after=first.through_index) is None
    d.set("k2")
    second = d.sm.propose_outbox_write(d.sm.lease_index, 0, after=first.through_index)
    assert second is not None and second.from_index == first.through_index
    assert second.row_count == 1  # only the row after the first range
    # The second commits first (say the first was lost): refused, nothing changes.
    pending = d.sm.pending.rows()
    early = d.apply(second).result
    assert isinstance(early, OutboxWriteResult) and early.error is not None
    assert early.error.code is ErrorCode.STALE_RANGE
    assert d.sm.outboxed_through == 0 and d.sm.pending.rows() == pending
    # In log order both apply, and the rows outboxed are the rows computed.
    second = d.sm.propose_outbox_write(d.sm.lease_index, 0, after=first.through_index)
    assert second is not None
    assert d.apply(first).result == OutboxWriteResult(rows=1)
    assert d.apply(second).result == OutboxWriteResult(rows=1)
    assert [r.emit_seq.commit_index for r in d.rows("s")] == [3, 4]
    assert d.sm.pending.rows() == ()


def test_outbox_entries_from_a_deposed_lease_holder_are_fenced() -> None:
    d = Driver()
    d.lease("node-a")
    old_lease = d.sm.lease_index
    d.subscribe("s", "all")
    d.set("k")
    proposal = d.sm.propose_outbox_write(old_lease, 0)
    d.lease("node-b")
    assert proposal is not None
    result = d.apply(proposal).result
    assert isinstance(result, OutboxWriteResult) and result.error is not None
    assert result.error.code is ErrorCode.STALE_LEASE and d.sm.outboxed_through == 0
    assert len(d.sm.pending.rows()) == 1
    purge = d.apply(OutboxPurge(old_lease, (), now_ms=1)).result
    assert isinstance(purge, PurgeResult) and purge.error is not None


def test_unsubscribe_by_owner_only_and_drops_rows() -> None:
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    d.set("k")
    d.outbox()
    denied = d.unsubscribe("s", principal="mallory").result
    assert denied == UnsubscribeResult("s", denied.error)  # type: ignore[union-attr]
    assert denied.error is not None and denied.error.code is ErrorCode.NOT_OWNER  # type: ignore[union-attr]
    applied = d.unsubscribe("s")
    assert SubscriptionClosed("s", CloseReason.UNSUBSCRIBED) in applied.effects
    assert d.sm.subs.get("s") is None and d.sm.subs.outbox_size() == 0


def test_unsubscribe_between_proposal_and_commit_keeps_digest_valid() -> None:
    d = Driver()
    d.lease()
    d.subscribe("s1", "all")
    d.subscribe("s2", "all")
    d.set("k")
    proposal = d.sm.propose_outbox_write(d.sm.lease_index, 0)
    d.unsubscribe("s1")
    assert proposal is not None
    result = d.apply(proposal).result
    assert result == OutboxWriteResult(rows=1)
    assert d.rows("s1") == () and len(d.rows("s2")) == 1


# ---- acks and purge ---------------------------------------------------------------------


def _one_row(d: Driver, sub: str = "s") -> EmitSeq:
    d.lease()
    d.subscribe(sub, "all")
    d.set("k1")
    d.set("k2")
    d.outbox()
    return d.rows(sub)[0].emit_seq


def test_ack_purges_exactly_the_covered_rows() -> None:
    d = Driver()
    first = _one_row(d)
    before = d.rows("s")
    result = d.ack("s", first)
    assert result.acks[0].status is AckStatus.ACCEPTED and result.purged_rows == 1
    assert d.rows("s") == before[1:]


def test_purge_effect_carries_rows_and_ack_time() -> None:
    d = Driver()
    first = _one_row(d)
    applied = d.apply(
        OutboxPurge(
            d.sm.lease_index,
            (__import__("sevendb.outbox.entries").outbox.entries.Ack("s", "alice", first),),
            now_ms=5_000,
        )
    )
    (purged,) = [e for e in applied.effects if isinstance(e, RowsPurged)]
    assert purged.ack_time_ms == 5_000 and [r.emit_seq for r in purged.rows] == [first]


@pytest.mark.parametrize(
    ("who", "offset", "status"),
    [
        ("alice", 0, AckStatus.DUPLICATE),
        ("alice", -1, AckStatus.REGRESSIVE),
        ("alice", 1000, AckStatus.FUTURE),
        ("mallory", 0, AckStatus.NOT_OWNER),
    ],
)
def test_bad_acks_are_rejected_and_change_nothing(who: str, offset: int, status: AckStatus) -> None:
    d = Driver()
    first = _one_row(d)
    d.ack("s", first)
    before = d.sm.digest()
    target = EmitSeq(BUCKET, 1, first.commit_index + offset)
    result = d.ack("s", target, principal=who)
    assert result.acks[0].status is status
    sub = d.sm.subs.get("s")
    assert sub is not None and sub.acked == first and len(d.rows("s")) == 1
    # Only the applied index moved.
    assert BucketStateMachine.restore(d.sm.snapshot()).subs.outbox_size() == 1
    assert before != d.sm.digest()


def test_ack_of_unknown_subscription() -> None:
    d = Driver()
    d.lease()
    assert d.ack("nope", EmitSeq(BUCKET, 1, 1)).acks[0].status is AckStatus.SUBSCRIPTION_NOT_FOUND


def test_an_ack_cannot_pass_the_last_row_computed() -> None:
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    d.set("k")
    d.set("other")
    assert d.ack("s", EmitSeq(BUCKET, 1, d.index + 1)).acks[0].status is AckStatus.FUTURE
    assert len(d.rows("s")) == 2


def test_an_ack_of_rows_not_yet_checkpointed_purges_them_and_the_checkpoint_still_applies() -> None:
    """The derived emission mode sends a row before its OUTBOX_WRITE; the client may ack
    it first. The OUTBOX_WRITE's digest still covers it (a replica that computed
    otherwise still quarantines itself), and it never comes back."""
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    d.set("k1")
    d.set("k2")
    first, second = d.rows("s")
    proposal = d.sm.propose_outbox_write(d.sm.lease_index, d.tick())
    assert proposal is not None and proposal.row_count == 2
    result = d.ack("s", first.emit_seq)
    assert result.acks[0].status is AckStatus.ACCEPTED and result.purged_rows == 1
    assert d.rows("s") == (second,) and len(d.sm.pending.rows()) == 2
    assert d.apply(proposal).result == OutboxWriteResult(rows=2)
    assert d.rows("s") == (second,) and d.sm.pending.rows() == ()
    assert d.sm.propose_outbox_write(d.sm.lease_index, d.tick()) is None


# ---- reconnect --------------------------------------------------------------------------


def test_reconnect_decisions() -> None:
    d = Driver()
    first = _one_row(d)
    sub = d.sm.subs.get("s")
    assert sub is not None
    ok = d.sm.decide_reconnect("s", "alice", sub.start)
    assert ok.status is ReconnectStatus.OK and len(ok.resume) == 2
    assert ok.next_commit_index == sub.start.commit_index + 1
    ok2 = d.sm.decide_reconnect("s", "alice", first)
    assert ok2.status is ReconnectStatus.OK and [r.emit_seq for r in ok2.resume] == [
        d.rows("s")[1].emit_seq
    ]
    ahead = d.sm.decide_reconnect("s", "alice", EmitSeq(BUCKET, 1, 10_000))
    assert ahead.status is ReconnectStatus.INVALID_SEQUENCE
    never = d.sm.decide_reconnect("s", "alice", EmitSeq(BUCKET, 1, sub.start.commit_index - 1))
    assert never.status is ReconnectStatus.INVALID_SEQUENCE
    missing = d.sm.decide_reconnect("zz", "alice", first)
    assert missing.status is ReconnectStatus.SUBSCRIPTION_NOT_FOUND and not missing.not_owner
    foreign = d.sm.decide_reconnect("s", "mallory", first)
    assert foreign.status is ReconnectStatus.SUBSCRIPTION_NOT_FOUND and foreign.not_owner
    d.ack("s", d.rows("s")[1].emit_seq)
    stale = d.sm.decide_reconnect("s", "alice", first)
    assert stale.status is ReconnectStatus.STALE_SEQUENCE


# ---- stall window and safety point ------------------------------------------------------


def test_stalled_subscriber_is_dropped_from_safety_point_then_expired() -> None:
    d = Driver()
    first = _one_row(d)
    window = 1_000
    now = d.now_ms
    start = d.sm.subs.get("s").start  # type: ignore[union-attr]
    assert d.sm.safety_point(now, window) == start.commit_index
    assert stalled_subscriptions(d.sm, now, window) == ()
    later = now + window + 1
    assert stalled_subscriptions(d.sm, later, window) == ("s",)
    assert d.sm.safety_point(later, window) == d.sm.applied_index
    # A repeated or unknown name expires nothing more.
    applied = d.apply(OutboxPurge(d.sm.lease_index, (), ("s", "s", "nope"), window, later))
    assert applied.result == PurgeResult(expired=("s",))
    assert SubscriptionClosed("s", CloseReason.STALLED) in applied.effects
    assert d.sm.subs.outbox_size() == 0
    recon = d.sm.decide_reconnect("s", "alice", first)
    assert recon.status is ReconnectStatus.STALE_SEQUENCE
    assert d.ack("s", first).acks[0].status is AckStatus.STALE


def test_expiry_of_an_active_subscriber_is_ignored() -> None:
    d = Driver()
    _one_row(d)
    applied = d.apply(OutboxPurge(d.sm.lease_index, (), ("s",), 10**9, d.now_ms))
    assert applied.result == PurgeResult()
    assert len(d.rows("s")) == 2


def test_safety_point_takes_the_minimum_of_its_inputs() -> None:
    d = Driver()
    for i in range(10):
        d.set(f"k{i}")
    assert d.sm.safety_point(0) == 10
    assert d.sm.safety_point(0, cold_replica_checkpoint=4) == 4
    assert d.sm.safety_point(0, cold_replica_checkpoint=8, migration_hold_point=6) == 6


# ---- epochs, lease, order ---------------------------------------------------------------


def test_epoch_create_moves_emit_seq_forward_and_rejects_stale() -> None:
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    d.set("k1")
    d.epoch()
    d.set("k2")
    d.outbox()
    rows = d.rows("s")
    assert [r.emit_seq.epoch_counter for r in rows] == [1, 2]
    assert rows[0].emit_seq < rows[1].emit_seq and rows[1].prev_emit_seq == rows[0].emit_seq
    assert rows[1].emit_seq.commit_index > rows[0].emit_seq.commit_index
    stale = d.apply(__import__("sevendb.outbox.entries").outbox.entries.EpochCreate(2)).result
    assert stale.error is not None and stale.error.code is ErrorCode.STALE_EPOCH  # type: ignore[union-attr]


def test_apply_order_is_enforced() -> None:
    d = Driver()
    d.set("k")
    with pytest.raises(ApplyOrderError):
        d.sm.apply(d.index, encode_entry(Write((Op(OpKind.SET, "x"),))))


def test_log_indexes_may_skip() -> None:
    d = Driver()
    d.set("a")
    d.apply(Write((Op(OpKind.SET, "b"),)), gap=5)
    assert d.sm.applied_index == 6


# ---- snapshot and sync ------------------------------------------------------------------


def test_snapshot_restore_round_trip_is_identical() -> None:
    d = Driver()
    d.init_producer(3)
    _one_row(d)
    d.set("p", producer=ProducerRef(3, 0, 0))
    restored = BucketStateMachine.restore(d.sm.snapshot())
    assert restored.snapshot() == d.sm.snapshot() and restored.digest() == d.sm.digest()
    dup = Driver(restored)
    result = write_result(dup, "p", producer=ProducerRef(3, 0, 0))
    assert result.duplicate


def test_a_format_1_snapshot_restores_with_its_pending_rows_in_the_outbox() -> None:
    """Format 1 kept rows not yet checkpointed only in the pending batches: each joins
    its live subscription, none an unsubscribed one or one format 1 marked stale."""
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    d.subscribe("gone", "all")
    d.set("k1")
    d.outbox()
    d.set("k2")
    d.unsubscribe("gone")
    raw = msgpack.unpackb(d.sm.snapshot(), raw=False)
    assert raw[0] == 3
    stale = [["gone", *raw[9][0][1:9], []]]  # "s" as it was, under another name
    restored = BucketStateMachine.restore(version_1_snapshot(d.sm, tuple(stale)))
    assert restored.subs.outbox_rows("s") == d.rows("s") and len(d.rows("s")) == 2
    assert restored.subs.get("gone") is None and restored.subs.outbox_size() == 2
    assert restored.decide_reconnect("gone", "alice", d.rows("s")[0].emit_seq).status is (
        ReconnectStatus.STALE_SEQUENCE
    )
    assert d.outbox() is not None
    restored.apply(*d.log[-1])  # the same digest: the pending batches are as they were
    assert restored.subs.outbox_rows("s") == d.rows("s") and restored.pending.rows() == ()


def test_restore_rejects_garbage() -> None:
    from sevendb.outbox.errors import SnapshotError

    with pytest.raises(SnapshotError):
        BucketStateMachine.restore(b"\x01\x02not a snapshot")


def test_sync_pages_through_state_with_an_exclusive_cursor() -> None:
    d = Driver()
    for i in range(25):
        d.set(f"k{i:02}")
    seen: list[str] = []
    since, key, pages = 0, "", 0
    while True:
        page = d.sm.sync_page(since, key, 10)
        seen.extend(item.key for item in page.items)
        since, key, pages = page.next_since_index, page.next_since_key, pages + 1
        if not page.has_more:
            break
    assert seen == [f"k{i:02}" for i in range(25)] and pages == 3
    assert len(d.sm.sync_page(0, "", 10**6).items) == 25  # clamped at SYNC_LIMIT_MAX >= 25
    assert len(d.sm.sync_page(0, "", 0).items) == min(25, limits.SYNC_LIMIT_DEFAULT)


# ---- write batches ----------------------------------------------------------------------


def test_write_batch_applies_each_write_in_order_with_its_own_result() -> None:
    from sevendb.outbox.entries import WriteBatch
    from sevendb.outbox.model import WriteBatchResult

    d = Driver()
    d.lease()
    d.subscribe("s", "prefix:a")
    d.init_producer(5)
    batch = WriteBatch(
        (
            Write((Op(OpKind.SET, "a1", b"x"),), ProducerRef(5, 0, 0), 1),
            Write((Op(OpKind.SET, "a1", b"y", Expected.exact(1)),), None, 2),
            Write((Op(OpKind.SET, "a2", b"z", Expected.exact(9)),), None, 3),  # refused
            Write((Op(OpKind.SET, "b", b"w"),), None, 4),
            Write((Op(OpKind.SET, "a1", b"x"),), ProducerRef(5, 0, 0), 5),  # producer retry
        )
    )
    applied = d.apply(batch)
    result = applied.result
    assert isinstance(result, WriteBatchResult) and len(result.results) == 5
    first, second, refused, other, retry = result.results
    assert first.commit.commit_index == d.index and first.versions == (("a1", 1),)
    assert second.versions == (("a1", 2),) and second.error is None
    assert refused.error is not None and refused.error.code is ErrorCode.PRECONDITION_FAILED
    assert other.error is None and retry.duplicate and retry.commit == first.commit
    assert d.sm.get("a2") is None and d.sm.get("a1").value == b"y"  # type: ignore[union-attr]
    d.outbox()
    (row,) = d.rows("s")  # one delta for the whole source entry
    assert [(c.key, c.value) for c in row.delta.changes] == [("a1", b"x"), ("a1", b"y")]


def test_write_batch_equals_the_same_writes_one_by_one_for_data() -> None:
    from sevendb.outbox.entries import WriteBatch

    writes = [Write((Op(OpKind.SET, f"k{i % 3}", bytes([i])),), None, i) for i in range(9)]
    batched, single = Driver(), Driver()
    batched.apply(WriteBatch(tuple(writes)))
    for w in writes:
        single.apply(w)
    for k in ("k0", "k1", "k2"):
        a, b = batched.sm.get(k), single.sm.get(k)
        assert a is not None and b is not None
        assert (a.value, a.version) == (b.value, b.version)


def test_a_full_garbage_collection_does_not_walk_the_keys() -> None:
    """A loaded node paused up to 195 ms in full collections that walked a record
    object per key; the keys' records are now invisible to the collector."""
    import gc

    d = Driver()
    for i in range(200):
        d.set(f"k{i}", b"v%d" % i)
    d.set("k0", b"again", Expected.exact(1))  # an update replaces a record
    gc.collect()
    assert not gc.is_tracked(d.sm.store._data)
    record = d.sm.get("k0")
    assert record is not None and (record.value, record.version) == (b"again", 2)


def test_a_later_snapshot_is_of_the_state_when_it_was_asked_for() -> None:
    """The replica makes snapshot bytes in another thread while applies go on."""
    d = Driver()
    d.lease()
    d.subscribe("s", "prefix:k")
    d.init_producer(7)
    for i in range(50):
        d.set(f"k{i}", b"v%d" % i, producer=ProducerRef(7, 0, i) if i < 3 else None)
        if i == 25:
            d.outbox()
    before = d.sm.snapshot()
    make = d.sm.snapshot_later()
    # Everything the snapshot refers to moves on: keys, a producer's results, the
    # subscription's rows, head and ack, the pending rows.
    d.set("k0", b"changed", producer=ProducerRef(7, 0, 3))
    d.set("new", b"key")
    d.outbox()
    head = d.sm.subs.sorted()[0].head
    d.ack("s", head)
    d.set("k1", b"pending")
    assert make() == before
    keys = [item[0] for item in msgpack.unpackb(before)[7]]
    assert keys == sorted(keys) and len(keys) == 50  # canonical: sorted, not insertion order
    assert d.sm.snapshot() != before
    assert BucketStateMachine.restore(make()).digest() == xxhash.xxh64_hexdigest(before)


_seqs = st.builds(
    EmitSeq, st.sampled_from(["u1", "ü2"]), st.integers(0, 2**32), st.integers(0, 2**63 - 1)
)
_deltas = st.builds(
    Delta,
    st.lists(
        st.builds(
            Change,
            st.text(max_size=8),
            st.sampled_from(list(OpKind)),
            st.binary(max_size=8),
            st.integers(0, 2**63 - 1),
        ),
        max_size=3,
    ).map(tuple),
    st.integers(0, 2**63 - 1),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(_seqs, min_size=1, max_size=3), st.lists(_deltas, min_size=1, max_size=3), st.data()
)
def test_rows_digest_is_xxh64_over_each_rows_canonical_encoding(
    seqs: list[EmitSeq], deltas: list[Delta], data: st.DataObject
) -> None:
    """The digest OUTBOX_WRITE carries is pinned to the rows' msgpack encoding (logs
    written by one version are checked by the next), however it is computed: rows
    here share EmitSeq and Delta objects, as the rows of one source entry do."""
    rows = data.draw(
        st.lists(
            st.builds(
                OutboxRow,
                st.text(max_size=6),
                st.sampled_from(seqs),
                st.sampled_from(seqs),
                st.sampled_from(deltas),
            ),
            max_size=8,
        )
    )
    hasher = xxhash.xxh64()
    for row in rows:
        hasher.update(msgpack.packb(row.pack(), use_bin_type=True))
    assert rows_digest(iter(rows)) == (len(rows), hasher.intdigest())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["all", "key:a/1", "prefix:a/", "prefix:b", "key:b/2"]), max_size=6),
    st.lists(
        st.lists(st.sampled_from(["a/1", "a/2", "b/2", "c"]), min_size=1, max_size=4, unique=True),
        min_size=1,
        max_size=4,
    ),
)
def test_each_subscription_gets_a_row_of_exactly_the_changes_its_query_matches(
    queries: list[str], writes: list[list[str]]
) -> None:
    """Whether a write's changes all match the same subscriptions (one shared delta)
    or not (a delta per distinct choice of changes), the rows are the definition's."""
    d = Driver()
    plans = {}
    for i, query in enumerate(queries):
        d.subscribe(f"s{i}", query)
        plans[f"s{i}"] = plan_query(Query.parse(query))
    for keys in writes:
        ops = tuple(Op(OpKind.SET, key, key.encode(), ANY) for key in keys)
        applied = d.apply(Write(ops, None, d.tick()))
        rows = [r for e in applied.effects if isinstance(e, RowsPending) for r in e.rows]
        expected = [
            (sub_id, [key for key in keys if plan.matches(key)])
            for sub_id, plan in sorted(plans.items())
            if any(plan.matches(key) for key in keys)
        ]
        assert [(r.sub_id, [c.key for c in r.delta.changes]) for r in rows] == expected
        assert all(r.delta.size_bytes == delta_bytes(r.delta.changes) for r in rows)


def test_key_range_reads_keys_in_order_as_they_were_when_asked() -> None:
    d = Driver()
    for key in ("b/2", "a/1", "b/1", "c", "b/3", "a/2"):
        d.set(key, key.encode())
    later = d.sm.store.range_later("", "", "b/", "", 2)
    d.set("b/0")  # after the call: not in its answer
    d.delete("b/1")
    page, more = later()
    assert [(kv.key, kv.value) for kv in page] == [("b/1", b"b/1"), ("b/2", b"b/2")] and more
    page, more = d.sm.store.range_later("", "", "b/", "b/2", 2)()
    assert [kv.key for kv in page] == ["b/3"] and not more
    page, more = d.sm.store.range_later("a/2", "b/3", "", "", 10)()
    assert [kv.key for kv in page] == ["a/2", "b/0", "b/2"] and not more
    page, _ = d.sm.store.range_later("", "", "", "", 100)()
    assert [kv.key for kv in page] == ["a/1", "a/2", "b/0", "b/2", "b/3", "c"]
