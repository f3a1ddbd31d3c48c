"""The metrics port of real nodes: every family of `metrics.FAMILIES` with its
labels, the Raft, gRPC, archive and process families moving with the traffic, and
`/healthz`, `/readyz` and 404 (docs/operations.md)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_harness import LocalCluster, wait_for
from prometheus_client.parser import text_string_to_metric_families

from sevendb.cluster.common.auth import auth_metadata
from sevendb.cluster.ops.local import log_file
from sevendb.cluster.server.metrics import FAMILIES
from sevendb.outbox.keys import bucket_of
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk import SubscribeOptions

pytestmark = pytest.mark.slow

Samples = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SEVENDB_LOG_REQUESTS", "true")  # the nodes log each call (at DEBUG)
        c = LocalCluster.start(tmp_path_factory.mktemp("metrics") / "data", buckets=2)
    try:
        c.wait_settled()
        yield c
    finally:
        c.stop()


def _url(cluster: LocalCluster, node_id: str, path: str) -> str:
    node = cluster.spec.node(node_id)
    return f"http://{node.host}:{node.metrics_port}{path}"


def get(cluster: LocalCluster, node_id: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(_url(cluster, node_id, path), timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(cluster: LocalCluster, node_id: str) -> tuple[dict[str, tuple[str, set[str]]], Samples]:
    """(family -> (type, label names), sample name -> [(labels, value)]) of one node;
    a counter's family is named with its ``_total`` as in `FAMILIES`."""
    status, text = get(cluster, node_id, "/metrics")
    assert status == 200
    families: dict[str, tuple[str, set[str]]] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        labels: set[str] = set()
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
            labels |= set(sample.labels) - {"le"}
        families[name] = (family.type, labels)
    return families, samples


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        value
        for have, value in samples.get(name, [])
        if all(have.get(k) == v for k, v in labels.items())
    )


def test_every_family_with_its_labels(cluster: LocalCluster, tmp_path: Path) -> None:
    with cluster.client() as client:
        options = SubscribeOptions(ack_every_events=1)
        with client.subscribe("prefix:m/", options=options) as sub:
            for i in range(20):
                client.put(f"m/{i}", b"x")
            seen: set[str] = set()
            while len(seen) < 20:
                event = sub.poll(30)
                assert event is not None, "no event within 30 s"
                seen |= {c.key for c in event.changes}

            def streams_open() -> float:
                return sum(
                    total(scrape(cluster, n)[1], "sevendb_grpc_server_streams_in_flight")
                    for n in cluster.spec.node_ids
                )

            assert wait_for(streams_open, 10, "an open stream to show") >= 1
    _write_twice(cluster, "m/dup")  # one duplicate answered
    found: dict[str, tuple[str, set[str]]] = {}
    merged: Samples = {}
    for node_id in cluster.spec.node_ids:
        families, samples = scrape(cluster, node_id)
        for name, (kind, labels) in families.items():
            found.setdefault(name, (kind, set()))[1].update(labels)
        for name, values in samples.items():
            merged.setdefault(name, []).extend(values)
    for name, (kind, label_names) in FAMILIES.items():
        assert name in found, f"{name} is not exported"
        assert found[name][0] == kind, (name, found[name][0])
        if name != "sevendb_reconnect_status_total":  # labelled once a Reconnect happens
            assert found[name][1] == set(label_names), (name, found[name][1])
    extra = {n for n in found if n.startswith("sevendb_")} - set(FAMILIES)
    assert not extra, f"exported but not in FAMILIES (nor docs/operations.md): {extra}"
    # The families move with the traffic: 20 writes, each applied by 3 replicas, sent once.
    assert total(merged, "sevendb_commits_total") >= 60
    assert total(merged, "sevendb_events_sent_total") >= 20
    assert total(merged, "sevendb_emit_latency_seconds_count") >= 20
    assert total(merged, "sevendb_grpc_server_handled_total", code="OK") >= 20
    assert total(merged, "sevendb_grpc_server_handling_seconds_count") >= 20
    assert total(merged, "sevendb_raft_is_leader", bucket="0") == 1
    assert total(merged, "sevendb_raft_has_leader", bucket="0") == 3
    assert total(merged, "sevendb_raft_is_leader", bucket="meta") == 1
    assert total(merged, "sevendb_raft_journal_fsync_duration_seconds_count") > 0
    assert total(merged, "sevendb_raft_journal_bytes_written_total") > 0
    assert total(merged, "process_resident_memory_bytes") > 0
    assert total(merged, "sevendb_process_threads") > 3
    # Idempotent producers: the client's (one per bucket it wrote to) and this test's;
    # the retried write counted once, by the node that answered it.
    assert total(merged, "sevendb_idempotent_producers") >= 2
    assert total(merged, "sevendb_producer_duplicates_total") == 1


