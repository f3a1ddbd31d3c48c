"""Start positions and the retained history in the core (docs/core.md, "Start
positions", "Retained history"): a subscription may start in the past, within the
window the bucket retains, and `history_page` pages it; past the window the answer
is STALE_SEQUENCE."""

from __future__ import annotations

import gc
import itertools

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import HistoryTrim, OpKind, Start, StartKind, Subscribe
from sevendb.outbox.errors import ErrorCode, InvalidArgument, StaleSequence
from sevendb.outbox.history import History
from sevendb.outbox.model import HistoryTrimResult, SubscribeResult
from sevendb.outbox.query import Query, plan_query
from sevendb.outbox.state import BucketStateMachine
from tests.helpers import BUCKET, Driver, replay

EARLIEST = Start(StartKind.EARLIEST)


def subscribe(d: Driver, sub_id: str, query: str, start: Start) -> SubscribeResult:
    q = Query.parse(query)
    applied = d.apply(Subscribe(sub_id, "alice", q, plan_query(q).plan_hash, d.tick(), "", start))
    assert isinstance(applied.result, SubscribeResult)
    return applied.result


def keys(d: Driver, sub_id: str) -> list[str]:
    return [c.key for row in d.rows(sub_id) for c in row.delta.changes]


def history(d: Driver) -> Driver:
    """A bucket with a subscriber from the beginning and six writes, two per prefix."""
    d.lease()
    d.subscribe("always", "prefix:o/")
    for key in ("o/1", "x/1", "o/2", "x/2", "o/3", "x/3"):
        d.set(key)
    return d


def test_a_subscription_from_earliest_gets_what_one_from_the_beginning_got() -> None:
    d = history(Driver())
    late = subscribe(d, "late", "prefix:o/", EARLIEST)
    assert late.error is None and late.start == EmitSeq(BUCKET, 1, 0)
    # The same rows, chained the same way, as the subscription that was there.
    assert [(r.emit_seq, r.delta) for r in d.rows("late")] == [
        (r.emit_seq, r.delta) for r in d.rows("always")
    ]
    assert d.rows("late")[0].prev_emit_seq == late.start
    assert all(b.prev_emit_seq == a.emit_seq for a, b in itertools.pairwise(d.rows("late")))
    d.set("o/4")  # and then live, on the same chain
    assert keys(d, "late") == ["o/1", "o/2", "o/3", "o/4"]
    assert d.rows("late")[-1].prev_emit_seq == d.rows("late")[-2].emit_seq
    # The replayed rows are checkpointed like any others, on every replica alike.
    assert d.outbox() is not None
    assert replay(d.log).digest() == d.sm.digest()


def test_after_a_position_and_from_a_time() -> None:
    d = history(Driver())
    o2 = d.rows("always")[1]
    after = subscribe(d, "after", "prefix:o/", Start(StartKind.AFTER, o2.emit_seq))
    assert after.start == o2.emit_seq and keys(d, "after") == ["o/3"]
    subscribe(d, "at", "prefix:o/", Start(StartKind.TIME, time_ms=o2.delta.commit_time_ms))
    assert keys(d, "at") == ["o/2", "o/3"]
    future = subscribe(d, "later", "all", Start(StartKind.TIME, time_ms=d.now_ms + 10**6))
    assert future.error is None and keys(d, "later") == []
    d.set("o/9")
    assert keys(d, "later") == ["o/9"]


def test_positions_not_of_this_log_are_refused_and_change_nothing() -> None:
    d = history(Driver())
    before = d.sm.snapshot()
    for bad in (EmitSeq("other-bucket", 1, 2), EmitSeq(BUCKET, 1, d.index + 5)):
        result = subscribe(d, "bad", "all", Start(StartKind.AFTER, bad))
        assert result.error is not None and result.error.code is ErrorCode.INVALID_ARGUMENT
    head = msgpack.unpackb(d.sm.snapshot())
    assert head[4:] == msgpack.unpackb(before)[4:]  # all but the applied index


