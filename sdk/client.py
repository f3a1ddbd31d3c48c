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

The work is done by the same core as `AsyncClient` (`sevendb.sdk.async_client`), on
an asyncio loop in a background thread (`sevendb.sdk.engine`): each call here runs
the coroutine there and waits for it. Writes go straight to the thread-safe write
pipeline, so `write_async` keeps many in flight from one thread.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar, overload

from sevendb.outbox.entries import Op
from sevendb.outbox.errors import InvalidArgument
from sevendb.outbox.query import Query
from sevendb.sdk.async_client import (
    AsyncClient,
    RetryPolicy,
    WriteQueue,
    _HistoryPage,
    history_starts,
    write_bucket,
    write_request,
)
from sevendb.sdk.async_client import (
    _op_pb as _op_pb,
)
from sevendb.sdk.cursor_store import CursorStore
from sevendb.sdk.engine import Engine
from sevendb.sdk.groups import SESSION_TIMEOUT_S_DEFAULT, GroupSubscription
from sevendb.sdk.handover import Handover
from sevendb.sdk.models import (
    ClusterLayout,
    NodeStatus,
    RangePage,
    Record,
    WriteResult,
    delete_op,
    set_op,
)
from sevendb.sdk.producer import Producer
from sevendb.sdk.streams import Event
from sevendb.sdk.subscription import (
    StartAt,
    SubscribeOptions,
    Subscription,
    close_subscriptions,
    parse_query,
)
from sevendb.sdk.tls import SYSTEM_ROOTS, TLS
from sevendb.sdk.transactions import AsyncTransaction
from sevendb.sdk.writer import WritePipeline

T = TypeVar("T")


