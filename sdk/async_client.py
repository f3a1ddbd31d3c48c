"""The client as coroutines, on the caller's own asyncio loop: `AsyncClient`.

    async with AsyncClient(["127.0.0.1:7001"], token=token) as client:
        await client.put("orders/1", b"paid")
        async with await client.subscribe("prefix:orders/", cursor="orders.cursor") as sub:
            async for event in sub:
                ...

Every operation of `sevendb.sdk.Client` is here a coroutine, with the same
arguments, options (`RetryPolicy`, `WriteQueue`, TLS, token) and errors. The SDK's
machinery (write pipeline, producer, subscription streams, acks; see
`sevendb.sdk.engine`) runs on the loop that first uses the client, over grpc.aio
channels: no thread of its own, no thread hop per call. The only work sent off the
loop is the cursor file's fsync. A `Client` is this same core run on a loop in a
background thread, each call a bridge to it.

An `AsyncClient` belongs to one loop (the one it first ran on); close it
(`await client.close()`, or ``async with``) before that loop ends.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar, overload

import grpc
from grpc import aio

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import ANY, ExpectKind, Op, OpKind, StartKind, Write
from sevendb.outbox.errors import InvalidArgument, SevenDBError
from sevendb.outbox.query import Query, plan_query
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk.acks import AckPipeline
from sevendb.sdk.cursor_store import CursorStore
from sevendb.sdk.engine import (
    ERROR_CODE_KEY,
    LEADER_HINT_KEY,
    RETRY_AFTER_KEY,
    Engine,
    trailer,
)
from sevendb.sdk.errors import (
    BrokenReason,
    ResourceExhausted,
    SubscriptionBroken,
    Unavailable,
    domain_error,
    retry_after_s,
)
from sevendb.sdk.groups import (
    SESSION_TIMEOUT_S_DEFAULT,
    GroupSubscription,
    Ownership,
    check_group,
)
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
    aclose_subscriptions,
    parse_query,
    starts_for,
)
from sevendb.sdk.tls import SYSTEM_ROOTS, TLS
from sevendb.sdk.transactions import AsyncTransaction, TxnSession, init_session
from sevendb.sdk.writer import QUEUE_BYTES_MAX, QUEUE_WAIT_S, QUEUE_WRITES_MAX, WritePipeline

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long and how often to retry UNAVAILABLE (leader changes, restarts) and
    RESOURCE_EXHAUSTED with a retry-after (rate limits). `deadline_s` bounds a call
    or a write, all attempts included; it also bounds how long `subscribe` waits
    for its streams."""

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
    """Backpressure: how many unanswered writes a client holds (queued, in flight,
    or waiting to be retried). A write beyond `max_writes` or `max_bytes` waits
    until earlier ones are answered (a `Client` blocks, an `AsyncClient` awaits),
    for up to `wait_s`, then raises `ResourceExhausted` (nothing is sent). On a
    `Client`'s own loop thread (a write's callback), where waiting would deadlock,
    it raises at once. A single write larger than `max_bytes` is taken when nothing
    else is unanswered."""

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


def write_request(ops: Sequence[Op]) -> pb.WriteRequest:
    """A write's request, checked as the node would (limits, a key twice) before
    anything is sent: `InvalidArgument` / `LimitExceeded` otherwise."""
    if not ops:
        raise InvalidArgument("a write needs at least one op")
    request = pb.WriteRequest(ops=[_op_pb(op) for op in ops])
    Write(tuple(ops))
    return request


def write_bucket(ops: Sequence[Op], layout: ClusterLayout) -> int:
    """The one bucket a write's keys route to (a write is atomic within a bucket)."""
    bucket = layout.bucket_of(ops[0].key)
    if len(ops) > 1:
        buckets = {layout.bucket_of(op.key) for op in ops}
        if len(buckets) > 1:
            raise InvalidArgument(
                f"ops route to buckets {sorted(buckets)}; a write is atomic within one bucket"
            )
    return bucket


def _node_status(response: pb.StatusResponse) -> NodeStatus:
    def replica(r: pb.ReplicaStatus) -> ReplicaStatus:
        values: dict[str, Any] = {f.name: getattr(r, f.name) for f in fields(ReplicaStatus)}
        values["members"] = tuple(r.members)
        values["connected"] = tuple(r.connected)
        return ReplicaStatus(**values)

    return NodeStatus(response.node_id, tuple(replica(r) for r in response.replicas))


