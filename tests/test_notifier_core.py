"""The notifier's pure decisions, and its conversation with the SDK cursor in memory."""

from __future__ import annotations

import itertools
import sys

import pytest
from helpers import BUCKET, Driver
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sevendb.notifier.core import (
    AttachStatus,
    EmissionMode,
    NotifierConfig,
    NotifierCore,
    default_lease_holder,
    needs_lease,
    rendezvous_lease_holder,
)
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import Lease, Op, OpKind, OutboxPurge, Write
from sevendb.outbox.errors import ErrorCode
from sevendb.outbox.model import (
    AckStatus,
    OutboxRow,
    OutboxWriteResult,
    PurgeResult,
    ReconnectStatus,
    RowsOutboxed,
    RowsPending,
)
from sevendb.sdk.cursor import StreamCursor

LITERAL = NotifierConfig(emission=EmissionMode.LITERAL)
MODES = list(EmissionMode)


def holder_with_sub(query: str = "prefix:a/", holder: str = "n1") -> tuple[Driver, EmitSeq]:
    d = Driver(holder=holder)
    d.lease()
    d.subscribe("s", query)
    sub = d.sm.subs.get("s")
    assert sub is not None
    return d, sub.start


def write(d: Driver, key: str, value: bytes = b"v") -> None:
    d.apply(Write((Op(OpKind.SET, key, value),), now_ms=d.tick()))


# ---- the lease --------------------------------------------------------------------


def test_default_lease_holder_is_the_leader() -> None:
    assert default_lease_holder("n2") == "n2"


def test_rendezvous_is_deterministic_and_order_independent() -> None:
    replicas = ["n1", "n2", "n3", "n4"]
    chosen = {
        rendezvous_lease_holder("bucket-7", 3, list(p)) for p in itertools.permutations(replicas)
    }
    assert len(chosen) == 1
    # Across epochs the choice spreads over the replicas (it is a hash, not "the first").
    holders = {rendezvous_lease_holder("bucket-7", epoch, replicas) for epoch in range(1, 40)}
    assert len(holders) > 1


def test_rendezvous_picks_the_highest_hash_and_needs_a_replica() -> None:
    import xxhash

    replicas = ["a", "b", "c"]
    best = max(replicas, key=lambda r: xxhash.xxh64_intdigest(f"u/2/{r}".encode()))
    assert rendezvous_lease_holder("u", 2, replicas) == best
    with pytest.raises(ValueError):
        rendezvous_lease_holder("u", 2, [])


def test_needs_lease_only_for_the_desired_replica_that_lacks_it() -> None:
    d = Driver(holder="n1")
    assert needs_lease(d.sm, "n1", "n1", 5) == Lease("n1", 5)
    assert needs_lease(d.sm, "n2", "n1") is None  # not me
    d.lease("n1")
    assert needs_lease(d.sm, "n1", "n1") is None  # already holds it
    assert needs_lease(d.sm, "n2", "n2", 7) == Lease("n2", 7)


# ---- attach ---------------------------------------------------------------------------


def test_attach_requires_the_lease() -> None:
    d, start = holder_with_sub(holder="n1")
    outcome = NotifierCore("n2").attach(d.sm, "s", "alice", start, d.now_ms)
    assert outcome.status is AttachStatus.NOT_HOLDER
    assert outcome.holder == "n1"


def test_attach_refuses_to_judge_a_client_ahead_of_the_applied_state() -> None:
    d, _ = holder_with_sub()
    ahead = EmitSeq(BUCKET, 1, d.sm.applied_index + 5)
    outcome = NotifierCore("n1").attach(d.sm, "s", "alice", ahead, d.now_ms)
    assert outcome.status is AttachStatus.BEHIND


def test_attach_refusals_carry_the_reconnect_decision() -> None:
    d, start = holder_with_sub()
    core = NotifierCore("n1")
    other = core.attach(d.sm, "s", "mallory", start, d.now_ms)
    assert other.status is AttachStatus.REFUSED
    assert other.decision is not None
    assert other.decision.status is ReconnectStatus.SUBSCRIPTION_NOT_FOUND
    assert other.decision.not_owner
    before = core.attach(d.sm, "s", "alice", EmitSeq(BUCKET, 1, 0), d.now_ms)
    assert before.decision is not None
    assert before.decision.status is ReconnectStatus.INVALID_SEQUENCE
    assert core.streams() == ()