class Client:
    """A connection to a sevendb cluster through any of its nodes' client endpoints.

    `token` authenticates every call (`sevendb token NAME` mints one); a subscription
    belongs to the token's principal. `tls` says which CA to trust and which client
    certificate to present (`TLS`; by default TLS trusting the system's CAs; None:
    plaintext, for a cluster made with --insecure). With a client certificate and no
    token, on a cluster that requires client certificates, the certificate's name is
    the principal. `retry` says how long to retry, `write_queue` how many unanswered
    writes to hold before a write waits (backpressure). Thread-safe. (In a coroutine,
    use `AsyncClient`: a call here blocks the caller's thread.)
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
        self._core = AsyncClient(
            endpoints, token=token, tls=tls, retry=retry, write_queue=write_queue
        )
        self._producer = self._core._producer
        """The client's own idempotent producer: every write carries its sequence."""
        self.metadata = self._core.metadata
        self._lock = threading.Lock()
        self._engine: Engine | None = None

    def close(self) -> None:
        """Close the connections. Writes not answered yet fail with "the client is
        closing" (they may still commit). Open subscriptions are closed first, as by
        their own `close()` (the final acks and unsubscribes of all of them together),
        and their consumers' iterations end."""
        self._close(failed=sys.exc_info()[1] is not None)

    def _close(self, *, failed: bool) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
            _, subs, writes = self._core._take_all()
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

    def _loop(self) -> Engine:
        """The engine (its loop thread started on first use), bound to the core."""
        with self._lock:
            if self._engine is None:
                self._engine = self._core._engine = Engine(self._core._endpoints, self._core._tls)
            return self._engine

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run one of the core's coroutines on the client's loop and wait for it."""
        engine = self._loop()
        if engine.on_loop_thread():
            coro.close()
            raise InvalidArgument(
                "a blocking Client call on the client's own loop (a write's callback) "
                "would wait for itself: call it from another thread"
            )
        return engine.submit(coro).result()

    def _call(self, fn: Any) -> Any:
        """The core's retried call, `fn(stub, timeout)` returning an awaitable."""
        return self._run(self._core._call(fn))

    # ---- cluster ---------------------------------------------------------------------

    def layout(self, *, refresh: bool = False) -> ClusterLayout:
        """The cluster's buckets and nodes (cached; `refresh` asks again)."""
        known = self._core._layout
        if known is not None and not refresh:
            return known
        return self._run(self._core.layout(refresh=refresh))

    def status(self, endpoint: str, *, digests: bool = False) -> NodeStatus:
        """One node's view of its replicas (no retry: it is about that node). With
        `digests` each replica also hashes its state (a snapshot: not for tight loops)."""
        return self._run(self._core.status(endpoint, digests=digests))

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
        request = write_request(ops)
        bucket = write_bucket(ops, self.layout())
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
        op = set_op(key, value, expected_version=expected_version, must_not_exist=must_not_exist)
        return self.write([op])

    def delete(self, key: str, *, expected_version: int | None = None) -> WriteResult:
        """Delete one key (`delete_op` says what the condition means: `expected_version=0`
        is "must not exist")."""
        return self.write([delete_op(key, expected_version=expected_version)])

    def get(self, key: str) -> Record | None:
        """The key's value and version, read at its bucket's leader (None: no such key)."""
        return self._run(self._core.get(key))

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
        return self._run(
            self._core.range(
                prefix=prefix,
                start=start,
                end=end,
                limit=limit,
                page_token=page_token,
                serializable=serializable,
            )
        )

    def sync_bucket(self, bucket: int, *, page_size: int = 0) -> Iterator[Record]:
        """Every key of a bucket, in pages of `page_size` (0: the node's default),
        ordered by the commit that last changed it (docs/wire.md, "Paged sync")."""
        since: tuple[int, str] | None = (0, "")
        while since is not None:
            records, since = self._run(self._core._sync_page(bucket, since, page_size))
            yield from records

    def sync_then_subscribe(
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
        (sdk/handover.py), for a start older than the retained history or an
        application that wants the state first. Subscribes (as `subscribe`), then reads
        the state with paged Syncs; apply the records, then of each event only
        ``handover.fresh(event.emit_seq.commit_index, event.changes)``. With `start`,
        from there if the retained history reaches it (no state), else - on its own -
        the state then the stream (`handover.stale_start`); `AsyncClient.sync_then_subscribe`."""
        return self._run(
            self._core.sync_then_subscribe(
                query, cursor=cursor, name=name, options=options, durable=durable, start=start
            )
        )

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
        for bucket, begin in history_starts(self._run(self._core.layout()), parsed, after):
            page = _HistoryPage(bucket, begin, begin)
            while page.more:
                page = self._run(self._core._history_page(parsed, page, through, page_size))
                yield from page.events

    def transaction(self, transactional_id: str, *, timeout_ms: int = 0) -> Transaction:
        """A transaction of `transactional_id` (`AsyncClient.transaction`): ``with
        client.transaction("orders") as txn: txn.put(...)`` commits at the end of the
        block, aborts if it raises."""
        return Transaction(self, self._core.transaction(transactional_id, timeout_ms=timeout_ms))

    def init_transactions(self, transactional_id: str, *, timeout_ms: int = 0) -> None:
        """`AsyncClient.init_transactions`: register `transactional_id` now, fencing its
        earlier instances."""
        self._run(self._core.init_transactions(transactional_id, timeout_ms=timeout_ms))

    def producer(self, bucket_count: int | None = None) -> IdempotentProducer:
        """A producer of its own (another id, its own sequences): every `Client` write
        is idempotent already, through the client's producer. `bucket_count` is
        ignored (the cluster's layout decides; kept for earlier callers)."""
        return IdempotentProducer(self)

    # ---- subscriptions ----------------------------------------------------------------

    @overload
    def subscribe(
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
    def subscribe(
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

    def subscribe(
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
        `RetryPolicy` deadline (30 s by default). With `group`: a consumer group
        member, as `AsyncClient.subscribe` says (a `GroupSubscription`).

        With `on_event`, the subscription is not iterated: each event is handed to
        `on_event(event)` on the client's background thread, in order per bucket, and
        is processed once it returns (`Subscription.wait_closed` says more). Keep it
        short: every subscription of the client waits while it runs."""
        core: Any = self._core  # one call whatever `group` is (the overloads split it)
        return self._run(
            core.subscribe(
                query,
                cursor=cursor,
                name=name,
                options=options,
                durable=durable,
                start=start,
                group=group,
                session_timeout_s=session_timeout_s,
                on_event=on_event,
            )
        )

    def _pipeline(self) -> WritePipeline[WriteResult]:
        self._loop()
        with self._lock:  # the engine and its pipeline together (a close may race)
            return self._core._pipeline()


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


class Transaction:
    """The blocking face of an `AsyncTransaction` (one implementation: each call runs
    the async one on the client's loop)."""

    def __init__(self, client: Client, core: AsyncTransaction) -> None:
        self._client = client
        self._core = core

    @property
    def transactional_id(self) -> str:
        return self._core.transactional_id

    @property
    def number(self) -> int:
        return self._core.number

    def write(self, ops: Sequence[Op]) -> None:
        self._client._run(self._core.write(ops))

    def put(
        self,
        key: str,
        value: bytes,
        *,
        expected_version: int | None = None,
        must_not_exist: bool = False,
    ) -> None:
        self._client._run(
            self._core.put(
                key, value, expected_version=expected_version, must_not_exist=must_not_exist
            )
        )

    def delete(self, key: str, *, expected_version: int | None = None) -> None:
        self._client._run(self._core.delete(key, expected_version=expected_version))

    def ack(self, event: Event) -> None:
        """`AsyncTransaction.ack`: the event's acknowledgement commits with this
        transaction or not at all."""
        self._client._run(self._core.ack(event))

    def commit(self) -> tuple[int, ...]:
        return self._client._run(self._core.commit())

    def abort(self) -> None:
        self._client._run(self._core.abort())

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._client._run(self._core.__aexit__(exc_type, exc, tb))


__all__ = ["Client", "IdempotentProducer", "RetryPolicy", "Transaction", "WriteQueue"]
