"""What every handler of the node's gRPC service shares: the node's current spec,
replicas and notifiers, the caller's principal, where a bucket is served (the
leader's or a holder's client address), forwarding a request to the node that
can serve it, and proposing an entry and waiting for it to apply.

The handlers (`writes`, `reads`, `streams`, `session`, `acks`, `admin`) each hold
one `Edge`; `service.NodeService` builds it and them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import grpc
from google.protobuf.message import Message
from grpc import aio

from sevendb.cluster.common.acl import Acl, Denied, Permission
from sevendb.cluster.common.auth import (
    AUTH_METADATA_KEY,
    NODE_PRINCIPAL,
    AuthError,
    Keyring,
    check_principal,
    token_from_metadata,
)
from sevendb.cluster.common.bundle import ClusterSecrets
from sevendb.cluster.common.tls import PeerIdentity, peer_identity
from sevendb.cluster.common.topology import ClusterSpec, ConfigError, NodeSpec
from sevendb.cluster.raft.replica import ApplyOutcome, BucketReplica, ReplicaUnavailable
from sevendb.cluster.server.errors import Ctx, Failure, status_of_unavailable
from sevendb.cluster.server.meta import ClusterView, MetaMember
from sevendb.cluster.server.metrics import NodeMetrics
from sevendb.cluster.server.overload import RateLimiter, ServerLimits
from sevendb.notifier.host import BucketNotifier
from sevendb.outbox.entries import Entry, OutboxPurge, encode_entry
from sevendb.outbox.errors import Rejection
from sevendb.outbox.query import Query, QueryKind
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2_grpc as pb_grpc

FORWARD_KEY: Final = "sevendb-forwarded"
"""Metadata of a request one node forwarded to another (forwarded once at most)."""
ON_BEHALF_KEY: Final = "sevendb-principal"
"""Metadata of a forwarded request whose caller authenticated by its certificate:
the principal it was, believed only from a node (its own certificate says so)."""
PROPOSE_TIMEOUT_S: Final = 5.0
FORWARD_TIMEOUT_S: Final = 10.0

T = TypeVar("T")
R = TypeVar("R", bound=Message)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Result(Protocol):
    """A core result that may carry a deterministic refusal."""

    @property
    def error(self) -> Rejection | None: ...


Res = TypeVar("Res", bound=_Result)


@dataclass(frozen=True, slots=True)
class Call:
    """One call as its handler sees it: authenticated (`principal`, empty for the
    calls that need no token) and with its metadata read once."""

    context: Ctx
    principal: str
    metadata: Sequence[tuple[str, Any]]
    method: str
    """The RPC's name (what `Edge.forward` calls on another node)."""
    admin: bool = False
    """The principal may administer the cluster (``admin``, or granted ``admin``)."""


class NodeHost(Protocol):
    """What the service needs of its node (cluster/server/node.py's Node)."""

    node_id: str
    me: NodeSpec
    spec: ClusterSpec
    replicas: dict[int, BucketReplica]
    notifiers: dict[int, BucketNotifier]
    view: ClusterView
    meta: MetaMember | None
    secrets: ClusterSecrets
    draining: bool
    """Stopping (SIGTERM): new writes and streams are refused (`rpc`)."""

    @property
    def keyring(self) -> Keyring:
        """The token keys and revocations in force (they follow the metadata)."""
        ...

    @property
    def acl(self) -> Acl:
        """The access-control grants in force (they follow the metadata)."""
        ...

    @property
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """How this node reaches another node's client port (None: plaintext)."""
        ...