def test_attach_after_a_position_is_an_ack_of_it() -> None:
    d, _ = holder_with_sub()
    core = NotifierCore("n1")
    write(d, "a/1")
    write(d, "a/2")
    d.outbox()
    rows = d.rows("s")
    outcome = core.attach(d.sm, "s", "alice", rows[0].emit_seq, d.now_ms)
    assert outcome.status is AttachStatus.ATTACHED
    assert [a.up_to for a in core.queued_acks()] == [rows[0].emit_seq]


# ---- sending ----------------------------------------------------------------------------


def test_the_literal_mode_sends_outboxed_rows_after_the_position_in_order() -> None:
    d, start = holder_with_sub()
    core = NotifierCore("n1", LITERAL)
    write(d, "a/1")
    assert core.attach(d.sm, "s", "alice", start, d.now_ms).status is AttachStatus.ATTACHED
    assert core.next_batches(d.sm, 100, d.now_ms) == []  # pending rows are never sent
    d.outbox()
    write(d, "a/2")
    write(d, "b/1")  # not matched
    d.outbox()
    batches = core.next_batches(d.sm, 100, d.now_ms)
    assert [(s, [r.emit_seq.commit_index for r in rows]) for s, rows in batches] == [("s", [3, 5])]
    assert core.next_batches(d.sm, 100, d.now_ms) == []  # nothing new
    assert core.position("s") == batches[0][1][-1].emit_seq


def test_the_derived_mode_sends_rows_once_their_source_applied() -> None:
    d, start = holder_with_sub()
    core = NotifierCore("n1")
    assert core.config.emission is EmissionMode.DERIVED  # the default
    write(d, "a/1")
    assert core.attach(d.sm, "s", "alice", start, d.now_ms).status is AttachStatus.ATTACHED
    first = core.next_batches(d.sm, 100, d.now_ms)
    assert [(s, [r.emit_seq.commit_index for r in rows]) for s, rows in first] == [("s", [3])]
    assert d.sm.outboxed_through == 0  # no OUTBOX_WRITE was needed
    write(d, "a/2")
    write(d, "b/1")  # not matched
    second = core.next_batches(d.sm, 100, d.now_ms)
    assert [(s, [r.emit_seq.commit_index for r in rows]) for s, rows in second] == [("s", [4])]
    assert core.next_batches(d.sm, 100, d.now_ms) == []


@pytest.mark.parametrize("mode", MODES)
def test_an_ack_past_what_the_mode_may_have_sent_is_future(mode: EmissionMode) -> None:
    """The state machine keeps rows from their apply; the literal mode sends none
    before its OUTBOX_WRITE, so an ack of one is an ack of what was never sent."""
    d, _ = holder_with_sub()
    core = NotifierCore("n1", NotifierConfig(emission=mode))
    write(d, "a/1")
    (row,) = d.rows("s")
    outcome = core.on_client_ack(d.sm, "s", "alice", row.emit_seq, d.now_ms)
    if mode is EmissionMode.LITERAL:
        assert outcome.status is AckStatus.FUTURE and core.queued_acks() == ()
        d.outbox()
        outcome = core.on_client_ack(d.sm, "s", "alice", row.emit_seq, d.now_ms)
    assert outcome.status is AckStatus.ACCEPTED
    assert [a.up_to for a in core.queued_acks()] == [row.emit_seq]


def test_the_window_bounds_events_in_flight_and_acks_open_it() -> None:
    d, start = holder_with_sub()
    core = NotifierCore("n1", NotifierConfig(window_events=2, resend_after_ms=10_000))
    for i in range(5):
        write(d, f"a/{i}")
    d.outbox()
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    first = core.next_batches(d.sm, 100, d.now_ms)
    assert len(first[0][1]) == 2
    assert core.next_batches(d.sm, 100, d.now_ms) == []  # window full
    outcome = core.on_client_ack(d.sm, "s", "alice", first[0][1][0].emit_seq, d.now_ms)
    assert outcome.status is AckStatus.ACCEPTED
    assert core.in_flight("s") == 1
    second = core.next_batches(d.sm, 100, d.now_ms)
    assert len(second[0][1]) == 1
    assert core.next_batches(d.sm, 1, d.now_ms) == []


