"""The SDK's persist-then-ack schedule (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sevendb.outbox.emitseq import EmitSeq
from sevendb.sdk.progress import Acked, Outstanding, Progress, undone_changes


def seq(i: int) -> EmitSeq:
    return EmitSeq("u", 1, i)


def progress(every: int = 3) -> Progress:
    p = Progress(every_events=every, interval_s=0.5, resend_after_s=2.0)
    p.start(0, "s0", seq(10))
    p.start(1, "s1", seq(20))
    return p


def test_flush_is_due_after_enough_events_or_time() -> None:
    p = progress()
    assert not p.due(0.0) and p.next_due_s(0.0) is None
    p.processed(0, "s0", seq(11), now_s=1.0)
    assert not p.due(1.0) and p.next_due_s(1.0) == pytest.approx(0.5)
    assert p.due(1.5)  # interval since the first unflushed event
    p.processed(0, "s0", seq(12), now_s=1.1)
    p.processed(1, "s1", seq(21), now_s=1.2)
    assert p.due(1.2)  # three events
    flush = p.take_flush(1.2)
    assert flush.positions == ((0, "s0", seq(12)), (1, "s1", seq(21)))
    assert p.flushed(0) == seq(12) and not p.due(1.3)


def test_reconnects_resume_from_the_flushed_position_not_the_processed_one() -> None:
    p = progress()
    p.processed(0, "s0", seq(11), now_s=0.0)
    assert p.flushed(0) == seq(10)  # processed, but not yet durable: never skip it


def test_duplicates_and_replaced_streams_are_ignored() -> None:
    p = progress(every=1)
    p.processed(0, "s0", seq(10), now_s=0.0)  # the start itself
    p.processed(0, "old-sub", seq(30), now_s=0.0)  # an event of a replaced stream
    assert not p.due(0.0)


def test_unconfirmed_acks_are_resent_and_confirmed_ones_are_not() -> None:
    p = progress(every=1)
    p.processed(0, "s0", seq(11), now_s=0.0)
    assert p.take_flush(0.0).positions == ((0, "s0", seq(11)),)
    assert not p.due(1.0) and p.due(2.0)  # no answer: resend after 2 s
    assert p.take_flush(2.0).positions == ((0, "s0", seq(11)),)
    p.confirmed(0, "s0", seq(11))
    assert not p.due(10.0) and p.take_flush(10.0).positions == ()


def test_a_final_flush_takes_every_stream_that_processed_anything() -> None:
    """Confirmed or not: a closing subscription has its acks confirmed as applied
    (a normal ack is confirmed once queued). A stream with nothing processed since
    it started has nothing to ack."""
    p = progress(every=100)
    p.processed(0, "s0", seq(11), now_s=0.0)
    p.processed(1, "s1", seq(25), now_s=0.0)
    p.take_flush(0.0)
    p.confirmed(0, "s0", seq(11))
    assert p.take_flush(0.1, final=True).positions == ((0, "s0", seq(11)), (1, "s1", seq(25)))
    p.start(0, "s0-new", seq(40))
    assert p.take_flush(0.2, final=True).positions == ((1, "s1", seq(25)),)
    p.forget(1)  # dropped (STALE): its cursor must not come back
    assert p.take_flush(0.3, final=True).positions == ()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Progress(every_events=0, interval_s=1, resend_after_s=1)


def test_explicit_acks_move_the_processed_position_only_over_the_acked_prefix() -> None:
    """Acks come in any order; the cumulative position a node is sent never covers
    an event not acked yet (nor one nak'd, which is simply not acked)."""
    out: Outstanding[EmitSeq] = Outstanding()
    for i in (11, 12, 13, 14):
        out.handed(0, "s0", seq(i))
    assert out.ack(0, "s0", seq(13)) == (Acked.PENDING, None, 0)
    assert out.ack(0, "s0", seq(12)) == (Acked.PENDING, None, 0)  # 11 is still out
    assert out.ack(0, "s0", seq(11)) == (Acked.PENDING, seq(13), 3)
    assert out.ack(0, "s0", seq(12)) == (Acked.ALREADY, None, 0)  # twice: nothing
    assert out.is_open(0, "s0", seq(14)) and not out.is_open(0, "s0", seq(13))
    out.handed(0, "s0", seq(14))  # delivered again after a nak: still one entry
    assert out.ack(0, "s0", seq(14)) == (Acked.PENDING, seq(14), 1)
    assert out.ack(0, "s0", seq(99)) == (Acked.UNKNOWN, None, 0)
    assert out.ack(1, "s1", seq(1)) == (Acked.UNKNOWN, None, 0)


def test_explicit_acks_of_a_replaced_stream_are_dropped() -> None:
    out: Outstanding[EmitSeq] = Outstanding()
    out.handed(0, "old", seq(11))
    out.handed(0, "new", seq(5))  # the bucket resubscribed: a new stream
    assert out.ack(0, "old", seq(11)) == (Acked.ALREADY, None, 0)
    assert out.ack(0, "new", seq(5)) == (Acked.PENDING, seq(5), 1)


def test_processed_counts_every_event_a_position_covers() -> None:
    p = progress(every=3)
    p.processed(0, "s0", seq(13), now_s=0.0, count=3)
    assert p.due(0.0)


# ---- per-change delivery -------------------------------------------------------------------


def test_an_entry_is_processed_and_acked_only_with_its_last_change() -> None:
    p = progress(every=1)
    p.processed_change(0, "s0", seq(11), 0, 3, now_s=0.0)
    p.processed_change(0, "s0", seq(11), 1, 3, now_s=0.0)
    flush = p.take_flush(0.0)
    assert flush.positions == ()  # nothing to ack: the entry is not whole
    assert flush.saves == ((0, "s0", seq(10), (seq(11), 2)),)  # but persisted
    assert p.flushed(0) == seq(10)  # a reconnect resumes before the entry
    p.processed_change(0, "s0", seq(11), 1, 3, now_s=0.0)  # again: a duplicate
    assert not p.due(0.0)
    p.processed_change(0, "s0", seq(11), 2, 3, now_s=0.0)
    flush = p.take_flush(0.0)
    assert flush.positions == ((0, "s0", seq(11)),)
    assert flush.saves == ((0, "s0", seq(11), None),)


def test_a_resumed_partial_entry_skips_the_changes_processed_before() -> None:
    assert undone_changes(seq(11), 3, (seq(11), 2)) == range(2, 3)
    assert undone_changes(seq(12), 3, (seq(11), 2)) == range(0, 3)  # another entry
    assert undone_changes(seq(11), 3, None) == range(0, 3)
    p = Progress(every_events=1, interval_s=1, resend_after_s=1)
    p.start(0, "s0", seq(10), (seq(11), 2))
    p.processed_change(0, "s0", seq(11), 1, 3, now_s=0.0)  # before the partial: dropped
    assert not p.due(0.0)
    p.start(0, "s0", seq(12), (seq(11), 2))  # a partial behind the position: stale
    p.processed_change(0, "s0", seq(13), 0, 2, now_s=0.0)
    assert p.take_flush(0.0).saves == ((0, "s0", seq(12), (seq(13), 1)),)


def test_explicit_acks_of_changes_cover_only_the_acked_prefix() -> None:
    out: Outstanding[tuple[EmitSeq, int, int]] = Outstanding()
    for i in range(3):
        out.handed(0, "s0", (seq(11), i, 3))
    assert out.ack(0, "s0", (seq(11), 1, 3)) == (Acked.PENDING, None, 0)
    assert out.ack(0, "s0", (seq(11), 0, 3)) == (Acked.PENDING, (seq(11), 1, 3), 2)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    crashes=st.lists(st.integers(1, 12), max_size=3),
    every=st.integers(1, 3),
)
def test_per_change_processing_across_crashes(
    sizes: list[int], crashes: list[int], every: int
) -> None:
    """A consumer processes an entry's changes one by one and crashes after random
    numbers of them; each restart resumes from what it persisted, the node delivering
    every entry after the persisted position. Then: every change is processed; a run
    starts right after what was persisted, so only unpersisted changes come twice
    (with a persist per change, none); an ack never covers an entry with a change not
    processed yet."""
    entries = [(seq(11 + k), size) for k, size in enumerate(sizes)]
    disk: tuple[EmitSeq, tuple[EmitSeq, int] | None] = (seq(10), None)
    processed: list[tuple[EmitSeq, int]] = []
    for crash_after in [*crashes, None]:
        p = Progress(every_events=every, interval_s=1.0, resend_after_s=10.0)
        p.start(0, "s0", *disk)
        resumed_at = disk
        run: list[tuple[EmitSeq, int]] = []
        for emit_seq, size in (e for e in entries if e[0] > disk[0]):
            for i in undone_changes(emit_seq, size, disk[1]):
                if crash_after is not None and len(run) == crash_after:
                    break
                run.append((emit_seq, i))
                p.processed_change(0, "s0", emit_seq, i, size, now_s=0.0)
                if p.due(0.0):
                    flush = p.take_flush(0.0)
                    for _, _, position in flush.positions:  # acked: every change processed
                        done = set(processed + run)
                        assert all(
                            (e, j) in done for e, n in entries if e <= position for j in range(n)
                        )
                    for _, _, position, partial in flush.saves:
                        disk = (position, partial)
            else:
                continue
            break
        if crash_after is None:
            for _, _, position, partial in p.take_flush(0.0, final=True).saves:
                disk = (position, partial)
        if run:  # the run began right after what was persisted
            first_entry, first_index = run[0]
            expected_index = (
                resumed_at[1][1] if resumed_at[1] and resumed_at[1][0] == first_entry else 0
            )
            assert first_index == expected_index
            assert first_entry == min(e for e, _ in entries if e > resumed_at[0])
        assert run == sorted(run)
        processed.extend(run)
    assert set(processed) == {(e, i) for e, n in entries for i in range(n)}
    if every == 1:
        assert len(processed) == len(set(processed))
