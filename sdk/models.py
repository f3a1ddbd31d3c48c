"""The values a `Client` takes and returns: plain dataclasses and the core's own
types, never protobuf messages, so an application does not depend on the wire.

A write is a sequence of the core's `Op` values (`set_op` and `delete_op` build
them); the core checks each as it is made, so a malformed op is refused with
`InvalidArgument` before anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import ANY, NOT_EXISTS, Expected, Op, OpKind
from sevendb.outbox.errors import InvalidArgument
from sevendb.outbox.keys import bucket_of
from sevendb.outbox.query import Query, QueryKind


def set_op(
    key: str, value: bytes, *, expected_version: int | None = None, must_not_exist: bool = False
) -> Op:
    """Set `key` to `value`; with `expected_version` only if the key is at exactly
    that version, where 0 means "does not exist" (a key's versions start at 1, as in
    etcd); with `must_not_exist` only if it does not exist. Both together must agree
    (`expected_version` 0 or None), else `InvalidArgument`."""
    if expected_version is None and not must_not_exist:  # most writes
        return Op(OpKind.SET, key, value)
    return Op(OpKind.SET, key, value, _expected(expected_version, must_not_exist))


def delete_op(key: str, *, expected_version: int | None = None) -> Op:
    """Delete `key`; with `expected_version` only if the key is at exactly that
    version, where 0 means "does not exist" (the delete then changes nothing, and
    fails if the key exists)."""
    return Op(OpKind.DEL, key, b"", _expected(expected_version, False))


def _expected(version: int | None, must_not_exist: bool) -> Expected:
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise InvalidArgument(f"expected_version must be an integer, not {version!r}")
    if version is not None and version < 0:
        raise InvalidArgument(f"expected_version must be >= 0 (0: must not exist), not {version}")
    if must_not_exist and version:
        raise InvalidArgument(
            f"must_not_exist and expected_version={version} contradict each other "
            "(a key that must not exist has no version; expected_version=0 says the same)"
        )
    if must_not_exist or version == 0:
        return NOT_EXISTS
    return ANY if version is None else Expected.exact(version)


@dataclass(frozen=True, slots=True)
class WriteResult:
    """A committed write: where it committed, and each key's version after it.
    `duplicate`: an idempotent producer's retry of a write that had committed
    (the original commit is returned, nothing was applied twice).
    `position_known` is False only for a duplicate whose original result the node
    no longer kept (docs/errors.md, "A write's result lost"): the write committed
    once, but `committed` is `EmitSeq("", 0, 0)` (before every real position) and
    `versions` is empty."""

    committed: EmitSeq
    bucket: int
    versions: dict[str, int] = field(default_factory=dict)
    duplicate: bool = False
    position_known: bool = True


@dataclass(frozen=True, slots=True)
class Record:
    """A key's current value and version, and the commit that last changed it."""

    key: str
    value: bytes
    version: int
    mod_commit_index: int


@dataclass(frozen=True, slots=True)
class RangePage:
    """One page of `Client.range`: records in key order, and the token of the next
    page (empty: the range is done)."""

    records: tuple[Record, ...]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class ClusterLayout:
    """What `ClusterInfo` says: buckets (uuid, replica nodes) and nodes."""

    cluster_id: str
    bucket_uuids: tuple[str, ...]
    bucket_nodes: tuple[tuple[str, ...], ...]
    nodes: tuple[str, ...]

    @property
    def buckets(self) -> int:
        return len(self.bucket_uuids)

    def bucket_of(self, key: str) -> int:
        return bucket_of(key, self.buckets)

    def buckets_of(self, query: Query) -> list[int]:
        """The buckets `query` spans: its key's for a key query, else every one."""
        if query.kind is QueryKind.KEY:
            return [self.bucket_of(query.arg)]
        return list(range(self.buckets))


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One replica of one bucket, as its node sees it (docs/wire.md, `Status`)."""

    bucket: int
    bucket_uuid: str
    address: str
    """This replica's Raft address; `leader`: the leader it knows ("" for none)."""
    leader: str
    is_leader: bool
    term: int
    commit_index: int
    applied_index: int
    log_len: int
    epoch_counter: int
    digest: str
    """xxh64 of the bucket's state ("" unless asked for): equal on replicas that
    applied the same log."""
    quarantined: str
    """Why the replica quarantined itself ("" when it did not)."""
    members: tuple[str, ...]
    fsyncs: int
    lease_holder: str
    """Raft address of the notifier lease holder the committed state names."""
    emitting: bool
    subscriptions: int
    outbox_rows: int
    connected: tuple[str, ...]
    """Raft addresses of the members this replica's transport is connected to."""
    producers: int
    """Idempotent producers the bucket remembers (they expire when idle)."""


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """A node's `Status`: its id and every replica it holds."""

    node_id: str
    replicas: tuple[ReplicaStatus, ...]


__all__ = [
    "ClusterLayout",
    "NodeStatus",
    "RangePage",
    "Record",
    "ReplicaStatus",
    "WriteResult",
    "delete_op",
    "set_op",
]
