"""Subscription administration: `ListSubscriptions`, `ShowSubscription` and
`DeleteSubscription` (`sevendb subscriptions list|show|delete`).

Served by the bucket's leader (forwarded there from any other node), from its
applied state. The "admin" principal sees and deletes every subscription; any other
principal only its own (another's is NOT_FOUND, as if it did not exist). Deleting is
an UNSUBSCRIBE committed on the owner's behalf: the rows go, the slot is freed, and
an attached stream ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from sevendb.cluster.raft.replica import BucketReplica, ReplicaUnavailable
from sevendb.cluster.server.edge import Call, Edge, now_ms
from sevendb.cluster.server.errors import Failure
from sevendb.cluster.server.streams import Streams
from sevendb.outbox import lifecycle
from sevendb.outbox.entries import Unsubscribe
from sevendb.outbox.model import SubscriptionInfo, UnsubscribeResult
from sevendb.outbox.state import BucketStateMachine
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb

T = TypeVar("T")
R = TypeVar("R", bound=Message)


class SubscriptionAdmin:
    """The subscription administration handlers of one node."""

    def __init__(self, edge: Edge, streams: Streams) -> None:
        self._edge = edge
        self._streams = streams

    async def _on_leader(
        self,
        call: Call,
        bucket: int,
        request: Message,
        reply: type[R],
        serve: Callable[[BucketReplica], Awaitable[R]],
    ) -> R:
        """`serve` on this node's replica of `bucket` if it leads; otherwise the
        leader's answer (forwarded)."""
        self._edge.check_bucket(bucket)
        replica = self._edge.leader_replica(bucket)
        if replica is None:
            return await self._edge.forward(call, bucket, request, reply, to_leader=True)
        return await serve(replica)

    def _read(
        self, replica: BucketReplica, bucket: int, fn: Callable[[BucketStateMachine], T]
    ) -> T:
        try:
            return replica.read(fn)
        except ReplicaUnavailable as exc:
            raise self._edge.unavailable(bucket, exc) from None

    async def list_subscriptions(
        self, request: pb.ListSubscriptionsRequest, call: Call
    ) -> pb.ListSubscriptionsResponse:
        bucket = request.bucket
        admin = call.admin
        owner = (request.owner or None) if admin else call.principal

        def page(sm: BucketStateMachine) -> tuple[list[SubscriptionInfo], bool]:
            ids, more = lifecycle.subscription_page(sm, request.after_sub_id, request.limit, owner)
            infos = [lifecycle.subscription_info(sm, sub_id) for sub_id in ids]
            return [info for info in infos if info is not None], more

        async def serve(replica: BucketReplica) -> pb.ListSubscriptionsResponse:
            infos, more = self._read(replica, bucket, page)
            return pb.ListSubscriptionsResponse(
                subscriptions=[self._info(bucket, info) for info in infos], has_more=more
            )

        return await self._on_leader(call, bucket, request, pb.ListSubscriptionsResponse, serve)

    async def show_subscription(
        self, request: pb.SubscriptionRequest, call: Call
    ) -> pb.SubscriptionInfo:
        async def serve(replica: BucketReplica) -> pb.SubscriptionInfo:
            return self._info(request.bucket, self._visible(replica, request, call))

        return await self._on_leader(call, request.bucket, request, pb.SubscriptionInfo, serve)

    async def delete_subscription(
        self, request: pb.SubscriptionRequest, call: Call
    ) -> pb.DeleteSubscriptionResponse:
        async def serve(replica: BucketReplica) -> pb.DeleteSubscriptionResponse:
            info = self._visible(replica, request, call)
            entry = Unsubscribe(info.sub_id, info.principal, now_ms())
            # Committed for the owner it had when read: if it was deleted and taken by
            # someone else meanwhile, the core refuses (NOT_OWNER) and nothing changes.
            await self._edge.commit(request.bucket, entry, UnsubscribeResult)
            return pb.DeleteSubscriptionResponse(rows_dropped=info.rows + info.pending_rows)

        reply = pb.DeleteSubscriptionResponse
        return await self._on_leader(call, request.bucket, request, reply, serve)

    def _visible(
        self, replica: BucketReplica, request: pb.SubscriptionRequest, call: Call
    ) -> SubscriptionInfo:
        """The subscription, if the caller may see it (NOT_FOUND otherwise)."""
        if not request.sub_id:
            raise Failure.invalid("a subscription request needs sub_id")
        info = self._read(
            replica, request.bucket, lambda sm: lifecycle.subscription_info(sm, request.sub_id)
        )
        if info is None or (not call.admin and info.principal != call.principal):
            raise Failure(
                grpc.StatusCode.NOT_FOUND,
                f"no subscription {request.sub_id} in bucket {request.bucket}",
                error="SUBSCRIPTION_NOT_FOUND",
            )
        return info

    def _info(self, bucket: int, info: SubscriptionInfo) -> pb.SubscriptionInfo:
        notifier = self._edge.notifiers.get(bucket)
        known = notifier is not None and notifier.emitting
        return pb.SubscriptionInfo(
            sub_id=info.sub_id,
            bucket=bucket,
            owner=info.principal,
            query=codec.query_to_pb(info.query),
            start=codec.seq_to_pb(info.start),
            head=codec.seq_to_pb(info.head),
            acked=codec.seq_to_pb(info.acked),
            lag=info.lag,
            last_active_ms=info.last_active_ms,
            rows=info.rows,
            row_bytes=info.row_bytes,
            pending_rows=info.pending_rows,
            attached=known and self._streams.attached(bucket, info.sub_id),
            attached_known=known,
        )


__all__ = ["SubscriptionAdmin"]
