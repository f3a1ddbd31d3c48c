"""The loop side of a subscription: one stream per bucket, on the client's loop.

Each bucket's stream is a Subscribe (or, once subscribed, a Reconnect after the
last flushed position) on the client's `Session` to a node (`sevendb.sdk.sessions`).
It follows its notifier lease holder: on a redirect, a closed stream, a gap in the
``prev_emit_seq`` chain or a dead node it reconnects, and `StreamCursor` drops what
was seen already. Events ready for the application go to the subscription's inbox
(`sevendb.sdk.subscription`, the application side). Loop only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Final, NamedTuple

import grpc
from grpc import aio

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import LATEST, Start
from sevendb.outbox.errors import ErrorCode, SevenDBError
from sevendb.outbox.model import Change
from sevendb.outbox.query import Query
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk.cursor import StreamCursor
from sevendb.sdk.engine import (
    ERROR_CODE_KEY,
    RETRY_AFTER_KEY,
    Engine,
    leader_hint,
    trailer,
)
from sevendb.sdk.errors import (
    BrokenReason,
    SubscriptionBroken,
    Unavailable,
    domain_error,
    retry_after_s,
)
from sevendb.sdk.flusher import Flusher
from sevendb.sdk.progress import Partial, undone_changes
from sevendb.sdk.sessions import Sessions, SessionStream

if TYPE_CHECKING:
    from sevendb.sdk.subscription import SubscribeOptions

log = logging.getLogger(__name__)

_FATAL: Final = {
    code: BrokenReason(code.name)
    for code in (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
    )
} | {grpc.StatusCode.OUT_OF_RANGE: BrokenReason.STALE_SEQUENCE}
"""gRPC statuses that end a bucket stream for good, and the reason reported
(OUT_OF_RANGE: a start position older than the bucket's retained history)."""


class Event(NamedTuple):
    """One log entry of one bucket - the committed changes it made, in order -
    delivered once and in order per bucket. Writes committed together (one atomic
    write, or concurrent writes the leader batched into one entry) are one event
    with several changes under one `emit_seq` (docs/emission.md, "Event
    granularity"). With `SubscribeOptions(per_change=True)` an event is one change
    alone: `changes` holds it, `change_index` is its place in the entry and `entry_changes`
    the entry's size.

    Immutable; a named tuple because one is built per delivered event (half the cost
    of a frozen dataclass)."""

    bucket: int
    sub_id: str
    emit_seq: EmitSeq
    prev_emit_seq: EmitSeq
    changes: tuple[Change, ...]
    commit_time_ms: int
    change_index: int | None = None
    """Per-change delivery: this change's place in its entry (None: the whole entry)."""
    entry_changes: int = 0
    """Per-change delivery: how many changes its entry has (0: the whole entry)."""

    @property
    def position(self) -> tuple[EmitSeq, int]:
        """``(emit_seq, i)``: a change's position in its bucket's stream, ordered;
        for a whole entry, that of its last change."""
        index = len(self.changes) - 1 if self.change_index is None else self.change_index
        return self.emit_seq, index

    @property
    def last_of_entry(self) -> bool:
        """Is this the whole entry, or its last change (processing it completes the
        entry, which is then acknowledged)?"""
        return self.change_index is None or self.change_index + 1 >= self.entry_changes


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
class _Redirect(Exception):
    def __init__(self, address: str | None) -> None:
        self.address = address


@dataclass(slots=True)
class BucketStream:
    bucket: int
    sub_id: str | None
    subscribed: bool
    cursor: StreamCursor[Event] | None = None
    target: str | None = None
    task: asyncio.Task[None] | None = None
    duplicates: int = 0
    reconnects: int = 0
    caught_up: bool = False
    ready: bool = False
    """Set once the stream is subscribed (SubAck) or resumed (ReconnectAck OK)."""
    begin: Start = LATEST
    """Where its first Subscribe starts (a later one, after a reset: the latest)."""
    history: list[str] = field(default_factory=list)
    skip: Partial | None = None
    """Per-change delivery: the changes of an entry a resumed process had processed
    (from its cursor), not to be delivered again."""


def split_changes(event: Event, skip: Partial | None) -> list[Event]:
    """Per-change delivery: an entry as one event per change, without those `skip`
    says were processed already (`undone_changes`)."""
    size = len(event.changes)
    return [
        Event(
            event.bucket,
            event.sub_id,
            event.emit_seq,
            event.prev_emit_seq,
            (event.changes[i],),
            event.commit_time_ms,
            i,
            size,
        )
        for i in undone_changes(event.emit_seq, size, skip)
    ]


def _event(bucket: int, ev: pb.DataEvent) -> Event:
    # The hot path of a subscriber: each nested message read costs a wrapper object,
    # so every one is read once.
    at = ev.emit_seq
    epoch = at.epoch_id
    prev = ev.prev_emit_seq
    prev_epoch = prev.epoch_id
    delta = ev.delta
    packed = ev.packed_changes
    changes = codec.unpack_changes(packed) if packed else codec.changes_from_pb(delta.changes)
    return Event(
        bucket,
        ev.sub_id,
        EmitSeq(epoch.bucket_uuid, epoch.epoch_counter, at.commit_index),
        EmitSeq(prev_epoch.bucket_uuid, prev_epoch.epoch_counter, prev.commit_index),
        changes,
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


class BucketStreams:
    """The streams of one subscription, one per bucket (loop only, apart from the
    constructor and `target_of`). Events ready for the application go to `put`, and
    so does the error that ends the subscription."""

    def __init__(
        self,
        engine: Engine,
        sessions: Sessions,
        flusher: Flusher,
        query: Query,
        options: SubscribeOptions,
        streams: dict[int, BucketStream],
        put: Callable[[list[Event] | BaseException], None],
        durable: str = "",
    ) -> None:
        self._engine = engine
        self.durable = durable
        """The durable name each bucket's Subscribe carries ("" for none)."""
        self.fence: pb.GroupFence | None = None
        """A consumer group member's term its Subscribe, Reconnect and acks carry
        (sdk/groups.py), registered in `fences` by sub_id for the ack pipeline."""
        self.fences: dict[str, pb.GroupFence] = {}
        self._sessions = sessions
        self._flusher = flusher
        self.query = query
        self.options = options
        self.streams = streams
        self._put = put
        self.closed = False
        """Set when the subscription closes: no stream starts again."""
        self.failure: BaseException | None = None
        """The error that ended the subscription (also put to the application)."""
        self._changed: asyncio.Event | None = None
        """Set when a stream becomes ready or the subscription fails (`wait_ready`)."""

    def target_of(self, bucket: int) -> str:
        """The node a bucket's acks go to: its stream's."""
        return self.streams[bucket].target or self._first_target(bucket)

    def _left(self, stream: BucketStream) -> None:
        """The stream's node did not serve it (refused it, or is down): no longer the
        bucket's first choice."""
        if stream.target is not None and self._engine.holders.get(stream.bucket) == stream.target:
            del self._engine.holders[stream.bucket]

    def _first_target(self, bucket: int) -> str:
        """Where a bucket's stream goes first: the node its last stream was established
        on (likely still the lease holder), else any (a redirect says where to go)."""
        return self._engine.holders.get(bucket) or self._engine.any_endpoint()

    async def start(self) -> None:
        for stream in self.streams.values():
            stream.task = asyncio.get_running_loop().create_task(self._run_stream(stream))

    async def wait_ready(self, timeout_s: float) -> None:
        """Until every bucket's stream is established (so that a write made afterwards
        is always delivered); raises the error that ended the subscription, or
        `SubscriptionBroken` after `timeout_s`."""
        changed = self._changed = self._changed or asyncio.Event()
        try:
            # `asyncio.timeout`, not `wait_for`: no task and no timer per wait.
            async with asyncio.timeout(timeout_s):
                while not all(s.ready for s in self.streams.values()):
                    if self.failure is not None:
                        raise self.failure
                    changed.clear()
                    await changed.wait()
        except TimeoutError:
            stream = next(s for s in self.streams.values() if not s.ready)
            raise SubscriptionBroken(
                f"bucket {stream.bucket}: no stream within {timeout_s:g} s "
                f"(last: {stream.history[-1] if stream.history else 'no answer'})",
                BrokenReason.UNAVAILABLE,
            ) from None
        finally:
            self._changed = None  # not kept for the subscription's life

    def _ready(self, stream: BucketStream) -> None:
        stream.ready = True
        if stream.target is not None:
            self._engine.holders[stream.bucket] = stream.target
        if self._changed is not None:
            self._changed.set()

    def _broken(self, error: SubscriptionBroken) -> None:
        """The subscription ends with `error` (the application's next read raises it)."""
        self.failure = error
        self._put(error)
        if self._changed is not None:
            self._changed.set()

    async def stop(self) -> None:
        self.closed = True
        self._flusher.stop()
        tasks = [s.task for s in self.streams.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _hand_over(self, ready: list[Event]) -> None:
        if self.options.per_change:
            streams = self.streams
            ready = [c for e in ready for c in split_changes(e, streams[e.bucket].skip)]
        self._put(ready)
        self._flusher.handed(len(ready))

    async def _run_stream(self, stream: BucketStream) -> None:
        opts = self.options
        backoff = opts.backoff_initial_s
        while not self.closed:
            try:
                await self._stream_once(stream)
                backoff = opts.backoff_initial_s
            except _Redirect as redirect:
                self._left(stream)
                stream.target = redirect.address
                if redirect.address is None:
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, opts.backoff_max_s)
            except aio.AioRpcError as exc:
                fatal = _FATAL.get(exc.code())
                if fatal is not None:
                    self._broken(
                        SubscriptionBroken(
                            f"bucket {stream.bucket}: {exc.code().name}: {exc.details()}", fatal
                        )
                    )
                    return
                hint = leader_hint(exc)
                self._left(stream)
                stream.target = hint
                stream.reconnects += 1
                after = retry_after_s(trailer(exc, RETRY_AFTER_KEY))
                if after is not None:  # RESOURCE_EXHAUSTED: the node named its wait
                    await asyncio.sleep(after)
                elif hint is None:
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, opts.backoff_max_s)
            except SubscriptionBroken as exc:
                self._broken(exc)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug: surface it, never spin silently
                log.exception("bucket %d stream failed", stream.bucket)
                self._broken(
                    SubscriptionBroken(f"bucket {stream.bucket}: {exc!r}", BrokenReason.INTERNAL)
                )
                return

    async def _stream_once(self, stream: BucketStream) -> None:
        target = stream.target or self._first_target(stream.bucket)
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

    def _on_message(self, stream: BucketStream, message: pb.StreamMessage) -> bool:
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

    async def _subscribe(self, stream: BucketStream, target: str) -> SessionStream:
        if stream.sub_id is None:
            stream.sub_id = secrets.token_hex(16)
            if self._flusher.store is not None:
                # Known before the server hears of it: a crash now resubscribes with
                # the same id (idempotent) instead of leaving an orphan behind.
                await asyncio.to_thread(self._flusher.save, stream.bucket, stream.sub_id, None)
        request = pb.SubscribeRequest(
            bucket=stream.bucket,
            query=codec.query_to_pb(self.query),
            sub_id=stream.sub_id,
            durable=self.durable,
            start=codec.start_to_pb(stream.begin),
            group=self.fence,
            packed_changes=True,
            isolation=(
                pb.SubscribeRequest.READ_UNCOMMITTED
                if self.options.isolation == "read_uncommitted"
                else pb.SubscribeRequest.READ_COMMITTED
            ),
        )
        call = self._sessions.subscribe(target, request)
        try:
            return await self._subscribed(stream, call)
        except BaseException:
            call.cancel()
            raise

    async def _subscribed(self, stream: BucketStream, call: SessionStream) -> SessionStream:
        """A Subscribe once its stream is open: the SubAck, then the start persisted."""
        assert stream.sub_id is not None
        first = await call.read()
        if first is aio.EOF or first.WhichOneof("kind") != "sub_ack":
            raise _Redirect(None)
        start = codec.seq_from_pb(first.sub_ack.start_emit_seq)
        named = first.sub_ack.sub_id
        if self.durable and named and named != stream.sub_id:
            # The durable name resumed the subscription made under another id: the
            # stream is that one's, from its acknowledged position.
            if self._flusher.store is not None:
                await asyncio.to_thread(self._flusher.forget_cursor, stream.sub_id)
            stream.sub_id = named
        if self.fence is not None:
            self.fences[stream.sub_id] = self.fence
        stream.cursor = StreamCursor(start, reorder_buffer_max=self.options.reorder_buffer_max)
        self._flusher.start(stream.bucket, stream.sub_id, start)
        if self._flusher.store is not None:
            await asyncio.to_thread(self._flusher.save, stream.bucket, stream.sub_id, start)
        stream.subscribed, stream.begin = True, LATEST
        how = "resumed durable" if first.sub_ack.resumed else "subscribed"
        stream.history.append(f"{how} {stream.sub_id} at {start}")
        self._ready(stream)
        return call

    async def _reconnect(self, stream: BucketStream, target: str) -> SessionStream | None:
        assert stream.sub_id is not None and stream.cursor is not None
        after = self._flusher.flushed(stream.bucket)
        assert after is not None
        request = codec.reconnect_request(stream.sub_id, stream.bucket, after)
        request.packed_changes = True
        if self.fence is not None:
            request.group.CopyFrom(self.fence)
        call = self._sessions.reconnect(target, request)
        first = await call.read()  # closes the stream itself if cancelled
        if first is aio.EOF or first.WhichOneof("kind") != "reconnect_ack":
            call.cancel()
            raise _Redirect(None)
        status = first.reconnect_ack.status
        if status == pb.ReconnectAck.OK:
            stream.cursor.resumed(stream.cursor.released)  # keep what was released
            stream.history.append(f"resumed {stream.sub_id} after {after}")
            self._ready(stream)
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
        stream.sub_id, stream.subscribed, stream.cursor, stream.skip = None, False, None, None
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


async def end_on_server(
    engine: Engine,
    metadata: tuple[tuple[str, str], ...],
    ids: Sequence[tuple[int, str]],
    timeout_s: float,
) -> list[SevenDBError]:
    """Unsubscribe each (bucket, sub_id) - a replicated UNSUBSCRIBE: the node drops the
    subscription and its rows - retrying UNAVAILABLE (following the leader hint) for
    up to `timeout_s` in all. One already gone counts as ended. Returns the errors of
    those that could not be ended."""
    deadline = time.monotonic() + timeout_s

    async def end(bucket: int, sub_id: str) -> SevenDBError | None:
        request = pb.UnsubscribeRequest(sub_id=sub_id, bucket=bucket)
        target, backoff = engine.any_endpoint(), 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                await engine.stub(target).Unsubscribe(
                    request, metadata=metadata, timeout=max(0.05, left)
                )
                return None
            except aio.AioRpcError as exc:
                detail = exc.details() or ""
                typed = domain_error(exc.code(), detail, trailer(exc, ERROR_CODE_KEY))
                if typed is not None:
                    return None if typed.code is ErrorCode.SUBSCRIPTION_NOT_FOUND else typed
                if time.monotonic() + backoff > deadline:
                    return Unavailable(f"unsubscribe {sub_id}: {exc.code().name}: {detail}")
                hint = leader_hint(exc)
                target = hint or engine.any_endpoint()
                await asyncio.sleep(0 if hint else backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 1.0)

    results = await asyncio.gather(*(end(bucket, sub_id) for bucket, sub_id in ids))
    return [r for r in results if r is not None]


__all__ = [
    "BucketStream",
    "BucketStreams",
    "Event",
    "Recovery",
    "StreamReset",
    "StreamResetReason",
    "end_on_server",
    "offer_events",
]
