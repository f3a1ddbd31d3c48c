"""Cluster layout: buckets, nodes, rendezvous placement, migrations.

A `ClusterSpec` is minted once by `new_cluster` (that is when each `bucket_uuid` is
chosen) and given to every node as its genesis (`sevendb cluster init`); every later
change goes through the metadata Raft group (`sevendb.cluster.common.meta`).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Final

import xxhash

from sevendb.cluster.common.files import fsync_dir, write_synced
from sevendb.outbox.keys import bucket_of

SPEC_FORMAT_VERSION: Final = 1
BUCKETS_MAX: Final = 1024
NODES_MAX: Final = 64


class ConfigError(ValueError):
    """The cluster configuration is invalid; the message says which field and why."""


def _checksum(body: dict[str, object]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh64_hexdigest(canonical)


def rendezvous(bucket_uuid: str, node_ids: Sequence[str], replicas: int) -> list[str]:
    """The `replicas` nodes with the highest xxh64(bucket_uuid/node) scores.

    Adding or removing a node moves only the buckets whose top-R set changes.
    """
    scored = sorted(
        node_ids,
        key=lambda n: (xxhash.xxh64_intdigest(f"{bucket_uuid}/{n}".encode()), n),
        reverse=True,
    )
    return scored[:replicas]


@dataclass(frozen=True, slots=True)
class NodeSpec:
    node_id: str
    host: str
    grpc_port: int
    raft_port_base: int
    """Bucket b's replica on this node listens on raft_port_base + b."""
    metrics_port: int = 0
    """HTTP port of the node's Prometheus ``/metrics`` (0: not served)."""
    draining: bool = False
    """Being removed (`sevendb node remove`): placement skips it; `sevendb rebalance`
    moves its buckets away and then drops it from the cluster."""
    meta_port: int = 0
    """Port of this node's member of the metadata Raft group (0: not a voter; the
    node follows the metadata through a voter's gRPC port)."""

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def raft_address(self, bucket: int) -> str:
        return f"{self.host}:{self.raft_port_base + bucket}"

    @property
    def meta_address(self) -> str:
        return f"{self.host}:{self.meta_port}"


@dataclass(frozen=True, slots=True)
class BucketSpec:
    bucket: int
    bucket_uuid: str
    nodes: tuple[str, ...]
    """Node ids holding a replica, in placement order."""


