"""The gRPC API of one node (grpc.aio): routes each request to its bucket's replica
or notifier, and streams subscriptions.

Thin by design: validation comes from the core's entry constructors, decisions from
the core and `NotifierCore`, replication from `BucketReplica`; this module only
translates. Blocking work (replication, status digests) runs off the event loop;
the notifier threads hand rows to streams through `_StreamSink`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import Any, Final, Generic, NoReturn, Protocol, TypeAlias, TypeVar

import grpc
from grpc import aio

from sevendb.cluster.common.auth import (
    ADMIN_PRINCIPAL,
    AUTH_METADATA_KEY,
    AuthError,
    principal_from_metadata,
)
from sevendb.cluster.common.topology import ClusterSpec, ConfigError, NodeSpec
from sevendb.cluster.raft.replica import (
    ApplyOutcome,
    BucketReplica,
    MembershipChangeInProgress,
    ReplicaUnavailable,
)
from sevendb.cluster.server.batcher import Outcome, WriteBatcher
from sevendb.cluster.server.errors import (
    ERROR_CODE_KEY,
    LEADER_HINT_KEY,
    STATUS_OF,
    status_of_unavailable,
)
from sevendb.cluster.server.faults import NO_SESSION, FaultPoints
from sevendb.cluster.server.metrics import NodeMetrics
from sevendb.notifier.core import AttachStatus
from sevendb.notifier.host import AckWait, BucketNotifier
from sevendb.outbox import limits
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    ANY,
    Entry,
    EpochCreate,
    Expected,
    ExpectKind,
    InitProducer,
    Op,
    ProducerRef,
    Subscribe,
    Unsubscribe,
    Write,
    check_key,
    encode_entry,
    op_kind,
)
from sevendb.outbox.errors import Rejection, SevenDBError
from sevendb.outbox.keys import bucket_of
from sevendb.outbox.model import (
    AckStatus,
    Delta,
    EpochResult,
    InitProducerResult,
    OutboxRow,
    ReconnectStatus,
    SubscribeResult,
    UnsubscribeResult,
    WriteResult,
)
from sevendb.outbox.query import Query, QueryKind, plan_query
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.proto.mailbox import mailbox

log = logging.getLogger(__name__)
T = TypeVar("T")
Ctx: TypeAlias = "aio.ServicerContext[Any, Any]"

FORWARD_KEY: Final = "sevendb-forwarded"
PROPOSE_TIMEOUT_S: Final = 5.0
FORWARD_TIMEOUT_S: Final = 10.0
STREAM_WRITES_IN_FLIGHT: Final = 16
"""WriteMany requests one WriteStream has handled at once."""
ACK_WAIT_S_MAX: Final = 10.0
"""The longest an `AckBatch` with `wait_applied` is held (less if its deadline is sooner)."""
_ACK_WAIT_POLL_S: Final = 0.005
_ACK_WAIT_POLL_MAX_S: Final = 0.05
_ACK_TAKEN: Final = (pb.AckResult.ACCEPTED, pb.AckResult.DUPLICATE, pb.AckResult.REGRESSIVE)
STREAM_BATCH_EVENTS_MAX: Final = 4096
"""Most events one EventBatch of a call's own stream carries: deliveries queued while
its task was busy share one. (A Session's stream sends each delivery as it lands.)"""
STREAM_MESSAGE_BYTES: Final = 1024 * 1024
"""An EventBatch takes events until it is about this large (an entry, so an event, is
at most 2 MiB: every message stays below gRPC's 4 MiB)."""
SESSION_STREAMS_MAX: Final = limits.SUBSCRIPTIONS_PER_BUCKET_MAX
"""Most streams open at once on one Session call."""
SESSION_RESPONSE_BYTES: Final = 1024 * 1024
"""A SessionResponse takes queued items until it is about this large."""

_ACK_STATUS: Final = {
    AckStatus.ACCEPTED: pb.AckResult.ACCEPTED,
    AckStatus.REGRESSIVE: pb.AckResult.REGRESSIVE,
    AckStatus.DUPLICATE: pb.AckResult.DUPLICATE,
    AckStatus.FUTURE: pb.AckResult.FUTURE,
    AckStatus.NOT_OWNER: pb.AckResult.NOT_OWNER,
    AckStatus.SUBSCRIPTION_NOT_FOUND: pb.AckResult.SUBSCRIPTION_NOT_FOUND,
    AckStatus.STALE: pb.AckResult.STALE,
}
_RECONNECT_STATUS: Final = {
    ReconnectStatus.OK: pb.ReconnectAck.OK,
    ReconnectStatus.STALE_SEQUENCE: pb.ReconnectAck.STALE_SEQUENCE,
    ReconnectStatus.INVALID_SEQUENCE: pb.ReconnectAck.INVALID_SEQUENCE,
    ReconnectStatus.SUBSCRIPTION_NOT_FOUND: pb.ReconnectAck.SUBSCRIPTION_NOT_FOUND,
}


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# ---- protobuf <-> core ---------------------------------------------------------------


def seq_pb(seq: EmitSeq) -> pb.EmitSeq:
    return pb.EmitSeq(
        epoch_id=pb.EmitSeq.EpochId(bucket_uuid=seq.bucket_uuid, epoch_counter=seq.epoch_counter),
        commit_index=seq.commit_index,
    )


def seq_from_pb(msg: pb.EmitSeq) -> EmitSeq:
    return EmitSeq(msg.epoch_id.bucket_uuid, msg.epoch_id.epoch_counter, msg.commit_index)


class EventEncoder:
    """DataEvent messages for outbox rows; on the event loop only.

    The rows of one source entry share their EmitSeq and usually their Delta, and go
    out on every matching subscription's stream: each is built as a message once
    and copied into the events (building from Python objects cost several times the
    copy). The most recent are kept, each with its object so that its id is not
    reused, up to `count` of them and about `bytes_max` of keys and values.
    """

    def __init__(self, count: int = 4096, bytes_max: int = 32 * 1024 * 1024) -> None:
        self._count = count
        self._bytes_max = bytes_max
        self._bytes = 0
        self._built: dict[int, tuple[object, Any, int]] = {}

    def add(self, batch: pb.EventBatch, row: OutboxRow) -> int:
        """Append the row's DataEvent to `batch`, built in place: a DataEvent made on
        its own is copied again by `EventBatch(events=...)` (2.1 -> 0.9 us an event).
        Returns about how many bytes the event takes."""
        event = batch.events.add(sub_id=row.sub_id)
        seq, seq_size = self._message(row.emit_seq)
        prev, prev_size = self._message(row.prev_emit_seq)
        delta, delta_size = self._message(row.delta)
        event.emit_seq.CopyFrom(seq)
        event.prev_emit_seq.CopyFrom(prev)
        event.delta.CopyFrom(delta)
        return seq_size + prev_size + delta_size + len(row.sub_id)

    def _message(self, part: EmitSeq | Delta) -> tuple[Any, int]:
        hit = self._built.get(id(part))
        if hit is None or hit[0] is not part:
            message: Any
            if isinstance(part, EmitSeq):
                message, size = seq_pb(part), 64
            else:
                message = delta_pb(part)
                size = 64 + sum(len(c.key) + len(c.value) for c in part.changes)
            hit = self._built[id(part)] = (part, message, size)
            self._bytes += size
            while len(self._built) > self._count or self._bytes > self._bytes_max:
                oldest = next(iter(self._built))
                self._bytes -= self._built.pop(oldest)[2]
        return hit[1], hit[2]


M = TypeVar("M", pb.StreamMessage, pb.SessionItem)
NewBatch: TypeAlias = Callable[[], tuple[M, pb.StreamMessage]]
"""Makes what a stream sends its next events in, and the `events` StreamMessage to
fill inside it: the message itself on a call of its own, or a Session's item (so
events are built in place, never copied into the item)."""


def _event_message() -> tuple[pb.StreamMessage, pb.StreamMessage]:
    """An empty `events` StreamMessage (the oneof set even while it holds none)."""
    message = pb.StreamMessage()
    message.events.SetInParent()
    return message, message


def _session_batch(stream_id: int) -> NewBatch[pb.SessionItem]:
    def new() -> tuple[pb.SessionItem, pb.StreamMessage]:
        item = pb.SessionItem(stream_id=stream_id)
        item.message.events.SetInParent()
        return item, item.message

    return new


def delta_pb(delta: Delta) -> pb.Delta:
    return pb.Delta(
        changes=[
            pb.Change(key=c.key, op=int(c.op), value=c.value, version=c.version)  # type: ignore[arg-type]
            for c in delta.changes
        ],
        commit_time_ms=delta.commit_time_ms,
    )


def _op_from_pb(op: pb.Op) -> Op:
    expected = ANY
    if op.HasField("expected"):
        which = op.expected.WhichOneof("kind")
        if which == "not_exists":
            expected = Expected(ExpectKind.NOT_EXISTS)
        elif which == "exact":
            expected = Expected.exact(op.expected.exact)
    return Op(op_kind(op.kind), op.key, op.value, expected)


def query_from_pb(query: pb.Query) -> Query:
    kind = QueryKind(query.kind)  # ValueError for an unknown kind
    if kind is QueryKind.KEY or (kind is QueryKind.PREFIX and query.arg):
        check_key(query.arg)
    return Query(kind, query.arg)


# ---- errors --------------------------------------------------------------------------


class _Failure(Exception):
    """How a request fails: a gRPC status, plus the domain error code and the leader's
    client address as trailing metadata. Raised anywhere below a handler; the handler
    wrappers (`_unary`, `_streaming`) turn it into the call's status, and WriteMany
    into one write's outcome."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        leader: str | None = None,
        error: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.leader = leader
        self.error = error

    @classmethod
    def rejected(cls, rejection: Rejection) -> _Failure:
        return cls(
            STATUS_OF[rejection.code],
            f"{rejection.code}: {rejection.message}",
            error=str(rejection.code),
        )

    @classmethod
    def domain(cls, exc: SevenDBError) -> _Failure:
        return cls(STATUS_OF[exc.code], str(exc), error=str(exc.code))

    def fill(self, out: pb.WriteOutcome) -> None:
        """Make `out` the outcome of a write of a WriteMany that failed this way."""
        out.code = self.code.value[0]
        out.message = self.message
        out.error = self.error or ""
        out.leader = self.leader or ""

    async def abort(self, context: Ctx) -> NoReturn:
        trailers = []
        if self.leader:
            trailers.append((LEADER_HINT_KEY, self.leader))
        if self.error:
            trailers.append((ERROR_CODE_KEY, self.error))
        await context.abort(self.code, self.message, trailing_metadata=tuple(trailers))
        raise AssertionError("unreachable")  # context.abort raises


def _stream_end(failure: _Failure) -> pb.StreamEnd:
    """How a Session stream ends that its own call would have ended with `failure`."""
    return pb.StreamEnd(
        code=failure.code.value[0],
        message=failure.message,
        leader=failure.leader or "",
        error=failure.error or "",
    )


def _requests_done(out: asyncio.Queue[pb.SessionItem | None], reader: asyncio.Task[None]) -> None:
    """A Session's request reader failed (a bug): log it and end the call."""
    if not reader.cancelled() and reader.exception() is not None:
        log.error("session request reader failed", exc_info=reader.exception())
        out.put_nowait(None)


def _session_item(
    out: asyncio.Queue[pb.SessionItem | None],
    sid: int,
    message: pb.SessionItem | pb.StreamMessage | pb.StreamEnd,
) -> None:
    """Queue what Session stream `sid` sends: events already in their item, or a
    message or end to put in one (rare, small)."""
    if isinstance(message, pb.StreamMessage):
        message = pb.SessionItem(stream_id=sid, message=message)
    elif isinstance(message, pb.StreamEnd):
        message = pb.SessionItem(stream_id=sid, end=message)
    out.put_nowait(message)


def _forget_stream(
    streams: dict[int, asyncio.Task[None]], sid: int, task: asyncio.Task[None]
) -> None:
    if streams.get(sid) is task:  # not a newer stream that reused the id
        del streams[sid]


H = TypeVar("H", bound=Callable[..., Awaitable[Any]])
G = TypeVar("G", bound=Callable[..., AsyncIterator[Any]])


def _unary(handler: H) -> H:
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: Ctx) -> Any:
        try:
            return await handler(self, request, context)
        except _Failure as failure:
            await failure.abort(context)

    return wrapper  # type: ignore[return-value]


