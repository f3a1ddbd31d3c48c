"""Administration (principal "admin": membership, leadership, epochs) and operations
(`Status`, `ClusterInfo`: no token). Served by the node asked; a membership change or
an epoch needs the bucket's leader. The metadata RPCs are in `metadata`."""

from __future__ import annotations

import asyncio
import time

import grpc

from sevendb.cluster.common.auth import ADMIN_PRINCIPAL
from sevendb.cluster.raft.replica import (
    BucketReplica,
    MembershipChangeInProgress,
    ReplicaUnavailable,
)
from sevendb.cluster.server.edge import PROPOSE_TIMEOUT_S, Call, Edge, now_ms
from sevendb.cluster.server.errors import Failure
from sevendb.outbox.entries import EpochCreate
from sevendb.outbox.model import EpochResult
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb


def require_admin(call: Call) -> None:
    """PERMISSION_DENIED unless the caller may administer the cluster (the admin
    principal, or a principal granted the admin permission)."""
    if not call.admin:
        raise Failure.denied(
            f"principal {call.principal!r} lacks the admin permission on the cluster: "
            f"administration needs the {ADMIN_PRINCIPAL!r} principal "
            f"(`sevendb token {ADMIN_PRINCIPAL}`) or `sevendb acl grant {call.principal} admin`"
        )


def local_replica(edge: Edge, bucket: int) -> BucketReplica:
    """This node's replica of `bucket`; UNAVAILABLE (naming a node that has one) if
    there is none here."""
    edge.check_bucket(bucket)
    replica = edge.replicas.get(bucket)
    if replica is None:
        raise Failure(
            grpc.StatusCode.UNAVAILABLE,
            f"bucket {bucket}: no replica on this node",
            leader=edge.some_host(bucket),
        )
    return replica


