"""BucketNotifier, the notifier adapter, on a real replicated bucket.

Three replicas run in this process (see test_replica.py); the notifier is attached
to the leader. Its own thread is never started: each test drives it by hand, so
what happens without that thread is what the tick thread did.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_replica import Cluster, wait_until, write

from sevendb.cluster.raft.replica import BucketReplica
from sevendb.notifier.core import AttachStatus
from sevendb.notifier.host import INLINE_STREAMS_MAX, BucketNotifier, NotifierSettings
from sevendb.outbox.entries import Subscribe, encode_entry
from sevendb.outbox.model import OutboxRow, SubscribeResult
from sevendb.outbox.query import Query, plan_query

PRINCIPAL = "alice"


class Sink:
    """An attached stream that keeps what it is handed."""

    def __init__(self) -> None:
        self.rows: list[OutboxRow] = []
        self.closed: str | None = None
        self.lock = threading.Lock()

    def deliver(self, rows: tuple[OutboxRow, ...]) -> None:
        with self.lock:
            self.rows.extend(rows)

    def close(self, reason: str) -> None:
        self.closed = reason


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[BucketReplica]:
    cluster = Cluster(tmp_path).start_all()
    try:
        yield cluster.leader()
    finally:
        cluster.close()


def holding_the_lease(replica: BucketReplica) -> BucketNotifier:
    """A notifier that holds the committed lease, after passes of its loop run by hand."""
    # Nothing acks in these tests: no stream may be rewound for a resend meanwhile.
    notifier = BucketNotifier(replica, NotifierSettings(resend_after_ms=600_000))
    replica.on_applied = notifier.on_applied  # as a node wires them
    replica.after_applies = notifier.after_applies

    def holds() -> bool:
        notifier._step()  # one pass of the loop its thread would run
        return notifier.emitting

    wait_until(holds, what="the notifier to hold the lease")
    return notifier


def subscribe(replica: BucketReplica, sub_id: str, query: str) -> SubscribeResult:
    q = Query.parse(query)
    outcome = replica.propose(
        encode_entry(Subscribe(sub_id, PRINCIPAL, q, plan_query(q).plan_hash, int(time.time())))
    )
    assert outcome.applied is not None
    result = outcome.applied.result
    assert isinstance(result, SubscribeResult) and result.start is not None
    return result


def test_the_tick_thread_outboxes_and_sends_new_rows_itself(leader: BucketReplica) -> None:
    notifier = holding_the_lease(leader)
    start = subscribe(leader, "s1", "prefix:k/").start
    assert start is not None
    sink = Sink()
    attached, _ = notifier.attach("s1", PRINCIPAL, start, sink)
    assert attached.status is AttachStatus.ATTACHED

    committed = [leader.propose(write(f"k/{i}")).commit_index for i in range(5)]

    # Nothing runs the notifier's loop any more: the OUTBOX_WRITE for these rows was
    # proposed, and the rows sent once it applied, from the replica's tick thread.
    def all_sent() -> bool:
        with sink.lock:
            return len(sink.rows) == len(committed)

    wait_until(all_sent, what="the rows to reach the stream")
    assert [row.emit_seq.commit_index for row in sink.rows] == committed
    assert leader.read(lambda sm: sm.outboxed_through) >= committed[-1]
    assert sink.closed is None


def test_a_notifier_with_many_streams_leaves_them_to_its_thread(
    leader: BucketReplica,
) -> None:
    notifier = holding_the_lease(leader)
    sinks: dict[str, Sink] = {}
    for i in range(INLINE_STREAMS_MAX + 1):
        start = subscribe(leader, f"s{i}", "prefix:k/").start
        assert start is not None
        sinks[f"s{i}"] = sink = Sink()
        attached, _ = notifier.attach(f"s{i}", PRINCIPAL, start, sink)
        assert attached.status is AttachStatus.ATTACHED
    notifier._wake.clear()  # attaching woke it

    committed = [leader.propose(write(f"k/{i}")).commit_index for i in range(5)]

    # The tick thread leaves the work to the thread, and wakes it for it.
    wait_until(notifier._wake.is_set, what="the notifier thread to be woken")

    def delivered() -> bool:
        notifier._step()  # the passes the woken thread runs
        return all(len(sink.rows) == len(committed) for sink in sinks.values())

    wait_until(delivered, what="every row on every stream")
    for sub_id, sink in sinks.items():
        assert [row.emit_seq.commit_index for row in sink.rows] == committed, sub_id
