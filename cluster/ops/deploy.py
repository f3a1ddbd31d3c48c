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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from sevendb.cluster.common.auth import ADMIN_PRINCIPAL
from sevendb.cluster.common.bundle import (
    CA_FILE,
    CA_KEY_FILE,
    CLIENT_FILE,
    ClusterSecrets,
    NodeTLS,
    read_public,
    read_secret_bytes,
    write_client_config,
    write_file,
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

if TYPE_CHECKING:
    from sevendb.cluster.common.tls import Issued

__all__ = [
    "PortPlan",
    "cluster_init",
    "load_ca_files",
    "node_init",
    "node_run",
    "node_tls",
    "parse_node",
    "with_bucket_uuids",
    "write_client_bundle",
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


def load_ca_files(cert: Path, key: Path) -> Issued:
    """An operator's CA (or the one `cluster init` made): its certificate and key,
    the key refused unless mode 0600, the two checked to belong together."""
    from sevendb.cluster.common.tls import Issued, load_ca

    ca = Issued(read_public(cert, "CA certificate"), read_secret_bytes(key, "a CA key"))
    load_ca(ca)
    return ca


def node_tls(ca: Issued, node: NodeSpec, sans: Sequence[str] = ()) -> NodeTLS:
    """A node's certificate from `ca`: valid for its advertised host and `sans`."""
    from sevendb.cluster.common.tls import issue

    issued = issue(ca, node.node_id, hosts=[node.host, *sans])
    return NodeTLS(ca.cert_pem, issued.cert_pem, issued.key_pem)


def cluster_init(
    out: Path,
    nodes: Sequence[str],
    *,
    buckets: int,
    replicas: int,
    meta_voters: int = META_VOTERS_DEFAULT,
    ports: PortPlan = PortPlan(),
    listen_host: str | None = None,
    insecure: bool = False,
    ca: Issued | None = None,
    sans: Sequence[str] = (),
    progress: Callable[[str], None] = lambda _: None,
    bucket_uuids: Sequence[str] = (),
    node_extra: str = "",
) -> ClusterSpec:
    """Mint a cluster and write a bundle per node (out/<id>/) and a client bundle
    (out/client.toml): with TLS, a CA of the cluster's own (out/ca-key.pem) unless
    `ca` is the operator's, a certificate per node for its host and `sans`, and an
    admin client certificate; with `insecure`, none (plaintext). `bucket_uuids`: the
    buckets' identities (a restore; default new ones); `node_extra`: lines added to
    each node.toml's [node] section."""
    from sevendb.cluster.common.tls import new_ca

    if insecure and (ca is not None or sans):
        raise ConfigError("--insecure makes no certificate: drop --ca-cert/--ca-key/--san")
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
    if not insecure and ca is None:
        ca = new_ca(spec.cluster_id)
        progress(f"wrote {write_file(out / CA_KEY_FILE, ca.key_pem, secret=True)} (keep it safe)")
    for node in spec.nodes:
        tls = None if ca is None else node_tls(ca, node, sans)
        path = write_node_bundle(
            out / node.node_id,
            spec,
            node,
            secrets,
            tls,
            listen_host=listen_host,
            extra=node_extra,
        )
        progress(f"wrote {path}")
    progress(f"wrote {write_client_bundle(out / CLIENT_FILE, spec, secrets, ca)}")
    return spec


def write_client_bundle(
    path: Path, spec: ClusterSpec, secrets: ClusterSecrets, ca: Issued | None
) -> Path:
    """client.toml at `path`: an admin token and, with `ca`, the CA and an admin
    client certificate beside it (without: a plaintext bundle)."""
    from sevendb.cluster.common.tls import issue

    admin = None if ca is None else issue(ca, ADMIN_PRINCIPAL, server=False)
    return write_client_config(
        path,
        spec,
        secrets,
        now_ms=time.time_ns() // 1_000_000,
        ca_pem=None if ca is None else ca.cert_pem,
        admin_cert=None if admin is None else (admin.cert_pem, admin.key_pem),
    )


def node_init(
    admin: ClusterAdmin,
    out: Path,
    node: str,
    *,
    ports: PortPlan = PortPlan(),
    listen_host: str | None = None,
    ca: Issued | None,
    sans: Sequence[str] = (),
    progress: Callable[[str], None] = lambda _: None,
) -> NodeSpec:
    """Register a new node in the running cluster's metadata and write its bundle
    (out/<id>/): start it on its machine with `sevendb node run`. Its certificate is
    issued by `ca` (None: the cluster is plaintext, the admin connection too)."""
    if (ca is None) != (admin.tls is None):
        raise ConfigError(
            "the new node needs a certificate from the cluster's CA (--ca-cert/--ca-key, "
            f"default {CA_FILE} and {CA_KEY_FILE} beside client.toml)"
            if ca is None
            else "the cluster is plaintext (insecure = true): its nodes have no certificate"
        )
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
    tls = None if ca is None else node_tls(ca, spec, sans)
    path = write_node_bundle(
        out / node_id, genesis, spec, secrets, tls, seeds=seeds, listen_host=listen_host
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
    parser.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME",
        help="another host name or address every node certificate is valid for (a load "
        "balancer's, a Service's; repeat)",
    )
    parser.add_argument(
        "--ca-cert", type=Path, help="the CA certificate to issue node certificates with"
    )
    parser.add_argument("--ca-key", type=Path, help="its private key (mode 0600)")


def port_plan(args: argparse.Namespace) -> PortPlan:
    return PortPlan(args.grpc_port, args.raft_port, args.metrics_port, args.meta_port)