def test_max_events_bounds_one_call() -> None:
    d, start = holder_with_sub()
    core = NotifierCore("n1")
    for i in range(4):
        write(d, f"a/{i}")
    d.outbox()
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    assert sum(len(rows) for _, rows in core.next_batches(d.sm, 3, d.now_ms)) == 3
    assert sum(len(rows) for _, rows in core.next_batches(d.sm, 3, d.now_ms)) == 1


@settings(max_examples=200, deadline=None)
@example(  # the window fills, the pass drops the stream, an ack must bring it back
    [("write", 0), ("write", 0), ("outbox", 0), ("send", 0), ("send", 0), ("ack", 0), ("send", 0)],
    EmissionMode.LITERAL,
)
@given(
    st.lists(
        st.tuples(st.sampled_from(["write", "outbox", "send", "ack", "attach"]), st.integers(0, 3)),
        max_size=60,
    ),
    st.sampled_from(MODES),
)
def test_a_pass_over_ready_streams_sends_what_a_full_pass_sends(
    script: list[tuple[str, int]], mode: EmissionMode
) -> None:
    """`next_batches(full=False)` looks only at streams marked ready (attached, acked,
    or named by `mark_ready` from the effects that make rows sendable in the mode:
    RowsPending when derived, RowsOutboxed when literal, as the node does; and, now
    and then, the streams with events in flight, as its housekeeping does); it must
    send exactly what a scan of every stream sends."""
    d = Driver(holder="n1")
    d.lease()
    subs = [f"s{i}" for i in range(4)]
    for i, sub_id in enumerate(subs):
        d.subscribe(sub_id, f"prefix:k{i % 2}/")
    config = NotifierConfig(window_events=1, resend_after_ms=10**9, emission=mode)  # often full
    full, lean = NotifierCore("n1", config), NotifierCore("n1", config)
    sendable = RowsPending if mode is EmissionMode.DERIVED else RowsOutboxed
    for core in (full, lean):
        for sub_id in subs[:2]:
            core.attach(d.sm, sub_id, "alice", d.sm.subs.get(sub_id).start, d.now_ms)  # type: ignore[union-attr]
    for step, n in script:
        if step in ("write", "outbox"):
            applied_ = (
                [d.set(f"k0/{d.tick()}"), d.set(f"k1/{d.tick()}")]
                if step == "write"
                else [a for a in (d.outbox(),) if a is not None]
            )
            lean.mark_ready(
                r.sub_id
                for applied in applied_
                for e in applied.effects
                if isinstance(e, sendable)
                for r in e.rows
            )
        elif step == "send":
            expected = full.next_batches(d.sm, 2 + n, d.now_ms)
            if n % 2:  # as its host's housekeeping does: then the in-flight streams too
                lean.mark_in_flight_ready()
            assert lean.next_batches(d.sm, 2 + n, d.now_ms, full=False) == expected
        elif step == "ack" and full.position(subs[n]) is not None:
            up_to = full.position(subs[n])
            assert up_to is not None
            for core in (full, lean):
                core.on_client_ack(d.sm, subs[n], "alice", up_to, d.now_ms)
        elif step == "attach":
            sub = d.sm.subs.get(subs[n])
            assert sub is not None
            for core in (full, lean):
                core.attach(d.sm, subs[n], "alice", max(sub.start, sub.acked), d.now_ms)
    while True:  # and once everything is outboxed, both drain the same rows
        d.outbox()
        lean.mark_ready(subs)
        batch = lean.next_batches(d.sm, 100, d.now_ms, full=False)
        assert batch == full.next_batches(d.sm, 100, d.now_ms)
        if not batch:
            break
        for sub_id, rows in batch:
            for core in (full, lean):
                core.on_client_ack(d.sm, sub_id, "alice", rows[-1].emit_seq, d.now_ms)


