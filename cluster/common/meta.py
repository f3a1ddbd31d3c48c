"""The cluster's metadata as records of the metadata Raft group.

The metadata group is a Raft group like a bucket's - the same hardened replica and
the same deterministic state machine - whose keys describe the cluster instead of
holding application data. Every node is given the genesis spec (`sevendb cluster
init`); the group holds only what changed since, one record per thing:

    node/<id>        a node added or changed (JSON of its NodeSpec), or {"removed": true}
    bucket/<n>       the nodes holding bucket n now: {"nodes": [...]}
    migration/<n>    the migration of bucket n in progress (JSON of its MigrationSpec)

`overlay(genesis, records)` is the current spec; `changes(old, new)` the records
that turn one spec into another, written as one compare-and-set write so that two
operators never both win. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any, Final

from sevendb.cluster.common.topology import (
    ClusterSpec,
    ConfigError,
    MigrationSpec,
    NodeSpec,
)

__all__ = ["BUCKET", "MIGRATION", "NODE", "changes", "overlay"]

NODE: Final = "node/"
BUCKET: Final = "bucket/"
MIGRATION: Final = "migration/"
_REMOVED: Final = {"removed": True}


def _encode(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _decode(key: str, raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        raise ConfigError(f"metadata record {key!r} is not JSON") from None
    if not isinstance(value, dict):
        raise ConfigError(f"metadata record {key!r} is not an object")
    return value


def _node(key: str, value: Mapping[str, Any]) -> NodeSpec:
    try:
        return NodeSpec(**{k: value[k] for k in value if k in NodeSpec.__dataclass_fields__})
    except TypeError as exc:
        raise ConfigError(f"metadata record {key!r}: {exc}") from None


def _migration(key: str, value: Mapping[str, Any]) -> MigrationSpec:
    try:
        return MigrationSpec(
            int(value["bucket"]),
            tuple(value["from_nodes"]),
            tuple(value["to_nodes"]),
            int(value["hold_point"]),
            int(value["epoch_target"]),
            int(value["started_ms"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"metadata record {key!r}: {exc}") from None


def overlay(genesis: ClusterSpec, records: Mapping[str, bytes]) -> ClusterSpec:
    """The spec `records` make of `genesis` (validated). Unknown prefixes are
    other metadata (not topology) and ignored here."""
    nodes = {n.node_id: n for n in genesis.nodes}
    order = [n.node_id for n in genesis.nodes]
    buckets = list(genesis.buckets)
    migrations: list[MigrationSpec] = []
    for key in sorted(records):
        value = _decode(key, records[key])
        if key.startswith(NODE):
            node_id = key.removeprefix(NODE)
            if value == _REMOVED:
                nodes.pop(node_id, None)
            else:
                nodes[node_id] = _node(key, value)
                if node_id not in order:
                    order.append(node_id)
        elif key.startswith(BUCKET):
            index = int(key.removeprefix(BUCKET))
            if not 0 <= index < len(buckets):
                raise ConfigError(f"metadata record {key!r}: no bucket {index}")
            buckets[index] = replace(buckets[index], nodes=tuple(value["nodes"]))
        elif key.startswith(MIGRATION):
            migrations.append(_migration(key, value))
    spec = replace(
        genesis,
        nodes=tuple(nodes[n] for n in order if n in nodes),
        buckets=tuple(buckets),
        migrations=tuple(migrations),
    )
    spec.validate("cluster metadata")
    return spec


def changes(old: ClusterSpec, new: ClusterSpec) -> dict[str, bytes | None]:
    """The records to set (bytes) or delete (None) so that the metadata turns from
    `old` into `new`. Both must be the same cluster with the same buckets."""
    if (old.cluster_id, len(old.buckets)) != (new.cluster_id, len(new.buckets)):
        raise ConfigError("a spec change cannot change the cluster id or the bucket count")
    out: dict[str, bytes | None] = {}
    before = {n.node_id: n for n in old.nodes}
    after = {n.node_id: n for n in new.nodes}
    for node_id, node in after.items():
        if before.get(node_id) != node:
            out[NODE + node_id] = _encode(asdict(node))
    for node_id in before.keys() - after.keys():
        out[NODE + node_id] = _encode(_REMOVED)
    for a, b in zip(old.buckets, new.buckets, strict=True):
        if a != b:
            if (a.bucket, a.bucket_uuid) != (b.bucket, b.bucket_uuid):
                raise ConfigError(f"bucket {a.bucket}: only its nodes may change")
            out[f"{BUCKET}{b.bucket}"] = _encode({"nodes": list(b.nodes)})
    was = {m.bucket: m for m in old.migrations}
    now = {m.bucket: m for m in new.migrations}
    for bucket, migration in now.items():
        if was.get(bucket) != migration:
            out[f"{MIGRATION}{bucket}"] = _encode(asdict(migration))
    for bucket in was.keys() - now.keys():
        out[f"{MIGRATION}{bucket}"] = None
    return out
