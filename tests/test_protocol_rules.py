"""The pure and in-process parts of the protocol's answers (the real-process side is
tests/test_protocol_answers.py): a reconnect position beyond everything the bucket
applied is INVALID_SEQUENCE whatever its epoch; malformed requests are logged at most
once per interval; every method of the service has a route."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import BUCKET, Driver

from sevendb.cluster.common.acl import Acl
from sevendb.cluster.common.auth import Keyring
from sevendb.cluster.common.bundle import ClusterSecrets
from sevendb.cluster.common.topology import ClusterSpec, NodeSpec, new_cluster
from sevendb.cluster.raft.replica import BucketReplica
from sevendb.cluster.server.meta import ClusterView, MetaMember
from sevendb.cluster.server.rpc import MalformedLog, Route, method_handlers
from sevendb.cluster.server.service import NodeService
from sevendb.notifier.host import BucketNotifier
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.model import ReconnectStatus
from sevendb.proto import sevendb_pb2 as pb


def test_a_position_beyond_the_applied_index_is_invalid_in_any_epoch() -> None:
    """Epoch 1 at an index the log never reached, while the subscription has moved on
    into epoch 2: the position is before its acked point by order, but was never
    emitted, so INVALID_SEQUENCE (not STALE_SEQUENCE, which would say it once was)."""
    d = Driver(holder="n1")
    d.lease()
    d.subscribe("s", "prefix:a/")
    d.epoch()
    d.set("a/1")
    d.outbox()
    [row] = d.rows("s")
    d.ack("s", row.emit_seq)
    never = EmitSeq(BUCKET, 1, d.sm.applied_index + 10)
    assert never < row.emit_seq  # ordered before the acked point
    decision = d.sm.decide_reconnect("s", "alice", never)
    assert decision.status is ReconnectStatus.INVALID_SEQUENCE, decision
    assert "beyond anything committed" in decision.message
    # The subscription's own positions still resume.
    assert d.sm.decide_reconnect("s", "alice", row.emit_seq).status is ReconnectStatus.OK


def test_malformed_requests_are_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    malformed = MalformedLog(every_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, "sevendb.cluster.server.rpc")
    for _ in range(1000):
        malformed.note("Get", "ipv4:1.2.3.4:5", ValueError("x" * 10_000))
    assert len(caplog.records) == 1
    assert len(caplog.records[0].getMessage()) < 400  # bounded, whatever the error says
    now[0] += 10.0
    malformed.note("Write", "ipv4:1.2.3.4:5", ValueError("bad"))
    assert len(caplog.records) == 2
    assert "(1000 since the last such warning)" in caplog.records[1].getMessage()


@dataclass
class _Node:
    """A node with no replicas: enough to build the service's route table."""

    spec: ClusterSpec
    node_id: str = "n1"
    replicas: dict[int, BucketReplica] = field(default_factory=dict)
    notifiers: dict[int, BucketNotifier] = field(default_factory=dict)
    me: NodeSpec = field(init=False)
    view: ClusterView = field(init=False)
    meta: MetaMember | None = None
    secrets: ClusterSecrets = field(default_factory=ClusterSecrets.new)
    draining: bool = False
    channel_credentials: None = None

    def __post_init__(self) -> None:
        self.me = self.spec.node(self.node_id)
        self.view = ClusterView(self.spec, Path(tempfile.mkdtemp()))

    @property
    def keyring(self) -> Keyring:
        return self.secrets.keyring()

    @property
    def acl(self) -> Acl:
        return Acl()


def test_every_method_of_the_service_has_a_route_and_no_route_is_extra() -> None:
    node = NodeSpec("n1", "127.0.0.1", 9001, 9002, 9003)
    spec = new_cluster(nodes=[node], buckets=1, replicas=1, meta_voters=0)
    service = NodeService(_Node(spec))
    routes = service.routes()
    names = {m.name for m in pb.DESCRIPTOR.services_by_name["SevenDB"].methods}
    assert set(routes) == names
    assert set(method_handlers(service.edge, routes)) == names
    with pytest.raises(ValueError, match="Extra"):
        method_handlers(service.edge, {**routes, "Extra": Route(service.reads.get)})
    without_get = {k: v for k, v in routes.items() if k != "Get"}
    with pytest.raises(ValueError, match="Get"):
        method_handlers(service.edge, without_get)
