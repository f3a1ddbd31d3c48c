"""Subscription streams: `Subscribe` and `Reconnect`, on calls of their own or as the
streams of a `Session` (`session.py`). Served by the bucket's notifier lease holder;
any other node sends the client there.

A stream attaches to the holder's notifier, then sends its opening (SubAck or
ReconnectAck), its events and, on a Reconnect, `CaughtUp` where catch-up ends.
One stream per subscription: a newer one fences the older, which ends
FAILED_PRECONDITION with the `STREAM_SUPERSEDED` error (docs/wire.md). A Reconnect
from a position beyond what the holder applied is judged only once the holder is
current (a read barrier): a lagging holder answers after catching up, and a
position beyond the log is INVALID_SEQUENCE, never an endless retry. A principal
holding `principal_subscriptions_max` subscriptions in a bucket is refused a new one
(RESOURCE_EXHAUSTED, `TOO_MANY_SUBSCRIPTIONS`); a stream the notifier ends for a
slow subscriber ends UNAVAILABLE with `SLOW_SUBSCRIBER` (docs/wire.md). A Subscribe
with a durable name resumes the principal's subscription of that name after its
acknowledged position, and is refused FAILED_PRECONDITION `DURABLE_IN_USE` while a
stream of it is attached (one live consumer per name). A consumer group's
subscription (its durable name is a group's: `groups.py`) is used only with the
bucket's current owner and generation (`GroupFence`), refused `GROUP_FENCED`
otherwise; the owner's Subscribe supersedes an older stream instead of being refused.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from sevendb.cluster.common.acl import Permission
from sevendb.cluster.raft.replica import BucketReplica, ReplicaUnavailable
from sevendb.cluster.server.batcher import BatcherFull, Batchers, SubscribeBatcher
from sevendb.cluster.server.edge import PROPOSE_TIMEOUT_S, Call, Edge, now_ms
from sevendb.cluster.server.errors import Failure
from sevendb.cluster.server.groups import check_fence, fence_failure
from sevendb.cluster.server.sinks import (
    Encoder,
    EventEncoder,
    M,
    NewBatch,
    StreamSink,
    event_message,
)
from sevendb.notifier.core import SLOW_SUBSCRIBER, Attach, AttachStatus
from sevendb.notifier.host import BucketNotifier
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import LATEST, Isolation, Subscribe
from sevendb.outbox.errors import SevenDBError
from sevendb.outbox.model import OutboxRow, ReconnectStatus, SubscribeResult
from sevendb.outbox.query import plan_query
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb

Push = Callable[[M | pb.StreamMessage], None]
"""Where a Session's stream hands its messages (None: a call of its own, which
yields them)."""


class Streams:
    """The subscription stream handlers of one node."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge
        self._events = EventEncoder()
        self._attached: dict[tuple[int, str], StreamSink] = {}
        """(bucket, sub_id) -> the sink of the subscription's newest attached stream."""
        self._batchers = Batchers(self._new_batcher)

    def _new_batcher(self, replica: BucketReplica) -> SubscribeBatcher:
        return SubscribeBatcher(
            replica,
            asyncio.get_running_loop(),
            timeout_s=PROPOSE_TIMEOUT_S,
            retry_after_ms=self._edge.limits.overloaded_retry_after_ms,
        )

    def close(self) -> None:
        self._batchers.close()

    async def _commit(self, notifier: BucketNotifier, entry: Subscribe) -> SubscribeResult:
        """Commit `entry` through the bucket's `SubscribeBatcher` (in one entry with the
        SUBSCRIBEs waiting with it): its own result, or its own refusal (a Failure)."""
        bucket = notifier.bucket
        replica = self._edge.replicas.get(bucket)
        if replica is None:  # removed since `_holder` found the notifier
            raise Failure(grpc.StatusCode.UNAVAILABLE, f"bucket {bucket}: moved; retry")
        try:
            (done,) = await self._batchers.of(replica).submit([entry])
        except BatcherFull as exc:
            raise Failure.exhausted(str(exc), codec.OVERLOADED, exc.retry_after_ms) from None
        except ReplicaUnavailable as exc:
            raise self._edge.unavailable(bucket, exc) from None
        if isinstance(done, ReplicaUnavailable):
            raise self._edge.unavailable(bucket, done)
        if isinstance(done, BaseException):
            raise done
        if done.error is not None:
            raise Failure.rejected(done.error)
        return done

    async def subscribe_call(
        self, request: pb.SubscribeRequest, call: Call
    ) -> AsyncIterator[pb.StreamMessage]:
        async for message in self.subscribe(call.principal, request, event_message, None):
            yield message

    async def reconnect_call(
        self, request: pb.ReconnectRequest, call: Call
    ) -> AsyncIterator[pb.StreamMessage]:
        async for message in self.reconnect(call.principal, request, event_message, None):
            yield message

    def _holder(self, bucket: int) -> BucketNotifier:
        """This node's notifier of `bucket` if it is emitting; otherwise the client is
        sent to the holder (UNAVAILABLE with its address as the leader hint)."""
        notifier = self._edge.notifiers.get(bucket)
        if notifier is not None and notifier.emitting:
            return notifier
        if notifier is None:
            hint: str | None = self._edge.some_host(bucket)
        else:
            hint = self._edge.client_address(bucket, notifier.holder())
        me = self._edge.me
        raise Failure(
            grpc.StatusCode.UNAVAILABLE,
            f"bucket {bucket}: this node does not hold the notifier lease"
            + (f"; try {hint}" if hint and hint != me else "; retry shortly"),
            leader=hint if hint != me else None,
        )

    def _check_room(
        self, notifier: BucketNotifier, principal: str, sub_id: str, durable: str
    ) -> None:
        """Refuse a new subscription to a principal holding its most in the bucket (a
        repeated Subscribe of one it holds, or one naming a durable subscription it
        holds, is let through: it makes nothing new)."""
        most = self._edge.limits.principal_subscriptions_max
        try:
            full = notifier.replica.read(
                lambda sm: (
                    sm.subs.get(sub_id) is None
                    and not (durable and sm.subs.durable_id(principal, durable))
                    and sm.subs.count(principal) >= most
                )
            )
        except ReplicaUnavailable as exc:
            raise self._edge.unavailable(notifier.bucket, exc) from None
        if full:
            raise Failure.exhausted(
                f"principal {principal!r} holds {most} subscriptions in bucket "
                f"{notifier.bucket}, its most; unsubscribe one first",
                codec.TOO_MANY_SUBSCRIPTIONS,
                None,
            )

    def attached(self, bucket: int, sub_id: str) -> bool:
        """Is a stream of this subscription attached on this node?"""
        return (bucket, sub_id) in self._attached

    def _fence(self, bucket: int, sub_id: str, sink: StreamSink) -> None:
        """`sink`'s stream is the subscription's newest: end an older one."""
        older = self._attached.get((bucket, sub_id))
        self._attached[bucket, sub_id] = sink
        if older is not None and older is not sink:
            older.fence()

    async def subscribe(
        self,
        principal: str,
        request: pb.SubscribeRequest,
        new_batch: NewBatch[M],
        push: Push[M] | None,
    ) -> AsyncIterator[M | pb.StreamMessage]:
        bucket = request.bucket
        self._edge.check_bucket(bucket)
        sub_id = request.sub_id or secrets.token_hex(16)
        try:
            query = codec.query_from_pb(request.query)
            start = codec.start_from_pb(request.start) if request.HasField("start") else LATEST
            entry = Subscribe(
                sub_id,
                principal,
                query,
                plan_query(query).plan_hash,
                now_ms(),
                request.durable,
                start,
                Isolation(request.isolation),
            )
        except SevenDBError as exc:
            raise Failure.domain(exc) from None
        except ValueError as exc:
            raise Failure.invalid(f"bad query: {exc}") from None
        self._edge.allow_query(principal, query)
        notifier = self._holder(bucket)
        fence = request.group if request.HasField("group") else None
        self._check_group(notifier, principal, "", entry.durable, fence)
        self._check_room(notifier, principal, sub_id, entry.durable)
        result = await self._commit(notifier, entry)
        assert result.start is not None and result.acked is not None
        resumed = result.existing and bool(entry.durable)
        self._check_group(notifier, principal, "", entry.durable, fence)
        if (
            resumed
            and fence is None
            and result.sub_id != sub_id
            and self.attached(bucket, result.sub_id)
        ):
            raise Failure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"durable subscription {entry.durable!r} has a live consumer (a stream is "
                f"attached in bucket {bucket}); one consumer at a time",
                error=codec.DURABLE_IN_USE,
            )
        # A durable name resumes its subscription after what was acknowledged (read
        # as it attaches: a purge may have applied since the SUBSCRIBE); a new
        # subscription (or a retried Subscribe of one) starts at its start.
        sub_id = result.sub_id
        sink = StreamSink(asyncio.get_running_loop())
        if resumed:
            attach, _, after = notifier.resume(sub_id, principal, sink)
        else:
            after = result.start
            attach, _ = notifier.attach(sub_id, principal, after, sink)
        if attach.status is AttachStatus.ACK_PENDING:
            raise Failure(grpc.StatusCode.UNAVAILABLE, f"bucket {bucket}: {attach.message}")
        if attach.status is not AttachStatus.ATTACHED:
            # The lease moved between the proposal and now: the client reconnects.
            raise Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: subscribed, but the notifier moved ({attach.message}); "
                "reconnect",
                leader=self._edge.client_address(bucket, attach.holder),
            )
        self._fence(bucket, sub_id, sink)
        ack = pb.SubAck(
            sub_id=sub_id,
            start_emit_seq=codec.seq_to_pb(after),
            bucket=bucket,
            plan_hash=result.plan_hash,
            resumed=resumed,
        )
        opening = [pb.StreamMessage(sub_ack=ack)]
        pump = self._pump(
            principal,
            notifier,
            sub_id,
            sink,
            None,
            new_batch,
            push,
            opening,
            fence=fence,
            packed=request.packed_changes,
        )
        async for message in pump:
            yield message

    async def reconnect(
        self,
        principal: str,
        request: pb.ReconnectRequest,
        new_batch: NewBatch[M],
        push: Push[M] | None,
    ) -> AsyncIterator[M | pb.StreamMessage]:
        if not request.sub_id or not request.HasField("last_processed_emit_seq"):
            raise Failure.invalid("Reconnect needs sub_id and last_processed_emit_seq")
        after = codec.seq_from_pb(request.last_processed_emit_seq)
        if request.HasField("bucket"):
            bucket: int | None = request.bucket
            self._edge.check_bucket(request.bucket)
        else:
            bucket = self._edge.bucket_of_uuid.get(after.bucket_uuid)
        if bucket is None:
            self._count_reconnect(ReconnectStatus.INVALID_SEQUENCE)
            status = pb.ReconnectAck.INVALID_SEQUENCE
            yield pb.StreamMessage(reconnect_ack=pb.ReconnectAck(status=status))
            return
        notifier = self._holder(bucket)
        self._allow_resume(principal, notifier, request.sub_id)
        fence = request.group if request.HasField("group") else None
        self._check_group(notifier, principal, request.sub_id, None, fence)
        sink = StreamSink(asyncio.get_running_loop())
        attach, head = await self._attach(notifier, request.sub_id, principal, after, sink)
        if attach.status is AttachStatus.NOT_HOLDER:
            raise Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: {attach.status}: {attach.message}; retry",
                leader=self._edge.client_address(bucket, attach.holder),
            )
        decision = attach.decision
        assert decision is not None
        if decision.not_owner:
            raise Failure(
                grpc.StatusCode.PERMISSION_DENIED,
                f"subscription {request.sub_id} belongs to another principal",
                error="NOT_OWNER",
            )
        self._count_reconnect(decision.status)
        reply = pb.StreamMessage(
            reconnect_ack=pb.ReconnectAck(
                status=codec.RECONNECT_STATUS[decision.status],
                current_epoch_id=codec.epoch_to_pb(decision.current_epoch),
                next_commit_index=decision.next_commit_index,
            )
        )
        if attach.status is not AttachStatus.ATTACHED:
            yield reply
            return
        self._fence(bucket, request.sub_id, sink)
        # Catch-up ends with the last event committed for the subscription when it
        # attached (outboxed or still pending), so every event committed before the
        # Reconnect precedes CaughtUp, and every later one follows it.
        opening = [reply]
        if head <= after:
            caught_up = pb.CaughtUp(sub_id=request.sub_id, head_emit_seq=codec.seq_to_pb(head))
            opening.append(pb.StreamMessage(caught_up=caught_up))
        catch_up_head = head if head > after else None
        async for message in self._pump(
            principal,
            notifier,
            request.sub_id,
            sink,
            catch_up_head,
            new_batch,
            push,
            opening,
            fence=fence,
            packed=request.packed_changes,
        ):
            yield message

    async def _attach(
        self,
        notifier: BucketNotifier,
        sub_id: str,
        principal: str,
        after: EmitSeq,
        sink: StreamSink,
    ) -> tuple[Attach, EmitSeq]:
        """Attach a Reconnect's stream (`BucketNotifier.attach`). A client ahead of what
        this holder applied is judged only once the holder is current: after a read
        barrier it has applied everything committed before the request, so a client
        still ahead is ahead of the log (refused INVALID_SEQUENCE by the core's
        `decide_reconnect`), not ahead of a lagging holder. Never BEHIND."""
        attach, head = notifier.attach(sub_id, principal, after, sink)
        if attach.status is not AttachStatus.BEHIND:
            return attach, head
        await self._edge.read_barrier(notifier.bucket)
        attach, head = notifier.attach(sub_id, principal, after, sink)
        if attach.status is not AttachStatus.BEHIND:
            return attach, head
        try:
            decision = notifier.replica.read(
                lambda sm: sm.decide_reconnect(sub_id, principal, after)
            )
        except ReplicaUnavailable as exc:
            raise self._edge.unavailable(notifier.bucket, exc) from None
        assert decision.status is not ReconnectStatus.OK, decision
        return Attach(AttachStatus.REFUSED, decision, message=decision.message), head

    async def _pump(
        self,
        principal: str,
        notifier: BucketNotifier,
        sub_id: str,
        sink: StreamSink,
        catch_up_head: EmitSeq | None,
        new_batch: NewBatch[M],
        push: Push[M] | None,
        opening: Sequence[pb.StreamMessage],
        *,
        fence: pb.GroupFence | None = None,
        packed: bool = False,
    ) -> AsyncIterator[M | pb.StreamMessage]:
        """An attached stream: `opening` (its SubAck or ReconnectAck), then its events
        (`Encoder`) until the notifier closes it, a newer stream fences it or the
        client leaves, and detached however it ends. With `push` (a Session's
        stream), events are handed to it where the rows land on the loop, without
        waking this generator's task for every delivery: the generator then only
        waits for the stream to close. Every change is checked against the principal's
        read permission as it leaves: one it may no longer read (a grant revoked since
        it subscribed) ends the stream PERMISSION_DENIED before anything of its batch
        is sent. A consumer group member's stream (`fence`) ends GROUP_FENCED before a
        batch leaves once its term is over (another member owns the bucket now): rows
        leave only on the current owner's stream. `packed`: the events' changes in
        `packed_changes` (the client asked for them so)."""
        encode = Encoder(self._events, sub_id, catch_up_head, new_batch, packed)

        def check(rows: Sequence[OutboxRow]) -> None:
            self._check_readable(principal, sub_id, rows)
            if fence is not None:  # a group member's: only while its term lasts
                self._check_group(notifier, principal, sub_id, None, fence)

        try:
            for first in opening:
                yield first
            if push is not None:

                def deliver(rows: Sequence[OutboxRow]) -> None:
                    check(rows)
                    for message in encode(rows):
                        push(message)

                reason = await sink.push_to(deliver)
            else:
                while not isinstance(item := await sink.get(), str):
                    check(item)
                    for message in encode(item):
                        yield message
                reason = item
            raise self._closed(notifier, sub_id, sink, reason)
        finally:
            sink.stop()
            notifier.detach(sub_id, sink)
            if self._attached.get((notifier.bucket, sub_id)) is sink:
                del self._attached[notifier.bucket, sub_id]

    def _check_group(
        self,
        notifier: BucketNotifier,
        principal: str,
        sub_id: str,
        durable: str | None,
        fence: pb.GroupFence | None,
    ) -> None:
        """GROUP_FENCED unless a consumer group's subscription is used by the bucket's
        owner in its generation (`groups.check_fence`; `durable` "" is no name)."""
        if durable == "" and fence is None:
            return
        reason = check_fence(self._edge, notifier, principal, sub_id, durable, fence)
        if reason is not None:
            raise fence_failure(reason)

    def _allow_resume(self, principal: str, notifier: BucketNotifier, sub_id: str) -> None:
        """PERMISSION_DENIED if `principal` may no longer read what its subscription
        selects (a grant revoked since it subscribed)."""
        try:
            sub = notifier.replica.read(lambda sm: sm.subs.get(sub_id))
        except ReplicaUnavailable as exc:
            raise self._edge.unavailable(notifier.bucket, exc) from None
        if sub is not None and sub.principal == principal:  # another's: NOT_OWNER below
            self._edge.allow_query(principal, sub.query)

    def _check_readable(self, principal: str, sub_id: str, rows: Sequence[OutboxRow]) -> None:
        """PERMISSION_DENIED if a change of `rows` is of a key `principal` may not read."""
        if self._edge.reads_everything(principal):
            return
        readable = self._edge.readable(principal)
        for row in rows:
            for change in row.delta.changes:
                if not readable(change.key):
                    self._edge.allow(principal, Permission.READ, change.key)  # raises

    def _closed(
        self, notifier: BucketNotifier, sub_id: str, sink: StreamSink, reason: str
    ) -> Failure:
        """How a stream the node closed ends."""
        if sink.fenced:
            return Failure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"subscription {sub_id} was resumed on a newer stream; this one is over",
                error=codec.STREAM_SUPERSEDED,
            )
        if reason.startswith(SLOW_SUBSCRIBER):
            return Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"stream of {sub_id} ended: {reason}",
                error=codec.SLOW_SUBSCRIBER,
            )
        holder = self._edge.client_address(notifier.bucket, notifier.holder())
        return Failure(
            grpc.StatusCode.UNAVAILABLE,
            f"stream closed: {reason}; reconnect",
            leader=holder if holder != self._edge.me else None,
        )

    def _count_reconnect(self, status: ReconnectStatus) -> None:
        if self._edge.metrics is not None:
            self._edge.metrics.reconnected(status.name)


__all__ = ["Streams"]