def _call_error(exc: aio.AioRpcError) -> SevenDBError | None:
    after = retry_after_s(trailer(exc, RETRY_AFTER_KEY))
    return domain_error(exc.code(), exc.details() or "", trailer(exc, ERROR_CODE_KEY), after)


def _record(item: pb.KeyValue | pb.GetResponse, key: str) -> Record:
    return Record(key, item.value, item.version, item.mod_commit_index)


@dataclass(frozen=True, slots=True)
class _HistoryPage:
    """Where a bucket's history read is: the position the next page is read after,
    the last event's position (the next one's `prev_emit_seq`), and this page."""

    bucket: int
    after: EmitSeq | None
    prev: EmitSeq | None
    events: tuple[Event, ...] = ()
    more: bool = True


class AsyncClient:
    """A connection to a sevendb cluster, as coroutines on the caller's loop (see the
    module docstring). Arguments, options and errors as for `Client`: `token`
    authenticates every call, `tls` says which CA to trust and which client
    certificate to present (None: plaintext), `retry` how long to retry,
    `write_queue` how many unanswered writes to hold before a write waits."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        token: str | None = None,
        tls: TLS | None = SYSTEM_ROOTS,
        retry: RetryPolicy | None = None,
        write_queue: WriteQueue | None = None,
    ) -> None:
        if not endpoints or isinstance(endpoints, str):
            raise InvalidArgument("a client needs at least one endpoint (a list of host:port)")
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
        self._preferred = 0
        self._layout: ClusterLayout | None = None
        self._engine: Engine | None = None
        self._writes: WritePipeline[WriteResult] | None = None
        self._acks: AckPipeline | None = None
        self._sessions: Sessions | None = None
        self._subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()
        self._txn_sessions: dict[str, TxnSession] = {}

    async def close(self) -> None:
        """Close the connections. Writes not answered yet fail with `ClientClosed`
        (they may still commit). Open subscriptions are closed first, as by their own
        `aclose()`, and their consumers' iterations end. The client may be used again
        afterwards (it connects anew)."""
        await self._close(failed=sys.exc_info()[1] is not None)

    async def _close(self, *, failed: bool) -> None:
        engine, subs, writes = self._take_all()
        if engine is None:
            return
        await aclose_subscriptions(subs, failed=failed)
        if writes is not None:
            await writes.close()
        await engine.aclose()

    def _take_all(
        self,
    ) -> tuple[Engine | None, list[Subscription], WritePipeline[WriteResult] | None]:
        """Forget the engine and what runs on it (to be closed by the caller)."""
        subs = list(self._subscriptions)
        self._subscriptions.clear()
        engine, self._engine = self._engine, None
        writes, self._writes = self._writes, None
        self._acks = self._sessions = None
        return engine, subs, writes

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        """`close`; leaving the block by an exception leaves the event each
        subscription's consumer had in hand unprocessed."""
        await self._close(failed=exc is not None)

    def _loop(self) -> Engine:
        """The engine, on the running loop (made on first use); refused on another
        loop (its channels and tasks belong to the first)."""
        engine = self._engine
        if engine is not None and engine.threaded:
            return engine  # a `Client`'s: its calls come from any thread
        loop = asyncio.get_running_loop()
        if engine is None:
            engine = self._engine = Engine(self._endpoints, self._tls, loop)
        elif engine.loop is not loop:
            raise InvalidArgument(
                "an AsyncClient belongs to the event loop it first ran on; make one per "
                "loop (or close it first)"
            )
        return engine

    async def _call(self, fn: Callable[[pb_grpc.SevenDBStub, float], Awaitable[T]]) -> T:
        """`fn(stub, timeout)` retried per the `RetryPolicy`: every attempt ends by
        the deadline."""
        engine = self._loop()
        policy = self._retry
        deadline = time.monotonic() + policy.deadline_s
        backoff = policy.backoff_initial_s
        target = self._endpoints[self._preferred % len(self._endpoints)]
        last: aio.AioRpcError | None = None
        for _attempt in range(policy.attempts_max):
            left = deadline - time.monotonic()
            try:
                return await fn(engine.stub(target), max(0.01, min(policy.call_timeout_s, left)))
            except aio.AioRpcError as exc:
                typed = _call_error(exc)
                if typed is not None:
                    raise typed from None
                last = exc
                hint = trailer(exc, LEADER_HINT_KEY)
                if hint:
                    target = hint
                else:
                    self._preferred += 1
                    target = self._endpoints[self._preferred % len(self._endpoints)]
            after = retry_after_s(trailer(last, RETRY_AFTER_KEY))
            wait = after if after is not None else backoff * (0.5 + random.random())
            if time.monotonic() + wait > deadline:
                break
            await asyncio.sleep(wait)
            backoff = min(backoff * 2, policy.backoff_max_s)
        detail = "no attempt" if last is None else f"{last.code().name}: {last.details()}"
        if last is not None and last.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            after = retry_after_s(trailer(last, RETRY_AFTER_KEY))
            raise ResourceExhausted(f"refused for now by the cluster: {detail}", after)
        raise Unavailable(
            f"cannot reach the cluster at {','.join(self._endpoints)} within "
            f"{policy.deadline_s:g} s: {detail}"
        )

    # ---- cluster ---------------------------------------------------------------------

    async def layout(self, *, refresh: bool = False) -> ClusterLayout:
        """The cluster's buckets and nodes (cached; `refresh` asks again)."""
        if self._layout is None or refresh:
            info: pb.ClusterInfoResponse = await self._call(
                lambda s, t: s.ClusterInfo(pb.ClusterInfoRequest(), timeout=t)
            )
            self._layout = ClusterLayout(
                info.cluster_id,
                tuple(b.bucket_uuid for b in info.buckets),
                tuple(tuple(b.nodes) for b in info.buckets),
                tuple(info.nodes),
            )
        return self._layout

    async def status(self, endpoint: str, *, digests: bool = False) -> NodeStatus:
        """One node's view of its replicas (no retry: it is about that node). With
        `digests` each replica also hashes its state (a snapshot: not for tight loops)."""
        try:
            response: pb.StatusResponse = (
                await self._loop()
                .stub(endpoint)
                .Status(pb.StatusRequest(with_digests=digests), timeout=self._retry.call_timeout_s)
            )
        except aio.AioRpcError as exc:
            raise _call_error(exc) or Unavailable(f"{endpoint}: {exc.details()}") from None
        return _node_status(response)

    # ---- writes and reads --------------------------------------------------------------

    async def write(self, ops: Sequence[Op]) -> WriteResult:
        """Apply `ops` atomically (all keys in one bucket); returns once committed.
        Idempotent: retried after a lost answer, it never applies twice
        (`WriteResult.duplicate` then says it was a retry of a committed write).
        Concurrent writes (``asyncio.gather``, tasks) share requests; with the
        `WriteQueue` full a write awaits room."""
        return await self._write(ops, self._producer)

    async def _write(self, ops: Sequence[Op], producer: Producer) -> WriteResult:
        request = write_request(ops)
        bucket = write_bucket(ops, await self.layout())
        return await self._pipeline().submit_async(request, bucket, producer)

    async def put(
        self,
        key: str,
        value: bytes,
        *,
        expected_version: int | None = None,
        must_not_exist: bool = False,
    ) -> WriteResult:
        """Set one key (`set_op` says what the conditions mean)."""
        op = set_op(key, value, expected_version=expected_version, must_not_exist=must_not_exist)
        return await self.write([op])

    async def delete(self, key: str, *, expected_version: int | None = None) -> WriteResult:
        """Delete one key (`delete_op` says what the condition means)."""
        return await self.write([delete_op(key, expected_version=expected_version)])

    async def get(self, key: str) -> Record | None:
        """The key's value and version, read at its bucket's leader (None: no such key)."""
        response: pb.GetResponse = await self._call(
            lambda s, t: s.Get(pb.GetRequest(key=key), timeout=t, metadata=self.metadata)
        )
        return _record(response, key) if response.found else None

    async def sync_bucket(self, bucket: int, *, page_size: int = 0) -> AsyncIterator[Record]:
        """Every key of a bucket, in pages of `page_size` (0: the node's default),
        ordered by the commit that last changed it (docs/wire.md, "Paged sync")."""
        since: tuple[int, str] | None = (0, "")
        while since is not None:
            records, since = await self._sync_page(bucket, since, page_size)
            for record in records:
                yield record

    async def _sync_page(
        self, bucket: int, since: tuple[int, str], page_size: int
    ) -> tuple[list[Record], tuple[int, str] | None]:
        """One page of `sync_bucket`, and where the next starts (None: the last)."""
        request = pb.SyncRequest(
            bucket=bucket, since_commit_index=since[0], since_key=since[1], limit=page_size
        )
        page: pb.SyncResponse = await self._call(
            lambda s, t: s.Sync(request, timeout=t, metadata=self.metadata)
        )
        records = [_record(item, item.key) for item in page.items]
        if not page.has_more:
            return records, None
        return records, (page.next_since_commit_index, page.next_since_key)

    async def range(
        self,
        *,
        prefix: str = "",
        start: str = "",
        end: str = "",
        limit: int = 0,
        page_token: str = "",
        serializable: bool = False,
    ) -> RangePage:
        """`Client.range` as a coroutine."""
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
        response: pb.RangeResponse = await self._call(
            lambda s, t: s.Range(request, timeout=t, metadata=self.metadata)
        )
        records = tuple(_record(i, i.key) for i in response.items)
        return RangePage(records, response.next_page_token)

    async def history(
        self,
        query: str | Query,
        *,
        after: StartAt = "earliest",
        through: int = 0,
        page_size: int = 0,
    ) -> AsyncIterator[Event]:
        """`Client.history` as an async iterator."""
        parsed = parse_query(query)
        for bucket, begin in history_starts(await self.layout(), parsed, after):
            page = _HistoryPage(bucket, begin, begin)
            while page.more:
                page = await self._history_page(parsed, page, through, page_size)
                for event in page.events:
                    yield event

    async def _history_page(
        self, query: Query, last: _HistoryPage, through: int, page_size: int
    ) -> _HistoryPage:
        """The page of a bucket's history after `last`."""
        request = pb.HistoryRequest(
            bucket=last.bucket,
            query=codec.query_to_pb(query),
            after=None if last.after is None else codec.seq_to_pb(last.after),
            through_commit_index=through,
            limit=page_size,
        )
        page: pb.HistoryResponse = await self._call(
            lambda s, t: s.History(request, timeout=t, metadata=self.metadata)
        )
        prev = last.prev if last.prev is not None else codec.seq_from_pb(page.retained_after)
        events = []
        for item in page.events:
            at = codec.seq_from_pb(item.emit_seq)
            changes = codec.changes_from_pb(item.delta.changes)
            events.append(Event(last.bucket, "", at, prev, changes, item.delta.commit_time_ms))
            prev = at
        after = codec.seq_from_pb(page.next_after) if page.more else last.after
        return _HistoryPage(last.bucket, after, prev, tuple(events), page.more)

    def transaction(self, transactional_id: str, *, timeout_ms: int = 0) -> AsyncTransaction:
        """A transaction of `transactional_id` (docs/transactions.md): ``async with
        client.transaction("orders") as txn: await txn.put(...)`` writes any keys of
        any buckets, visible together at the commit or never. The first transaction
        of an id through this client fences the id's earlier instances. `timeout_ms`
        (0: 60 s) aborts a transaction left open longer."""
        return AsyncTransaction(self, transactional_id, timeout_ms)

    async def init_transactions(self, transactional_id: str, *, timeout_ms: int = 0) -> None:
        """Register `transactional_id` now, fencing its earlier instances (their open
        transaction is aborted), as its first transaction would (Kafka's
        `initTransactions`). A consume-transform-produce process calls it before it
        resumes its durable subscription: an open transaction of a killed predecessor
        holding an ack of the subscription would otherwise hold the resume until its
        timeout (docs/transactions.md)."""
        await self._txn_session(transactional_id, timeout_ms)

    async def _txn_session(self, transactional_id: str, timeout_ms: int = 0) -> TxnSession:
        """This client's registration of `transactional_id` (made on first use)."""
        session = self._txn_sessions.get(transactional_id)
        if session is None:
            session = await init_session(self, transactional_id, timeout_ms)
            self._txn_sessions[transactional_id] = session
        return session

    def producer(self) -> AsyncIdempotentProducer:
        """A producer of its own (another id, its own sequences): every write is
        idempotent already, through the client's producer."""
        return AsyncIdempotentProducer(self)

    # ---- subscriptions ----------------------------------------------------------------

    @overload
    async def subscribe(
        self,
        query: str | Query,
        *,
        cursor: CursorStore | str | Path | None = None,
        name: str | None = None,
        options: SubscribeOptions | None = None,
        durable: str | None = None,
        start: StartAt = None,
        group: None = None,
        session_timeout_s: float = SESSION_TIMEOUT_S_DEFAULT,
        on_event: Callable[[Event], object] | None = None,
    ) -> Subscription: ...

    @overload
    async def subscribe(
        self,
        query: str | Query,
        *,
        cursor: None = None,
        name: None = None,
        options: SubscribeOptions | None = None,
        durable: None = None,
        start: None = None,
        group: str,
        session_timeout_s: float = SESSION_TIMEOUT_S_DEFAULT,
        on_event: None = None,
    ) -> GroupSubscription: ...

    async def subscribe(
        self,
        query: str | Query,
        *,
        cursor: CursorStore | str | Path | None = None,
        name: str | None = None,
        options: SubscribeOptions | None = None,
        durable: str | None = None,
        start: StartAt = None,
        group: str | None = None,
        session_timeout_s: float = SESSION_TIMEOUT_S_DEFAULT,
        on_event: Callable[[Event], object] | None = None,
    ) -> Subscription | GroupSubscription:
        """Subscribe to `query` (``key:K``, ``prefix:P``, ``all`` or a `Query`) in every
        bucket it spans; read it with ``async for`` (and end it with ``async with``,
        `Subscription.aclose`). With `cursor` (a file or a `CursorStore`), a restarted
        process resumes after the last event it processed; `name` tells apart several
        subscriptions sharing one cursor file (default: the durable name, else the
        query). `durable` and `start` as for `Client.subscribe`.

        Returns once every bucket's stream is established: a write made afterwards is
        always delivered. Raises `SubscriptionBroken` if that takes longer than the
        `RetryPolicy` deadline (30 s by default).

        With `group`, this process joins the principal's consumer group of that name
        (sdk/groups.py): the query's buckets are dealt over the group's live members,
        and a `GroupSubscription` delivers those of this member's (no cursor, durable
        or start: the group's position is the server's). A member that has not beaten
        for `session_timeout_s` loses its buckets to the others.

        With `on_event`, the subscription is not iterated: each event is handed to
        `on_event(event)` on this client's loop, in order per bucket, and is
        processed once it returns (`Subscription.wait_closed` says more)."""
        parsed = parse_query(query)
        if group is not None:
            check_group(group, session_timeout_s)
            if cursor is not None or name is not None or durable is not None or start:
                raise InvalidArgument(
                    "a group subscription takes no cursor, name, durable or start"
                )
            if on_event is not None:
                raise InvalidArgument("a group subscription is iterated: it takes no on_event")
        layout = await self.layout()
        buckets = layout.buckets_of(parsed)
        if group is not None:
            member = GroupSubscription(
                self,
                self._loop(),
                parsed,
                buckets,
                group,
                options=options,
                session_timeout_s=session_timeout_s,
            )
            await member._start()
            return member
        starts = starts_for(start, buckets, layout.bucket_uuids)
        engine = self._loop()
        if self._acks is None or self._sessions is None:
            self._acks = AckPipeline(engine, self.metadata)
            self._sessions = Sessions(engine, self.metadata)
        sub = Subscription(
            self.metadata,
            engine,
            self._acks,
            self._sessions,
            parsed,
            buckets,
            cursor=cursor,
            name=name,
            options=options,
            durable=durable,
            starts=starts,
            on_event=on_event,
        )
        await sub._start(self._retry.deadline_s)
        self._subscriptions.add(sub)
        return sub

    async def _group_beat(
        self, query: Query, bucket: int, group: str, member: str, timeout_ms: int, leaving: bool
    ) -> Ownership:
        request = pb.GroupBeatRequest(
            bucket=bucket,
            group=group,
            member=member,
            session_timeout_ms=timeout_ms,
            leaving=leaving,
            query=codec.query_to_pb(query),
        )
        answer: pb.GroupBeatResponse = await self._call(
            lambda s, t: s.GroupBeat(request, timeout=t, metadata=self.metadata)
        )
        return Ownership(answer.owner, answer.generation, tuple(answer.members))

    async def _subscribe_owned(
        self,
        query: Query,
        bucket: int,
        group: str,
        fence: tuple[str, int],
        options: SubscribeOptions,
    ) -> Subscription:
        """The group's durable subscription of one bucket, for the member that owns
        it in this generation (sdk/groups.py)."""
        engine = self._loop()
        if self._acks is None or self._sessions is None:
            self._acks = AckPipeline(engine, self.metadata)
            self._sessions = Sessions(engine, self.metadata)
        sub = Subscription(
            self.metadata,
            engine,
            self._acks,
            self._sessions,
            query,
            [bucket],
            options=options,
            durable=group,
            fence=fence,
        )
        await sub._start(self._retry.deadline_s)
        self._subscriptions.add(sub)
        return sub

    async def sync_then_subscribe(
        self,
        query: str | Query,
        *,
        cursor: CursorStore | str | Path | None = None,
        name: str | None = None,
        options: SubscribeOptions | None = None,
        durable: str | None = None,
        start: StartAt = None,
    ) -> tuple[dict[str, Record], Subscription, Handover]:
        """The keys `query` matches as they are now, then their changes: a
        snapshot-then-stream handover with no gap and no duplicate between the two
        (sdk/handover.py). Subscribes (as `subscribe`), then reads the state with paged
        Syncs; apply the records, then of each event only
        ``handover.fresh(event.emit_seq.commit_index, event.changes)``.

        With `start`, the subscription starts there if every bucket's retained
        history reaches it (the state is then empty: the history comes as events);
        if one does not (`STALE_SEQUENCE`), it falls back on its own to the state,
        then the stream from the latest (`handover.stale_start` says so)."""
        parsed = parse_query(query)
        kw: dict[str, Any] = {"cursor": cursor, "name": name, "options": options}
        if start is not None and start != "latest":
            try:
                sub = await self.subscribe(parsed, durable=durable, start=start, **kw)
                return {}, sub, Handover(())
            except SubscriptionBroken as exc:
                if exc.reason is not BrokenReason.STALE_SEQUENCE:
                    raise
        sub = await self.subscribe(parsed, durable=durable, **kw)
        plan = plan_query(parsed)
        read: dict[str, Record] = {}
        for bucket in (await self.layout()).buckets_of(parsed):
            async for record in self.sync_bucket(bucket):
                if plan.matches(record.key):
                    read[record.key] = record
        synced = ((k, r.mod_commit_index) for k, r in read.items())
        return read, sub, Handover(synced, stale_start=start is not None and start != "latest")

    def _pipeline(self) -> WritePipeline[WriteResult]:
        if self._writes is None:
            policy = self._retry
            self._writes = WritePipeline(
                self._loop(),
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


class AsyncIdempotentProducer:
    """`IdempotentProducer` for an `AsyncClient`: writes with a producer id of its
    own. Made by `AsyncClient.producer()`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._producer = Producer()

    @property
    def producer_id(self) -> int:
        return self._producer.producer_id

    async def put(
        self, key: str, value: bytes, *, expected_version: int | None = None
    ) -> WriteResult:
        op = set_op(key, value, expected_version=expected_version)
        return await self._client._write([op], self._producer)


def history_starts(
    layout: ClusterLayout, query: Query, after: StartAt
) -> list[tuple[int, EmitSeq | None]]:
    """Each bucket `query` spans, with the position its history is read after."""
    buckets = layout.buckets_of(query)
    starts = starts_for(after, buckets, layout.bucket_uuids)
    found = []
    for bucket in buckets:
        begin = starts[bucket]
        if begin.kind not in (StartKind.EARLIEST, StartKind.AFTER):
            raise InvalidArgument("history reads after 'earliest' or an emit_seq")
        found.append((bucket, begin.after))
    return found


__all__ = [
    "AsyncClient",
    "AsyncIdempotentProducer",
    "RetryPolicy",
    "WriteQueue",
    "write_bucket",
    "write_request",
]