def test_past_the_trimmed_window_is_stale_sequence() -> None:
    d = history(Driver())
    rows = d.rows("always")
    d.apply(HistoryTrim(rows[1].emit_seq.commit_index, d.tick()))  # drops o/1 .. o/2
    assert d.sm.history.after == rows[1].emit_seq
    old = subscribe(d, "old", "all", Start(StartKind.AFTER, rows[0].emit_seq))
    assert old.error is not None and old.error.code is ErrorCode.STALE_SEQUENCE
    early = subscribe(d, "early", "all", Start(StartKind.TIME, time_ms=1))
    assert early.error is not None and early.error.code is ErrorCode.STALE_SEQUENCE
    earliest = subscribe(d, "e", "prefix:o/", EARLIEST)
    assert earliest.start == rows[1].emit_seq and keys(d, "e") == ["o/3"]
    with pytest.raises(StaleSequence):
        d.sm.history.page(plan_query(Query.parse("all")), rows[0].emit_seq, None, 10)
    # The window survives a snapshot: x/2, o/3, x/3, 4 bytes each (key and value).
    restored = BucketStateMachine.restore(d.sm.snapshot())
    assert restored.digest() == d.sm.digest() and restored.history.after == d.sm.history.after
    assert restored.history.size() == d.sm.history.size() == (3, 12)


def test_history_pages_a_query_between_positions() -> None:
    d = history(Driver())
    plan = plan_query(Query.parse("prefix:x/"))
    first = d.sm.history.page(plan, None, None, 2)
    assert [e.changes[0].key for e in first.events] == ["x/1", "x/2"] and first.more
    # A page ends where it stopped looking: the next starts there, nothing skipped.
    rest = d.sm.history.page(plan, first.next_after, None, 100)
    assert [e.changes[0].key for e in rest.events] == ["x/3"] and not rest.more
    x2 = first.events[1].emit_seq.commit_index
    bounded = d.sm.history.page(plan, None, x2, 100)
    assert [e.changes[0].key for e in bounded.events] == ["x/1", "x/2"] and not bounded.more
    with pytest.raises(InvalidArgument):
        d.sm.history.page(plan, EmitSeq("elsewhere", 1, 1), None, 10)


