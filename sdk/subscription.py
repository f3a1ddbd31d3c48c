"""Subscriptions: a query's committed changes, delivered effective-once.

    with Client(endpoints, token=token) as client:
        for event in client.subscribe("prefix:orders/", cursor="orders.cursor"):
            handle(event)                       # then ask for the next one

An event counts as processed when the application asks for the next one (or
closes the subscription). Processed positions are persisted to the cursor store
(fsync + atomic rename) and only then acknowledged, in batches; a restarted
process with the same cursor file resumes right after the last persisted event.
A crash between handling an event and that persist repeats at most the unpersisted
events (``ack_every_events``) - make handling idempotent by ``emit_seq`` or persist
your own state together with the cursor if that matters.

A query that spans buckets (a prefix, all) is one server subscription per bucket;
their events are merged as they arrive, ordered within each bucket (like Kafka
partitions). Each bucket's stream follows its notifier lease holder: on a redirect,
a closed stream, a gap in the ``prev_emit_seq`` chain or a dead node it reconnects
after the last flushed position, and `StreamCursor` drops what was seen already.

The streams run on one background asyncio loop per `Client` (grpc.aio), so a
process can hold thousands of them; the application iterates synchronously
(``for``) or asynchronously (``async for``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Final, NamedTuple, TypeAlias

import grpc
from grpc import aio

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import op_kind
from sevendb.outbox.errors import InvalidArgument
from sevendb.outbox.model import Change
from sevendb.outbox.query import Query
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto.mailbox import Mailbox, mailbox
from sevendb.sdk.acks import AckPipeline
from sevendb.sdk.cursor import StreamCursor
from sevendb.sdk.cursor_store import CursorStore
from sevendb.sdk.engine import ERROR_CODE_KEY, Engine, leader_hint, trailer
from sevendb.sdk.errors import BrokenReason, SubscriptionBroken, Unavailable, domain_error
from sevendb.sdk.flusher import Flusher
from sevendb.sdk.progress import Progress
from sevendb.sdk.sessions import Sessions, SessionStream

log = logging.getLogger(__name__)

CLOSE_ACK_WAIT_S: Final = 3.0
"""How long `Subscription.close` waits, by default, for its final acks to be applied."""

_FATAL: Final = {
    code: BrokenReason(code.name)
    for code in (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
    )
}
"""gRPC statuses that end a bucket stream for good, and the reason reported."""


# ---- public types ----------------------------------------------------------------------


class Event(NamedTuple):
    """One committed change set of one bucket, delivered once and in order per bucket.

    Immutable; a named tuple because one is built per delivered event (half the cost
    of a frozen dataclass)."""

    bucket: int
    sub_id: str
    emit_seq: EmitSeq
    prev_emit_seq: EmitSeq
    changes: tuple[Change, ...]
    commit_time_ms: int


class StreamResetReason(StrEnum):
    STALE_SEQUENCE = "STALE_SEQUENCE"
    """The server no longer holds the stream's history (dropped for stalling, or
    older than what was purged)."""
    INVALID_SEQUENCE = "INVALID_SEQUENCE"
    """The saved position is not on the server's stream (e.g. ahead of it)."""
    SUBSCRIPTION_NOT_FOUND = "SUBSCRIPTION_NOT_FOUND"
    """The server has no such subscription (ended, or never made)."""


@dataclass(frozen=True, slots=True)
class StreamReset:
    """A bucket's stream could not be resumed and starts afresh (a new subscription
    from the current end of the log): events in between were missed. Resynchronise
    that bucket's state (`Client.sync_bucket`) if the application needs it."""

    bucket: int
    old_sub_id: str
    reason: StreamResetReason


class Recovery(StrEnum):
    """What a subscription does when a bucket's stream cannot resume (`StreamResetReason`)."""

    RESUBSCRIBE = "resubscribe"
    """Subscribe afresh from the current end of the log, and report the `StreamReset`
    to `SubscribeOptions.on_reset` (the events in between are missed)."""
    RAISE = "raise"
    """Stop: the application's next read raises `SubscriptionBroken`."""