def _streaming(handler: G) -> G:
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: Ctx) -> AsyncIterator[Any]:
        try:
            async for message in handler(self, request, context):
                yield message
        except _Failure as failure:
            await failure.abort(context)

    return wrapper  # type: ignore[return-value]


# ---- streams -------------------------------------------------------------------------


class _StreamSink:
    """Carries one stream's rows from a notifier thread to its handler on the loop.

    The notifier's flow-control window bounds what can be queued here."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._mailbox = mailbox(loop)  # a notifier pass wakes the loop once, not per stream
        self._queue: asyncio.Queue[tuple[OutboxRow, ...] | str] = asyncio.Queue()
        self._closed: str | None = None
        self._pushing: tuple[Callable[[Sequence[OutboxRow]], None], asyncio.Future[str]] | None
        self._pushing = None
        """While set (`push_to`), deliveries go to the callable until the future is done."""

    def deliver(self, rows: tuple[OutboxRow, ...]) -> None:
        self._put(rows)

    def close(self, reason: str) -> None:
        self._put(reason)

    def _put(self, item: tuple[OutboxRow, ...] | str) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the node is stopping
            self._mailbox.post(self._land, item)

    def _land(self, item: tuple[OutboxRow, ...] | str) -> None:
        # A done future: the stream closed, failed, or its task was cancelled (closed
        # by the client, or its call ended) and has not yet run `stop`; nothing may
        # reach the call after that.
        if self._pushing is None or self._pushing[1].done():
            self._queue.put_nowait(item)
            return
        push, ended = self._pushing
        if isinstance(item, str):
            ended.set_result(item)
            return
        try:
            push(item)
        except Exception as exc:  # a bug: end the stream, loudly
            ended.set_exception(exc)

    async def get(self) -> list[OutboxRow] | str:
        """The rows queued so far (at least one), or why the stream closed."""
        if self._closed is not None:
            return self._closed
        first = await self._queue.get()
        if isinstance(first, str):
            return first
        rows = list(first)
        while len(rows) < STREAM_BATCH_EVENTS_MAX and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, str):
                self._closed = item
                break
            rows.extend(item)
        return rows

    def push_to(self, push: Callable[[Sequence[OutboxRow]], None]) -> asyncio.Future[str]:
        """From now on hand each delivery to `push` where it lands on the loop (what
        is queued first), instead of queueing it for `get`. The future resolves with
        why the stream closed, or fails with what `push` raised."""
        ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if self._closed is not None:
            ended.set_result(self._closed)
            return ended
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, str):
                ended.set_result(item)
                return ended
            push(item)
        self._pushing = (push, ended)
        return ended

    def stop(self) -> None:
        """Push nothing more (the stream is over)."""
        self._pushing = None


class _Encoder(Generic[M]):
    """A stream's rows as the messages it sends: events in batches of about
    STREAM_MESSAGE_BYTES at most (far below gRPC's 4 MiB a message) and, while a
    catch-up head is set, `CaughtUp` right after the event that reaches it, so no
    live event is ever interleaved before catch-up ends."""

    def __init__(
        self,
        events: EventEncoder,
        sub_id: str,
        catch_up_head: EmitSeq | None,
        new_batch: NewBatch[M],
    ) -> None:
        self._events = events
        self._sub_id = sub_id
        self._head = catch_up_head
        self._new_batch: NewBatch[M] = new_batch

    def __call__(self, rows: Sequence[OutboxRow]) -> list[M | pb.StreamMessage]:
        out: list[M | pb.StreamMessage] = []
        head = self._head
        batch, message = self._new_batch()
        size = 0
        for row in rows:
            if size >= STREAM_MESSAGE_BYTES:
                out.append(batch)
                batch, message = self._new_batch()
                size = 0
            if head is not None and row.emit_seq > head:
                if message.events.events:
                    out.append(batch)
                    batch, message = self._new_batch()
                    size = 0
                out.append(self._caught_up(head))
                head = None
            size += self._events.add(message.events, row)
        out.append(batch)
        if head is not None and rows[-1].emit_seq == head:
            out.append(self._caught_up(head))
            head = None
        self._head = head
        return out

    def _caught_up(self, head: EmitSeq) -> pb.StreamMessage:
        return pb.StreamMessage(
            caught_up=pb.CaughtUp(sub_id=self._sub_id, head_emit_seq=seq_pb(head))
        )


# ---- the servicer ----------------------------------------------------------------------


class NodeHost(Protocol):
    """What the service needs of its node (cluster/server/node.py's Node)."""

    node_id: str
    me: NodeSpec
    spec: ClusterSpec
    replicas: dict[int, BucketReplica]
    notifiers: dict[int, BucketNotifier]

    def reload(self) -> list[int]: ...


class NodeService(pb_grpc.SevenDBServicer):
    """Client-facing API of one node; any node accepts any request."""

    def __init__(
        self, node: NodeHost, metrics: NodeMetrics | None = None, faults: FaultPoints | None = None
    ) -> None:
        self._node = node
        self._faults = faults
        self._node_id = node.node_id
        self._me = node.me.grpc_address
        self._metrics = metrics
        self._batchers: dict[int, WriteBatcher] = {}
        self._bucket_of_uuid = {b.bucket_uuid: b.bucket for b in node.spec.buckets}
        self._channels: dict[str, aio.Channel] = {}
        self._events = EventEncoder()

    # The node's spec, replicas and notifiers change when it reloads cluster.json
    # (migrations); each access sees one consistent version of each.
    @property
    def _spec(self) -> ClusterSpec:
        return self._node.spec

    @property
    def _replicas(self) -> dict[int, BucketReplica]:
        return self._node.replicas

    @property
    def _notifiers(self) -> dict[int, BucketNotifier]:
        return self._node.notifiers

    async def close(self) -> None:
        for batcher in self._batchers.values():
            batcher.close()
        for channel in self._channels.values():
            await channel.close()

    # ---- plumbing ------------------------------------------------------------------

    def _principal(self, context: Ctx) -> str:
        try:
            return principal_from_metadata(self._spec.password, context.invocation_metadata() or ())
        except AuthError as exc:
            raise _Failure(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None

    def _stub(self, address: str) -> pb_grpc.SevenDBStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio.insecure_channel(address)
        return pb_grpc.SevenDBStub(channel)

    def _client_address(self, bucket: int, raft_address: str | None) -> str | None:
        if not raft_address:
            return None
        node = self._spec.node_of_raft_address(bucket, raft_address)
        return None if node is None else node.grpc_address

    def _some_host(self, bucket: int) -> str:
        """A node holding a replica of `bucket` (for requests this node cannot serve)."""
        return self._spec.node(self._spec.buckets[bucket].nodes[0]).grpc_address

    def _check_bucket(self, bucket: int) -> None:
        if bucket >= len(self._spec.buckets):
            raise _Failure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bucket {bucket} does not exist (0..{len(self._spec.buckets) - 1})",
            )

    async def _forward(
        self,
        metadata: Sequence[tuple[str, Any]],
        bucket: int,
        call: Callable[[pb_grpc.SevenDBStub, tuple[tuple[str, str], ...]], Awaitable[T]],
        *,
        to_leader: bool,
    ) -> T:
        """Send the request to a node that can serve it (one hop at most)."""
        if any(k == FORWARD_KEY for k, _ in metadata):
            raise _Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: no leader here yet; retry",
                leader=self._leader_address(bucket),
            )
        target = self._leader_address(bucket) if to_leader else None
        if target is None and bucket not in self._replicas:
            target = self._some_host(bucket)
        if target is None or target == self._me:
            local = self._replicas.get(bucket)
            if local is not None and local.data_loss is not None:
                raise self._unavailable(bucket, local.data_loss)
            raise _Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket} has no known leader; retry shortly",
            )
        forwarded = [(FORWARD_KEY, self._node_id)]
        forwarded += [(k, str(v)) for k, v in metadata if k == AUTH_METADATA_KEY]
        try:
            return await call(self._stub(target), tuple(forwarded))
        except aio.AioRpcError as exc:
            raise _Failure(
                exc.code(), exc.details() or "forwarded call failed", leader=target
            ) from None

    def _leader_address(self, bucket: int) -> str | None:
        replica = self._replicas.get(bucket)
        return None if replica is None else self._client_address(bucket, replica.leader)

    def _unavailable(self, bucket: int, exc: ReplicaUnavailable) -> _Failure:
        hint = self._client_address(bucket, exc.leader_hint)
        code = status_of_unavailable(exc.reason)
        return _Failure(code, f"bucket {bucket}: {exc}", leader=hint)

    async def _wait(self, bucket: int, future: Future[T]) -> T:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), PROPOSE_TIMEOUT_S)
        except ReplicaUnavailable as exc:
            raise self._unavailable(bucket, exc) from None
        except TimeoutError:
            raise _Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: not committed within {PROPOSE_TIMEOUT_S} s (outcome unknown)",
                leader=self._leader_address(bucket),
            ) from None

    async def _propose(self, bucket: int, entry: Entry) -> ApplyOutcome:
        try:
            future = self._replicas[bucket].submit(encode_entry(entry))
        except ReplicaUnavailable as exc:
            raise self._unavailable(bucket, exc) from None
        outcome = await self._wait(bucket, future)
        if outcome.error is not None or outcome.applied is None:
            raise _Failure(grpc.StatusCode.INTERNAL, f"bucket {bucket}: {outcome.error}")
        return outcome

    # ---- writes --------------------------------------------------------------------

    def _parse_write(self, request: pb.WriteRequest) -> tuple[int, Write]:
        """Validate one write and find its bucket (raises _Failure)."""
        try:
            ops = tuple(_op_from_pb(op) for op in request.ops)
            producer = None
            if request.HasField("producer"):
                p = request.producer
                producer = ProducerRef(p.producer_id, p.producer_epoch, p.sequence)
            entry = Write(ops, producer, now_ms())
        except SevenDBError as exc:
            raise _Failure.domain(exc) from None
        except ValueError as exc:
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, f"bad op: {exc}") from None
        count = len(self._spec.buckets)
        bucket = bucket_of(ops[0].key, count)
        if len(ops) > 1:
            buckets = {bucket_of(op.key, count) for op in ops}
            if len(buckets) > 1:
                raise _Failure(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"ops route to buckets {sorted(buckets)}; a write is atomic within one bucket",
                )
        return bucket, entry

    def _batcher(self, bucket: int) -> WriteBatcher | None:
        """The batcher of this node's replica of `bucket` (None: no replica here)."""
        replica = self._replicas.get(bucket)
        if replica is None:
            return None
        batcher = self._batchers.get(bucket)
        if batcher is None or batcher.replica is not replica:  # new, or restarted
            batcher = self._batchers[bucket] = WriteBatcher(
                replica, asyncio.get_running_loop(), timeout_s=PROPOSE_TIMEOUT_S
            )
        return batcher

    def _forward_write(
        self, request: pb.WriteRequest, metadata: Sequence[tuple[str, Any]], bucket: int
    ) -> Awaitable[pb.WriteResponse]:
        return self._forward(
            metadata,
            bucket,
            lambda s, md: s.Write(request, timeout=FORWARD_TIMEOUT_S, metadata=md),
            to_leader=False,
        )

    def _committed(self, bucket: int, done: object) -> WriteResult | pb.WriteResponse:
        """A started write's committed result (raises _Failure for a failed one)."""
        if isinstance(done, ReplicaUnavailable):
            raise self._unavailable(bucket, done)
        if isinstance(done, BaseException):
            raise done
        if isinstance(done, WriteResult) and done.error is not None:
            raise _Failure.rejected(done.error)
        assert isinstance(done, WriteResult | pb.WriteResponse), done
        return done

    @staticmethod
    def _fill_write(
        out: pb.WriteResponse,
        bucket: int,
        done: WriteResult | pb.WriteResponse,
        seqs: dict[EmitSeq, pb.EmitSeq],
    ) -> None:
        """Fill `out` in place: building messages and copying them into their parent
        cost more than the rest of a write's answer. `seqs` caches the commit
        positions built so far (the writes of one entry share theirs)."""
        if isinstance(done, pb.WriteResponse):
            out.CopyFrom(done)  # forwarded
            return
        committed = seqs.get(done.commit)
        if committed is None:
            committed = seqs[done.commit] = seq_pb(done.commit)
        out.bucket = bucket
        out.committed.CopyFrom(committed)
        out.duplicate = done.duplicate
        for key, version in done.versions:
            out.versions.add(key=key, version=version)

    @_unary
    async def Write(self, request: pb.WriteRequest, context: Ctx) -> pb.WriteResponse:
        self._principal(context)
        bucket, entry = self._parse_write(request)
        batcher = self._batcher(bucket)
        done: Outcome | pb.WriteResponse
        if batcher is None:
            metadata = context.invocation_metadata() or ()
            done = await self._forward_write(request, metadata, bucket)
        else:
            try:
                submitted = batcher.submit([entry])
            except ReplicaUnavailable as exc:
                raise self._unavailable(bucket, exc) from None
            (done,) = await submitted
        response = pb.WriteResponse()
        self._fill_write(response, bucket, self._committed(bucket, done), {})
        return response

    @_unary
    async def WriteMany(self, request: pb.WriteManyRequest, context: Ctx) -> pb.WriteManyResponse:
        self._principal(context)
        return await self._write_many(request, context.invocation_metadata() or ())

    @_streaming
    async def WriteStream(
        self, requests: AsyncIterator[pb.WriteManyRequest], context: Ctx
    ) -> AsyncIterator[pb.WriteStreamResponse]:
        """WriteMany on one stream: up to `STREAM_WRITES_IN_FLIGHT` requests are
        handled at once (the next is read only when the answer to one is sent: HTTP/2
        flow control holds the client back, and a client that stops reading answers
        stops being served), each answered under its id as it commits.
        Answers ready together leave in one message, so that the client sees them
        together (and sends the writes they prompt together). A caller without a
        valid token gets every request answered UNAUTHENTICATED rather than the
        stream ended: ending it races with the client's write, and grpc then reports
        INTERNAL to the client instead (seen in CI)."""
        try:
            self._principal(context)
            refused = None
        except _Failure as failure:
            refused = failure
        metadata = context.invocation_metadata() or ()
        answers: asyncio.Queue[pb.WriteManyResponse | None] = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_WRITES_IN_FLIGHT)
        handling: set[asyncio.Task[None]] = set()

        async def answer(request: pb.WriteManyRequest) -> None:
            try:
                if refused is not None:
                    raise refused
                response = await self._write_many(request, metadata)
            except Exception as exc:
                if not isinstance(exc, _Failure):
                    log.exception("WriteStream: request %d failed", request.id)
                    exc = _Failure(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
                response = pb.WriteManyResponse()
                for _ in request.writes:
                    exc.fill(response.outcomes.add())
            response.id = request.id
            answers.put_nowait(response)  # its slot is freed once the answer is sent

        async def read() -> None:
            try:
                async for request in requests:
                    await slots.acquire()
                    task = asyncio.create_task(answer(request))
                    handling.add(task)
                    task.add_done_callback(handling.discard)
                await asyncio.gather(*handling)
            finally:
                answers.put_nowait(None)  # the client is done, or gone

        reader = asyncio.create_task(read())
        try:
            while (response := await answers.get()) is not None:
                message = pb.WriteStreamResponse(answers=[response])
                while not answers.empty() and (response := answers.get_nowait()) is not None:
                    message.answers.append(response)
                yield message  # returns once grpc took it: a client that does not read
                for _ in message.answers:  # its answers stops being read from
                    slots.release()
                if response is None:
                    break
        finally:
            reader.cancel()
            for task in handling:
                task.cancel()

    async def _write_many(
        self, request: pb.WriteManyRequest, metadata: Sequence[tuple[str, Any]]
    ) -> pb.WriteManyResponse:
        if len(request.writes) > limits.WRITES_PER_BATCH_MAX:
            raise _Failure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.writes)} writes in one call; the limit is "
                f"{limits.WRITES_PER_BATCH_MAX}",
            )
        # Per write: refused up front, or (bucket, place): its place in the bucket's
        # group here, or -1 - its place among the writes forwarded elsewhere.
        plan: list[_Failure | tuple[int, int]] = []
        groups: dict[int, list[Write]] = {}
        forwards: list[Awaitable[pb.WriteResponse]] = []
        for write in request.writes:
            try:
                bucket, entry = self._parse_write(write)
            except _Failure as failure:
                plan.append(failure)
                continue
            if bucket in self._replicas:
                group = groups.setdefault(bucket, [])
                plan.append((bucket, len(group)))
                group.append(entry)
            else:
                plan.append((bucket, -1 - len(forwards)))
                forwards.append(self._forward_write(write, metadata, bucket))
        submitted: dict[int, Awaitable[list[Outcome]]] = {}
        refused: dict[int, _Failure] = {}
        for bucket, group in groups.items():
            batcher = self._batcher(bucket)
            assert batcher is not None  # the bucket has a replica here
            try:
                submitted[bucket] = batcher.submit(group)
            except ReplicaUnavailable as exc:
                refused[bucket] = self._unavailable(bucket, exc)
        done = await asyncio.gather(*submitted.values(), *forwards, return_exceptions=True)
        outcomes = dict(zip(submitted, done, strict=False))
        forwarded = done[len(submitted) :]

        response = pb.WriteManyResponse()
        leaders: dict[int, str] = {}
        seqs: dict[EmitSeq, pb.EmitSeq] = {}
        for item in plan:
            out = response.outcomes.add()
            try:
                if isinstance(item, _Failure):
                    raise item
                bucket, place = item
                if bucket in refused:
                    raise refused[bucket]
                got = outcomes[bucket] if place >= 0 else forwarded[-1 - place]
                ok = self._committed(bucket, got[place] if isinstance(got, list) else got)
            except _Failure as failure:
                failure.fill(out)
                continue
            self._fill_write(out.ok, bucket, ok, seqs)
            # Name the leader when it is elsewhere: the SDK sends there next time.
            if bucket not in leaders:
                address = self._leader_address(bucket)
                leaders[bucket] = address if address and address != self._me else ""
            out.leader = leaders[bucket]
        return response

    @_unary
    async def InitProducer(
        self, request: pb.InitProducerRequest, context: Ctx
    ) -> pb.InitProducerResponse:
        self._principal(context)
        bucket = request.bucket
        self._check_bucket(bucket)
        if bucket not in self._replicas:
            return await self._forward(
                context.invocation_metadata() or (),
                bucket,
                lambda s, md: s.InitProducer(request, timeout=FORWARD_TIMEOUT_S, metadata=md),
                to_leader=False,
            )
        # Ids are minted at the edge (randomness stays out of the core).
        pid = request.producer_id or (secrets.randbits(62) | 1)
        outcome = await self._propose(bucket, InitProducer(pid, now_ms()))
        assert outcome.applied is not None
        result = outcome.applied.result
        assert isinstance(result, InitProducerResult)
        if result.error is not None:
            raise _Failure.rejected(result.error)
        return pb.InitProducerResponse(producer_id=pid, producer_epoch=result.epoch, bucket=bucket)

    # ---- reads (served by the leader) ------------------------------------------------

    def _leader_replica(self, bucket: int) -> BucketReplica | None:
        replica = self._replicas.get(bucket)
        if replica is not None and replica.is_leader and not replica.quarantined:
            return replica
        return None

    @_unary
    async def Get(self, request: pb.GetRequest, context: Ctx) -> pb.GetResponse:
        self._principal(context)
        try:
            key = check_key(request.key)
        except SevenDBError as exc:
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        bucket = bucket_of(key, len(self._spec.buckets))
        replica = self._leader_replica(bucket)
        if replica is None:
            return await self._forward(
                context.invocation_metadata() or (),
                bucket,
                lambda s, md: s.Get(request, timeout=FORWARD_TIMEOUT_S, metadata=md),
                to_leader=True,
            )
        record = replica.read(lambda sm: sm.get(key))
        if record is None:
            return pb.GetResponse(found=False)
        return pb.GetResponse(
            found=True,
            value=record.value,
            version=record.version,
            mod_commit_index=record.mod_index,
        )

    @_unary
    async def Sync(self, request: pb.SyncRequest, context: Ctx) -> pb.SyncResponse:
        self._principal(context)
        bucket = request.bucket
        self._check_bucket(bucket)
        replica = self._leader_replica(bucket)
        if replica is None:
            return await self._forward(
                context.invocation_metadata() or (),
                bucket,
                lambda s, md: s.Sync(request, timeout=FORWARD_TIMEOUT_S, metadata=md),
                to_leader=True,
            )
        limit = min(request.limit or limits.SYNC_LIMIT_DEFAULT, limits.SYNC_LIMIT_MAX)
        page = replica.read(
            lambda sm: sm.sync_page(request.since_commit_index, request.since_key, limit)
        )
        return pb.SyncResponse(
            items=[
                pb.KeyValue(
                    key=i.key, value=i.value, version=i.version, mod_commit_index=i.mod_index
                )
                for i in page.items
            ],
            has_more=page.has_more,
            next_since_commit_index=page.next_since_index,
            next_since_key=page.next_since_key,
            applied_index=page.applied_index,
        )

    # ---- subscriptions -------------------------------------------------------------

    def _holder(self, bucket: int) -> BucketNotifier:
        """This node's notifier of `bucket` if it is emitting; otherwise the client is
        sent to the holder (UNAVAILABLE with its address as the leader hint)."""
        notifier = self._notifiers.get(bucket)
        if notifier is not None and notifier.emitting:
            return notifier
        if notifier is None:
            hint: str | None = self._some_host(bucket)
        else:
            hint = self._client_address(bucket, notifier.holder())
        raise _Failure(
            grpc.StatusCode.UNAVAILABLE,
            f"bucket {bucket}: this node does not hold the notifier lease"
            + (f"; try {hint}" if hint and hint != self._me else "; retry shortly"),
            leader=hint if hint != self._me else None,
        )

    @_streaming
    async def Subscribe(
        self, request: pb.SubscribeRequest, context: Ctx
    ) -> AsyncIterator[pb.StreamMessage]:
        async for message in self._subscribe(
            self._principal(context), request, _event_message, None
        ):
            yield message

    @_streaming
    async def Reconnect(
        self, request: pb.ReconnectRequest, context: Ctx
    ) -> AsyncIterator[pb.StreamMessage]:
        async for message in self._reconnect(
            self._principal(context), request, _event_message, None
        ):
            yield message

    async def _subscribe(
        self,
        principal: str,
        request: pb.SubscribeRequest,
        new_batch: NewBatch[M],
        push: Callable[[M | pb.StreamMessage], None] | None,
    ) -> AsyncIterator[M | pb.StreamMessage]:
        bucket = request.bucket
        self._check_bucket(bucket)
        sub_id = request.sub_id or secrets.token_hex(16)
        try:
            query = query_from_pb(request.query)
            entry = Subscribe(sub_id, principal, query, plan_query(query).plan_hash, now_ms())
        except SevenDBError as exc:
            raise _Failure.domain(exc) from None
        except ValueError as exc:
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, f"bad query: {exc}") from None
        notifier = self._holder(bucket)
        outcome = await self._propose(bucket, entry)
        assert outcome.applied is not None
        result = outcome.applied.result
        assert isinstance(result, SubscribeResult)
        if result.error is not None:
            raise _Failure.rejected(result.error)
        assert result.start is not None
        sink = _StreamSink(asyncio.get_running_loop())
        attach, _ = notifier.attach(sub_id, principal, result.start, sink)
        if attach.status is not AttachStatus.ATTACHED:
            # The lease moved between the proposal and now: the client reconnects.
            raise _Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: subscribed, but the notifier moved ({attach.message}); "
                "reconnect",
                leader=self._client_address(bucket, attach.holder),
            )
        ack = pb.SubAck(
            sub_id=sub_id,
            start_emit_seq=seq_pb(result.start),
            bucket=bucket,
            plan_hash=result.plan_hash,
        )
        opening = [pb.StreamMessage(sub_ack=ack)]
        async for message in self._pump(notifier, sub_id, sink, None, new_batch, push, opening):
            yield message

    async def _reconnect(
        self,
        principal: str,
        request: pb.ReconnectRequest,
        new_batch: NewBatch[M],
        push: Callable[[M | pb.StreamMessage], None] | None,
    ) -> AsyncIterator[M | pb.StreamMessage]:
        if not request.sub_id or not request.HasField("last_processed_emit_seq"):
            raise _Failure(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Reconnect needs sub_id and last_processed_emit_seq",
            )
        after = seq_from_pb(request.last_processed_emit_seq)
        bucket = self._bucket_of_uuid.get(after.bucket_uuid)
        if bucket is None:
            self._count_reconnect("INVALID_SEQUENCE")
            yield pb.StreamMessage(
                reconnect_ack=pb.ReconnectAck(status=pb.ReconnectAck.INVALID_SEQUENCE)
            )
            return
        notifier = self._holder(bucket)
        sink = _StreamSink(asyncio.get_running_loop())
        attach, head = notifier.attach(request.sub_id, principal, after, sink)
        if attach.status in (AttachStatus.NOT_HOLDER, AttachStatus.BEHIND):
            raise _Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: {attach.status}: {attach.message}; retry",
                leader=self._client_address(bucket, attach.holder),
            )
        decision = attach.decision
        assert decision is not None
        if decision.not_owner:
            raise _Failure(
                grpc.StatusCode.PERMISSION_DENIED,
                f"subscription {request.sub_id} belongs to another principal",
                error="NOT_OWNER",
            )
        self._count_reconnect(decision.status.name)
        reply = pb.StreamMessage(
            reconnect_ack=pb.ReconnectAck(
                status=_RECONNECT_STATUS[decision.status],
                current_epoch_id=pb.EmitSeq.EpochId(
                    bucket_uuid=decision.current_epoch.bucket_uuid,
                    epoch_counter=decision.current_epoch.epoch_counter,
                ),
                next_commit_index=decision.next_commit_index,
            )
        )
        if attach.status is not AttachStatus.ATTACHED:
            yield reply
            return
        # Catch-up ends with the last event committed for the subscription when it
        # attached (outboxed or still pending), so every event committed before the
        # Reconnect precedes CaughtUp, and every later one follows it.
        opening = [reply]
        if head <= after:
            caught_up = pb.CaughtUp(sub_id=request.sub_id, head_emit_seq=seq_pb(head))
            opening.append(pb.StreamMessage(caught_up=caught_up))
        async for message in self._pump(
            notifier,
            request.sub_id,
            sink,
            head if head > after else None,
            new_batch,
            push,
            opening,
        ):
            yield message

    async def _pump(
        self,
        notifier: BucketNotifier,
        sub_id: str,
        sink: _StreamSink,
        catch_up_head: EmitSeq | None,
        new_batch: NewBatch[M],
        push: Callable[[M | pb.StreamMessage], None] | None,
        opening: Sequence[pb.StreamMessage],
    ) -> AsyncIterator[M | pb.StreamMessage]:
        """An attached stream: `opening` (its SubAck or ReconnectAck), then its events
        (`_Encoder`) until the notifier closes it or the client leaves, and detached
        however it ends. With `push` (a Session's stream), events are handed to it
        where the rows land on the loop, without waking this generator's task for
        every delivery: the generator then only waits for the stream to close."""
        encode = _Encoder(self._events, sub_id, catch_up_head, new_batch)
        try:
            for first in opening:
                yield first
            if push is not None:

                def deliver(rows: Sequence[OutboxRow]) -> None:
                    for message in encode(rows):
                        push(message)

                reason = await sink.push_to(deliver)
            else:
                while not isinstance(item := await sink.get(), str):
                    for message in encode(item):
                        yield message
                reason = item
            holder = self._client_address(notifier.bucket, notifier.holder())
            raise _Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"stream closed: {reason}; reconnect",
                leader=holder if holder != self._me else None,
            )
        finally:
            sink.stop()
            notifier.detach(sub_id, sink)

    async def Session(
        self, requests: AsyncIterator[pb.SessionRequest], context: Ctx
    ) -> AsyncIterator[pb.SessionResponse]:
        """Many Subscribe and Reconnect streams on one call. Each stream runs exactly
        as on its own call, in a task that queues its messages (once attached, its
        events are queued where its rows land, without waking the task: `_pump`); the
        call sends what is queued as one SessionResponse, so the events of many
        subscriptions share a gRPC message (and a loop turn on both ends). A stream's
        failure or bad request ends that stream only (`StreamEnd` carries the status
        its own call would have ended with); the call ends when the client closes it,
        or half-closes it and its streams are over."""
        if self._faults is not None and self._faults.holds(NO_SESSION):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        try:
            principal = self._principal(context)
        except _Failure as failure:
            await failure.abort(context)
        out: asyncio.Queue[pb.SessionItem | None] = asyncio.Queue()
        streams: dict[int, asyncio.Task[None]] = {}
        reader = asyncio.get_running_loop().create_task(
            self._session_requests(requests, principal, streams, out)
        )
        reader.add_done_callback(functools.partial(_requests_done, out))
        carried: pb.SessionItem | None = None
        try:
            while (first := carried if carried is not None else await out.get()) is not None:
                # Up to about SESSION_RESPONSE_BYTES, or one item alone if it is
                # larger: never more than a stream's own call would have carried.
                response = pb.SessionResponse(items=[first])
                size, carried, ended = first.ByteSize(), None, False
                while not out.empty():
                    item = out.get_nowait()
                    if item is None:
                        ended = True
                        break
                    n = item.ByteSize()
                    if size + n > SESSION_RESPONSE_BYTES:
                        carried = item
                        break
                    response.items.append(item)
                    size += n
                yield response
                if ended:
                    return
        finally:
            reader.cancel()
            for task in list(streams.values()):
                task.cancel()

    async def _session_requests(
        self,
        requests: AsyncIterator[pb.SessionRequest],
        principal: str,
        streams: dict[int, asyncio.Task[None]],
        out: asyncio.Queue[pb.SessionItem | None],
    ) -> None:
        """Open and close a Session's streams as its requests say; once the client has
        half-closed the call and the streams are over, end the call (None)."""
        loop = asyncio.get_running_loop()
        async for request in requests:
            sid = request.stream_id
            op = request.WhichOneof("op")
            if op == "close":
                task = streams.pop(sid, None)
                if task is not None:
                    task.cancel()
                continue
            failure = None
            if op is None:
                failure = _Failure(grpc.StatusCode.INVALID_ARGUMENT, "SessionRequest without op")
            elif sid in streams:
                failure = _Failure(
                    grpc.StatusCode.INVALID_ARGUMENT, f"stream {sid} is already open"
                )
            elif len(streams) >= SESSION_STREAMS_MAX:
                failure = _Failure(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a session holds at most {SESSION_STREAMS_MAX} streams",
                )
            if failure is not None:
                _session_item(out, sid, _stream_end(failure))
                continue
            new_batch = _session_batch(sid)
            queue_item = functools.partial(_session_item, out, sid)
            push: Callable[[pb.SessionItem | pb.StreamMessage], None] = queue_item
            messages = (
                self._subscribe(principal, request.subscribe, new_batch, push)
                if op == "subscribe"
                else self._reconnect(principal, request.reconnect, new_batch, push)
            )
            task = streams[sid] = loop.create_task(self._session_stream(sid, messages, queue_item))
            task.add_done_callback(functools.partial(_forget_stream, streams, sid))
        while streams:
            await asyncio.gather(*streams.values(), return_exceptions=True)
        out.put_nowait(None)

    async def _session_stream(
        self,
        sid: int,
        messages: AsyncIterator[pb.SessionItem | pb.StreamMessage],
        push: Callable[[pb.SessionItem | pb.StreamMessage | pb.StreamEnd], None],
    ) -> None:
        """Queue one stream's messages, then its end. Cancelled: closed, nothing sent."""
        try:
            async for message in messages:
                push(message)
            end = pb.StreamEnd()
        except _Failure as failure:
            end = _stream_end(failure)
        except Exception:
            log.exception("session stream %d failed", sid)
            end = pb.StreamEnd(code=grpc.StatusCode.INTERNAL.value[0], message="internal error")
        push(end)

    def _count_reconnect(self, status: str) -> None:
        if self._metrics is not None:
            self._metrics.reconnected(status)

    @_unary
    async def Ack(self, request: pb.AckBatch, context: Ctx) -> pb.AckResponse:
        principal = self._principal(context)
        if len(request.acks) > limits.ACKS_PER_PURGE_MAX:
            raise _Failure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.acks)} acks in one batch; the limit is {limits.ACKS_PER_PURGE_MAX}",
            )
        results = [self._ack_one(principal, ack) for ack in request.acks]
        if request.wait_applied:
            await self._wait_applied(principal, request.acks, results, context)
        return pb.AckResponse(results=results)

    async def _wait_applied(
        self, principal: str, acks: Sequence[pb.ClientAck], results: list[pb.AckResult], ctx: Ctx
    ) -> None:
        """Hold the answers of acks this node took until OUTBOX_PURGEs covering them
        are applied here. Polled (`Subscription.close` asks, rarely): one lock round
        per bucket and poll, every 5 ms at first and less often as the wait grows."""
        waiting: dict[int, list[int]] = {}  # bucket -> places in `acks`
        for i, result in enumerate(results):
            if result.status in _ACK_TAKEN:  # _ack_one found the bucket
                bucket = self._bucket_of_uuid[acks[i].up_to_emit_seq.epoch_id.bucket_uuid]
                waiting.setdefault(bucket, []).append(i)
        remaining = ctx.time_remaining()
        budget = ACK_WAIT_S_MAX if remaining is None else min(ACK_WAIT_S_MAX, remaining * 0.8)
        started = time.monotonic()
        while waiting:
            for bucket, places in list(waiting.items()):
                notifier = self._notifiers.get(bucket)
                states = (
                    [AckWait.LOST] * len(places)
                    if notifier is None
                    else notifier.acks_applied(
                        principal,
                        [(acks[i].sub_id, seq_from_pb(acks[i].up_to_emit_seq)) for i in places],
                    )
                )
                still = []
                for i, state in zip(places, states, strict=True):
                    if state is AckWait.QUEUED:
                        still.append(i)
                    elif state is AckWait.LOST:
                        results[i] = self._not_holder(bucket, notifier, acks[i].sub_id)
                    else:
                        results[i] = pb.AckResult(
                            sub_id=acks[i].sub_id,
                            status=_ACK_STATUS[state.status],
                            message=state.message,
                        )
                if still:
                    waiting[bucket] = still
                else:
                    del waiting[bucket]
            waited = time.monotonic() - started
            if waiting and waited >= budget:
                for i in itertools.chain.from_iterable(waiting.values()):
                    results[i] = pb.AckResult(
                        sub_id=acks[i].sub_id,
                        status=pb.AckResult.PENDING,
                        message=f"queued, but not applied within {budget:.2f}s; send it again",
                    )
                return
            if waiting:
                pause = min(_ACK_WAIT_POLL_MAX_S, _ACK_WAIT_POLL_S + waited / 10)
                await asyncio.sleep(min(pause, budget - waited))

    def _ack_one(self, principal: str, ack: pb.ClientAck) -> pb.AckResult:
        if not ack.sub_id or not ack.HasField("up_to_emit_seq"):
            return pb.AckResult(
                sub_id=ack.sub_id,
                status=pb.AckResult.SUBSCRIPTION_NOT_FOUND,
                message="an ack needs sub_id and up_to_emit_seq",
            )
        up_to = seq_from_pb(ack.up_to_emit_seq)
        bucket = self._bucket_of_uuid.get(up_to.bucket_uuid)
        if bucket is None:
            return pb.AckResult(
                sub_id=ack.sub_id,
                status=pb.AckResult.FUTURE,
                message=f"no bucket {up_to.bucket_uuid} in this cluster",
            )
        notifier = self._notifiers.get(bucket)
        outcome = None if notifier is None else notifier.ack(ack.sub_id, principal, up_to)
        if outcome is None:
            return self._not_holder(bucket, notifier, ack.sub_id)
        return pb.AckResult(
            sub_id=ack.sub_id, status=_ACK_STATUS[outcome.status], message=outcome.message
        )

    def _not_holder(
        self, bucket: int, notifier: BucketNotifier | None, sub_id: str
    ) -> pb.AckResult:
        where = self._client_address(bucket, None if notifier is None else notifier.holder())
        return pb.AckResult(
            sub_id=sub_id,
            status=pb.AckResult.NOT_HOLDER,
            message=f"bucket {bucket}: this node does not hold the notifier lease "
            f"(holder: {where or 'unknown yet'})",
            holder=where or "",
        )

    @_unary
    async def Unsubscribe(
        self, request: pb.UnsubscribeRequest, context: Ctx
    ) -> pb.UnsubscribeResponse:
        principal = self._principal(context)
        bucket = request.bucket
        self._check_bucket(bucket)
        if bucket not in self._replicas:
            return await self._forward(
                context.invocation_metadata() or (),
                bucket,
                lambda s, md: s.Unsubscribe(request, timeout=FORWARD_TIMEOUT_S, metadata=md),
                to_leader=False,
            )
        try:
            entry = Unsubscribe(request.sub_id, principal, now_ms())
        except SevenDBError as exc:
            raise _Failure.domain(exc) from None
        outcome = await self._propose(bucket, entry)
        assert outcome.applied is not None
        result = outcome.applied.result
        assert isinstance(result, UnsubscribeResult)
        if result.error is not None:
            raise _Failure.rejected(result.error)
        return pb.UnsubscribeResponse()

    # ---- administration (principal "admin") --------------------------------------------

    def _admin(self, context: Ctx) -> None:
        if self._principal(context) != ADMIN_PRINCIPAL:
            raise _Failure(
                grpc.StatusCode.PERMISSION_DENIED,
                f"administration needs the {ADMIN_PRINCIPAL!r} principal "
                f"(`sevendb token {ADMIN_PRINCIPAL}`)",
            )

    def _leading_replica(self, bucket: int) -> BucketReplica:
        self._check_bucket(bucket)
        replica = self._replicas.get(bucket)
        if replica is None:
            raise _Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: no replica on this node",
                leader=self._some_host(bucket),
            )
        if not replica.is_leader or replica.quarantined:
            raise _Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: this node is not the leader",
                leader=self._leader_address(bucket),
            )
        return replica

    async def _membership(
        self, request: pb.MemberRequest, context: Ctx, change: str
    ) -> pb.MemberResponse:
        self._admin(context)
        replica = self._leading_replica(request.bucket)
        call = replica.add_member if change == "add" else replica.remove_member
        try:
            await asyncio.to_thread(call, request.address, PROPOSE_TIMEOUT_S)
        except MembershipChangeInProgress as exc:
            raise _Failure(grpc.StatusCode.ABORTED, str(exc)) from None
        except ReplicaUnavailable as exc:
            raise self._unavailable(request.bucket, exc) from None
        except ValueError as exc:
            code = grpc.StatusCode.ALREADY_EXISTS if change == "add" else grpc.StatusCode.NOT_FOUND
            if "leader" in str(exc) or "this replica" in str(exc):
                code = grpc.StatusCode.FAILED_PRECONDITION
            raise _Failure(code, str(exc)) from None
        return pb.MemberResponse(members=replica.members())

    @_unary
    async def AddMember(self, request: pb.MemberRequest, context: Ctx) -> pb.MemberResponse:
        return await self._membership(request, context, "add")

    @_unary
    async def RemoveMember(self, request: pb.MemberRequest, context: Ctx) -> pb.MemberResponse:
        return await self._membership(request, context, "remove")

    @_unary
    async def TransferLeader(self, request: pb.MemberRequest, context: Ctx) -> pb.MemberResponse:
        self._admin(context)
        replica = self._leading_replica(request.bucket)
        if request.address not in replica.members():
            raise _Failure(
                grpc.StatusCode.NOT_FOUND,
                f"{request.address} is not a member of bucket {request.bucket}",
            )
        replica.transfer_leadership(request.address, timeout_s=PROPOSE_TIMEOUT_S)
        deadline = time.monotonic() + PROPOSE_TIMEOUT_S
        while replica.leader != request.address:
            if time.monotonic() > deadline:
                raise _Failure(
                    grpc.StatusCode.UNAVAILABLE,
                    f"bucket {request.bucket}: leadership did not move to {request.address} "
                    "(it must hold the whole log); retry",
                    leader=self._leader_address(request.bucket),
                )
            await asyncio.sleep(0.05)
        return pb.MemberResponse(members=replica.members())

    @_unary
    async def CreateEpoch(self, request: pb.EpochRequest, context: Ctx) -> pb.EpochResponse:
        self._admin(context)
        bucket = request.bucket
        replica = self._leading_replica(bucket)
        current = replica.read(lambda sm: sm.epoch)
        if current.epoch_counter == request.epoch_counter:
            return pb.EpochResponse(
                epoch_id=pb.EmitSeq.EpochId(
                    bucket_uuid=current.bucket_uuid, epoch_counter=current.epoch_counter
                )
            )
        outcome = await self._propose(bucket, EpochCreate(request.epoch_counter, now_ms()))
        assert outcome.applied is not None
        result = outcome.applied.result
        assert isinstance(result, EpochResult)
        if result.error is not None:
            raise _Failure.rejected(result.error)
        return pb.EpochResponse(
            epoch_id=pb.EmitSeq.EpochId(
                bucket_uuid=result.epoch.bucket_uuid, epoch_counter=result.epoch.epoch_counter
            ),
            commit_index=outcome.commit_index,
        )

    @_unary
    async def Reload(self, request: pb.ReloadRequest, context: Ctx) -> pb.ReloadResponse:
        self._admin(context)
        try:
            buckets = await asyncio.to_thread(self._node.reload)
        except ConfigError as exc:
            raise _Failure(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        return pb.ReloadResponse(buckets=buckets)

    # ---- operations --------------------------------------------------------------------

    async def ClusterInfo(
        self, request: pb.ClusterInfoRequest, context: Ctx
    ) -> pb.ClusterInfoResponse:
        spec = self._spec
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

    async def Status(self, request: pb.StatusRequest, context: Ctx) -> pb.StatusResponse:
        # Digests snapshot the whole core: off the event loop, and only on request.
        replicas = await asyncio.to_thread(self._status, request.with_digests)
        return pb.StatusResponse(node_id=self._node_id, replicas=replicas)

    def _status(self, with_digests: bool) -> list[pb.ReplicaStatus]:
        out = []
        for bucket, replica in sorted(self._replicas.items()):
            st = replica.status()
            core = (
                None
                if replica.quarantined
                else replica.read(
                    lambda sm: (
                        sm.digest() if with_digests else "",
                        sm.lease_holder,
                        len(sm.subscriptions()),
                        sm.outbox_size(),
                    )
                )
            )
            digest, holder, subs, outbox = core or ("", "", 0, 0)
            notifier = self._notifiers.get(bucket)
            out.append(
                pb.ReplicaStatus(
                    bucket=bucket,
                    bucket_uuid=self._spec.buckets[bucket].bucket_uuid,
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
                    connected=replica.connectivity().connected,
                )
            )
        return out


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


__all__ = ["EventEncoder", "NodeService", "query_from_pb", "seq_from_pb", "seq_pb"]