@dataclass(frozen=True, slots=True)
class MigrationSpec:
    """An unfinished `sevendb bucket migrate`: enough to resume or roll it back."""

    bucket: int
    from_nodes: tuple[str, ...]
    to_nodes: tuple[str, ...]
    hold_point: int
    """The bucket's commit index when the migration began: compaction never passes
    it while the migration runs (docs/contract.md §8, migration_hold_point)."""
    epoch_target: int
    """The epoch EPOCH_CREATE commits once the replicas have moved."""
    started_ms: int


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The cluster's topology: nodes, where each bucket's replicas are, migrations in
    flight. Created by `sevendb cluster init` (the genesis every node is given) and
    changed since through the metadata Raft group (`sevendb.cluster.common.meta`).
    Holds no secret."""

    cluster_id: str
    replicas: int
    nodes: tuple[NodeSpec, ...]
    buckets: tuple[BucketSpec, ...]
    migrations: tuple[MigrationSpec, ...] = ()
    meta_uuid: str = ""
    """The metadata group's identity (its bucket uuid)."""
    full_access: tuple[str, ...] = ()
    """Principals the genesis allows every key (read, write, idempotent producers:
    `sevendb.cluster.common.acl`); `sevendb cluster up` names its default principal,
    `sevendb cluster init` nobody. Left out of the JSON when empty."""

    def node(self, node_id: str) -> NodeSpec:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise ConfigError(f"no node {node_id!r} in this cluster (nodes: {self.node_ids})")

    @property
    def node_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]

    def bucket_for_key(self, key: str) -> BucketSpec:
        return self.buckets[bucket_of(key, len(self.buckets))]

    def replica_addresses(self, bucket: int) -> list[str]:
        spec = self.buckets[bucket]
        return [self.node(n).raft_address(bucket) for n in spec.nodes]

    def preferred_leaders(self) -> dict[int, str]:
        """A leader per bucket, spread evenly over the nodes: each bucket, in order,
        goes to whichever of its replicas' nodes has the fewest so far (ties: the
        placement order). Nodes hand leadership to the preferred replica when it is
        caught up, so leaders (and notifiers, and their CPU) are spread across
        processes instead of piling up where elections happened to land."""
        load = dict.fromkeys(self.node_ids, 0)
        out: dict[int, str] = {}
        for b in self.buckets:
            choice = min(b.nodes, key=lambda n: (load[n], b.nodes.index(n)))
            load[choice] += 1
            out[b.bucket] = choice
        return out

    def node_of_raft_address(self, bucket: int, address: str) -> NodeSpec | None:
        """The node whose replica of `bucket` listens on `address` (any node: during a
        migration a member may not be in the bucket's placement yet)."""
        for node in self.nodes:
            if node.raft_address(bucket) == address:
                return node
        return None

    def placement(self, bucket_uuid: str) -> list[str]:
        """Where rendezvous hashing puts a bucket now (draining nodes excluded)."""
        active = [n.node_id for n in self.nodes if not n.draining]
        return rendezvous(bucket_uuid, active, self.replicas)

    def migration(self, bucket: int) -> MigrationSpec | None:
        return next((m for m in self.migrations if m.bucket == bucket), None)

    @property
    def meta_voters(self) -> list[NodeSpec]:
        """The nodes holding a member of the metadata Raft group."""
        return [n for n in self.nodes if n.meta_port]

    # ---- edits (new specs; the caller saves them) ----------------------------------

    def with_bucket_nodes(self, bucket: int, nodes: Sequence[str]) -> ClusterSpec:
        buckets = list(self.buckets)
        buckets[bucket] = replace(buckets[bucket], nodes=tuple(nodes))
        return replace(self, buckets=tuple(buckets))

    def with_migration(self, migration: MigrationSpec | None, bucket: int) -> ClusterSpec:
        """Record (or, with None, clear) the migration of `bucket`."""
        kept = tuple(m for m in self.migrations if m.bucket != bucket)
        return replace(self, migrations=kept if migration is None else (*kept, migration))

    def with_node(self, node: NodeSpec) -> ClusterSpec:
        """Add `node`, or replace the node with its id."""
        others = tuple(n for n in self.nodes if n.node_id != node.node_id)
        order = [n.node_id for n in self.nodes]
        nodes = (*others, node)
        if node.node_id in order:
            nodes = tuple(node if n.node_id == node.node_id else n for n in self.nodes)
        return replace(self, nodes=nodes)

    def without_node(self, node_id: str) -> ClusterSpec:
        return replace(self, nodes=tuple(n for n in self.nodes if n.node_id != node_id))

    # ---- persistence -------------------------------------------------------------

    def to_json(self) -> str:
        """The spec as JSON with a checksum of its content, so that a damaged copy
        that still parses (a flipped digit of a port) is refused rather than used."""
        body = {"format": SPEC_FORMAT_VERSION, **asdict(self)}
        if not self.full_access:
            del body["full_access"]
        return json.dumps({**body, "checksum": _checksum(body)}, indent=2)

    @classmethod
    def from_json(cls, text: str, origin: str = "cluster spec") -> ClusterSpec:
        try:
            raw = json.loads(text)
            if "checksum" in raw and raw.pop("checksum") != _checksum(raw):
                raise ConfigError(f"{origin}: checksum mismatch (the file is damaged)")
            if raw.get("format") != SPEC_FORMAT_VERSION:
                raise ConfigError(
                    f"{origin}: format {raw.get('format')!r}, expected {SPEC_FORMAT_VERSION}"
                )
            spec = cls(
                cluster_id=str(raw["cluster_id"]),
                replicas=int(raw["replicas"]),
                nodes=tuple(
                    NodeSpec(
                        str(n["node_id"]),
                        str(n["host"]),
                        int(n["grpc_port"]),
                        int(n["raft_port_base"]),
                        int(n.get("metrics_port", 0)),
                        bool(n.get("draining", False)),
                        int(n.get("meta_port", 0)),
                    )
                    for n in raw["nodes"]
                ),
                buckets=tuple(
                    BucketSpec(
                        int(b["bucket"]), str(b["bucket_uuid"]), tuple(str(x) for x in b["nodes"])
                    )
                    for b in raw["buckets"]
                ),
                migrations=tuple(
                    MigrationSpec(
                        int(m["bucket"]),
                        tuple(str(x) for x in m["from_nodes"]),
                        tuple(str(x) for x in m["to_nodes"]),
                        int(m["hold_point"]),
                        int(m["epoch_target"]),
                        int(m["started_ms"]),
                    )
                    for m in raw.get("migrations", ())
                ),
                meta_uuid=str(raw.get("meta_uuid", "")),
                full_access=tuple(str(p) for p in raw.get("full_access", ())),
            )
        except ConfigError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{origin}: unreadable ({exc.__class__.__name__}: {exc})") from None
        spec.validate(origin)
        return spec

    def validate(self, origin: str = "cluster spec") -> None:
        if not self.nodes or len(self.nodes) > NODES_MAX:
            raise ConfigError(f"{origin}: needs 1..{NODES_MAX} nodes, has {len(self.nodes)}")
        if len(set(self.node_ids)) != len(self.node_ids):
            raise ConfigError(f"{origin}: node ids must be unique")
        if not 1 <= self.replicas <= len(self.nodes):
            raise ConfigError(
                f"{origin}: replicas must be 1..{len(self.nodes)} (the node "
                f"count), got {self.replicas}"
            )
        if not 1 <= len(self.buckets) <= BUCKETS_MAX:
            raise ConfigError(f"{origin}: needs 1..{BUCKETS_MAX} buckets")
        for i, b in enumerate(self.buckets):
            if b.bucket != i:
                raise ConfigError(f"{origin}: bucket {i} is numbered {b.bucket}")
            # A migration adds a replica before it removes one: R or R+1 at a time.
            if not self.replicas <= len(b.nodes) <= self.replicas + 1 or len(set(b.nodes)) != len(
                b.nodes
            ):
                raise ConfigError(f"{origin}: bucket {i} needs {self.replicas} distinct nodes")
            for node_id in b.nodes:
                self.node(node_id)
        for m in self.migrations:
            if not 0 <= m.bucket < len(self.buckets):
                raise ConfigError(f"{origin}: a migration names bucket {m.bucket}")
            for node_id in (*m.from_nodes, *m.to_nodes):
                self.node(node_id)
        ports: set[tuple[str, int]] = set()
        for n in self.nodes:
            for port in (
                n.grpc_port,
                *range(n.raft_port_base, n.raft_port_base + len(self.buckets)),
                *([n.metrics_port] if n.metrics_port else []),
                *([n.meta_port] if n.meta_port else []),
            ):
                if not 1 <= port <= 65535:
                    raise ConfigError(f"{origin}: node {n.node_id} port {port} out of range")
                if (n.host, port) in ports:
                    raise ConfigError(f"{origin}: port {port} is used twice on {n.host}")
                ports.add((n.host, port))

    def save(self, path: Path) -> Path:
        """Write to `path` atomically (tmp + fsync + rename): a crash never leaves half
        a spec."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_synced(tmp, self.to_json().encode())
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return path

    @classmethod
    def load(cls, path: Path) -> ClusterSpec:
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: unreadable ({exc})") from None
        return cls.from_json(text, str(path))


META_VOTERS_DEFAULT: Final = 3


def new_cluster(
    *,
    nodes: Sequence[NodeSpec],
    buckets: int,
    replicas: int,
    meta_voters: int = META_VOTERS_DEFAULT,
) -> ClusterSpec:
    """Mint a cluster: its id and every bucket's uuid are chosen once, here, and
    buckets placed by rendezvous hashing. The first `meta_voters` nodes (at most the
    node count; their `meta_port` must be set, the others' must be 0) hold the
    metadata Raft group."""
    voters = min(meta_voters, len(nodes))
    for i, node in enumerate(nodes):
        if bool(node.meta_port) != (i < voters):
            raise ConfigError(
                f"node {node.node_id}: the first {voters} nodes, and only they, need a meta port"
            )
    node_ids = [n.node_id for n in nodes]
    bucket_specs = []
    for b in range(buckets):
        bucket_uuid = str(uuid.uuid4())
        bucket_specs.append(
            BucketSpec(b, bucket_uuid, tuple(rendezvous(bucket_uuid, node_ids, replicas)))
        )
    spec = ClusterSpec(
        str(uuid.uuid4()), replicas, tuple(nodes), tuple(bucket_specs), meta_uuid=str(uuid.uuid4())
    )
    spec.validate()
    return spec