def test_a_pass_over_ready_streams_leaves_no_set_sized_for_every_stream() -> None:
    """After thousands of streams attached at once were looked at, the set of ready
    streams is small again: a set keeps its table after its members leave, and
    iterating it cost every later pass as much as the thousands (sorted, 50-100 us;
    bench_stages.py measured 63-70 -> 24-25 us per event with 10,000 streams)."""
    d = Driver(holder="n1")
    d.lease()
    core = NotifierCore("n1")
    for i in range(2_000):
        d.subscribe(f"s{i}", f"key:k{i}")
        start = d.sm.subs.get(f"s{i}").start  # type: ignore[union-attr]
        assert core.attach(d.sm, f"s{i}", "alice", start, d.now_ms).status is (
            AttachStatus.ATTACHED
        )
    empty = sys.getsizeof(set())
    assert sys.getsizeof(core._ready) > 10 * empty  # every attached stream is ready
    assert core.next_batches(d.sm, 100, d.now_ms, full=False) == []
    write(d, "k7")
    core.mark_ready(["s7"])
    assert sys.getsizeof(core._ready) == empty  # one member, a small table
    (batch,) = core.next_batches(d.sm, 100, d.now_ms, full=False)
    assert batch[0] == "s7" and len(batch[1]) == 1


def test_unacked_events_are_resent_after_the_resend_interval() -> None:
    d, start = holder_with_sub()
    core = NotifierCore("n1", NotifierConfig(resend_after_ms=100))
    write(d, "a/1")
    write(d, "a/2")
    d.outbox()
    core.attach(d.sm, "s", "alice", start, 0)
    sent = core.next_batches(d.sm, 100, 0)[0][1]
    assert core.next_batches(d.sm, 100, 50) == []
    core.on_client_ack(d.sm, "s", "alice", sent[0].emit_seq, 60)
    assert core.next_batches(d.sm, 100, 150) == []  # the ack was progress
    again = core.next_batches(d.sm, 100, 160)
    assert [r.emit_seq for r in again[0][1]] == [sent[1].emit_seq]


def test_old_epoch_rows_precede_new_epoch_rows() -> None:
    d, start = holder_with_sub()
    core = NotifierCore("n1")
    write(d, "a/1")
    d.epoch()
    write(d, "a/2")
    d.outbox()
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    rows = core.next_batches(d.sm, 100, d.now_ms)[0][1]
    assert [r.emit_seq.epoch_counter for r in rows] == [1, 2]
    assert rows[0].emit_seq < rows[1].emit_seq
    assert rows[1].prev_emit_seq == rows[0].emit_seq


def test_nothing_is_sent_once_the_lease_moved() -> None:
    d, start = holder_with_sub(holder="n1")
    core = NotifierCore("n1")
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    write(d, "a/1")
    d.outbox()
    d.lease("n2")
    assert core.next_batches(d.sm, 100, d.now_ms) == []
    assert core.outbox_entry(d.sm, d.sm.lease_index, d.now_ms) is None
    assert core.purge_entry(d.sm, d.sm.lease_index, d.now_ms, 1_000) is None


def test_closed_streams_lists_dropped_subscriptions() -> None:
    d, start = holder_with_sub()
    core = NotifierCore("n1")
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    assert core.closed_streams(d.sm) == ()
    d.unsubscribe("s")
    assert core.closed_streams(d.sm) == ("s",)
    # Looking only among the closures an applied entry named: unattached or live
    # names are not streams to end.
    assert core.closed_streams(d.sm, ["s", "never-attached"]) == ("s",)
    assert core.closed_streams(d.sm, ["never-attached"]) == ()
    core.detach("s")
    assert core.streams() == ()


# ---- acks and purges -------------------------------------------------------------------


