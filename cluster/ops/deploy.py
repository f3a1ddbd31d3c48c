"""`sevendb cluster init`, `sevendb node init` and `sevendb node run`: making the
bundles of a cluster across machines, and running a node from one (docs/deploy.md).

    sevendb cluster init --out bundles --node n1=10.0.0.1 --node n2=10.0.0.2 \\
        --node n3=10.0.0.3 --buckets 16
    scp -r bundles/n1 10.0.0.1:/etc/sevendb     # one bundle per machine
    sevendb node run --config /etc/sevendb/node.toml
    sevendb --config bundles/client.toml status
    sevendb --config bundles/client.toml node init --node n4=10.0.0.4 --out bundles
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sevendb.cluster.common.bundle import (
    CLIENT_FILE,
    ClusterSecrets,
    write_client_config,
    write_node_bundle,
)
from sevendb.cluster.common.topology import (
    BUCKETS_MAX,
    META_VOTERS_DEFAULT,
    BucketSpec,
    ClusterSpec,
    ConfigError,
    NodeSpec,
    new_cluster,
    rendezvous,
)
from sevendb.cluster.ops.admin import ClusterAdmin

__all__ = [
    "PortPlan",
    "cluster_init",
    "node_init",
    "node_run",
    "parse_node",
    "with_bucket_uuids",
]

NODE_MODULE: Final = "sevendb.cluster.server.node"


@dataclass(frozen=True)
class PortPlan:
    """The ports every node of a cluster uses (each machine has its own address)."""

    grpc: int = 7001
    raft_base: int = 7100
    metrics: int = 9101
    meta: int = 7000

    def node(self, node_id: str, host: str, grpc: int | None, *, voter: bool) -> NodeSpec:
        return NodeSpec(
            node_id,
            host,
            grpc or self.grpc,
            self.raft_base,
            self.metrics,
            meta_port=self.meta if voter else 0,
        )


def parse_node(text: str) -> tuple[str, str, int | None]:
    """``n1=HOST`` or ``n1=HOST:GRPC_PORT`` -> (id, host, port or None)."""
    node_id, eq, address = text.partition("=")
    if not eq or not node_id or not address:
        raise ConfigError(f"--node {text!r}: expected ID=HOST or ID=HOST:PORT")
    host, colon, port = address.rpartition(":")
    if not colon or "]" in port:
        return node_id, address, None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--node {text!r}: {port!r} is not a port")
    return node_id, host, int(port)


def with_bucket_uuids(spec: ClusterSpec, bucket_uuids: Sequence[str]) -> ClusterSpec:
    """`spec` with these buckets (a restored cluster keeps its buckets' identities),
    each placed by rendezvous hashing as a new cluster's are."""
    node_ids = spec.node_ids
    buckets = tuple(
        BucketSpec(b, u, tuple(rendezvous(u, node_ids, spec.replicas)))
        for b, u in enumerate(bucket_uuids)
    )
    new = dataclasses.replace(spec, buckets=buckets)
    new.validate()
    return new


def _fresh(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty: bundles are written once, into a new directory")


def cluster_init(
    out: Path,
    nodes: Sequence[str],
    *,
    buckets: int,
    replicas: int,
    meta_voters: int = META_VOTERS_DEFAULT,
    ports: PortPlan = PortPlan(),
    listen_host: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
    bucket_uuids: Sequence[str] = (),
    node_extra: str = "",
) -> ClusterSpec:
    """Mint a cluster and write a bundle per node (out/<id>/) and a client bundle
    (out/client.toml). `bucket_uuids`: the buckets' identities (a restore; default
    new ones); `node_extra`: lines added to each node.toml's [node] section."""
    if not nodes:
        raise ConfigError("name the cluster's nodes: --node ID=HOST (at least one)")
    if not 1 <= buckets <= BUCKETS_MAX:
        raise ConfigError(f"--buckets must be 1..{BUCKETS_MAX}, got {buckets}")
    if meta_voters not in (1, 3, 5):
        raise ConfigError(f"--meta-voters must be 1, 3 or 5, got {meta_voters}")
    if replicas > len(nodes):
        raise ConfigError(f"--replicas {replicas} needs at least as many nodes ({len(nodes)})")
    _fresh(out)
    parsed = [parse_node(n) for n in nodes]
    voters = min(meta_voters, len(parsed))
    specs = [
        ports.node(node_id, host, port, voter=i < voters)
        for i, (node_id, host, port) in enumerate(parsed)
    ]
    spec = new_cluster(nodes=specs, buckets=buckets, replicas=replicas, meta_voters=voters)
    if bucket_uuids:
        spec = with_bucket_uuids(spec, bucket_uuids)
    secrets = ClusterSecrets.new()
    for node in spec.nodes:
        path = write_node_bundle(
            out / node.node_id, spec, node, secrets, listen_host=listen_host, extra=node_extra
        )
        progress(f"wrote {path}")
    progress(f"wrote {write_client_config(out / CLIENT_FILE, spec, secrets)}")
    return spec


def node_init(
    admin: ClusterAdmin,
    out: Path,
    node: str,
    *,
    ports: PortPlan = PortPlan(),
    listen_host: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> NodeSpec:
    """Register a new node in the running cluster's metadata and write its bundle
    (out/<id>/): start it on its machine with `sevendb node run`."""
    import grpc

    from sevendb.proto import sevendb_pb2 as pb

    node_id, host, port = parse_node(node)
    _fresh(out / node_id)
    meta = admin.read()
    if node_id in meta.spec.node_ids:
        raise ConfigError(f"the cluster already has a node {node_id!r}")
    try:
        bundle: pb.JoinBundleResponse = admin.any_node(
            lambda s: s.JoinBundle(pb.JoinBundleRequest(), metadata=admin.metadata, timeout=10)
        )
    except grpc.RpcError as exc:
        raise ConfigError(f"the cluster refused: {exc.code().name}: {exc.details()}") from None
    spec = ports.node(node_id, host, port, voter=False)
    genesis = ClusterSpec.from_json(bundle.genesis, "the cluster's genesis")
    (out / node_id).mkdir(parents=True, exist_ok=True)
    secrets_path = out / node_id / "secrets.tmp.toml"
    secrets_path.write_text(bundle.secrets)
    os.chmod(secrets_path, 0o600)
    try:
        secrets = ClusterSecrets.load(secrets_path)
    finally:
        secrets_path.unlink()
    admin.save(meta, meta.spec.with_node(spec), wait=False)
    seeds = [n.grpc_address for n in meta.spec.nodes]
    path = write_node_bundle(
        out / node_id, genesis, spec, secrets, seeds=seeds, listen_host=listen_host
    )
    progress(f"registered node {node_id} ({spec.grpc_address}) and wrote {path}")
    return spec


def node_run(argv: Sequence[str]) -> int:
    """Replace this process with a node process (the server's own entry point, so
    that the operator's tools never import the server)."""
    os.execv(sys.executable, [sys.executable, "-m", NODE_MODULE, *argv])


def add_port_arguments(parser: argparse.ArgumentParser) -> None:
    plan = PortPlan()
    for flag, default, text in (
        ("--grpc-port", plan.grpc, "client port"),
        ("--raft-port", plan.raft_base, "bucket b's Raft port is this + b"),
        ("--metrics-port", plan.metrics, "Prometheus /metrics; 0: off"),
        ("--meta-port", plan.meta, "the metadata group's Raft port, on voters"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument(
        "--listen-host",
        help="the address nodes bind (default: each node's advertised host; 0.0.0.0: all)",
    )


def port_plan(args: argparse.Namespace) -> PortPlan:
    return PortPlan(args.grpc_port, args.raft_port, args.metrics_port, args.meta_port)