def _write_twice(cluster: LocalCluster, key: str) -> None:
    """A producer's write sent twice with the same sequence: applied once, the second
    answered as a duplicate."""
    stub = cluster.stub(cluster.spec.nodes[0].grpc_address)
    md = auth_metadata(cluster.token())
    bucket = bucket_of(key, len(cluster.spec.buckets))
    made = stub.InitProducer(pb.InitProducerRequest(bucket=bucket), metadata=md, timeout=10)
    ref = pb.ProducerRef(producer_id=made.producer_id, producer_epoch=made.producer_epoch)
    write = pb.WriteRequest(ops=[pb.Op(key=key, value=b"once")], producer=ref)
    first = stub.Write(write, metadata=md, timeout=10)
    again = stub.Write(write, metadata=md, timeout=10)
    assert not first.duplicate and again.duplicate


def test_a_refused_call_is_counted_under_its_code(cluster: LocalCluster) -> None:
    node = cluster.spec.nodes[0]
    with cluster.channel(node.grpc_address) as channel:
        stub = pb_grpc.SevenDBStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as refused:
            stub.CreateEpoch(
                pb.EpochRequest(bucket=0, epoch_counter=99),
                metadata=auth_metadata(cluster.token("nobody")),
                timeout=5,
            )
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    _, samples = scrape(cluster, node.node_id)
    counted = total(
        samples, "sevendb_grpc_server_handled_total", method="CreateEpoch", code="PERMISSION_DENIED"
    )
    assert counted == 1
    # ... and logged, with its principal and status, as a JSON line of the node's log.
    lines = [json.loads(line) for line in log_file(cluster.data_dir, node.node_id).open()]
    refused_lines = [
        line
        for line in lines
        if line.get("method") == "CreateEpoch" and line.get("code") == "PERMISSION_DENIED"
    ]
    assert len(refused_lines) == 1, refused_lines
    (line,) = refused_lines
    assert line["principal"] == "nobody" and line["level"] == "DEBUG"
    assert line["node"] == node.node_id and line["logger"] == "sevendb.request"
    assert line["time"].endswith("Z") and line["duration_ms"] >= 0
    started = [x for x in lines if x["message"].startswith("bucket 0: replica")]
    assert started and all(x["bucket"] == 0 for x in started)


def test_health_endpoints(cluster: LocalCluster) -> None:
    node_id = cluster.spec.node_ids[0]
    assert get(cluster, node_id, "/healthz") == (200, "ok\n")
    assert wait_for(lambda: get(cluster, node_id, "/readyz")[0] == 200, 30, "/readyz to answer 200")
    status, body = get(cluster, node_id, "/nope")
    assert status == 404 and "/nope" in body
    assert get(cluster, node_id, "/")[0] == 404


def test_readyz_says_which_replica_has_no_leader(cluster: LocalCluster) -> None:
    """Last in this module: two of three nodes killed, the third's buckets (and its
    metadata member) lose their leader; /readyz says so, /healthz is still 200."""
    first, *others = cluster.spec.node_ids
    for node_id in others:
        cluster.kill9(node_id)
    try:
        expected = ("bucket 0: no leader", "bucket 1: no leader", "the metadata group: no leader")

        def not_ready() -> bool:
            status, body = get(cluster, first, "/readyz")
            return status == 503 and all(reason in body for reason in expected)

        wait_for(not_ready, 30, "/readyz to answer 503 for every replica of the node")
        assert get(cluster, first, "/healthz")[0] == 200
    finally:
        cluster.restart()
    assert wait_for(lambda: get(cluster, first, "/readyz")[0] == 200, 60, "/readyz 200 again")