def test_acks_are_validated_cumulative_and_batched_into_one_purge() -> None:
    d = Driver(holder="n1")
    d.lease()
    d.subscribe("s1", "all", "alice")
    d.subscribe("s2", "all", "bob")
    core = NotifierCore("n1")
    for i in range(3):
        write(d, f"k{i}")
    d.outbox()
    r1, r2 = d.rows("s1"), d.rows("s2")
    assert core.on_client_ack(d.sm, "s1", "bob", r1[0].emit_seq, 0).status is AckStatus.NOT_OWNER
    assert core.on_client_ack(d.sm, "s1", "alice", r1[0].emit_seq, 0).status is AckStatus.ACCEPTED
    assert core.on_client_ack(d.sm, "s1", "alice", r1[1].emit_seq, 0).status is AckStatus.ACCEPTED
    assert core.on_client_ack(d.sm, "s1", "alice", r1[0].emit_seq, 0).status is (
        AckStatus.REGRESSIVE
    )
    assert core.on_client_ack(d.sm, "s2", "bob", r2[2].emit_seq, 0).status is AckStatus.ACCEPTED
    future = EmitSeq(BUCKET, 1, 999)
    assert core.on_client_ack(d.sm, "s2", "bob", future, 0).status is AckStatus.FUTURE
    purge = core.purge_entry(d.sm, d.sm.lease_index, d.tick(), 10_000)
    assert purge is not None
    assert [(a.sub_id, a.principal, a.up_to) for a in purge.acks] == [
        ("s1", "alice", r1[1].emit_seq),
        ("s2", "bob", r2[2].emit_seq),
    ]
    # Lost with a leader change? Proposed again until the applied state covers it.
    assert core.purge_entry(d.sm, d.sm.lease_index, d.tick(), 10_000) == OutboxPurge(
        purge.lease_index, purge.acks, (), 10_000, d.now_ms
    )
    result = d.apply(purge).result
    assert isinstance(result, PurgeResult)
    assert [o.status for o in result.acks] == [AckStatus.ACCEPTED, AckStatus.ACCEPTED]
    assert [r.emit_seq for r in d.rows("s1")] == [r1[2].emit_seq]
    assert d.rows("s2") == ()
    assert core.purge_entry(d.sm, d.sm.lease_index, d.tick(), 10_000) is None


def test_purge_expires_stalled_subscriptions() -> None:
    d, start = holder_with_sub()
    core = NotifierCore("n1")
    write(d, "a/1")
    d.outbox()
    purge = core.purge_entry(d.sm, d.sm.lease_index, d.now_ms + 5_000, 1_000)
    assert purge is not None
    assert purge.expire == ("s",)
    assert purge.acks == ()
    result = d.apply(purge).result
    assert isinstance(result, PurgeResult)
    assert result.expired == ("s",)
    decision = d.sm.decide_reconnect("s", "alice", start)
    assert decision.status is ReconnectStatus.STALE_SEQUENCE


def test_purge_batches_are_bounded() -> None:
    d = Driver(holder="n1")
    d.lease()
    for i in range(5):
        d.subscribe(f"s{i}", "all")
    write(d, "k")
    d.outbox()
    core = NotifierCore("n1", NotifierConfig(acks_per_purge_max=2))
    for i in range(5):
        core.on_client_ack(d.sm, f"s{i}", "alice", d.rows(f"s{i}")[0].emit_seq, 0)
    purge = core.purge_entry(d.sm, d.sm.lease_index, d.tick(), 10_000)
    assert purge is not None and len(purge.acks) == 2


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        NotifierConfig(window_events=0)
    with pytest.raises(ValueError):
        NotifierConfig(resend_after_ms=0)
    with pytest.raises(ValueError):
        NotifierConfig(acks_per_purge_max=10**6)
    with pytest.raises(ValueError):
        NotifierConfig(checkpoint_interval_ms=0)
    with pytest.raises(ValueError):
        NotifierConfig(emission="derived")  # type: ignore[arg-type]


# ---- outbox writes and failover ------------------------------------------------------