@dataclass(frozen=True, slots=True)
class SubscribeOptions:
    """How a subscription persists, acknowledges and recovers. A policy may also be
    given as its string value (``"raise"``); anything else is `InvalidArgument`."""

    on_stale: Recovery = Recovery.RESUBSCRIBE
    """STALE_SEQUENCE / SUBSCRIPTION_NOT_FOUND: the server no longer has the stream."""
    on_invalid: Recovery = Recovery.RAISE
    """INVALID_SEQUENCE: the saved position is not on the server's stream."""
    on_reset: Callable[[StreamReset], None] | None = None
    ack_every_events: int = 256
    """Persist and ack after this many processed events ..."""
    ack_interval_s: float = 0.02
    """... or this long after the first unflushed one (up to a quarter of it sooner),
    whichever comes first."""
    ack_resend_s: float = 1.0
    reorder_buffer_max: int = 1024
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("on_stale", "on_invalid"):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, Recovery(value))
            except ValueError:
                choices = " or ".join(repr(r.value) for r in Recovery)
                raise InvalidArgument(f"{name} must be {choices}, not {value!r}") from None
        if self.ack_every_events < 1 or self.ack_interval_s <= 0 or self.ack_resend_s <= 0:
            raise InvalidArgument("ack_every_events >= 1, ack_interval_s > 0, ack_resend_s > 0")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise InvalidArgument("0 < backoff_initial_s <= backoff_max_s")
        if self.reorder_buffer_max < 1:
            raise InvalidArgument("reorder_buffer_max >= 1")


@dataclass(frozen=True, slots=True)
class SubscriptionStats:
    """Counters of a subscription, over all its bucket streams."""

    buckets: int
    duplicates_dropped: int
    """Events delivered again by a node and dropped here (never seen twice)."""
    reconnects: int
    cursor_writes: int
    """Saves to the cursor store (0 without one)."""


def parse_query(query: str | Query) -> Query:
    """``key:K``, ``prefix:P``, ``all`` or a `Query`."""
    if isinstance(query, Query):
        return query
    try:
        return Query.parse(query)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


class _Inbox:
    """Batches of events from the loop to the application, sync or async."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: collections.deque[list[Event] | BaseException] = collections.deque()
        self._waiter: tuple[Mailbox, asyncio.Future[None]] | None = None

    def put(self, item: list[Event] | BaseException) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            box, future = waiter
            box.post(_wake, future)

    def peek_error(self) -> BaseException | None:
        with self._cond:
            return next((i for i in self._items if isinstance(i, BaseException)), None)

    def get(self, timeout_s: float | None) -> list[Event] | BaseException | None:
        with self._cond:
            if not self._items and (timeout_s is None or timeout_s > 0):
                self._cond.wait(timeout_s)
            return self._items.popleft() if self._items else None

    async def aget(self) -> list[Event] | BaseException:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                future: asyncio.Future[None] = loop.create_future()
                self._waiter = (mailbox(loop), future)
            try:
                await future
            finally:
                with self._cond:
                    if self._waiter is not None and self._waiter[1] is future:
                        self._waiter = None


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# ---- one bucket's stream -------------------------------------------------------------


class _Redirect(Exception):
    def __init__(self, address: str | None) -> None:
        self.address = address


@dataclass(slots=True)
class _BucketStream:
    bucket: int
    sub_id: str | None
    subscribed: bool
    cursor: StreamCursor[Event] | None = None
    target: str | None = None
    task: asyncio.Task[None] | None = None
    duplicates: int = 0
    reconnects: int = 0
    caught_up: bool = False
    ready: threading.Event = field(default_factory=threading.Event)
    """Set once the stream is subscribed (SubAck) or resumed (ReconnectAck OK)."""
    history: list[str] = field(default_factory=list)


def _event(bucket: int, ev: pb.DataEvent) -> Event:
    # The hot path of a subscriber: each nested message read costs a wrapper object,
    # so every one is read once.
    at = ev.emit_seq
    epoch = at.epoch_id
    prev = ev.prev_emit_seq
    prev_epoch = prev.epoch_id
    delta = ev.delta
    changes = delta.changes
    if len(changes) == 1:
        c = changes[0]
        decoded: tuple[Change, ...] = (Change(c.key, op_kind(c.op), c.value, c.version),)
    else:
        decoded = tuple(Change(c.key, op_kind(c.op), c.value, c.version) for c in changes)
    return Event(
        bucket,
        ev.sub_id,
        EmitSeq(epoch.bucket_uuid, epoch.epoch_counter, at.commit_index),
        EmitSeq(prev_epoch.bucket_uuid, prev_epoch.epoch_counter, prev.commit_index),
        decoded,
        delta.commit_time_ms,
    )


def offer_events(
    cursor: StreamCursor[Event], bucket: int, events: Sequence[pb.DataEvent]
) -> tuple[list[Event], int, bool]:
    """Offer one message's events to a stream's cursor: (events ready for the
    application, duplicates dropped, gap). The events released before a gap are
    ready too: the cursor has moved past them, so a resent copy is a duplicate."""
    ready: list[Event] = []
    duplicates = 0
    for ev in events:
        offered = cursor.offer(_event(bucket, ev))
        if offered.duplicate:
            duplicates += 1
        elif offered.gap:
            return ready, duplicates, True
        ready.extend(offered.ready)
    return ready, duplicates, False


# ---- the subscription --------------------------------------------------------------------

FinalAck: TypeAlias = tuple[str, str, EmitSeq, Callable[[EmitSeq], None]]
"""(node address, sub_id, position, confirmed) of a closing subscription's final ack."""