class Edge:
    """The node as its handlers use it (see the module docstring)."""

    def __init__(
        self,
        node: NodeHost,
        metrics: NodeMetrics | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        self.node = node
        self.node_id = node.node_id
        self.me = node.me.grpc_address
        self.metrics = metrics
        self.limits = limits or ServerLimits()
        self.rates = RateLimiter(self.limits)
        """Per-principal write rates (charged by the node whose replica batches a write)."""
        self.bucket_of_uuid = {b.bucket_uuid: b.bucket for b in node.spec.buckets}
        self._channels: dict[str, aio.Channel] = {}

    # The node's spec, replicas and notifiers change when the cluster's metadata does
    # (migrations); each access sees one consistent version of each.
    @property
    def spec(self) -> ClusterSpec:
        return self.node.spec

    @property
    def replicas(self) -> dict[int, BucketReplica]:
        return self.node.replicas

    @property
    def notifiers(self) -> dict[int, BucketNotifier]:
        return self.node.notifiers

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    def principal(self, metadata: Sequence[tuple[str, Any]], context: Ctx | None) -> str:
        """Who the call is from: its bearer token's principal if it sends one, else
        its client certificate's (verified by TLS against the cluster's CA, when the
        node requires client certificates); a node's certificate may speak for the
        caller of a request it forwards. UNAUTHENTICATED when neither says."""
        keyring, now = self.node.keyring, now_ms()
        try:
            token = token_from_metadata(metadata)
            if token is not None:
                return keyring.verify(token, now_ms=now)
            identity = _peer(context)
            if identity is None:
                raise AuthError(
                    "no token: send 'authorization: Bearer <token>' (see `sevendb token`) "
                    "or a client certificate from the cluster's CA"
                )
            if identity.is_node:
                behalf = dict(metadata).get(ON_BEHALF_KEY)
                if behalf is None or FORWARD_KEY not in dict(metadata):
                    return NODE_PRINCIPAL
                return check_principal(str(behalf))
            principal = check_principal(identity.principal)
            not_before = keyring.revoked.get(principal)
            if not_before is not None and identity.not_before_ms < not_before:
                raise AuthError(
                    f"the certificates of {principal!r} issued before {not_before} ms were revoked"
                )
            return principal
        except (AuthError, ConfigError) as exc:
            raise Failure(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None

    # ---- access control (docs/security.md, "Access control") --------------------------

    @property
    def acl(self) -> Acl:
        return self.node.acl

    def allow(self, principal: str, permission: Permission, key: str = "") -> None:
        """PERMISSION_DENIED, naming the permission, unless `principal` has it (on `key`)."""
        try:
            self.node.acl.check(principal, permission, key)
        except Denied as exc:
            raise Failure.denied(str(exc)) from None

    def allow_query(self, principal: str, query: Query) -> None:
        """PERMISSION_DENIED unless `principal` may read every key `query` selects: a
        subscription is refused rather than filtered (docs/security.md)."""
        try:
            if query.kind is QueryKind.KEY:
                self.node.acl.check(principal, Permission.READ, query.arg)
            else:
                self.node.acl.check_prefix(principal, query.arg)
        except Denied as exc:
            raise Failure.denied(str(exc)) from None

    def reads_everything(self, principal: str) -> bool:
        """May `principal` read every key now (no check per key is needed)?"""
        return self.node.acl.allows(principal, Permission.READ, "")

    def readable(self, principal: str) -> Callable[[str], bool]:
        """Which keys `principal` may read now (a filter)."""
        if self.reads_everything(principal):
            return lambda _key: True
        acl = self.node.acl
        return lambda key: acl.allows(principal, Permission.READ, key)

    # ---- where a bucket is served ------------------------------------------------------

    def check_bucket(self, bucket: int) -> None:
        if bucket >= len(self.spec.buckets):
            raise Failure.invalid(
                f"bucket {bucket} does not exist (0..{len(self.spec.buckets) - 1})"
            )

    def client_address(self, bucket: int, raft_address: str | None) -> str | None:
        if not raft_address:
            return None
        node = self.spec.node_of_raft_address(bucket, raft_address)
        return None if node is None else node.grpc_address

    def some_host(self, bucket: int) -> str:
        """A node holding a replica of `bucket` (for requests this node cannot serve)."""
        return self.spec.node(self.spec.buckets[bucket].nodes[0]).grpc_address

    def another_node(self) -> str | None:
        """Some other node's client address (where a draining node sends callers)."""
        others = [n.grpc_address for n in self.spec.nodes if n.node_id != self.node_id]
        return others[int(time.monotonic()) % len(others)] if others else None

    def leader_address(self, bucket: int) -> str | None:
        replica = self.replicas.get(bucket)
        return None if replica is None else self.client_address(bucket, replica.leader)

    def leader_replica(self, bucket: int) -> BucketReplica | None:
        """This node's replica of `bucket` if it leads (and serves)."""
        replica = self.replicas.get(bucket)
        if replica is not None and replica.is_leader and not replica.quarantined:
            return replica
        return None

    def unavailable(self, bucket: int, exc: ReplicaUnavailable) -> Failure:
        hint = self.client_address(bucket, exc.leader_hint)
        return Failure(status_of_unavailable(exc.reason), f"bucket {bucket}: {exc}", leader=hint)

    # ---- forwarding --------------------------------------------------------------------

    def stub(self, address: str) -> pb_grpc.SevenDBStub:
        channel = self._channels.get(address)
        if channel is None:
            creds = self.node.channel_credentials
            channel = self._channels[address] = (
                aio.insecure_channel(address)
                if creds is None
                else aio.secure_channel(address, creds)
            )
        return pb_grpc.SevenDBStub(channel)

    @staticmethod
    def auth_of(call: Call) -> list[tuple[str, str]]:
        """The call's credentials, to forward with it: its token, or (a caller known
        by its certificate) the principal this node vouches for."""
        token = [(k, str(v)) for k, v in call.metadata if k == AUTH_METADATA_KEY]
        if token or not call.principal:
            return token
        return [(ON_BEHALF_KEY, call.principal)]

    async def forward(
        self,
        call: Call,
        bucket: int,
        request: Message,
        reply: type[R],
        *,
        to_leader: bool,
        method: str | None = None,
    ) -> R:
        """Send `request` to a node that can serve it, as the call's own RPC (or
        `method`): the bucket's leader (`to_leader`), or else any node with a replica
        of it. One hop at most: a forwarded request that cannot be served there fails
        UNAVAILABLE with the leader's address."""
        if any(k == FORWARD_KEY for k, _ in call.metadata):
            raise Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: no leader here yet; retry",
                leader=self.leader_address(bucket),
            )
        target = self.leader_address(bucket) if to_leader else None
        if target is None and bucket not in self.replicas:
            target = self.some_host(bucket)
        if target is None or target == self.me:
            local = self.replicas.get(bucket)
            if local is not None and local.data_loss is not None:
                raise self.unavailable(bucket, local.data_loss)
            raise Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket} has no known leader; retry shortly",
            )
        forwarded = [(FORWARD_KEY, self.node_id), *self.auth_of(call)]
        rpc = getattr(self.stub(target), method or call.method)
        try:
            answer = await rpc(request, timeout=FORWARD_TIMEOUT_S, metadata=tuple(forwarded))
        except aio.AioRpcError as exc:
            # The answer's domain error goes back with it (a forwarded History older
            # than the window is STALE_SEQUENCE, not a bare OUT_OF_RANGE).
            error = dict(exc.trailing_metadata() or ()).get(codec.ERROR_CODE_KEY)
            raise Failure(
                exc.code(),
                exc.details() or "forwarded call failed",
                leader=target,
                error=error if isinstance(error, str) else None,
            ) from None
        assert isinstance(answer, reply), answer
        return answer

    async def unless_local(
        self, call: Call, bucket: int, request: Message, reply: type[R]
    ) -> R | None:
        """None if this node has a replica of `bucket` (the caller serves the request);
        otherwise the answer of a node that has one (`forward`)."""
        self.check_bucket(bucket)
        if bucket in self.replicas:
            return None
        return await self.forward(call, bucket, request, reply, to_leader=False)

    # ---- proposing -------------------------------------------------------------------

    async def wait(self, bucket: int, future: Future[T]) -> T:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), PROPOSE_TIMEOUT_S)
        except ReplicaUnavailable as exc:
            raise self.unavailable(bucket, exc) from None
        except TimeoutError:
            raise Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: not committed within {PROPOSE_TIMEOUT_S} s (outcome unknown)",
                leader=self.leader_address(bucket),
            ) from None

    async def propose(self, bucket: int, entry: Entry) -> ApplyOutcome:
        """Replicate `entry` through this node's replica of `bucket`; its outcome once
        applied here."""
        try:
            future = self.replicas[bucket].submit(encode_entry(entry))
        except ReplicaUnavailable as exc:
            raise self.unavailable(bucket, exc) from None
        outcome = await self.wait(bucket, future)
        if outcome.error is not None or outcome.applied is None:
            raise Failure(grpc.StatusCode.INTERNAL, f"bucket {bucket}: {outcome.error}")
        return outcome

    async def commit(self, bucket: int, entry: Entry, result: type[Res]) -> tuple[Res, int]:
        """`propose`, for an entry whose result may refuse it (raised as its Failure):
        the result and the commit index."""
        outcome = await self.propose(bucket, entry)
        assert outcome.applied is not None
        got = outcome.applied.result
        assert isinstance(got, result), got
        if got.error is not None:
            raise Failure.rejected(got.error)
        return got, outcome.commit_index

    async def read_barrier(self, bucket: int) -> int:
        """Make this node's replica of `bucket` current: once this returns, it has
        applied every entry committed before the call (a read-index round through
        the log: an empty OUTBOX_PURGE, which changes nothing, is committed by the
        leader and applied here after everything before it). The barrier's index.
        UNAVAILABLE if it cannot commit (no leader, no quorum, a deposed leader)."""
        try:
            lease_index = self.replicas[bucket].read(lambda sm: sm.lease_index)
        except ReplicaUnavailable as exc:
            raise self.unavailable(bucket, exc) from None
        outcome = await self.propose(bucket, OutboxPurge(lease_index, now_ms=now_ms()))
        return outcome.commit_index


def _peer(context: Ctx | None) -> PeerIdentity | None:
    """The identity of the call's verified client certificate, or None."""
    if context is None:
        return None
    pem = (context.auth_context() or {}).get("x509_pem_cert")
    return peer_identity(pem[0]) if pem else None


__all__ = [
    "FORWARD_KEY",
    "ON_BEHALF_KEY",
    "FORWARD_TIMEOUT_S",
    "PROPOSE_TIMEOUT_S",
    "Call",
    "Edge",
    "NodeHost",
    "now_ms",
]
