"""Start positions and history against real processes (docs/wire.md, "Start positions"
and "History"): a subscription from the earliest retained change, after an emit_seq or
from a time gets the committed changes before it and then live ones on one chain, no
gap, no duplicate; `History` pages the same; past the retained window, STALE_SEQUENCE."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cluster_harness import LocalCluster, wait_for
from test_emission import Collector, Writer, check_delivery, committed

from sevendb.outbox.errors import StaleSequence
from sevendb.sdk import BrokenReason, SubscriptionBroken

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    monkeypatch.setenv("SEVENDB_NOTIFIER_HISTORY_ENTRIES", "30")
    c = LocalCluster.start(tmp_path / "data", buckets=2)
    try:
        yield c
    finally:
        c.stop()


def test_starts_in_the_past_and_history_then_stale_past_the_window(
    cluster: LocalCluster,
) -> None:
    with cluster.client() as client:
        writer = Writer(client, "h/")
        writer.write(12)
        # From the earliest retained change: the 12 before, then live ones, one chain.
        early = Collector(client.subscribe("prefix:h/", start="earliest"))
        writer.write(6)
        early.wait_keys(set(writer.attempted))
        early.stop()
        check_delivery(early.events, committed(client, writer.attempted), 2, prefix="h/")
        # History pages the same changes, in order, on the same chains.
        paged = list(client.history("prefix:h/", page_size=4))
        assert [(e.bucket, e.emit_seq, e.prev_emit_seq, e.changes) for e in paged] == sorted(
            ((e.bucket, e.emit_seq, e.prev_emit_seq, e.changes) for e in early.events),
            key=lambda t: (t[0], t[1]),
        )
        # After an emit_seq (one key, one bucket), and from a time.
        for i in range(4):
            client.put("one", f"v{i}".encode())
        versions = list(client.history("key:one"))
        assert [e.changes[0].version for e in versions] == [1, 2, 3, 4]
        after = Collector(client.subscribe("key:one", start=versions[1].emit_seq))
        stamp = datetime.fromtimestamp(versions[3].commit_time_ms / 1000, UTC)
        since = Collector(client.subscribe("key:one", start=stamp))
        client.put("one", b"v4")
        wait_for(lambda: len(after.events) == 3 and len(since.events) == 2, 30, "both streams")
        assert [e.changes[0].version for e in after.events] == [3, 4, 5]
        assert [e.changes[0].version for e in since.events] == [4, 5]
        assert after.events[0].prev_emit_seq == versions[1].emit_seq
        for c in (after, since):
            c.stop()
        # Past the window (30 change sets a bucket; the holder trims once a second).
        first = paged[0]
        writer.write(100)

        def trimmed() -> bool:
            """Both buckets' histories no longer reach their first change."""
            for bucket in (0, 1):
                event = next(e for e in paged if e.bucket == bucket)
                try:
                    list(client.history(f"key:{event.changes[0].key}", after=event.emit_seq))
                except StaleSequence:
                    continue
                return False
            return True

        wait_for(trimmed, 30, "the history trimmed past the first changes", 0.2)
        with pytest.raises(SubscriptionBroken) as stale:
            client.subscribe(f"key:{first.changes[0].key}", start=first.emit_seq)
        assert stale.value.reason is BrokenReason.STALE_SEQUENCE
        assert "older than the retained history" in str(stale.value)
        # From that start, sync_then_subscribe falls back on its own: the state, then live.
        layout = client.layout()
        same = layout.bucket_of(first.changes[0].key)  # a key of first's bucket, not h/
        key = next(k for k in (f"x/{i}" for i in range(1000)) if layout.bucket_of(k) == same)
        client.put(key, b"once")
        state, sub, handover = client.sync_then_subscribe(f"key:{key}", start=first.emit_seq)
        assert handover.stale_start and state[key].value == b"once"
        client.put(key, b"again")
        event = sub.poll(10)
        assert event is not None
        fresh_changes = handover.fresh(event.emit_seq.commit_index, event.changes)
        assert [c.value for c in fresh_changes] == [b"again"]
        sub.close()
        # Within the window it replays the history instead: no state, the changes as events.
        newest = writer.attempted[-1]
        state, sub, handover = client.sync_then_subscribe(f"key:{newest}", start="earliest")
        assert state == {} and not handover.stale_start
        event = sub.poll(10)
        assert event is not None and [c.key for c in event.changes] == [newest]
        sub.close()
        # Past the window, the state then the stream: no gap, no duplicate between.
        state, sub, handover = client.sync_then_subscribe("prefix:h/")
        assert set(state) == set(writer.attempted)
        writer.write(5)
        client.delete("h/00000")
        mine = {k: r.value for k, r in state.items()}
        fresh = Collector(sub)
        newest = writer.attempted[-1]
        wait_for(lambda: {newest, "h/00000"} <= fresh.keys(), 30, "the live changes")
        fresh.stop()
        for event in fresh.events:
            for change in handover.fresh(event.emit_seq.commit_index, event.changes):
                if change.op.name == "SET":
                    mine[change.key] = change.value
                else:
                    mine.pop(change.key, None)
        truth = {
            r.key: r.value for b in (0, 1) for r in client.sync_bucket(b) if r.key.startswith("h/")
        }
        assert mine == truth and "h/00000" not in mine and newest in mine
        # The holders keep each bucket's window at its bound (once a second).
        wait_for(lambda: len(list(client.history("prefix:h/"))) <= 2 * 30, 30, "the window")
        kept = {c.key for e in client.history("prefix:h/") for c in e.changes}
        assert {newest, "h/00000"} <= kept and not kept & set(writer.attempted[1:12])