class Subscription:
    """A query subscribed in every bucket it spans; iterate it (sync or async).

    Made by `Client.subscribe`. `close()` (or leaving a ``with`` block) persists and
    acknowledges what was processed; `unsubscribe()` also ends the server side.
    """

    def __init__(
        self,
        metadata: tuple[tuple[str, str], ...],
        engine: Engine,
        acks: AckPipeline,
        sessions: Sessions,
        query: Query,
        buckets: Sequence[int],
        *,
        cursor: CursorStore | str | Path | None = None,
        name: str | None = None,
        options: SubscribeOptions | None = None,
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.query = query
        self.name = name or str(query)
        self.options = opts = options or SubscribeOptions()
        self._engine = engine
        self._acks = acks
        self._sessions = sessions
        self._metadata = metadata
        store = cursor if cursor is None or isinstance(cursor, CursorStore) else CursorStore(cursor)
        self._inbox = _Inbox()
        self._flusher = Flusher(
            engine,
            acks,
            store,
            self.name,
            Progress(
                every_events=opts.ack_every_events,
                interval_s=opts.ack_interval_s,
                resend_after_s=opts.ack_resend_s,
            ),
            interval_s=opts.ack_interval_s,
            target_of=self._target_of,
            failed=self._inbox.put,
        )
        self._closed = False
        self._batch: collections.deque[Event] = collections.deque()
        self._last: Event | None = None
        saved = {c.bucket: c for c in (store.named(self.name) if store else [])}
        self._streams: dict[int, _BucketStream] = {}
        for bucket in buckets:
            c = saved.get(bucket)
            stream = _BucketStream(
                bucket, c.sub_id if c else None, c is not None and c.position is not None
            )
            if c is not None and c.position is not None:
                stream.cursor = StreamCursor(c.position, reorder_buffer_max=opts.reorder_buffer_max)
                self._flusher.start(bucket, c.sub_id, c.position)
            self._streams[bucket] = stream
        started: Future[None] = engine.submit(self._start())
        started.result(10)
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        """Block until every bucket's stream is established, so that a write made after
        `Client.subscribe` returns is always delivered."""
        deadline = time.monotonic() + timeout_s
        for stream in self._streams.values():
            while not stream.ready.wait(0.05):
                failure = self._inbox.peek_error()
                if failure is not None or time.monotonic() > deadline:
                    self.close(flush=False)
                    raise failure or SubscriptionBroken(
                        f"bucket {stream.bucket}: no stream within {timeout_s:.0f} s "
                        f"(last: {stream.history[-1] if stream.history else 'no answer'})",
                        BrokenReason.UNAVAILABLE,
                    )

    def _target_of(self, bucket: int) -> str:
        """The node a bucket's acks go to: its stream's."""
        return self._streams[bucket].target or self._engine.any_endpoint()

    # ---- the application side ----------------------------------------------------------

    @property
    def sub_ids(self) -> dict[int, str]:
        """The server subscription id of each bucket's stream (once subscribed)."""
        return {b: s.sub_id for b, s in self._streams.items() if s.sub_id and s.subscribed}

    def stats(self) -> SubscriptionStats:
        streams = self._streams.values()
        store = self._flusher.store
        return SubscriptionStats(
            buckets=len(self._streams),
            duplicates_dropped=sum(s.duplicates for s in streams),
            reconnects=sum(s.reconnects for s in streams),
            cursor_writes=store.writes if store else 0,
        )

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        self._mark_processed()
        if self._flusher.due():
            self._flusher.flush()
        while not self._batch:
            if self._closed:
                raise StopIteration
            self._take(self._inbox.get(None))
        self._last = self._batch.popleft()
        return self._last

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        self._mark_processed()
        if self._flusher.due():
            if self._flusher.store is None:
                self._flusher.flush()  # nothing blocks: no thread hop
            else:
                await asyncio.to_thread(self._flusher.flush)  # fsync
        while not self._batch:
            if self._closed:
                raise StopAsyncIteration
            self._take(await self._inbox.aget())
        self._last = self._batch.popleft()
        return self._last

    def poll(self, timeout_s: float = 0.0) -> Event | None:
        """The next event if one arrives within `timeout_s`, else None."""
        self._mark_processed()
        if self._flusher.due():
            self._flusher.flush()
        deadline = time.monotonic() + timeout_s
        while not self._batch:
            if self._closed:
                return None
            left = deadline - time.monotonic()
            self._take(self._inbox.get(max(left, 0.0)))
            if left <= 0 and not self._batch:
                return None
        self._last = self._batch.popleft()
        return self._last

    def _take(self, item: list[Event] | BaseException | None) -> None:
        if isinstance(item, BaseException):
            self.close(flush=True)
            raise item
        if item:
            self._batch.extend(item)

    def _mark_processed(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            self._flusher.processed(last.bucket, last.sub_id, last.emit_seq)

    def close(self, *, flush: bool = True, ack_timeout_s: float = CLOSE_ACK_WAIT_S) -> None:
        """Stop the streams; persist and acknowledge what was processed (idempotent).

        The final acks are confirmed only once the node has applied a purge covering
        them, following the lease holder if it moves, for up to `ack_timeout_s`: after
        `close` returns the rows are gone from the outbox (and on their way to the
        archive). An ack still unconfirmed then is logged; its rows stay until a later
        reconnect of the subscription (which acks its position) or the stall window."""
        close_subscriptions([self], flush=flush, ack_timeout_s=ack_timeout_s)

    def _close_here(self, flush: bool) -> list[FinalAck]:
        """The caller's half of `close`: stop taking events, wake the consumer, persist
        the final flush. Returns its acks to send (none if already closed)."""
        if self._closed:
            return []
        self._mark_processed()
        self._closed = True
        self._inbox.put([])  # wakes a consumer blocked waiting for events
        final = self._flusher.close(final=flush)
        return [
            (
                self._target_of(bucket),
                sub_id,
                pos,
                functools.partial(self._flusher.confirmed, bucket, sub_id),
            )
            for bucket, sub_id, pos in final.positions
        ]

    def unsubscribe(self) -> None:
        """End the subscription on the server (every bucket) and forget its cursors."""
        self.close(flush=False)
        ids = self.sub_ids
        try:
            self._engine.submit(self._unsubscribe(ids)).result(30)
        except aio.AioRpcError as exc:
            detail = exc.details() or ""
            error = domain_error(exc.code(), detail, trailer(exc, ERROR_CODE_KEY))
            raise error or Unavailable(f"unsubscribe: {exc.code().name}: {detail}") from None
        if self._flusher.store is not None:
            self._flusher.store.forget(list(ids.values()))

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the loop side --------------------------------------------------------------------

    async def _start(self) -> None:
        for stream in self._streams.values():
            stream.task = asyncio.get_running_loop().create_task(self._run_stream(stream))

    async def _stop(self) -> None:
        self._flusher.stop()
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _unsubscribe(self, ids: dict[int, str]) -> None:
        await asyncio.gather(
            *(
                self._engine.stub(self._engine.any_endpoint()).Unsubscribe(
                    pb.UnsubscribeRequest(sub_id=sub_id, bucket=bucket),
                    metadata=self._metadata,
                    timeout=10,
                )
                for bucket, sub_id in ids.items()
            )
        )

    def _hand_over(self, ready: list[Event]) -> None:
        self._inbox.put(ready)
        self._flusher.handed(len(ready))

    async def _run_stream(self, stream: _BucketStream) -> None:
        opts = self.options
        backoff = opts.backoff_initial_s
        while not self._closed:
            try:
                await self._stream_once(stream)
                backoff = opts.backoff_initial_s
            except _Redirect as redirect:
                stream.target = redirect.address
                if redirect.address is None:
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, opts.backoff_max_s)
            except aio.AioRpcError as exc:
                fatal = _FATAL.get(exc.code())
                if fatal is not None:
                    self._inbox.put(
                        SubscriptionBroken(
                            f"bucket {stream.bucket}: {exc.code().name}: {exc.details()}", fatal
                        )
                    )
                    return
                hint = leader_hint(exc)
                stream.target = hint
                stream.reconnects += 1
                if hint is None:
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, opts.backoff_max_s)
            except SubscriptionBroken as exc:
                self._inbox.put(exc)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug: surface it, never spin silently
                log.exception("bucket %d stream failed", stream.bucket)
                self._inbox.put(
                    SubscriptionBroken(f"bucket {stream.bucket}: {exc!r}", BrokenReason.INTERNAL)
                )
                return

    async def _stream_once(self, stream: _BucketStream) -> None:
        target = stream.target or self._engine.any_endpoint()
        stream.target = target
        call = (
            await self._reconnect(stream, target)
            if stream.subscribed
            else await self._subscribe(stream, target)
        )
        if call is None:
            return
        try:
            # Every message now goes to `_on_message` as it arrives; what read()
            # returns is the stream's end (raised if it failed).
            call.push_to(functools.partial(self._on_message, stream))
            await call.read()
        finally:
            # However this ends (a gap, an error, a cancel), the node stops sending:
            # a session stream, unlike a dropped call, is not cancelled by the collector.
            call.cancel()
        stream.reconnects += 1  # the stream ended (or had a gap): resume

    def _on_message(self, stream: _BucketStream, message: pb.StreamMessage) -> bool:
        """On the loop: hand an open stream's events to the application. False on a
        gap: reconnect after the flushed position."""
        kind = message.WhichOneof("kind")
        if kind == "events":
            assert stream.cursor is not None
            ready, duplicates, gap = offer_events(
                stream.cursor, stream.bucket, message.events.events
            )
            stream.duplicates += duplicates
            if ready:
                self._hand_over(ready)
            return not gap
        if kind == "caught_up":
            stream.caught_up = True
        return True

    async def _subscribe(self, stream: _BucketStream, target: str) -> SessionStream:
        if stream.sub_id is None:
            stream.sub_id = uuid.uuid4().hex
            if self._flusher.store is not None:
                # Known before the server hears of it: a crash now resubscribes with
                # the same id (idempotent) instead of leaving an orphan behind.
                await asyncio.to_thread(self._flusher.save, stream.bucket, stream.sub_id, None)
        request = pb.SubscribeRequest(
            bucket=stream.bucket,
            query=codec.query_to_pb(self.query),
            sub_id=stream.sub_id,
        )
        call = self._sessions.subscribe(target, request)
        try:
            return await self._subscribed(stream, call)
        except BaseException:
            call.cancel()
            raise

    async def _subscribed(self, stream: _BucketStream, call: SessionStream) -> SessionStream:
        """A Subscribe once its stream is open: the SubAck, then the start persisted."""
        assert stream.sub_id is not None
        first = await call.read()
        if first is aio.EOF or first.WhichOneof("kind") != "sub_ack":
            raise _Redirect(None)
        start = codec.seq_from_pb(first.sub_ack.start_emit_seq)
        stream.cursor = StreamCursor(start, reorder_buffer_max=self.options.reorder_buffer_max)
        self._flusher.start(stream.bucket, stream.sub_id, start)
        if self._flusher.store is not None:
            await asyncio.to_thread(self._flusher.save, stream.bucket, stream.sub_id, start)
        stream.subscribed = True
        stream.history.append(f"subscribed {stream.sub_id} at {start}")
        stream.ready.set()
        return call

    async def _reconnect(self, stream: _BucketStream, target: str) -> SessionStream | None:
        assert stream.sub_id is not None and stream.cursor is not None
        after = self._flusher.flushed(stream.bucket)
        assert after is not None
        request = codec.reconnect_request(stream.sub_id, stream.bucket, after)
        call = self._sessions.reconnect(target, request)
        first = await call.read()  # closes the stream itself if cancelled
        if first is aio.EOF or first.WhichOneof("kind") != "reconnect_ack":
            call.cancel()
            raise _Redirect(None)
        status = first.reconnect_ack.status
        if status == pb.ReconnectAck.OK:
            stream.cursor.resumed(stream.cursor.released)  # keep what was released
            stream.history.append(f"resumed {stream.sub_id} after {after}")
            stream.ready.set()
            return call
        call.cancel()
        reason = StreamResetReason(pb.ReconnectAck.Status.Name(status))
        policy = (
            self.options.on_invalid
            if reason is StreamResetReason.INVALID_SEQUENCE
            else self.options.on_stale
        )
        if policy is Recovery.RAISE:
            raise SubscriptionBroken(
                f"bucket {stream.bucket}: subscription {stream.sub_id} cannot resume after "
                f"{after}: {reason}",
                BrokenReason(reason.value),
            )
        old = stream.sub_id
        stream.sub_id, stream.subscribed, stream.cursor = None, False, None
        self._flusher.forget(stream.bucket)  # nothing of it is persisted or acked again
        if self._flusher.store is not None:
            await asyncio.to_thread(self._flusher.forget_cursor, old)
        stream.history.append(f"{reason}: {old} dropped; subscribing again")
        if self.options.on_reset is not None:
            try:
                self.options.on_reset(StreamReset(stream.bucket, old, reason))
            except Exception:
                log.exception("on_reset callback failed")
        return None  # the next pass subscribes afresh