def test_the_trim_point_keeps_each_bound_and_the_safety_point() -> None:
    from sevendb.outbox.lifecycle import history_trim_point

    d = Driver()
    d.lease()
    for key in ("o/1", "x/1", "o/2", "x/2", "o/3", "x/3"):
        d.set(key)
    idx = [kept.emit_seq.commit_index for kept in d.sm.history]
    times = [kept.commit_time_ms for kept in d.sm.history]
    now, big = d.now_ms, 10**9
    assert history_trim_point(d.sm, now, big, big, 0) is None  # within every bound
    assert history_trim_point(d.sm, now, 4, big, 0) == idx[1]  # keeps the newest 4
    assert history_trim_point(d.sm, now, big, 4 * 4, 0) == idx[1]  # 16 bytes: 4 of 4 each
    assert history_trim_point(d.sm, now, big, big, now - times[3]) == idx[2]  # by age
    # A subscription with rows to acknowledge holds the history at its acked point.
    d.subscribe("held", "prefix:o/")
    d.set("o/4")
    d.set("o/5")
    held = d.sm.subs.get("held")
    assert held is not None
    floor = held.acked.commit_index
    assert d.sm.safety_point(d.tick()) == floor
    assert history_trim_point(d.sm, d.now_ms, 1, big, 0) == floor
    # Trimmed through the floor, which is no change set's index (the subscription's
    # start): a trim to the same floor would drop nothing, and is not proposed again
    # (it was, on every pass, appending an entry for ever).
    trimmed = d.apply(HistoryTrim(floor, d.tick())).result
    assert isinstance(trimmed, HistoryTrimResult) and trimmed.dropped == 6
    assert history_trim_point(d.sm, d.now_ms, 1, big, 0) is None
    second_newest = list(d.sm.history)[-2].emit_seq.commit_index
    d.ack("held", d.rows("held")[-1].emit_seq)  # acknowledged: it holds nothing
    assert history_trim_point(d.sm, d.now_ms, 1, big, 0) == second_newest


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["o/a", "o/b", "o/c", "x/d"]), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    st.integers(min_value=0, max_value=40),
    st.integers(min_value=1, max_value=3),
    st.integers(min_value=0, max_value=2**32),
)
def test_state_then_stream_has_no_gap_and_no_duplicate(
    ops: list[tuple[str, bool]], subscribe_at: int, page: int, seed: int
) -> None:
    """The handover of sdk/handover.py against the core: subscribe at a random point of
    a random sequence of SETs and DELs, page the state with Syncs interleaved with the
    later writes, apply the state read and then each event's fresh changes: the result
    is the bucket's final state, and no change of the stream is taken twice (a fresh
    change of a key is always newer than anything taken for it)."""
    import random

    from sevendb.sdk.handover import Handover

    rng = random.Random(seed)
    d = Driver()
    d.lease()
    plan = plan_query(Query.parse("prefix:o/"))
    pending = list(ops)

    def write(key: str, is_set: bool) -> None:
        if is_set:
            d.set(key, f"{key}@{d.index}".encode())
        else:
            d.delete(key)

    for key, is_set in pending[:subscribe_at]:
        write(key, is_set)
    pending = pending[subscribe_at:]
    d.subscribe("s", "prefix:o/")
    read: dict[str, tuple[bytes, int]] = {}
    since, since_key = 0, ""
    while True:  # paged Sync, with writes committing between the pages
        taken = rng.randint(0, min(3, len(pending)))
        for key, is_set in pending[:taken]:
            write(key, is_set)
        pending = pending[taken:]
        sync = d.sm.sync_page(since, since_key, page)
        for item in sync.items:
            if plan.matches(item.key):
                read[item.key] = (item.value, item.mod_index)
        since, since_key = sync.next_since_index, sync.next_since_key
        if not sync.has_more:
            break
    for key, is_set in pending:
        write(key, is_set)
    handover = Handover((key, mod) for key, (_, mod) in read.items())
    state = {key: value for key, (value, _) in read.items()}
    taken_at: dict[str, int] = {key: mod for key, (_, mod) in read.items()}
    for row in d.rows("s"):
        for change in handover.fresh(row.emit_seq.commit_index, row.delta.changes):
            assert row.emit_seq.commit_index > taken_at.get(change.key, -1)  # never twice
            taken_at[change.key] = row.emit_seq.commit_index
            if change.op is OpKind.SET:
                state[change.key] = change.value
            else:
                state.pop(change.key, None)
    everything = d.sm.sync_page(0, "", 10**6).items
    truth = {i.key: i.value for i in everything if plan.matches(i.key)}
    assert state == truth


def test_a_change_set_packs_to_the_same_snapshot_bytes_as_its_changes_lists() -> None:
    """`History.pack_kept` hands msgpack each change set's changes as the history keeps
    them (twice as fast as a list per change): the bytes must stay those of
    `Change.pack`, or replicas of two builds would disagree on the snapshot's digest."""
    d = history(Driver())
    d.delete("o/1")
    kept = list(d.sm.history.copy().pack_kept())
    sets = list(d.sm.history)
    assert any(change.op is OpKind.DEL for s in sets for change in s.changes)
    explicit = [[s.emit_seq.pack(), s.commit_time_ms, [c.pack() for c in s.changes]] for s in sets]
    assert msgpack.packb(kept, use_bin_type=True) == msgpack.packb(explicit, use_bin_type=True)


def test_the_garbage_collector_stops_tracking_the_retained_changes() -> None:
    """The retained history holds up to 10,000 change sets of recent writes; kept as
    `Change` named tuples (which CPython tracks for as long as they live) they were
    most of what a node's collections walked (its longest middle-generation
    collection 41-84 ms under load, 24-47 ms without them: docs/performance.md). Kept
    as tuples of atomic values, collections untrack them (each change at the first,
    its change set's tuple at the first or the second), and a snapshot restores them
    the same way."""
    d = history(Driver())
    d.delete("o/1")
    restored = History.unpack(list(d.sm.history.copy().pack_kept()), d.sm.history.pack_reach())
    gc.collect()
    gc.collect()
    for h in (d.sm.history, restored):
        sets = [changes for _, _, changes in h.pack_kept()]
        assert sum(len(changes) for changes in sets) >= 4
        assert not any(gc.is_tracked(changes) for changes in sets)
        assert not any(gc.is_tracked(change) for changes in sets for change in changes)
    assert list(restored) == list(d.sm.history)
