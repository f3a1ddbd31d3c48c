"""A new subscription's streams go first to the node each bucket's last stream was
established on (docs/sdk.md, "Where streams go"), not to any node: on a 3-node
cluster two first Subscribes in three went to a node that does not hold the bucket's
notifier lease and were refused (a third of set-up's CPU, docs/performance.md)."""

from __future__ import annotations

import pytest
from cluster_harness import LocalCluster

pytestmark = pytest.mark.slow


def test_later_subscriptions_go_straight_to_the_lease_holders(
    shared_cluster: LocalCluster,
) -> None:
    with shared_cluster.client() as client:
        first = client.subscribe("prefix:holders/")
        later = [client.subscribe(f"prefix:holders/{i}/") for i in range(6)]
        try:
            assert first.stats().buckets == 2
            # Each of the later ones: no stream refused and redirected (the old code:
            # 2 in 3 per bucket, 12 streams here).
            assert [sub.stats().reconnects for sub in later] == [0] * len(later)
        finally:
            for sub in [first, *later]:
                sub.close()