def close_subscriptions(
    subs: Sequence[Subscription], *, flush: bool = True, ack_timeout_s: float = CLOSE_ACK_WAIT_S
) -> None:
    """`Subscription.close` for subscriptions of one client at once: their final acks
    go out together and are waited for together, for up to `ack_timeout_s` in all."""
    if not subs:
        return
    acks = [ack for sub in subs for ack in sub._close_here(flush)]
    engine, pipeline = subs[0]._engine, subs[0]._acks
    if acks and not engine.loop.is_running():
        log.warning("the client is closed: %d final acks not sent", len(acks))
    elif acks:
        try:
            left = engine.submit(pipeline.ack_applied(acks, ack_timeout_s)).result(
                ack_timeout_s + 5
            )
        except Exception:
            log.exception("final acks failed")
        else:
            if left:
                log.warning(
                    "%d final acks not applied within %.1fs; their rows stay until the "
                    "subscription reconnects or stalls out",
                    left,
                    ack_timeout_s,
                )
    if engine.loop.is_running():  # not after the Client closed

        async def stop() -> None:
            await asyncio.gather(*(sub._stop() for sub in subs))

        with contextlib.suppress(Exception):
            engine.submit(stop()).result(5 + len(subs) / 1000)


__all__ = [
    "Event",
    "Recovery",
    "StreamReset",
    "StreamResetReason",
    "SubscribeOptions",
    "Subscription",
    "SubscriptionStats",
    "close_subscriptions",
    "parse_query",
]
