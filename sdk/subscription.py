"""Subscriptions: a query's committed changes, delivered effective-once - the
application's side (the streams themselves: `sevendb.sdk.streams`).

    with client.subscribe("prefix:orders/", cursor="orders.cursor") as sub:
        for event in sub:
            handle(event)       # raises: the event stays unacked, and comes again

**Processed.** An event is acknowledged only once processed. With the default
`AckMode.AUTO` an event is processed when the application asks for the next one
(``next``, ``anext``, `poll`), or leaves the subscription *normally*: a ``with``
(or ``async with``) block left without an exception, or `close` / `detach`
called while no exception is being handled. An exception out of the loop body
(leaving the ``with`` block with it, or `close` in the ``finally`` it passes
through) leaves the event in hand unprocessed: it is redelivered on resume. With
`AckMode.EXPLICIT` only `ack(event)` processes an event (in any order, from any
thread), and `nak(event, delay_s)` has this subscription deliver it again after the
delay; a bucket's acknowledged position never passes an event not acked. A
subscription made with ``on_event=f`` is not iterated: the client's loop calls
``f(event)``, and the event is processed once it returns; an exception from it ends
the subscription as one out of a loop does (`Subscription.wait_closed` raises it).

Processed positions are persisted to the cursor store (fsync + atomic rename) and
only then acknowledged, in batches; a restarted process with the same cursor file
resumes right after the last persisted event. A crash between handling an event
and that persist repeats at most the unpersisted events (``ack_every_events``) -
make handling idempotent by ``emit_seq`` or persist your own state together with
the cursor if that matters.

**Durable names.** ``client.subscribe(query, durable="billing")`` makes or resumes
the principal's subscription named "billing": its acknowledged position is the
server's (replicated by the acks' purges), so any process of the principal resumes it
with no cursor file, after the last *acknowledged* event (events processed after the
last ack, at most ``ack_every_events``, come again: a cursor file, kept beside, is
the cache that avoids that). One live consumer per name: while a stream of it is
attached, another's subscribe raises `SubscriptionBroken` (``DURABLE_IN_USE``).

**Ending.** `close()` (or leaving a ``with`` block) acknowledges what was processed
and then *unsubscribes*: a replicated UNSUBSCRIBE, after which the node drops the
subscription's rows. With a cursor store or a durable name it *detaches* instead (it
exists to resume): the server keeps the subscription, and a later `Client.subscribe`
with the same cursor or name resumes it. `detach()` says so explicitly; `unsubscribe()` ends a
subscription with a cursor too (and forgets its cursors).

A query that spans buckets (a prefix, all) is one server subscription per bucket;
their events are merged as they arrive, ordered within each bucket (like Kafka
partitions). The streams run on one background asyncio loop per `Client` (grpc.aio),
so a process can hold thousands of them; the application iterates synchronously
(``for``) or asynchronously (``async for``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Final, TypeAlias

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import LATEST, Start, StartKind
from sevendb.outbox.errors import InvalidArgument, SevenDBError
from sevendb.outbox.query import Query
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto.mailbox import Mailbox, mailbox
from sevendb.sdk.acks import AckPipeline
from sevendb.sdk.cursor import StreamCursor
from sevendb.sdk.cursor_store import CursorStore
from sevendb.sdk.engine import Engine
from sevendb.sdk.flusher import Flusher
from sevendb.sdk.progress import Acked, Outstanding, Progress
from sevendb.sdk.sessions import Sessions
from sevendb.sdk.streams import (
    BucketStream,
    BucketStreams,
    Event,
    Recovery,
    StreamReset,
    StreamResetReason,
    end_on_server,
    offer_events,
)

log = logging.getLogger(__name__)

CLOSE_ACK_WAIT_S: Final = 3.0
"""How long `Subscription.close` waits, by default, for its final acks to be applied
(and as long again for its unsubscribes)."""
UNSUBSCRIBE_WAIT_S: Final = 30.0
"""How long `Subscription.unsubscribe` retries before it raises."""


class AckMode(StrEnum):
    """When an event counts as processed (and may be acknowledged to the node)."""

    AUTO = "auto"
    """When the application asks for the next event, or leaves the subscription
    normally (see the module docstring): an exception out of the loop leaves the
    event in hand unprocessed."""
    EXPLICIT = "explicit"
    """Only when the application calls `Subscription.ack(event)` (for consumers that
    process asynchronously); `Subscription.nak(event, delay_s)` has it delivered
    again."""


@dataclass(frozen=True, slots=True)
class SubscribeOptions:
    """How a subscription persists, acknowledges and recovers. A policy or an ack mode
    may also be given as its string value (``"raise"``, ``"explicit"``); anything
    else is `InvalidArgument`."""

    on_stale: Recovery = Recovery.RESUBSCRIBE
    """STALE_SEQUENCE / SUBSCRIPTION_NOT_FOUND: the server no longer has the stream."""
    on_invalid: Recovery = Recovery.RAISE
    """INVALID_SEQUENCE: the saved position is not on the server's stream."""
    on_reset: Callable[[StreamReset], None] | None = None
    ack: AckMode = AckMode.AUTO
    """When an event counts as processed (see `AckMode`)."""
    ack_every_events: int = 256
    """Persist and ack after this many processed events ..."""
    ack_interval_s: float = 0.02
    """... or this long after the first unflushed one (up to a quarter of it sooner),
    whichever comes first."""
    ack_resend_s: float = 1.0
    reorder_buffer_max: int = 1024
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    per_change: bool = False
    """Deliver each change of a log entry as an event of its own (`Event.change_index`),
    processed and acked one at a time; the entry is acknowledged to the node once
    all its changes are processed, and a process resumed mid-entry skips the changes
    it had processed (docs/emission.md, "Event granularity")."""

    isolation: str = "read_committed"
    """What it receives of transactions: ``"read_committed"`` (a committed
    transaction's changes in a bucket as one event at its commit; nothing of an open or
    aborted one) or ``"read_uncommitted"`` (transactional writes as they apply, version
    0, aborted ones included). docs/transactions.md."""

    def __post_init__(self) -> None:
        if self.isolation not in ("read_committed", "read_uncommitted"):
            raise InvalidArgument(
                f"isolation must be 'read_committed' or 'read_uncommitted', not {self.isolation!r}"
            )
        for name, kind in (("on_stale", Recovery), ("on_invalid", Recovery), ("ack", AckMode)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                choices = " or ".join(repr(r.value) for r in kind)
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


StartAt: TypeAlias = str | datetime | EmitSeq | Mapping[int, EmitSeq] | None
"""Where a new subscription starts (`Client.subscribe(start=...)`): ``"latest"`` (or
None: only what commits after the subscribe), ``"earliest"`` (the oldest the bucket's
retained history reaches), a `datetime` (the first change committed at or after it),
an `EmitSeq` (after that position: a query of one bucket), or ``{bucket: EmitSeq}``
(after each, for every bucket the query spans)."""


def starts_for(start: StartAt, buckets: Sequence[int], uuids: Sequence[str]) -> dict[int, Start]:
    """Each bucket's `Start` for `start` (`StartAt`); `InvalidArgument` if it names no
    position for a bucket, or one of another bucket."""
    if start is None or start == "latest":
        return dict.fromkeys(buckets, LATEST)
    if start == "earliest":
        return dict.fromkeys(buckets, Start(StartKind.EARLIEST))
    if isinstance(start, datetime):
        if start.tzinfo is None:
            raise InvalidArgument("a start time must be timezone-aware (e.g. UTC)")
        return dict.fromkeys(buckets, Start(StartKind.TIME, time_ms=int(start.timestamp() * 1000)))
    if isinstance(start, EmitSeq):
        if len(buckets) != 1:
            raise InvalidArgument(
                f"an emit_seq names one bucket; this query spans {len(buckets)}: give "
                "{bucket: emit_seq} for each"
            )
        start = {buckets[0]: start}
    if not isinstance(start, Mapping):
        raise InvalidArgument(
            "start must be 'latest', 'earliest', a datetime, an EmitSeq or {bucket: EmitSeq}, "
            f"not {start!r}"
        )
    out = {}
    for bucket in buckets:
        after = start.get(bucket)
        if not isinstance(after, EmitSeq) or after.bucket_uuid != uuids[bucket]:
            raise InvalidArgument(f"start names no position of bucket {bucket} ({after!r})")
        out[bucket] = Start(StartKind.AFTER, after)
    return out


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
        self._cond = threading.Condition(threading.Lock())  # not reentered: no RLock
        self._items: collections.deque[list[Event] | BaseException] = collections.deque()
        self._waiter: tuple[Mailbox, asyncio.Future[None]] | None = None

    def put(self, item: list[Event] | BaseException) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            box, future = waiter
            if asyncio._get_running_loop() is future.get_loop():
                _wake(future)  # put on the waiter's own loop (an AsyncClient's): no hop
            else:
                box.post(_wake, future)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float | None) -> bool:
        """Block until `predicate()` holds (checked under the inbox's lock, after each
        `wake_all`), or `timeout_s` passes; whether it holds."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout_s)

    def wake_all(self, change: Callable[[], None]) -> None:
        """Run `change` under the inbox's lock, then wake every waiter (`wait_for`)."""
        with self._cond:
            change()
            self._cond.notify_all()

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