def test_a_new_holder_reproposes_what_its_predecessor_left() -> None:
    d, start = holder_with_sub(holder="n1")
    write(d, "a/1")
    write(d, "a/2")
    old = NotifierCore("n1")
    proposal = old.outbox_entry(d.sm, d.sm.lease_index, d.tick())
    assert proposal is not None  # ... but n1 dies before it commits
    d.lease("n2")
    stale = d.apply(proposal).result
    assert isinstance(stale, OutboxWriteResult) and stale.error is not None
    assert stale.error.code is ErrorCode.STALE_LEASE  # fenced
    new = NotifierCore("n2")
    retry = new.outbox_entry(d.sm, d.sm.lease_index, d.tick())
    assert retry is not None and retry.from_index == 0
    applied = d.apply(retry)
    assert isinstance(applied.result, OutboxWriteResult) and applied.result.rows == 2
    assert new.outbox_entry(d.sm, d.sm.lease_index, d.tick()) is None
    assert new.attach(d.sm, "s", "alice", start, d.now_ms).status is AttachStatus.ATTACHED
    rows = new.next_batches(d.sm, 10, d.now_ms)[0][1]
    assert [r.delta.changes[0].key for r in rows] == ["a/1", "a/2"]


def test_outbox_writes_are_pipelined_up_to_the_limit_and_restart_after_a_loss() -> None:
    d, _ = holder_with_sub()
    core = NotifierCore(
        "n1",
        NotifierConfig(
            outbox_writes_in_flight=2, outbox_retry_ms=500, emission=EmissionMode.LITERAL
        ),
    )
    proposed = []
    for key in ("a/1", "a/2", "a/3"):
        write(d, key)
        entry = core.outbox_entry(d.sm, d.sm.lease_index, d.tick())
        if entry is not None:
            core.outbox_proposed(entry, d.now_ms)
            proposed.append(entry)
    # Two in flight, each starting where the previous ends; the third write waits.
    assert [(e.from_index, e.through_index) for e in proposed] == [(0, 3), (3, 4)]
    assert core.outbox_entry(d.sm, d.sm.lease_index, d.tick()) is None
    d.apply(proposed[0])  # the first commits: room for the third write's row
    third = core.outbox_entry(d.sm, d.sm.lease_index, d.tick())
    assert third is not None and (third.from_index, third.row_count) == (4, 1)
    core.outbox_proposed(third, d.now_ms)
    # The second is lost: the third can never apply, so start again from the log.
    core.outbox_lost()
    retry = core.outbox_entry(d.sm, d.sm.lease_index, d.tick())
    assert retry is not None and (retry.from_index, retry.row_count) == (3, 2)
    core.outbox_proposed(retry, d.now_ms)
    # Nothing commits at all: after outbox_retry_ms the holder proposes from the log.
    assert core.outbox_entry(d.sm, d.sm.lease_index, d.tick(100)) is None
    again = core.outbox_entry(d.sm, d.sm.lease_index, d.tick(500))
    assert again is not None and again.from_index == 3
    assert d.apply(again).result == OutboxWriteResult(rows=2)
    assert d.sm.pending.rows() == ()


def test_derived_checkpoints_one_at_a_time_at_most_every_interval() -> None:
    d, _ = holder_with_sub()
    core = NotifierCore("n1", NotifierConfig(checkpoint_interval_ms=50, outbox_retry_ms=500))
    write(d, "a/1")
    first = core.outbox_entry(d.sm, d.sm.lease_index, d.tick())
    assert first is not None and (first.from_index, first.row_count) == (0, 1)
    core.outbox_proposed(first, d.now_ms)
    write(d, "a/2")
    assert core.outbox_entry(d.sm, d.sm.lease_index, d.tick(100)) is None  # one in flight
    d.apply(first)
    write(d, "a/3")
    second = core.outbox_entry(d.sm, d.sm.lease_index, d.tick())
    assert second is not None and (second.from_index, second.row_count) == (first.through_index, 2)
    core.outbox_proposed(second, d.now_ms)
    d.apply(second)
    write(d, "a/4")
    assert core.outbox_entry(d.sm, d.sm.lease_index, d.tick(20)) is None  # not due yet
    third = core.outbox_entry(d.sm, d.sm.lease_index, d.tick(30))
    assert third is not None and third.row_count == 1
    # A new holder checkpoints what its predecessor left, from the log's point.
    d.lease("n2")
    new = NotifierCore("n2")
    retry = new.outbox_entry(d.sm, d.sm.lease_index, d.tick())
    assert retry is not None and (retry.from_index, retry.row_count) == (second.through_index, 1)
    assert d.apply(retry).result == OutboxWriteResult(rows=1)
    assert d.sm.pending.rows() == ()


# ---- the conversation: notifier and SDK cursor joined in memory ------------------------


