"""Property tests of the core: determinism, snapshots, effective-once, purge safety."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BUCKET, Driver, replay
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import actions, run_actions

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import Ack, Op, OpKind, OutboxPurge, Write
from sevendb.outbox.model import (
    AckStatus,
    Applied,
    OutboxRow,
    PurgeResult,
    ReconnectStatus,
    RowsPending,
    RowsPurged,
)
from sevendb.outbox.state import BucketStateMachine
from sevendb.sdk.cursor import StreamCursor

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(actions)
def test_replaying_a_log_gives_identical_digest_and_effects(acts: list[tuple[object, ...]]) -> None:
    d = Driver()
    first = run_actions(d, acts)
    again = BucketStateMachine(BUCKET)
    second = []
    for index, data in d.log:
        try:
            second.append(again.apply(index, data))
        except Exception:  # malformed garbage: rejected the same way both times
            continue
    assert [a for a in first] == second
    assert again.snapshot() == d.sm.snapshot()
    assert again.digest() == d.sm.digest()


@SETTINGS
@given(actions, st.data())
def test_snapshot_restore_then_continue_equals_straight_apply(
    acts: list[tuple[object, ...]], data: st.DataObject
) -> None:
    d = Driver()
    run_actions(d, acts)
    cut = data.draw(st.integers(0, len(d.log)))
    head = replay(d.log[:cut])
    resumed = replay(d.log[cut:], BucketStateMachine.restore(head.snapshot()))
    assert resumed.digest() == d.sm.digest()


@SETTINGS
@given(actions)
def test_purge_never_removes_an_unacked_row(acts: list[tuple[object, ...]]) -> None:
    d = Driver()
    accepted: dict[str, EmitSeq] = {}
    computed: dict[str, list[OutboxRow]] = {}

    def check(applied: Applied) -> None:  # as each entry is applied, not after the last
        for effect in applied.effects:
            if isinstance(effect, RowsPending):
                for row in effect.rows:
                    computed.setdefault(row.sub_id, []).append(row)
        if isinstance(applied.result, PurgeResult):
            for outcome in applied.result.acks:
                if outcome.status is AckStatus.ACCEPTED:
                    sub = d.sm.subs.get(outcome.sub_id)
                    assert sub is not None
                    accepted[outcome.sub_id] = sub.acked
        for effect in applied.effects:
            if isinstance(effect, RowsPurged):
                for row in effect.rows:
                    assert row.emit_seq <= accepted[row.sub_id]

    run_actions(d, acts, after=check)
    for sub in d.sm.subs.sorted():  # an expired one is gone (and its rows with it)
        kept = list(sub.rows)
        acked = accepted.get(sub.sub_id, sub.start)
        unacked = [r for r in computed.get(sub.sub_id, []) if r.emit_seq > acked]
        # Everything computed and not acknowledged is still there (outboxed or not).
        assert [r.emit_seq for r in kept] == [
            r.emit_seq for r in unacked if r.emit_seq >= (kept[0].emit_seq if kept else r.emit_seq)
        ]
        assert all(r.emit_seq > acked for r in kept)


@settings(max_examples=200, deadline=None)
@given(
    writes=st.lists(st.sampled_from(["a/1", "a/2", "b", "a/3"]), min_size=1, max_size=40),
    outbox_every=st.integers(1, 5),
    faults=st.lists(
        st.sampled_from(["deliver", "drop", "dup", "swap", "reconnect", "ack"]), max_size=200
    ),
)
def test_effective_once_through_a_lossy_channel(
    writes: list[str], outbox_every: int, faults: list[str]
) -> None:
    """A client that dedupes by emit_seq sees every committed delta once, in order."""
    d = Driver()
    d.lease()
    d.subscribe("s", "prefix:a/")
    start = d.sm.subs.get("s").start  # type: ignore[union-attr]
    committed: list[OutboxRow] = []
    for i, key in enumerate(writes):
        for effect in d.apply(
            Write((Op(OpKind.SET, key, str(i).encode()),), now_ms=d.tick())
        ).effects:
            if isinstance(effect, RowsPending):
                committed.extend(r for r in effect.rows if r.sub_id == "s")
        if i % outbox_every == 0:
            d.outbox()
    d.outbox()

    cursor: StreamCursor[OutboxRow] = StreamCursor(start, reorder_buffer_max=4)
    processed: list[OutboxRow] = []
    channel = list(d.sm.decide_reconnect("s", "alice", start).resume)

    def reconnect() -> None:
        decision = d.sm.decide_reconnect("s", "alice", cursor.released)
        assert decision.status is ReconnectStatus.OK, decision.message
        cursor.resumed(cursor.released)
        channel[:] = list(decision.resume)

    def deliver(row: OutboxRow) -> None:
        offered = cursor.offer(row)
        processed.extend(offered.ready)
        if offered.gap:
            reconnect()

    for fault in faults:
        if not channel:
            break
        if fault == "deliver":
            deliver(channel.pop(0))
        elif fault == "drop":
            channel.pop(0)
        elif fault == "dup":
            deliver(channel[0])
        elif fault == "swap" and len(channel) > 1:
            channel[0], channel[1] = channel[1], channel[0]
        elif fault == "reconnect":
            reconnect()
        elif fault == "ack" and processed:
            d.apply(
                OutboxPurge(
                    d.sm.lease_index, (Ack("s", "alice", processed[-1].emit_seq),), now_ms=d.tick()
                )
            )
    # Faults stop: the stream heals by reconnecting until nothing is missing.
    for _ in range(len(committed) + 2):
        reconnect()
        while channel:
            deliver(channel.pop(0))
        if processed and processed[-1].emit_seq == (committed[-1].emit_seq if committed else start):
            break
    assert [r.emit_seq for r in processed] == [r.emit_seq for r in committed]
    assert [r.delta for r in processed] == [r.delta for r in committed]


_HASHSEED_SCRIPT = """
import random, sys
sys.path.insert(0, {tests!r})
from helpers import Driver
from strategies import run_actions
from hypothesis import strategies as st
rng = random.Random(1234)
keys = ["a/1", "a/2", "b/1", "b/2", "c", "ä/ü", "z"]
acts = []
for _ in range(400):
    r = rng.random()
    if r < 0.45:
        acts.append(("set", rng.choice(keys), bytes([rng.randrange(256)]), "any"))
    elif r < 0.55:
        acts.append(("del", rng.choice(keys)))
    elif r < 0.65:
        acts.append(("sub", rng.randrange(4), rng.choice(["all", "prefix:a/", "key:c"]), "alice"))
    elif r < 0.8:
        acts.append(("outbox",))
    elif r < 0.9:
        acts.append(("ack", rng.randrange(4), rng.randrange(3), "alice"))
    elif r < 0.95:
        acts.append(("lease", rng.choice(["n1", "n2"])))
    else:
        acts.append(("epoch",))
d = Driver()
run_actions(d, [("lease", "n1")] + acts)
print(d.sm.digest())
"""


@pytest.mark.slow
def test_digest_is_independent_of_pythonhashseed() -> None:
    tests = str(Path(__file__).parent)
    script = _HASHSEED_SCRIPT.format(tests=tests)
    digests = set()
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests
