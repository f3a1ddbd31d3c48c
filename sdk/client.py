"""The client: writes, reads, idempotent producers and subscriptions, against any
cluster node.

    with Client(["127.0.0.1:7001", "127.0.0.1:7002"], token=token) as client:
        client.put("orders/1", b"paid")
        for event in client.subscribe("prefix:orders/", cursor="orders.cursor"):
            ...

Any node accepts any request (it forwards to the bucket's leader, or redirects a
subscription to the bucket's notifier lease holder); on UNAVAILABLE the client
follows the leader hint or tries the next endpoint, with jittered backoff; on
RESOURCE_EXHAUSTED with a `sevendb-retry-after-ms` trailer (a rate limit) it waits that long.
Every write is idempotent: the client is a producer (`sevendb.sdk.producer`), so a
write retried after a lost answer, a timeout or a failover never applies twice.
Every error is a `SevenDBError` (the tree: `sevendb.sdk.errors`); what a call takes
and returns is in `sevendb.sdk.models`, never a protobuf message.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import grpc

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import ANY, ExpectKind, Op, OpKind, StartKind, Write
from sevendb.outbox.errors import InvalidArgument, SevenDBError
from sevendb.outbox.query import Query, QueryKind, plan_query
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk.acks import AckPipeline
from sevendb.sdk.cursor_store import CursorStore
from sevendb.sdk.engine import ERROR_CODE_KEY, LEADER_HINT_KEY, RETRY_AFTER_KEY, Engine
from sevendb.sdk.errors import ResourceExhausted, Unavailable, domain_error, retry_after_s
from sevendb.sdk.handover import Handover
from sevendb.sdk.models import (
    ClusterLayout,
    NodeStatus,
    RangePage,
    Record,
    ReplicaStatus,
    WriteResult,
    delete_op,
    set_op,
)
from sevendb.sdk.producer import Producer
from sevendb.sdk.sessions import Sessions
from sevendb.sdk.streams import Event
from sevendb.sdk.subscription import (
    StartAt,
    SubscribeOptions,
    Subscription,
    close_subscriptions,
    parse_query,
    starts_for,
)
from sevendb.sdk.tls import SYSTEM_ROOTS, TLS, sync_channel
from sevendb.sdk.writer import QUEUE_BYTES_MAX, QUEUE_WAIT_S, QUEUE_WRITES_MAX, WritePipeline

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long and how often to retry UNAVAILABLE (leader changes, restarts) and
    RESOURCE_EXHAUSTED with a retry-after (rate limits). `deadline_s` bounds a call
    or a write, all attempts included; it also bounds how long `Client.subscribe`
    waits for its streams."""

    attempts_max: int = 40
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0
    deadline_s: float = 30.0
    call_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts_max < 1 or self.deadline_s <= 0 or self.call_timeout_s <= 0:
            raise InvalidArgument("attempts_max >= 1, deadline_s > 0, call_timeout_s > 0")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise InvalidArgument("0 < backoff_initial_s <= backoff_max_s")


@dataclass(frozen=True, slots=True)
class WriteQueue:
    """Backpressure: how many unanswered writes a `Client` holds (queued, in flight,
    or waiting to be retried). A write beyond `max_writes` or `max_bytes` *blocks*
    until earlier ones are answered, for up to `wait_s`, then raises
    `ResourceExhausted` (nothing is sent). On the client's own loop thread (a write's
    callback), where waiting would deadlock, it raises at once. A single write larger
    than `max_bytes` is taken when nothing else is unanswered."""

    max_writes: int = QUEUE_WRITES_MAX
    max_bytes: int = QUEUE_BYTES_MAX
    wait_s: float = QUEUE_WAIT_S

    def __post_init__(self) -> None:
        if self.max_writes < 1 or self.max_bytes < 1 or self.wait_s < 0:
            raise InvalidArgument("max_writes >= 1, max_bytes >= 1, wait_s >= 0")


