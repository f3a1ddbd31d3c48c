"""Placement, routing and the persisted cluster spec."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sevendb.cluster.common.topology import (
    ClusterSpec,
    ConfigError,
    NodeSpec,
    new_cluster,
    rendezvous,
)
from sevendb.cluster.server.node import HandoverPacer
from sevendb.outbox.keys import bucket_of


def spec(nodes: int = 3, buckets: int = 8, replicas: int = 3) -> ClusterSpec:
    specs = [
        NodeSpec(f"n{i + 1}", "127.0.0.1", 30000 + i * 100, 30010 + i * 100, 30002 + i * 100)
        for i in range(nodes)
    ]
    return new_cluster(nodes=specs, buckets=buckets, replicas=replicas, meta_voters=0)


def test_bucket_of_is_stable_and_spreads_keys() -> None:
    assert bucket_of("orders/1", 8) == bucket_of("orders/1", 8)
    counts = [0] * 8
    for i in range(8000):
        counts[bucket_of(f"key-{i}", 8)] += 1
    assert min(counts) > 800  # roughly uniform


def test_rendezvous_moves_only_buckets_whose_top_set_changes() -> None:
    uuids = [f"bucket-{i}" for i in range(200)]
    before = {u: rendezvous(u, ["n1", "n2", "n3"], 3) for u in uuids}
    after = {u: rendezvous(u, ["n1", "n2", "n3", "n4"], 3) for u in uuids}
    moved = [u for u in uuids if set(before[u]) != set(after[u])]
    # Each bucket moves only if n4 enters its top 3 (≈ 3/4 of them), and then exactly
    # one replica changes.
    assert 0 < len(moved) < len(uuids)
    for u in moved:
        assert len(set(before[u]) - set(after[u])) == 1 and "n4" in after[u]
    for u in uuids:
        if u not in moved:
            assert set(before[u]) == set(after[u])


def test_new_cluster_mints_ids_once_and_round_trips(tmp_path: Path) -> None:
    s = spec()
    assert len({b.bucket_uuid for b in s.buckets}) == 8
    s.save(tmp_path / "genesis.json")
    loaded = ClusterSpec.load(tmp_path / "genesis.json")
    assert loaded == s
    assert loaded.replica_addresses(2) == [s.node(n).raft_address(2) for n in s.buckets[2].nodes]


def test_load_without_a_file_says_which(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"genesis\.json: no such file"):
        ClusterSpec.load(tmp_path / "genesis.json")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(replicas=4), "replicas must be"),
        (lambda d: d["buckets"][0].update(nodes=["n1", "n1", "n2"]), "distinct"),
        (lambda d: d["buckets"][1].update(nodes=["n1", "n2", "n9"]), "no node 'n9'"),
        (lambda d: d["nodes"][1].update(grpc_port=d["nodes"][0]["grpc_port"]), "used twice"),
        (lambda d: d.update(format=99), "format"),
        (lambda d: d.pop("replicas"), "unreadable"),
    ],
)
def test_invalid_specs_are_refused_with_clear_errors(mutate: object, message: str) -> None:
    raw = json.loads(spec().to_json())
    raw.pop("checksum")  # a spec written by hand
    mutate(raw)  # type: ignore[operator]
    with pytest.raises(ConfigError, match=message):
        ClusterSpec.from_json(json.dumps(raw))


def test_a_damaged_spec_that_still_parses_is_refused_by_its_checksum() -> None:
    raw = json.loads(spec().to_json())
    raw["nodes"][0]["grpc_port"] += 1  # one flipped digit
    with pytest.raises(ConfigError, match="checksum mismatch"):
        ClusterSpec.from_json(json.dumps(raw))


def test_key_routing_uses_the_bucket_count() -> None:
    s = spec(buckets=4)
    assert s.bucket_for_key("x").bucket == bucket_of("x", 4)
    assert dataclasses.replace(s, buckets=s.buckets[:1]).bucket_for_key("x").bucket == 0


def test_leader_hand_overs_back_off_while_the_bucket_keeps_coming_back() -> None:
    """A node hands a bucket to its preferred replica at once, then waits 2, 4, 8 ...
    seconds (up to the cap) each time the bucket comes back; other buckets are paced
    on their own, and a hand-over that held for the cap resets the wait."""
    pacer = HandoverPacer(base_s=2.0, max_s=30.0)
    now = 100.0
    waits = []
    for _ in range(6):
        assert pacer.due(0, now)
        wait_s = pacer.handed_over(0, now)
        waits.append(wait_s)
        assert not pacer.due(0, now + wait_s - 0.01)
        assert pacer.due(1, now)  # bucket 1 was never handed over
        now += wait_s
    assert waits == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    # The last hand-over held: long after its wait and the cap, the wait starts over.
    now += 30.0 + 30.0
    assert pacer.handed_over(0, now) == 2.0


def test_local_clusters_listen_outside_the_ephemeral_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outgoing connection may hold any ephemeral port when a node binds, and the
    node then cannot start: nodes get ports below or above that range only."""
    from sevendb.cluster.ops import local

    setting = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(local, "EPHEMERAL_RANGE_FILE", setting)
    setting.write_text("21500\t64000\n")  # leaves 21000-21499 and 64001-64999
    ports = local.allocate_ports(3, 32)
    per = local.PORTS_PER_NODE
    listening = [
        p
        for n in range(3)
        for p in (
            ports[per * n],
            *range(ports[per * n + 1], ports[per * n + 1] + 32),
            ports[per * n + 2],
            ports[per * n + 3],
        )
    ]
    assert len(set(listening)) == len(listening) == 3 * 35
    assert all(p < 21500 or 64000 < p < 65000 for p in listening)

    setting.write_text("1024 65535\n")
    with pytest.raises(ConfigError, match="outside the ephemeral range 1024-65535"):
        local.allocate_ports(1, 8)