class Conversation:
    """A holder's NotifierCore and a client's StreamCursor joined by a lossy channel
    (h11 style: two state machines, no network). The bucket log is a Driver."""

    def __init__(
        self, reorder_buffer_max: int = 2, mode: EmissionMode = EmissionMode.DERIVED
    ) -> None:
        self.d, self.start = holder_with_sub(holder="n1")
        self.core = NotifierCore(
            "n1", NotifierConfig(window_events=3, resend_after_ms=50, emission=mode)
        )
        self.cursor: StreamCursor[OutboxRow] = StreamCursor(self.start, reorder_buffer_max=2)
        self.persisted = self.start
        self.processed: list[OutboxRow] = []
        self.channel: list[OutboxRow] = []
        self.acks: list[EmitSeq] = []
        self.committed: list[OutboxRow] = []
        self.reorder_buffer_max = reorder_buffer_max
        self.attach()

    def attach(self) -> None:
        outcome = self.core.attach(self.d.sm, "s", "alice", self.persisted, self.d.now_ms)
        assert outcome.status is AttachStatus.ATTACHED, outcome
        self.cursor = StreamCursor(self.persisted, reorder_buffer_max=self.reorder_buffer_max)
        self.channel.clear()

    def write(self, key: str) -> None:
        applied = self.d.apply(Write((Op(OpKind.SET, key, b"x"),), now_ms=self.d.tick()))
        for effect in applied.effects:
            if isinstance(effect, RowsPending):
                self.committed.extend(r for r in effect.rows if r.sub_id == "s")

    def server_turn(self) -> None:
        sm = self.d.sm
        proposal = self.core.outbox_entry(sm, sm.lease_index, self.d.tick())
        if proposal is not None:
            self.d.apply(proposal)
        for _, rows in self.core.next_batches(sm, 100, self.d.now_ms):
            self.channel.extend(rows)
        for up_to in self.acks:
            self.core.on_client_ack(sm, "s", "alice", up_to, self.d.now_ms)
        self.acks.clear()
        purge = self.core.purge_entry(sm, sm.lease_index, self.d.now_ms, 10**9)
        if purge is not None:
            self.d.apply(purge)

    def deliver(self, row: OutboxRow) -> None:
        offered = self.cursor.offer(row)
        for ready in offered.ready:
            self.processed.append(ready)
            self.persisted = ready.emit_seq
        if offered.duplicate or offered.ready:
            self.acks.append(self.persisted)
        if offered.gap:
            self.attach()


@settings(max_examples=200, deadline=None)
@given(
    script=st.lists(
        st.sampled_from(["write", "server", "deliver", "drop", "dup", "swap", "reconnect", "tick"]),
        max_size=150,
    ),
    buffer=st.integers(1, 4),
    mode=st.sampled_from(MODES),
)
def test_conversation_is_effective_once_through_a_lossy_channel(
    script: list[str], buffer: int, mode: EmissionMode
) -> None:
    c = Conversation(buffer, mode)
    for i, step in enumerate(script):
        if step == "write":
            c.write(["a/1", "a/2", "b/1"][i % 3])
        elif step == "server":
            c.server_turn()
        elif step == "deliver" and c.channel:
            c.deliver(c.channel.pop(0))
        elif step == "drop" and c.channel:
            c.channel.pop(0)
        elif step == "dup" and c.channel:
            c.deliver(c.channel[0])
        elif step == "swap" and len(c.channel) > 1:
            c.channel[0], c.channel[1] = c.channel[1], c.channel[0]
        elif step == "reconnect":
            c.attach()
        elif step == "tick":
            c.d.tick(60)
        # Invariant at every step: what was processed is a prefix of the committed stream.
        assert c.processed == c.committed[: len(c.processed)]
    # Faults stop: the conversation converges (resends cover every loss).
    for _ in range(4 * len(c.committed) + 8):
        c.d.tick(60)
        c.server_turn()
        while c.channel:
            c.deliver(c.channel.pop(0))
    c.server_turn()
    assert c.processed == c.committed
    assert c.d.sm.subs.outbox_size() == 0
    assert c.d.sm.pending.rows() == ()