def _write_result(response: pb.WriteResponse) -> WriteResult:
    if not response.HasField("committed"):  # a duplicate whose result was lost (the pipeline)
        return WriteResult(EmitSeq("", 0, 0), response.bucket, {}, True, position_known=False)
    versions = response.versions
    if len(versions) == 1:  # most writes: no comprehension
        kv = versions[0]
        written = {kv.key: kv.version}
    else:
        written = {kv.key: kv.version for kv in versions}
    return WriteResult(
        codec.seq_from_pb(response.committed), response.bucket, written, response.duplicate
    )


def _op_pb(op: Op) -> pb.Op:
    if not isinstance(op, Op):
        raise InvalidArgument(f"a write takes Op values (set_op, delete_op), not {op!r}")
    kind = pb.Op.DEL if op.kind is OpKind.DEL else pb.Op.SET
    expected = op.expected
    if expected is ANY:  # most writes
        return pb.Op(kind=kind, key=op.key, value=op.value)
    if expected.kind is ExpectKind.EXACT:
        condition = pb.ExpectedVersion(exact=expected.version)
    elif expected.kind is ExpectKind.NOT_EXISTS:
        condition = pb.ExpectedVersion(not_exists=True)
    else:
        condition = None
    return pb.Op(kind=kind, key=op.key, value=op.value, expected=condition)


def _node_status(response: pb.StatusResponse) -> NodeStatus:
    def replica(r: pb.ReplicaStatus) -> ReplicaStatus:
        values: dict[str, Any] = {f.name: getattr(r, f.name) for f in fields(ReplicaStatus)}
        values["members"] = tuple(r.members)
        values["connected"] = tuple(r.connected)
        return ReplicaStatus(**values)

    return NodeStatus(response.node_id, tuple(replica(r) for r in response.replicas))


def _trailer(exc: grpc.RpcError, key: str) -> str | None:
    value = dict(exc.trailing_metadata() or ()).get(key)
    return value if isinstance(value, str) else None


def _call_error(exc: grpc.RpcError) -> SevenDBError | None:
    after = retry_after_s(_trailer(exc, RETRY_AFTER_KEY))
    return domain_error(exc.code(), exc.details() or "", _trailer(exc, ERROR_CODE_KEY), after)


