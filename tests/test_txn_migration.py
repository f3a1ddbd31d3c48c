"""A transaction open across a migration of one of its buckets (issue 29, docs/transactions.md,
"Migration"): real processes, `sevendb bucket migrate`'s code moving bucket 0 to other nodes
while a transaction has pending writes in it. The commit is delivered to a read_committed
subscriber once, in one event per bucket at its marker, with the `prev_emit_seq` chain
unbroken across the epoch; an abort across the migration back is never delivered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import LocalCluster
from test_emission import Collector, check_delivery, committed
from test_migration import check_moved, target_without_leader

from sevendb.cluster.ops.local import add_node
from sevendb.cluster.ops.migrate import migrate_bucket
from sevendb.outbox.keys import bucket_of
from sevendb.sdk.streams import Event

pytestmark = pytest.mark.slow
MOVED = 0  # the bucket migrated (test_migration's BUCKET)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster.start(tmp_path / "data", buckets=2)
    try:
        c.wait_settled()
        yield c
    finally:
        c.stop()


def keys(prefix: str, bucket: int, n: int) -> list[str]:
    return [k for k in (f"{prefix}{i}" for i in range(200)) if bucket_of(k, 2) == bucket][:n]


def events_with(events: list[Event], wanted: set[str]) -> list[Event]:
    return [e for e in events if wanted & {c.key for c in e.changes}]


def test_a_transaction_open_across_a_migration_commits_once_and_an_abort_never_shows(
    cluster: LocalCluster,
) -> None:
    moved_keys = keys("tm/", MOVED, 5)
    other_keys = keys("tm/", 1 - MOVED, 2)
    before, after = moved_keys[3], moved_keys[4]  # plain writes around the transactions
    original = tuple(cluster.spec.buckets[MOVED].nodes)
    new = add_node(cluster.data_dir).node_id
    with cluster.client() as client:
        collector = Collector(client.subscribe("prefix:tm/"))  # read_committed (the default)
        client.put(before, b"plain")
        # 1. commit: pending writes in the bucket on both sides of its migration
        txn = client.transaction("tm-app")
        txn.put(moved_keys[0], b"c0")
        txn.put(other_keys[0], b"c1")
        target = target_without_leader(cluster, new)
        migrate_bucket(cluster.admin(), MOVED, target, progress=print)
        check_moved(cluster, target, 2)
        assert client.get(moved_keys[0]) is None  # still pending after the move
        txn.put(moved_keys[1], b"c2")  # the new leader takes the transaction's writes
        txn.commit()
        first = {moved_keys[0], moved_keys[1], other_keys[0]}
        collector.wait_keys(first | {before})
        # 2. abort: pending writes in the bucket while it moves back
        doomed = client.transaction("tm-app")
        doomed.put(moved_keys[2], b"a0")
        doomed.put(other_keys[1], b"a1")
        migrate_bucket(cluster.admin(), MOVED, original, progress=print)
        check_moved(cluster, original, 3)
        doomed.abort()
        client.put(after, b"plain")  # the chain goes on after the abort
        collector.wait_keys({after})
        collector.stop()
        assert client.get(moved_keys[2]) is None and client.get(other_keys[1]) is None
        truth = committed(client, [*first, before, after])
    events = collector.events
    # every committed key once, per bucket an increasing, unbroken prev_emit_seq chain,
    # nothing of the aborted transaction (check_delivery: exactly the committed writes)
    check_delivery(events, truth, 2, prefix="tm/")
    # the commit: one event per bucket, whole, at its marker (after the epoch change)
    (in_moved,) = events_with(events, {moved_keys[0], moved_keys[1]})
    assert sorted(c.key for c in in_moved.changes) == sorted(moved_keys[:2])
    assert in_moved.emit_seq.epoch_counter == 2
    (in_other,) = events_with(events, {other_keys[0]})
    assert [c.key for c in in_other.changes] == [other_keys[0]]
    (last,) = events_with(events, {after})
    assert last.emit_seq.epoch_counter == 3
