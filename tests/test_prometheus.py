"""deploy/prometheus/alerts.yml in a real Prometheus scraping a three-node cluster:
quiet while the cluster is whole; with two of three nodes killed, every bucket (and
the metadata group) of the third loses its leader, and the no-leader and node-down
alerts fire; with the nodes back, they clear. The rules run as a test copy whose
`for:` durations are 3 s (tests/prometheus_harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster_harness import LocalCluster, wait_for
from prometheus_harness import prometheus

pytestmark = pytest.mark.slow


def test_no_leader_and_node_down_fire_and_clear(tmp_path: Path) -> None:
    cluster = LocalCluster.start(tmp_path / "data", buckets=2)
    try:
        cluster.wait_settled()
        nodes = cluster.spec.nodes
        with prometheus(cluster, tmp_path / "prometheus") as prom:
            # Every node scraped: 3 replicas of 2 buckets and of the metadata group.
            wait_for(
                lambda: len(prom.query("sevendb_raft_has_leader == 1")) == 9,
                60,
                "every replica scraped with a leader",
                0.5,
            )
            assert len(prom.query('up{job="sevendb"} == 1')) == 3
            assert prom.alerts("firing") == {} and prom.alerts("pending") == {}

            survivor, *victims = nodes
            for node in victims:
                cluster.kill9(node.node_id)

            def fired() -> dict[str, list[dict[str, str]]] | None:
                alerts = prom.alerts("firing")
                buckets = {a["bucket"] for a in alerts.get("SevendbNoLeader", [])}
                down = {a["instance"] for a in alerts.get("SevendbNodeDown", [])}
                return alerts if buckets == {"0", "1", "meta"} and len(down) == 2 else None

            alerts = wait_for(fired, 90, "the no-leader and node-down alerts to fire", 0.5)
            assert {a["instance"] for a in alerts["SevendbNodeDown"]} == {
                f"{n.host}:{n.metrics_port}" for n in victims
            }
            assert survivor.node_id not in str(alerts["SevendbNodeDown"])

            cluster.restart()
            wait_for(
                lambda: prom.alerts("firing") == {} and prom.alerts("pending") == {},
                120,
                "every alert to clear once the nodes are back",
                0.5,
            )
            assert len(prom.query("sevendb_raft_has_leader == 1")) == 9
    finally:
        cluster.stop()
