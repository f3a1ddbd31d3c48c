"""The lease holder's lifecycle and overload decisions (`NotifierCore`, issue 27):
which subscriptions an OUTBOX_PURGE expires or keeps alive, which producers it
forgets, the per-stream byte window, and ending the stream of a slow subscriber."""

from __future__ import annotations

import pytest
from helpers import Driver
from test_notifier_core import holder_with_sub, write

from sevendb.notifier.core import (
    AttachStatus,
    EmissionMode,
    NotifierConfig,
    NotifierCore,
    row_bytes,
)
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import OutboxPurge, ProducerRef
from sevendb.outbox.model import AckStatus, OutboxWriteResult, PurgeResult

WINDOW = 1_000


def holder(query: str = "key:a/1") -> tuple[Driver, EmitSeq]:
    return holder_with_sub(query)


def housekeeping(d: Driver, core: NotifierCore, now: int) -> OutboxPurge | None:
    """One housekeeping purge at `now`, applied if there is one."""
    d.now_ms = now
    purge = core.purge_entry(d.sm, d.sm.lease_index, now, WINDOW)
    if purge is not None:
        d.apply(purge)
    return purge


def test_an_attached_quiet_subscription_outlives_the_window_and_its_first_row() -> None:
    """Before, a subscriber attached all along on a key written once a day was
    expired the moment that write's row was outboxed: nothing but an ack counted as
    a sign of life, and it had had nothing to ack."""
    d, start = holder()
    core = NotifierCore("n1")
    assert core.attach(d.sm, "s", "alice", start, d.now_ms).status is AttachStatus.ATTACHED
    begin = d.now_ms
    for step in range(1, 7):  # housekeeping every half window, three windows long
        housekeeping(d, core, begin + step * WINDOW // 2)
    write(d, "a/1")
    d.outbox()
    purge = housekeeping(d, core, d.tick())
    assert purge is None or "s" not in purge.expire
    assert d.sm.subs.get("s") is not None and len(d.rows("s")) == 1


def test_a_detached_quiet_subscription_expires_once_the_holder_has_settled() -> None:
    d, _ = holder()
    core = NotifierCore("n1", NotifierConfig(attach_grace_ms=300))
    begin = d.now_ms
    first = housekeeping(d, core, begin + WINDOW + 1)  # idle, but the holder just started
    assert first is None or first.expire == ()
    later = housekeeping(d, core, begin + WINDOW + 301)
    assert later is not None and later.expire == ("s",)
    assert d.sm.subs.get("s") is None


def test_a_subscriber_that_acknowledges_nothing_expires_attached_or_not() -> None:
    d, start = holder()
    core = NotifierCore("n1", NotifierConfig(attach_grace_ms=0))
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    write(d, "a/1")
    d.outbox()
    core.next_batches(d.sm, 10, d.now_ms)  # sent, never acknowledged
    last = d.sm.subs.get("s").last_active_ms  # type: ignore[union-attr]
    purge = housekeeping(d, core, last + WINDOW + 1)
    assert purge is not None and purge.expire == ("s",) and purge.touch == ()
    assert core.closed_streams(d.sm) == ("s",)


def test_idle_producers_are_forgotten_by_the_holders_purge() -> None:
    d, _ = holder()
    core = NotifierCore("n1", NotifierConfig(producer_idle_ms=5_000))
    d.init_producer(7)
    d.init_producer(8)
    d.set("k", producer=ProducerRef(8, 0, 0))
    at = d.now_ms - 20 + 5_001  # 7 initialised 20 ms before 8's write
    purge = core.purge_entry(d.sm, d.sm.lease_index, at, 10**9)
    assert purge is not None and purge.expire_producers == (7,)
    assert purge.producer_idle_ms == 5_000
    assert d.apply(purge).result == PurgeResult(expired_producers=(7,))


def test_the_byte_window_bounds_what_a_stream_has_in_flight() -> None:
    d, start = holder("prefix:a/")
    core = NotifierCore("n1", NotifierConfig(window_bytes=400))
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    for i in range(5):
        write(d, f"a/{i}", b"x" * 100)
    d.outbox()
    [(_, rows)] = core.next_batches(d.sm, 100, d.now_ms)
    assert [row_bytes(r) for r in rows] == [167, 167]  # a third would pass 400 bytes
    assert core.next_batches(d.sm, 100, d.now_ms) == []
    # A batch counts until its last event is acknowledged.
    core.on_client_ack(d.sm, "s", "alice", rows[0].emit_seq, d.tick())
    assert core.next_batches(d.sm, 100, d.now_ms) == []
    core.on_client_ack(d.sm, "s", "alice", rows[1].emit_seq, d.tick())
    [(_, more)] = core.next_batches(d.sm, 100, d.now_ms)
    assert [r.emit_seq for r in more] == [r.emit_seq for r in d.rows("s")[2:4]]


def test_one_event_larger_than_the_byte_window_still_goes() -> None:
    d, start = holder("prefix:a/")
    core = NotifierCore("n1", NotifierConfig(window_bytes=100))
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    write(d, "a/big", b"x" * 1_000)
    write(d, "a/next")
    d.outbox()
    [(_, rows)] = core.next_batches(d.sm, 100, d.now_ms)
    assert len(rows) == 1 and core.in_flight("s") == 1


def test_a_subscriber_that_stops_acknowledging_loses_its_stream() -> None:
    """Before, a stream whose subscriber stopped acknowledging was resent its window
    every `resend_after_ms` for as long as the stall window (24 h), never ended."""
    d, start = holder("prefix:a/")
    core = NotifierCore("n1", NotifierConfig(resend_after_ms=100, slow_stream_ms=300))
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    for i in range(3):
        write(d, f"a/{i}")
    d.outbox()
    t0 = d.tick()
    core.next_batches(d.sm, 1, t0)  # one event in flight from t0
    assert core.slow_streams(t0 + 299) == ()
    assert core.next_batches(d.sm, 1, t0 + 150)  # rewound and resent: the wait goes on
    assert core.slow_streams(t0 + 299) == ()
    assert core.slow_streams(t0 + 300) == ("s",)
    # Acks that move keep it: the wait starts again with the next event in flight.
    core.on_client_ack(d.sm, "s", "alice", d.rows("s")[0].emit_seq, t0 + 250)
    core.next_batches(d.sm, 1, t0 + 260)
    assert core.slow_streams(t0 + 559) == ()
    assert core.slow_streams(t0 + 560) == ("s",)
    # Its subscriber reconnects: the new stream has nothing in flight, so is not slow.
    core.attach(d.sm, "s", "alice", d.rows("s")[0].emit_seq, t0 + 600)
    assert core.slow_streams(t0 + 10**6) == ()


def test_a_stream_with_nothing_in_flight_is_never_slow() -> None:
    d, start = holder("prefix:a/")
    core = NotifierCore("n1", NotifierConfig(resend_after_ms=100, slow_stream_ms=300))
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    write(d, "a/0")
    d.outbox()
    [(_, rows)] = core.next_batches(d.sm, 10, d.tick())
    core.on_client_ack(d.sm, "s", "alice", rows[-1].emit_seq, d.tick())
    assert core.slow_streams(d.now_ms + 10**6) == ()


# ---- lifecycles in both emission modes ----------------------------------------------


@pytest.mark.parametrize("how", ["unsubscribe", "expire"])
@pytest.mark.parametrize("mode", list(EmissionMode))
def test_a_deleted_subscriptions_rows_never_leave(mode: EmissionMode, how: str) -> None:
    """Rows computed and not yet checkpointed go with their subscription in both modes
    (in the derived one they were sendable already); the checkpoint's digest still
    covers them, and a new incarnation of the sub_id never gets them."""
    d, start = holder("prefix:a/")
    core = NotifierCore("n1", NotifierConfig(emission=mode, attach_grace_ms=0))
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    write(d, "a/1")
    write(d, "a/2")
    assert len(d.rows("s")) == 2 and d.sm.outboxed_through < d.sm.applied_index
    if how == "unsubscribe":
        d.unsubscribe("s")
    else:
        purge = housekeeping(d, core, d.now_ms + WINDOW + 1)
        assert purge is not None and purge.expire == ("s",)
    assert d.sm.subs.get("s") is None and d.sm.subs.outbox_size() == 0
    assert core.closed_streams(d.sm) == ("s",)
    assert core.next_batches(d.sm, 100, d.tick()) == []
    assert len(d.sm.pending.rows()) == 2  # kept for the checkpoint's digest only
    d.subscribe("s", "prefix:a/")  # the same sub_id again, before the checkpoint
    checkpoint = core.outbox_entry(d.sm, d.sm.lease_index, d.tick())
    assert checkpoint is not None and checkpoint.row_count == 2
    assert d.apply(checkpoint).result == OutboxWriteResult(rows=0)
    assert d.sm.pending.rows() == () and d.rows("s") == ()


@pytest.mark.parametrize("mode", list(EmissionMode))
def test_a_row_not_yet_checkpointed_is_one_to_acknowledge(mode: EmissionMode) -> None:
    """Keep-alives hold only a subscription with nothing to acknowledge, and a row
    counts from its computation, checkpointed or not: the rule is the state
    machine's, the same under either mode. Once acknowledged (in the derived mode
    before its checkpoint), the subscription is kept alive again."""
    d, start = holder()
    core = NotifierCore("n1", NotifierConfig(emission=mode, attach_grace_ms=0))
    core.attach(d.sm, "s", "alice", start, d.now_ms)
    write(d, "a/1")
    [row] = d.rows("s")
    quiet = d.now_ms + WINDOW // 4 + 1
    _, touch, _ = core.lifecycle(d.sm, quiet, WINDOW)
    assert touch == ()
    d.now_ms = quiet
    d.apply(OutboxPurge(d.sm.lease_index, (), (), WINDOW, quiet, ("s",)))  # ignored
    assert d.sm.subs.get("s").last_active_ms < quiet  # type: ignore[union-attr]
    sent = core.next_batches(d.sm, 10, d.tick())
    if mode is EmissionMode.LITERAL:
        assert sent == []  # not before its checkpoint, and so not acknowledged either
        assert core.on_client_ack(d.sm, "s", "alice", row.emit_seq, d.tick()).status is (
            AckStatus.FUTURE
        )
        d.apply(core.outbox_entry(d.sm, d.sm.lease_index, d.tick()))  # type: ignore[arg-type]
        sent = core.next_batches(d.sm, 10, d.tick())
    assert sent == [("s", (row,))]
    assert core.on_client_ack(d.sm, "s", "alice", row.emit_seq, d.tick()).status is (
        AckStatus.ACCEPTED
    )
    housekeeping(d, core, d.tick())
    assert d.rows("s") == ()
    if mode is EmissionMode.DERIVED:  # acknowledged before its checkpoint
        assert d.sm.outboxed_through < row.emit_seq.commit_index
    checkpoint = core.outbox_entry(d.sm, d.sm.lease_index, d.tick() + 100)
    if mode is EmissionMode.DERIVED:  # the acknowledged row is checkpointed all the same
        assert checkpoint is not None and checkpoint.row_count == 1
        assert d.apply(checkpoint).result == OutboxWriteResult(rows=1)
    else:
        assert checkpoint is None
    assert d.sm.pending.rows() == ()
    acked_at = d.sm.subs.get("s").last_active_ms  # type: ignore[union-attr]
    later = acked_at + WINDOW // 4 + 1
    _, touch, _ = core.lifecycle(d.sm, later, WINDOW)
    assert touch == ("s",)