class Client:
    """A connection to a sevendb cluster through any of its nodes' client endpoints.

    `token` authenticates every call (`sevendb token NAME` mints one); a subscription
    belongs to the token's principal. `tls` says which CA to trust and which client
    certificate to present (`TLS`; by default TLS trusting the system's CAs; None:
    plaintext, for a cluster made with --insecure). With a client certificate and no
    token, on a cluster that requires client certificates, the certificate's name is
    the principal. `retry` says how long to retry, `write_queue` how many unanswered
    writes to hold before a write waits (backpressure). Thread-safe.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        token: str | None = None,
        tls: TLS | None = SYSTEM_ROOTS,
        retry: RetryPolicy | None = None,
        write_queue: WriteQueue | None = None,
    ) -> None:
        if not endpoints:
            raise InvalidArgument("a Client needs at least one endpoint (host:port)")
        if tls is not None and not isinstance(tls, TLS):
            raise InvalidArgument(f"tls takes a sevendb.sdk.TLS or None (plaintext), not {tls!r}")
        self._endpoints = list(endpoints)
        self._tls = tls
        self._retry = retry or RetryPolicy()
        self._write_queue = write_queue or WriteQueue()
        self._producer = Producer()
        """The client's own idempotent producer: every write carries its sequence."""
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._channels: dict[str, grpc.Channel] = {}
        self._preferred = 0
        self._lock = threading.Lock()
        self._layout: ClusterLayout | None = None
        self._engine: Engine | None = None
        self._writes: WritePipeline[WriteResult] | None = None
        self._ack_pipeline: AckPipeline | None = None
        self._sessions: Sessions | None = None
        self._subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()

    def close(self) -> None:
        """Close the connections. Writes not answered yet fail with "the client is
        closing" (they may still commit). Open subscriptions are closed first, as by
        their own `close()` (the final acks and unsubscribes of all of them together),
        and their consumers' iterations end."""
        self._close(failed=sys.exc_info()[1] is not None)

    def _close(self, *, failed: bool) -> None:
        with self._lock:
            subs = list(self._subscriptions)
            self._subscriptions.clear()
            engine, self._engine = self._engine, None
            writes, self._writes = self._writes, None
            self._ack_pipeline = self._sessions = None
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
        if engine is None:
            return
        args = (engine, writes, subs, failed)
        if engine.on_loop_thread():  # from a callback: the loop cannot wait for itself
            threading.Thread(target=_shut_down, args=args, daemon=True).start()
        else:
            _shut_down(*args)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Leaving the block by an exception leaves the event each subscription's
        consumer had in hand unprocessed (`Subscription.close`)."""
        self._close(failed=exc is not None)

    def _stub(self, address: str) -> pb_grpc.SevenDBStub:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = sync_channel(address, self._tls)
        return pb_grpc.SevenDBStub(channel)

    def _call(self, fn: Callable[[pb_grpc.SevenDBStub, float], T]) -> T:
        """`fn(stub, timeout)` retried per the `RetryPolicy`: every attempt ends by
        the deadline."""
        policy = self._retry
        deadline = time.monotonic() + policy.deadline_s
        backoff = policy.backoff_initial_s
        target = self._endpoints[self._preferred % len(self._endpoints)]
        last: grpc.RpcError | None = None
        for _attempt in range(policy.attempts_max):
            left = deadline - time.monotonic()
            try:
                return fn(self._stub(target), max(0.01, min(policy.call_timeout_s, left)))
            except grpc.RpcError as exc:
                typed = _call_error(exc)
                if typed is not None:
                    raise typed from None
                last = exc
                hint = _trailer(exc, LEADER_HINT_KEY)
                if hint:
                    target = hint
                else:
                    self._preferred += 1
                    target = self._endpoints[self._preferred % len(self._endpoints)]
            after = retry_after_s(_trailer(last, RETRY_AFTER_KEY))
            wait = after if after is not None else backoff * (0.5 + random.random())
            if time.monotonic() + wait > deadline:
                break
            time.sleep(wait)
            backoff = min(backoff * 2, policy.backoff_max_s)
        detail = "no attempt" if last is None else f"{last.code().name}: {last.details()}"
        if last is not None and last.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            after = retry_after_s(_trailer(last, RETRY_AFTER_KEY))
            raise ResourceExhausted(f"refused for now by the cluster: {detail}", after)
        raise Unavailable(
            f"cannot reach the cluster at {','.join(self._endpoints)} within "
            f"{policy.deadline_s:g} s: {detail}"
        )

    # ---- cluster ---------------------------------------------------------------------

    def layout(self, *, refresh: bool = False) -> ClusterLayout:
        """The cluster's buckets and nodes (cached; `refresh` asks again)."""
        if self._layout is None or refresh:
            info: pb.ClusterInfoResponse = self._call(
                lambda s, t: s.ClusterInfo(pb.ClusterInfoRequest(), timeout=t)
            )
            self._layout = ClusterLayout(
                info.cluster_id,
                tuple(b.bucket_uuid for b in info.buckets),
                tuple(tuple(b.nodes) for b in info.buckets),
                tuple(info.nodes),
            )
        return self._layout

    def status(self, endpoint: str, *, digests: bool = False) -> NodeStatus:
        """One node's view of its replicas (no retry: it is about that node). With
        `digests` each replica also hashes its state (a snapshot: not for tight loops)."""
        try:
            response: pb.StatusResponse = self._stub(endpoint).Status(
                pb.StatusRequest(with_digests=digests), timeout=self._retry.call_timeout_s
            )
        except grpc.RpcError as exc:
            raise _call_error(exc) or Unavailable(f"{endpoint}: {exc.details()}") from None
        return _node_status(response)

    # ---- writes and reads --------------------------------------------------------------

    def write(self, ops: Sequence[Op]) -> WriteResult:
        """Apply `ops` atomically (all keys in one bucket); returns once committed.
        Build them with `set_op` and `delete_op`. Idempotent: retried after a lost
        answer, it never applies twice (`WriteResult.duplicate` then says it was a
        retry of a committed write)."""
        return self.write_async(ops).result()

    def write_async(self, ops: Sequence[Op]) -> Future[WriteResult]:
        """`write` without blocking: keep many in flight from one thread. Concurrent
        writes share `WriteMany` requests (see `sevendb.sdk.writer`). Blocks only
        while the client's `WriteQueue` is full."""
        return self._submit(ops, self._producer)

    def _submit(self, ops: Sequence[Op], producer: Producer) -> Future[WriteResult]:
        if not ops:
            raise InvalidArgument("a write needs at least one op")
        request = pb.WriteRequest(ops=[_op_pb(op) for op in ops])
        Write(tuple(ops))  # the node's own checks (limits, a key twice), before sending
        layout = self.layout()
        bucket = layout.bucket_of(ops[0].key)
        if len(ops) > 1:
            buckets = {layout.bucket_of(op.key) for op in ops}
            if len(buckets) > 1:
                raise InvalidArgument(
                    f"ops route to buckets {sorted(buckets)}; a write is atomic within one bucket"
                )
        return self._pipeline().submit(request, bucket, producer)

    def put(
        self,
        key: str,
        value: bytes,
        *,
        expected_version: int | None = None,
        must_not_exist: bool = False,
    ) -> WriteResult:
        """Set one key (`set_op` says what the conditions mean: `expected_version=0`
        is "must not exist")."""
        return self.write(
            [set_op(key, value, expected_version=expected_version, must_not_exist=must_not_exist)]
        )

    def delete(self, key: str, *, expected_version: int | None = None) -> WriteResult:
        """Delete one key (`delete_op` says what the condition means: `expected_version=0`
        is "must not exist")."""
        return self.write([delete_op(key, expected_version=expected_version)])

    def get(self, key: str) -> Record | None:
        response: pb.GetResponse = self._call(
            lambda s, t: s.Get(pb.GetRequest(key=key), timeout=t, metadata=self.metadata)
        )
        if not response.found:
            return None
        return Record(key, response.value, response.version, response.mod_commit_index)

    def range(
        self,
        *,
        prefix: str = "",
        start: str = "",
        end: str = "",
        limit: int = 0,
        page_token: str = "",
        serializable: bool = False,
    ) -> RangePage:
        """Current keys in key order across every bucket: those starting with `prefix`,
        or those in [`start`, `end`) (`end` empty: no end); at most `limit` (0: the
        node's default) per page; pass `next_page_token` back for the next page.
        Linearizable (it sees every write acknowledged before the call) unless
        `serializable`, which reads without a read barrier (may miss the latest
        writes). Keys the principal may not read are left out (docs/security.md)."""
        if prefix and (start or end):
            raise InvalidArgument("range: a prefix or start..end, not both")
        request = pb.RangeRequest(
            prefix=prefix,
            start=start,
            end=end,
            limit=limit,
            page_token=page_token,
            serializable=serializable,
        )
        response: pb.RangeResponse = self._call(
            lambda s, t: s.Range(request, timeout=t, metadata=self.metadata)
        )
        records = tuple(
            Record(i.key, i.value, i.version, i.mod_commit_index) for i in response.items
        )
        return RangePage(records, response.next_page_token)

    def sync_bucket(self, bucket: int, *, page_size: int = 0) -> Iterator[Record]:
        """Every key of a bucket, in pages of `page_size` (0: the node's default),
        ordered by the commit that last changed it (docs/wire.md, "Paged sync")."""
        since_index, since_key = 0, ""
        while True:
            request = pb.SyncRequest(
                bucket=bucket, since_commit_index=since_index, since_key=since_key, limit=page_size
            )
            page: pb.SyncResponse = self._call(
                lambda s, t, r=request: s.Sync(r, timeout=t, metadata=self.metadata)  # type: ignore[misc]
            )
            for item in page.items:
                yield Record(item.key, item.value, item.version, item.mod_commit_index)
            if not page.has_more:
                return
            since_index, since_key = page.next_since_commit_index, page.next_since_key

    def sync_then_subscribe(
        self,
        query: str | Query,
        *,
        cursor: CursorStore | str | Path | None = None,
        name: str | None = None,
        options: SubscribeOptions | None = None,
        durable: str | None = None,
    ) -> tuple[dict[str, Record], Subscription, Handover]:
        """The keys `query` matches as they are now, then their changes: a
        snapshot-then-stream handover with no gap and no duplicate between the two
        (sdk/handover.py), for a start older than the retained history or an
        application that wants the state first. Subscribes (as `subscribe`), then reads
        the state with paged Syncs; apply the records, then of each event only
        ``handover.fresh(event.emit_seq.commit_index, event.changes)``."""
        parsed = parse_query(query)
        sub = self.subscribe(parsed, cursor=cursor, name=name, options=options, durable=durable)
        plan = plan_query(parsed)
        read: dict[str, Record] = {}
        for bucket in self._buckets_of(parsed):
            read.update((r.key, r) for r in self.sync_bucket(bucket) if plan.matches(r.key))
        return read, sub, Handover((k, r.mod_commit_index) for k, r in read.items())

    def _buckets_of(self, query: Query) -> list[int]:
        layout = self.layout()
        if query.kind is QueryKind.KEY:
            return [layout.bucket_of(query.arg)]
        return list(range(layout.buckets))

    def history(
        self,
        query: str | Query,
        *,
        after: StartAt = "earliest",
        through: int = 0,
        page_size: int = 0,
    ) -> Iterator[Event]:
        """The committed changes `query` matches in each bucket's retained history,
        bucket by bucket, each in emit_seq order with its `prev_emit_seq` chain (events
        with `sub_id` ""), in pages of `page_size` (0: the node's default). `after`:
        ``"earliest"`` (default), an `EmitSeq` (a query of one bucket) or ``{bucket:
        EmitSeq}``; `through`: no change committed at a higher log index (0: none).
        Older than a bucket's history reaches: `StaleSequence` (read the state with
        `sync_bucket` instead; docs/wire.md, "History")."""
        parsed = parse_query(query)
        buckets = self._buckets_of(parsed)
        starts = starts_for(after, buckets, self.layout().bucket_uuids)
        for bucket in buckets:
            begin = starts[bucket]
            if begin.kind not in (StartKind.EARLIEST, StartKind.AFTER):
                raise InvalidArgument("history reads after 'earliest' or an emit_seq")
            yield from self._history_bucket(bucket, parsed, begin.after, through, page_size)

    def _history_bucket(
        self, bucket: int, query: Query, after: EmitSeq | None, through: int, page_size: int
    ) -> Iterator[Event]:
        prev = after
        while True:
            request = pb.HistoryRequest(
                bucket=bucket,
                query=codec.query_to_pb(query),
                after=None if after is None else codec.seq_to_pb(after),
                through_commit_index=through,
                limit=page_size,
            )
            page: pb.HistoryResponse = self._call(
                lambda s, t, r=request: s.History(r, timeout=t, metadata=self.metadata)  # type: ignore[misc]
            )
            if prev is None:
                prev = codec.seq_from_pb(page.retained_after)
            for item in page.events:
                at = codec.seq_from_pb(item.emit_seq)
                changes = tuple(codec.change_from_pb(c) for c in item.delta.changes)
                yield Event(bucket, "", at, prev, changes, item.delta.commit_time_ms)
                prev = at
            if not page.more:
                return
            after = codec.seq_from_pb(page.next_after)

    def producer(self, bucket_count: int | None = None) -> IdempotentProducer:
        """A producer of its own (another id, its own sequences): every `Client` write
        is idempotent already, through the client's producer. `bucket_count` is
        ignored (the cluster's layout decides; kept for earlier callers)."""
        return IdempotentProducer(self)

    # ---- subscriptions ----------------------------------------------------------------

    def subscribe(
        self,
        query: str | Query,
        *,
        cursor: CursorStore | str | Path | None = None,
        name: str | None = None,
        options: SubscribeOptions | None = None,
        durable: str | None = None,
        start: StartAt = None,
    ) -> Subscription:
        """Subscribe to `query` (``key:K``, ``prefix:P``, ``all`` or a `Query`) in every
        bucket it spans. With `cursor` (a file or a `CursorStore`), a restarted process
        resumes after the last event it processed; `name` tells apart several
        subscriptions sharing one cursor file (default: the durable name, else the
        query). With `durable`, the principal's subscription of that name is made or
        resumed, its position kept by the server: any process of the principal resumes
        it after its last acknowledged event, with no cursor file (one consumer at a
        time: a second one raises `SubscriptionBroken`, ``DURABLE_IN_USE``). `start`
        (`StartAt`) is where a new subscription starts: the latest by default, or in the
        bucket's retained history (older than it reaches: `SubscriptionBroken`,
        ``STALE_SEQUENCE``); a resumed one goes on where it was.

        Returns once every bucket's stream is established: a write made afterwards is
        always delivered. Raises `SubscriptionBroken` if that takes longer than the
        `RetryPolicy` deadline (30 s by default)."""
        parsed = parse_query(query)
        layout = self.layout()
        buckets = self._buckets_of(parsed)
        starts = starts_for(start, buckets, layout.bucket_uuids)
        with self._lock:  # the engine and its pipeline together (a close may race)
            engine = self._loop_locked()
            if self._ack_pipeline is None:
                self._ack_pipeline = AckPipeline(engine, self.metadata)
                self._sessions = Sessions(engine, self.metadata)
            acks, sessions = self._ack_pipeline, self._sessions
            assert sessions is not None
        sub = Subscription(
            self.metadata,
            engine,
            acks,
            sessions,
            parsed,
            buckets,
            cursor=cursor,
            name=name,
            options=options,
            ready_timeout_s=self._retry.deadline_s,
            durable=durable,
            starts=starts,
        )
        with self._lock:
            self._subscriptions.add(sub)
        return sub

    def _loop_locked(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(self._endpoints, self._tls)
        return self._engine

    def _pipeline(self) -> WritePipeline[WriteResult]:
        with self._lock:  # the engine and its pipeline together (a close may race)
            if self._writes is None:
                policy = self._retry
                self._writes = WritePipeline(
                    self._loop_locked(),
                    self.metadata,
                    _write_result,
                    deadline_s=policy.deadline_s,
                    call_timeout_s=policy.call_timeout_s,
                    backoff_initial_s=policy.backoff_initial_s,
                    backoff_max_s=policy.backoff_max_s,
                    max_writes=self._write_queue.max_writes,
                    max_bytes=self._write_queue.max_bytes,
                    wait_s=self._write_queue.wait_s,
                )
            return self._writes


def _shut_down(
    engine: Engine,
    writes: WritePipeline[Any] | None,
    subs: Sequence[Subscription],
    failed: bool,
) -> None:
    close_subscriptions(subs, failed=failed)
    if writes is not None and engine.loop.is_running():
        engine.submit(writes.close()).result(10)
    engine.close()


class IdempotentProducer:
    """A producer of its own: writes with another producer id than the client's, each
    sequenced per bucket (docs/core.md, entries WRITE and INIT_PRODUCER), so retries
    never double-commit. Every `Client` write does that already through the client's
    own producer; this is for code that wants a separate identity. Made by
    `Client.producer()`."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._producer = Producer()

    @property
    def producer_id(self) -> int:
        return self._producer.producer_id

    def put(self, key: str, value: bytes, *, expected_version: int | None = None) -> WriteResult:
        op = set_op(key, value, expected_version=expected_version)
        return self._client._submit([op], self._producer).result()


__all__ = ["Client", "IdempotentProducer", "RetryPolicy", "WriteQueue"]