_Position: TypeAlias = tuple[EmitSeq, int, int]
"""(emit_seq, i, size): a change's place in its stream (a whole entry's: its last)."""


def _position(event: Event) -> _Position:
    if event.change_index is None:
        size = len(event.changes)
        return event.emit_seq, size - 1, size
    return event.emit_seq, event.change_index, event.entry_changes


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


FinalAck: TypeAlias = tuple[str, str, EmitSeq, Callable[[EmitSeq], None]]
"""(node address, sub_id, position, confirmed) of a closing subscription's final ack."""


class Subscription:
    """A query subscribed in every bucket it spans; iterate it (sync or async).

    Made by `Client.subscribe`. `close()` (or leaving a ``with`` block) acknowledges
    what was processed and ends the subscription on the server - or, with a cursor
    store, keeps it there for a later resume (`detach`). See the module docstring
    for when an event counts as processed.
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
        durable: str | None = None,
        starts: Mapping[int, Start] | None = None,
        fence: tuple[str, int] | None = None,
        on_event: Callable[[Event], object] | None = None,
    ) -> None:
        if on_event is not None and not callable(on_event):
            raise InvalidArgument(f"on_event must be a callable, not {on_event!r}")
        if durable is not None and (not isinstance(durable, str) or not durable):
            raise InvalidArgument(f"durable must be a non-empty name, not {durable!r}")
        self.query = query
        self.durable = durable
        """The durable name: the server keeps this subscription's position under it."""
        self.name = name or durable or str(query)
        self.options = opts = options or SubscribeOptions()
        self._engine = engine
        self._acks = acks
        self._metadata = metadata
        store = cursor if cursor is None or isinstance(cursor, CursorStore) else CursorStore(cursor)
        self._keep = store is not None or durable is not None
        """Does closing keep the server's subscription (detach) or end it?"""
        self._inbox = _Inbox()
        self._on_event = on_event
        """Called with each event on the client's loop instead of an inbox to iterate."""
        put = self._inbox.put if on_event is None else self._deliver
        self._put = put
        """Where events ready for the application and the error that ends the
        subscription go: the inbox, or `_deliver` (with `on_event`)."""
        self._failure: BaseException | None = None
        """With `on_event`: what ended the subscription (`wait_closed` raises it)."""
        self._closed_done = False
        """Set (under the inbox's lock) once the close is over (`_closed_now`)."""
        self._end_waiters: list[asyncio.Future[None]] | None = None
        """`await_closed`'s (made on first use: a subscription holds few objects)."""
        self._ending: asyncio.Task[None] | None = None
        """With `on_event`: the close an error started (kept: a task nobody holds
        may be collected before it ends)."""
        streams: dict[int, BucketStream] = {}
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
            target_of=lambda bucket: self._streams.target_of(bucket),
            failed=put,
        )
        self._closed = False
        self._batch: collections.deque[Event] = collections.deque()
        self._last: Event | None = None
        """AUTO: the event in the application's hands (processed when it asks again)."""
        self._outstanding: Outstanding[_Position] | None = (
            Outstanding() if opts.ack is AckMode.EXPLICIT else None
        )
        self._ack_lock = threading.Lock()
        saved = {c.bucket: c for c in (store.named(self.name) if store else [])}
        for bucket in buckets:
            c = saved.get(bucket)
            stream = BucketStream(
                bucket, c.sub_id if c else None, c is not None and c.position is not None
            )
            stream.begin = (starts or {}).get(bucket, LATEST)
            if c is not None and c.position is not None:
                stream.cursor = StreamCursor(c.position, reorder_buffer_max=opts.reorder_buffer_max)
                stream.skip = c.partial if opts.per_change else None
                self._flusher.start(bucket, c.sub_id, c.position, stream.skip)
            streams[bucket] = stream
        self._streams = BucketStreams(
            engine, sessions, self._flusher, query, opts, streams, put, durable or ""
        )
        if fence is not None:  # a consumer group member's (sdk/groups.py)
            self._streams.fence = pb.GroupFence(member=fence[0], generation=fence[1])
            self._streams.fences = acks.fences

    async def _start(self, ready_timeout_s: float) -> None:
        """On the loop: start every bucket's stream and wait until all are established,
        so that a write made after `subscribe` returns is always delivered. A stream
        that fails, or is not up within `ready_timeout_s`, closes the subscription
        (nothing was processed) and raises."""
        await self._streams.start()
        try:
            await self._streams.wait_ready(ready_timeout_s)
        except BaseException:
            await aclose_subscriptions([self], flush=False)
            raise

    # ---- on_event ------------------------------------------------------------------------

    def _deliver(self, item: list[Event] | BaseException) -> None:
        """With `on_event`, on the client's loop: each event to the callable, marked
        processed once it returns (`AckMode.AUTO`). An error it raises, or the one
        that ends the streams, ends the subscription (`_fail`)."""
        if self._closed or self._failure is not None:
            return
        if isinstance(item, BaseException):
            self._fail(item)
            return
        handler = self._on_event
        assert handler is not None
        outstanding = self._outstanding
        for event in item:
            if outstanding is not None:
                with self._ack_lock:
                    outstanding.handed(event.bucket, event.sub_id, _position(event))
            try:
                handler(event)
            except Exception as exc:
                self._fail(exc)
                return
            if outstanding is None:
                emit_seq, index, size = _position(event)
                self._flusher.processed_change(event.bucket, event.sub_id, emit_seq, index, size)
            if self._closed:  # the callable closed it
                return
        if self._flusher.due():
            self._flusher.flush_soon()

    def _fail(self, error: BaseException) -> None:
        """With `on_event`: `error` ends the subscription, as an exception out of a
        loop over it would: what was processed is acknowledged, the event that failed
        is not, and the subscription is closed (detached with a cursor or a durable
        name, else ended on the server). `wait_closed` then raises `error`."""
        self._failure = error
        if not isinstance(error, SevenDBError):
            log.error("on_event of subscription %r failed; closing it", self.name, exc_info=error)
        self._ending = self._engine.loop.create_task(aclose_subscriptions([self], failed=True))

    def wait_closed(self, timeout_s: float | None = None) -> bool:
        """Block until the subscription is closed - by `close` (or `detach`,
        `unsubscribe`) from anywhere, or by an error: then this raises it (what its
        `on_event` raised, or the `SubscriptionBroken` that ended its streams). True
        once closed; False if `timeout_s` passed first. Not on the client's loop
        (`await_closed` there)."""
        self._blocking("wait for a subscription to close", "`await await_closed()`")
        closed = self._inbox.wait_for(lambda: self._closed_done, timeout_s)
        if closed and self._failure is not None:
            raise self._failure
        return closed

    async def await_closed(self) -> None:
        """`wait_closed` as a coroutine (no timeout: wrap it in `asyncio.timeout`)."""
        if not self._closed_done:
            waiter = asyncio.get_running_loop().create_future()
            waiters = self._end_waiters = self._end_waiters or []
            waiters.append(waiter)
            try:
                if not self._closed_done:  # closed meanwhile: no wake-up comes
                    await waiter
            finally:
                waiters.remove(waiter)
        if self._failure is not None:
            raise self._failure

    # ---- the application side ----------------------------------------------------------

    @property
    def sub_ids(self) -> dict[int, str]:
        """The server subscription id of each bucket's stream (once subscribed)."""
        streams = self._streams.streams
        return {b: s.sub_id for b, s in streams.items() if s.sub_id and s.subscribed}

    def stats(self) -> SubscriptionStats:
        streams = self._streams.streams.values()
        store = self._flusher.store
        return SubscriptionStats(
            buckets=len(streams),
            duplicates_dropped=sum(s.duplicates for s in streams),
            reconnects=sum(s.reconnects for s in streams),
            cursor_writes=store.writes if store else 0,
        )

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        self._blocking("iterate with `for`", "`async for`")
        self._iterable()
        self._mark_processed()
        if self._flusher.due():
            self._flusher.flush()
        while not self._batch:
            if self._closed:
                raise StopIteration
            self._take(self._inbox.get(None))
        return self._hand()

    def _iterable(self) -> None:
        if self._on_event is not None:
            raise InvalidArgument(
                "this subscription hands its events to its on_event callable: it cannot "
                "also be iterated (subscribe without on_event to iterate)"
            )

    def _blocking(self, what: str, instead: str) -> None:
        """A blocking call on the client's own loop (an `AsyncClient`'s, or a callback
        of a `Client`'s) would wait for that loop forever: refused."""
        if self._engine.on_loop_thread():
            raise InvalidArgument(
                f"cannot {what} on the client's own event loop (it would wait for itself): "
                f"use {instead}"
            )

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        self._iterable()
        self._mark_processed()
        if self._flusher.due():
            if self._flusher.store is None:
                self._flusher.flush()  # nothing blocks: no thread hop
            else:
                await asyncio.to_thread(self._flusher.flush)  # fsync
        while not self._batch:
            if self._closed:
                raise StopAsyncIteration
            item = await self._inbox.aget()
            if isinstance(item, BaseException):
                await aclose_subscriptions([self])
                raise item
            self._batch.extend(item)
        return self._hand()

    def poll(self, timeout_s: float = 0.0) -> Event | None:
        """The next event if one arrives within `timeout_s`, else None (blocking: not
        on an `AsyncClient`'s loop, where `async for` reads)."""
        self._blocking("poll", "`async for`")
        self._iterable()
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
        return self._hand()

    def _hand(self) -> Event:
        """The next event, now in the application's hands."""
        event = self._batch.popleft()
        if self._outstanding is None:
            self._last = event
        else:
            with self._ack_lock:
                self._outstanding.handed(event.bucket, event.sub_id, _position(event))
        return event

    def _take(self, item: list[Event] | BaseException | None) -> None:
        if isinstance(item, BaseException):
            close_subscriptions([self])
            raise item
        if item:
            self._batch.extend(item)

    def _mark_processed(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            emit_seq, index, size = _position(last)
            self._flusher.processed_change(last.bucket, last.sub_id, emit_seq, index, size)

    def ack(self, event: Event) -> None:
        """`AckMode.EXPLICIT`: the application finished `event` (any order, any
        thread; acking one twice does nothing). Its bucket's position is persisted and
        acknowledged once every event before it was acked too."""
        outstanding = self._explicit("ack")
        with self._ack_lock:
            found, position, covered = outstanding.ack(event.bucket, event.sub_id, _position(event))
            if position is not None:
                emit_seq, index, size = position
                self._flusher.processed_change(
                    event.bucket, event.sub_id, emit_seq, index, size, covered
                )
        if found is Acked.UNKNOWN:
            raise InvalidArgument(
                f"ack: no event at {event.emit_seq} of bucket {event.bucket} was handed out "
                "by this subscription"
            )
        if position is not None and self._flusher.due():
            self._flusher.flush_soon()

    def nak(self, event: Event, delay_s: float = 0.0) -> None:
        """`AckMode.EXPLICIT`: processing `event` failed. This subscription delivers
        it again after `delay_s` (out of order, after what came meanwhile), and its
        bucket's acknowledged position stays before it until it is acked: after a
        restart it comes again from the node. (A stream holds at most its window of
        unacked events, so an event nak'd for good stalls its bucket.)"""
        outstanding = self._explicit("nak")
        if not delay_s >= 0:
            raise InvalidArgument(f"nak: delay_s must be >= 0, not {delay_s!r}")
        with self._ack_lock:
            waiting = outstanding.is_open(event.bucket, event.sub_id, _position(event))
        if not waiting:
            raise InvalidArgument(
                f"nak: the event at {event.emit_seq} of bucket {event.bucket} is not awaiting "
                "an ack (acked already, or never handed out)"
            )
        if not self._closed:
            with contextlib.suppress(RuntimeError):  # the client's loop is gone
                loop = self._engine.loop
                self._engine.mailbox.post(loop.call_later, delay_s, self._put, [event])

    def _explicit(self, what: str) -> Outstanding[_Position]:
        if self._outstanding is None:
            raise InvalidArgument(
                f"{what}() is for SubscribeOptions(ack=AckMode.EXPLICIT); with AckMode.AUTO an "
                "event is processed when the next one is asked for"
            )
        return self._outstanding

    def close(self, *, flush: bool = True, ack_timeout_s: float = CLOSE_ACK_WAIT_S) -> None:
        """Stop the streams; persist and acknowledge what was processed; then end the
        subscription on the server (UNSUBSCRIBE: the node drops its rows), or, with a
        cursor store, keep it there for a later resume (`detach`). Idempotent.

        Called while an exception is being handled (in an ``except``, or a
        ``finally`` an exception passes through), the event in the application's
        hands is not processed (`AckMode.AUTO`). The final acks are confirmed only
        once the node has applied a purge covering them, following the lease holder
        if it moves, for up to `ack_timeout_s` (and the unsubscribes take up to as
        long again): after `close` returns the processed rows are gone from the
        outbox (and on their way to the archive). An ack or unsubscribe not done by
        then is logged; the rows stay until the subscription resumes, or the node
        expires it."""
        failed = sys.exc_info()[1] is not None
        close_subscriptions([self], failed=failed, flush=flush, ack_timeout_s=ack_timeout_s)

    async def aclose(self, *, flush: bool = True, ack_timeout_s: float = CLOSE_ACK_WAIT_S) -> None:
        """`close` as a coroutine (what an `AsyncClient`'s subscription needs: `close`
        would block its loop)."""
        failed = sys.exc_info()[1] is not None
        await aclose_subscriptions([self], failed=failed, flush=flush, ack_timeout_s=ack_timeout_s)

    def detach(self, *, ack_timeout_s: float = CLOSE_ACK_WAIT_S) -> None:
        """`close`, keeping the subscription on the server: a later `Client.subscribe`
        with the same cursor store and name, or the same durable name, resumes after
        the last processed event. What `close` does with a cursor store or a durable
        name. Without either it is refused (`InvalidArgument`): nothing could resume
        the subscription, which would only hold its rows on the server until it
        expired."""
        self._detachable()
        failed = sys.exc_info()[1] is not None
        close_subscriptions([self], failed=failed, ack_timeout_s=ack_timeout_s)

    async def adetach(self, *, ack_timeout_s: float = CLOSE_ACK_WAIT_S) -> None:
        """`detach` as a coroutine."""
        self._detachable()
        failed = sys.exc_info()[1] is not None
        await aclose_subscriptions([self], failed=failed, ack_timeout_s=ack_timeout_s)

    def _detachable(self) -> None:
        if self._flusher.store is None and self.durable is None:
            raise InvalidArgument(
                "detach keeps the subscription for a later resume, which needs its cursor "
                "or a durable name: subscribe with cursor=FILE or durable=NAME (or close() "
                "to end it)"
            )

    def _close_here(self, flush: bool, processed_last: bool) -> list[FinalAck]:
        """The caller's half of `close`: stop taking events, wake the consumer, persist
        the final flush. Returns its acks to send (none if already closed)."""
        if self._closed:
            return []
        if processed_last:
            self._mark_processed()
        self._last = None
        self._closed = self._streams.closed = True
        self._inbox.put([])  # wakes a consumer blocked waiting for events
        final = self._flusher.close(final=flush)
        return [
            (
                self._streams.target_of(bucket),
                sub_id,
                pos,
                partial(self._flusher.confirmed, bucket, sub_id),
            )
            for bucket, sub_id, pos in final.positions
        ]

    def _closed_now(self) -> None:
        """The close is over (final acks sent, streams stopped): wake `wait_closed`."""
        self._inbox.wake_all(self._set_closed_done)
        for waiter in list(self._end_waiters or ()):
            with contextlib.suppress(RuntimeError):  # its loop is gone
                mailbox(waiter.get_loop()).post(_wake, waiter)

    def _set_closed_done(self) -> None:
        self._closed_done = True

    def _server_ids(self) -> list[tuple[int, str]]:
        """Every (bucket, sub_id) the server may hold (also one whose Subscribe is
        unanswered)."""
        return [(b, s.sub_id) for b, s in self._streams.streams.items() if s.sub_id]

    def unsubscribe(self) -> None:
        """End the subscription on the server (every bucket) and forget its cursors,
        with or without a cursor store; raises if a bucket's could not be ended
        (after retrying for `UNSUBSCRIBE_WAIT_S`)."""
        ids = self._server_ids()
        self._keep = True  # ended below, where its errors are raised
        close_subscriptions([self], flush=False)
        errors: list[SevenDBError] = []
        if ids and self._engine.loop.is_running():
            end = end_on_server(self._engine, self._metadata, ids, UNSUBSCRIBE_WAIT_S)
            errors = self._engine.submit(end).result(UNSUBSCRIBE_WAIT_S + 5)
        self._ended(ids, errors)

    async def aunsubscribe(self) -> None:
        """`unsubscribe` as a coroutine."""
        ids = self._server_ids()
        self._keep = True
        await aclose_subscriptions([self], flush=False)
        errors: list[SevenDBError] = []
        if ids and self._engine.loop.is_running():
            end = end_on_server(self._engine, self._metadata, ids, UNSUBSCRIBE_WAIT_S)
            errors = await self._engine.run(end)
        self._ended(ids, errors)

    def _ended(self, ids: list[tuple[int, str]], errors: Sequence[BaseException]) -> None:
        if errors:
            raise errors[0]
        if self._flusher.store is not None:
            self._flusher.store.forget([sub_id for _, sub_id in ids])

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """`close`; leaving the block by an exception leaves the event in hand
        unprocessed."""
        close_subscriptions([self], failed=exc is not None)

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        """`aclose`; leaving the block by an exception leaves the event in hand
        unprocessed."""
        await aclose_subscriptions([self], failed=exc is not None)


def close_subscriptions(
    subs: Sequence[Subscription],
    *,
    failed: bool = False,
    flush: bool = True,
    ack_timeout_s: float = CLOSE_ACK_WAIT_S,
) -> None:
    """`Subscription.close` for subscriptions of one client at once: their final acks
    go out together and are waited for together, for up to `ack_timeout_s` in all,
    and so are the unsubscribes of those not kept. `failed`: an exception ends the
    consumer's loop, so the event in its hands is not processed. Blocking: not on
    the client's loop (`aclose_subscriptions` there)."""
    if not subs:
        return
    engine = subs[0]._engine
    subs[0]._blocking("close a subscription with a blocking call", "`await aclose()`")
    ends, acks = _begin_close(subs, failed, flush)
    try:
        if engine.loop.is_running():  # not after the Client closed
            try:
                engine.submit(_finish_close(subs, ends, acks, ack_timeout_s)).result(
                    2 * ack_timeout_s + 15 + len(subs) / 1000
                )
            except Exception:
                log.exception("closing %d subscriptions failed", len(subs))
        elif acks:
            log.warning("the client is closed: %d final acks not sent", len(acks))
    finally:
        for sub in subs:
            sub._closed_now()


async def aclose_subscriptions(
    subs: Sequence[Subscription],
    *,
    failed: bool = False,
    flush: bool = True,
    ack_timeout_s: float = CLOSE_ACK_WAIT_S,
) -> None:
    """`close_subscriptions` as a coroutine, from any loop (the cursor's fsync runs
    off it)."""
    if not subs:
        return
    engine = subs[0]._engine
    ends, acks = await asyncio.to_thread(_begin_close, subs, failed, flush)
    try:
        if engine.loop.is_running():
            await engine.run(_finish_close(subs, ends, acks, ack_timeout_s))
        elif acks:
            log.warning("the client is closed: %d final acks not sent", len(acks))
    finally:
        for sub in subs:
            sub._closed_now()


def _begin_close(
    subs: Sequence[Subscription], failed: bool, flush: bool
) -> tuple[list[tuple[int, str]], list[FinalAck]]:
    """The application's half of a close (the final cursor persist: blocking): the
    unsubscribes due, and the final acks."""
    ends = [ids for sub in subs if not sub._closed and not sub._keep for ids in sub._server_ids()]
    acks = [ack for sub in subs for ack in sub._close_here(flush, processed_last=not failed)]
    return ends, acks


async def _finish_close(
    subs: Sequence[Subscription],
    ends: list[tuple[int, str]],
    acks: list[FinalAck],
    ack_timeout_s: float,
) -> None:
    """The loop's half of a close: the final acks (confirmed as applied), the streams
    stopped, the unsubscribes. Never raises for the server's answers (a close cannot
    fail): it logs them; the node expires what stays."""
    engine, pipeline = subs[0]._engine, subs[0]._acks
    if acks:
        try:
            left = await pipeline.ack_applied(acks, ack_timeout_s)
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
    await asyncio.gather(*(sub._streams.stop() for sub in subs), return_exceptions=True)
    if not ends:
        return
    try:
        errors = await end_on_server(engine, subs[0]._metadata, ends, ack_timeout_s)
    except Exception:
        log.exception("unsubscribing on close failed")
        return
    if errors:
        log.warning(
            "%d of %d bucket subscriptions not ended on close (they stay until the node "
            "expires them): %s",
            len(errors),
            len(ends),
            errors[0],
        )


__all__ = [
    "AckMode",
    "Event",
    "Recovery",
    "StreamReset",
    "StartAt",
    "StreamResetReason",
    "SubscribeOptions",
    "Subscription",
    "SubscriptionStats",
    "aclose_subscriptions",
    "close_subscriptions",
    "offer_events",
    "parse_query",
    "starts_for",
]