class Admin:
    """The administration and operations handlers of one node."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge

    @staticmethod
    def _admin(call: Call) -> None:
        require_admin(call)

    def _leading_replica(self, bucket: int) -> BucketReplica:
        edge = self._edge
        replica = local_replica(edge, bucket)
        if not replica.is_leader or replica.quarantined:
            raise Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: this node is not the leader",
                leader=edge.leader_address(bucket),
            )
        return replica

    async def _membership(
        self, request: pb.MemberRequest, call: Call, change: str
    ) -> pb.MemberResponse:
        self._admin(call)
        replica = self._leading_replica(request.bucket)
        method = replica.add_member if change == "add" else replica.remove_member
        try:
            await asyncio.to_thread(method, request.address, PROPOSE_TIMEOUT_S)
        except MembershipChangeInProgress as exc:
            raise Failure(grpc.StatusCode.ABORTED, str(exc)) from None
        except ReplicaUnavailable as exc:
            raise self._edge.unavailable(request.bucket, exc) from None
        except ValueError as exc:
            code = grpc.StatusCode.ALREADY_EXISTS if change == "add" else grpc.StatusCode.NOT_FOUND
            if "leader" in str(exc) or "this replica" in str(exc):
                code = grpc.StatusCode.FAILED_PRECONDITION
            raise Failure(code, str(exc)) from None
        return pb.MemberResponse(members=replica.members())

    async def add_member(self, request: pb.MemberRequest, call: Call) -> pb.MemberResponse:
        return await self._membership(request, call, "add")

    async def remove_member(self, request: pb.MemberRequest, call: Call) -> pb.MemberResponse:
        return await self._membership(request, call, "remove")

    async def transfer_leader(self, request: pb.MemberRequest, call: Call) -> pb.MemberResponse:
        self._admin(call)
        replica = self._leading_replica(request.bucket)
        if request.address not in replica.members():
            raise Failure(
                grpc.StatusCode.NOT_FOUND,
                f"{request.address} is not a member of bucket {request.bucket}",
            )
        replica.transfer_leadership(request.address, timeout_s=PROPOSE_TIMEOUT_S)
        deadline = time.monotonic() + PROPOSE_TIMEOUT_S
        while replica.leader != request.address:
            if time.monotonic() > deadline:
                raise Failure(
                    grpc.StatusCode.UNAVAILABLE,
                    f"bucket {request.bucket}: leadership did not move to {request.address} "
                    "(it must hold the whole log); retry",
                    leader=self._edge.leader_address(request.bucket),
                )
            await asyncio.sleep(0.05)
        return pb.MemberResponse(members=replica.members())

    async def create_epoch(self, request: pb.EpochRequest, call: Call) -> pb.EpochResponse:
        self._admin(call)
        bucket = request.bucket
        replica = self._leading_replica(bucket)
        current = replica.read(lambda sm: sm.epoch)
        if current.epoch_counter == request.epoch_counter:
            return pb.EpochResponse(epoch_id=codec.epoch_to_pb(current))
        entry = EpochCreate(request.epoch_counter, now_ms())
        result, commit_index = await self._edge.commit(bucket, entry, EpochResult)
        return pb.EpochResponse(epoch_id=codec.epoch_to_pb(result.epoch), commit_index=commit_index)

    async def recover_bucket(self, request: pb.RecoverRequest, call: Call) -> pb.RecoverResponse:
        self._admin(call)
        self._edge.check_bucket(request.bucket)
        replica = self._edge.replicas.get(request.bucket)
        if replica is None:
            return pb.RecoverResponse(has_replica=False)
        if request.accept_loss:
            await asyncio.to_thread(replica.accept_loss)
        return pb.RecoverResponse(has_replica=True, state=replica.quarantined or "")

    # ---- operations (no token) ---------------------------------------------------------

    async def cluster_info(
        self, request: pb.ClusterInfoRequest, call: Call
    ) -> pb.ClusterInfoResponse:
        spec = self._edge.spec
        return pb.ClusterInfoResponse(
            cluster_id=spec.cluster_id,
            buckets=[
                pb.BucketInfo(
                    bucket=b.bucket,
                    bucket_uuid=b.bucket_uuid,
                    nodes=[spec.node(n).grpc_address for n in b.nodes],
                )
                for b in spec.buckets
            ],
            nodes=[n.grpc_address for n in spec.nodes],
        )

    async def status(self, request: pb.StatusRequest, call: Call) -> pb.StatusResponse:
        # Digests snapshot the whole core: off the event loop, and only on request.
        replicas = await asyncio.to_thread(self._status, request.with_digests)
        node = self._edge.node
        answer = pb.StatusResponse(
            node_id=self._edge.node_id,
            replicas=replicas,
            meta_version=node.view.state.version,
            meta_voter=node.meta is not None,
        )
        if node.meta is not None:
            meta = node.meta.replica
            answer.meta.CopyFrom(
                await asyncio.to_thread(self._replica_status, meta.bucket, meta, False)
            )
        return answer

    def _status(self, with_digests: bool) -> list[pb.ReplicaStatus]:
        return [
            self._replica_status(bucket, replica, with_digests)
            for bucket, replica in sorted(self._edge.replicas.items())
        ]

    def _replica_status(
        self, bucket: int, replica: BucketReplica, with_digests: bool
    ) -> pb.ReplicaStatus:
        st = replica.status()
        core = (
            None
            if replica.quarantined
            else replica.read(
                lambda sm: (
                    sm.digest() if with_digests else "",
                    sm.lease_holder,
                    len(sm.subs.sorted()),
                    sm.subs.outbox_size(),
                    len(sm.producers),
                )
            )
        )
        digest, holder, subs, outbox, producers = core or ("", "", 0, 0, 0)
        notifier = self._edge.notifiers.get(bucket)
        return pb.ReplicaStatus(
            bucket=max(bucket, 0),
            bucket_uuid=replica.bucket_uuid,
            address=replica.self_addr,
            leader=str(st.get("leader") or ""),
            is_leader=bool(st.get("is_leader")),
            term=_int(st.get("term")),
            commit_index=_int(st.get("commit_index")),
            applied_index=_int(st.get("applied_index")),
            log_len=_int(st.get("log_len")),
            epoch_counter=_int(st.get("epoch")),
            digest=digest,
            quarantined=replica.quarantined or "",
            members=replica.members(),
            fsyncs=_int(st.get("fsyncs")),
            lease_holder=holder,
            emitting=notifier is not None and notifier.emitting,
            subscriptions=subs,
            outbox_rows=outbox,
            producers=producers,
            connected=replica.connectivity().connected,
        )


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


__all__ = ["Admin", "local_replica", "require_admin"]
