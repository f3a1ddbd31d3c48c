"""Consumer groups on the node: the `GroupBeat` handler (a committed `GROUP_BEAT`
entry: outbox/groups.py decides) and the fence every use of a group's subscription
passes - its Subscribe, Reconnect and acks carry the member's `GroupFence`, refused
(`GROUP_FENCED`) unless it is the bucket's current owner and generation as this
node's replica applied them (docs/core.md, "Consumer groups")."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from sevendb.cluster.raft.replica import ReplicaUnavailable
from sevendb.cluster.server.edge import Call, Edge, now_ms
from sevendb.cluster.server.errors import Failure
from sevendb.notifier.host import BucketNotifier
from sevendb.outbox.errors import ErrorCode, SevenDBError
from sevendb.outbox.groups import SESSION_TIMEOUT_MS_DEFAULT, GroupBeat, GroupResult
from sevendb.outbox.state import BucketStateMachine
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb


class Groups:
    """The GroupBeat handler of one node."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge

    async def beat(self, request: pb.GroupBeatRequest, call: Call) -> pb.GroupBeatResponse:
        bucket = request.bucket
        self._edge.check_bucket(bucket)
        if not request.HasField("query"):
            raise Failure.invalid("GroupBeat needs the member's query")
        try:
            query = codec.query_from_pb(request.query)
        except (SevenDBError, ValueError) as exc:
            raise Failure.invalid(f"bad query: {exc}") from None
        self._edge.allow_query(call.principal, query)  # a member must be able to read it
        try:
            entry = GroupBeat(
                call.principal,
                request.group,
                request.member,
                bucket,
                request.session_timeout_ms or SESSION_TIMEOUT_MS_DEFAULT,
                request.leaving,
                now_ms(),
            )
        except SevenDBError as exc:
            raise Failure.domain(exc) from None
        result, _ = await self._edge.commit(bucket, entry, GroupResult)
        return pb.GroupBeatResponse(
            owner=result.owner, generation=result.generation, members=result.members
        )


def fence_failure(message: str) -> Failure:
    return Failure(grpc.StatusCode.FAILED_PRECONDITION, message, error=ErrorCode.GROUP_FENCED)


def _refusal(
    sm: BucketStateMachine,
    principal: str,
    sub_id: str,
    name: str | None,
    fence: pb.GroupFence | None,
) -> str | None:
    durable = name
    if durable is None:
        sub = sm.subs.get(sub_id)
        if sub is None or sub.principal != principal:
            return None  # not found / not the caller's: answered as before
        durable = sub.durable
    if not durable:
        return None if fence is None else "the subscription is no consumer group's"
    term = None if fence is None else (fence.member, fence.generation)
    return sm.groups.refuses(principal, durable, term)


def check_fence(
    edge: Edge,
    notifier: BucketNotifier,
    principal: str,
    sub_id: str,
    name: str | None,
    fence: pb.GroupFence | None,
) -> str | None:
    """Why the use of the subscription `sub_id` (its durable name, read here) or of
    the durable `name` with `fence` is refused here (`GroupTable.refuses`), or None;
    raises UNAVAILABLE if the replica cannot be read."""
    try:
        return notifier.replica.read(lambda sm: _refusal(sm, principal, sub_id, name, fence))
    except ReplicaUnavailable as exc:
        raise edge.unavailable(notifier.bucket, exc) from None


def check_fences(
    edge: Edge,
    notifier: BucketNotifier,
    principal: str,
    uses: Sequence[tuple[str, pb.GroupFence | None]],
) -> list[str | None]:
    """`check_fence` of each `(sub_id, fence)` (its durable name read here), in one
    read of the replica (an ack batch's)."""
    try:
        return notifier.replica.read(
            lambda sm: [_refusal(sm, principal, sub_id, None, fence) for sub_id, fence in uses]
        )
    except ReplicaUnavailable as exc:
        raise edge.unavailable(notifier.bucket, exc) from None


__all__ = ["Groups", "check_fence", "check_fences", "fence_failure"]
