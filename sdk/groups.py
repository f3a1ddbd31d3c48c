"""Consumer groups in the SDK: ``subscribe(query, group="workers")``.

Every process that subscribes to a query with the same group name (and principal)
is a member; the query's buckets are dealt over the live members, one owner per
bucket at a time (docs/sdk.md, "Consumer groups"). A `GroupSubscription`:

* beats every bucket of the query (`GroupBeat`, a replicated entry) when it starts,
  every `BEAT_INTERVAL_S` (1 s; a third of its session timeout if that is shorter), and
  when it closes (leaving): each answer names
  the bucket's owner and generation, as the bucket's state machine decided;
* for each bucket it owns, holds a one-bucket durable subscription of the group's
  name carrying its `(member, generation)` (sdk/subscription.py, explicit acks),
  which resumes after the group's acknowledged position in that bucket;
* drops a bucket it no longer owns at once: its events still queued are never handed
  out, and the node refuses anything of the old term (`GROUP_FENCED`);
* hands the application one merged stream; with `AckMode.AUTO` an event is processed
  (and acked through its bucket's subscription) when the next is asked for, as for a
  `Subscription`; with `AckMode.EXPLICIT`, `ack(event)` of a bucket the member no
  longer owns raises `GroupFenced`.

Works on an `AsyncClient`'s loop; a `Client` uses it from its threads through its
loop (``for``, `poll`, `close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.errors import GroupFenced, InvalidArgument, SevenDBError
from sevendb.outbox.groups import SESSION_TIMEOUT_MS_MAX, SESSION_TIMEOUT_MS_MIN
from sevendb.outbox.query import Query
from sevendb.sdk.engine import Engine
from sevendb.sdk.errors import Unavailable
from sevendb.sdk.streams import Event
from sevendb.sdk.subscription import AckMode, SubscribeOptions, Subscription

log = logging.getLogger(__name__)

SESSION_TIMEOUT_S_DEFAULT: Final = 10.0
"""A member that has not beaten for this long loses its buckets (docs/limits.md)."""

BEAT_INTERVAL_S: Final = 1.0
"""How often a member beats (a third of its session timeout if shorter): a bucket
whose owner changes waits for its new owner's next beat, so this bounds a rebalance
(Kafka's `heartbeat.interval.ms` is 3 s)."""

_CLOSED: Final = object()


@dataclass(frozen=True, slots=True)
class Ownership:
    """The bucket's owner and generation as the last beat answered."""

    owner: str
    generation: int
    members: tuple[str, ...]


class _Member(Protocol):
    """What a group needs of its client (an `AsyncClient`)."""

    async def _group_beat(
        self, query: Query, bucket: int, group: str, member: str, timeout_ms: int, leaving: bool
    ) -> Ownership: ...

    async def _subscribe_owned(
        self,
        query: Query,
        bucket: int,
        group: str,
        fence: tuple[str, int],
        options: SubscribeOptions,
    ) -> Subscription: ...


@dataclass(slots=True)
class _Owned:
    bucket: int
    generation: int
    sub: Subscription
    pump: asyncio.Task[None] | None = None


@dataclass(slots=True)
class GroupStats:
    """Counters of one member."""

    owned: dict[int, int] = field(default_factory=dict)
    """bucket -> generation, for each bucket the member owns now."""
    rebalances: int = 0
    """Times a bucket came to or left this member."""
    dropped: int = 0
    """Events of a bucket lost to another member before they were handed out."""


def check_group(group: object, session_timeout_s: object) -> int:
    """`InvalidArgument` for a bad group name or session timeout; the timeout in ms."""
    if not isinstance(group, str) or not group:
        raise InvalidArgument(f"group must be a non-empty name, not {group!r}")
    if isinstance(session_timeout_s, bool) or not isinstance(session_timeout_s, int | float):
        raise InvalidArgument(f"session_timeout_s must be a number, not {session_timeout_s!r}")
    timeout_ms = round(session_timeout_s * 1000)
    if not SESSION_TIMEOUT_MS_MIN <= timeout_ms <= SESSION_TIMEOUT_MS_MAX:
        raise InvalidArgument(
            f"session_timeout_s must be in [{SESSION_TIMEOUT_MS_MIN / 1000:g}, "
            f"{SESSION_TIMEOUT_MS_MAX / 1000:g}], not {session_timeout_s!r}"
        )
    return timeout_ms


class GroupSubscription:
    """One member of a consumer group over `query` (made by ``subscribe(query,
    group=NAME)``). Iterate it (``for`` / ``async for``, or `poll`); close it (or use
    ``with`` / ``async with``) to leave the group: its buckets move to the others."""

    def __init__(
        self,
        client: _Member,
        engine: Engine,
        query: Query,
        buckets: Sequence[int],
        group: str,
        *,
        options: SubscribeOptions | None = None,
        session_timeout_s: float = SESSION_TIMEOUT_S_DEFAULT,
        member: str | None = None,
    ) -> None:
        timeout_ms = check_group(group, session_timeout_s)
        self.query = query
        self.group = group
        self.member = member or uuid.uuid4().hex
        """This member's id (unique per process and subscribe)."""
        self.options = options or SubscribeOptions()
        self._inner_options = dataclasses.replace(self.options, ack=AckMode.EXPLICIT)
        self._client = client
        self._engine = engine
        self._buckets = tuple(buckets)
        self._timeout_ms = timeout_ms
        self._owned: dict[int, _Owned] = {}
        self._queue: asyncio.Queue[tuple[_Owned, Event] | object] = asyncio.Queue()
        self._returned: list[tuple[_Owned, Event]] = []
        """Taken for a blocking caller that was interrupted first: next out (a stack)."""
        self._in_transit: dict[object, tuple[_Owned, Event]] = {}
        """Taken for a blocking caller, not handed out yet (`_blocking_next`)."""
        self._last: tuple[_Owned, Event] | None = None
        """AUTO: the event in the application's hands (processed when it asks again)."""
        self._given: dict[tuple[int, EmitSeq, int], _Owned] = {}
        """EXPLICIT: handed-out events not yet acked, by (bucket, emit_seq, change)."""
        self._beats: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self.stats = GroupStats()

    # ---- membership ---------------------------------------------------------------------

    async def _start(self) -> None:
        """Join every bucket; what refuses a join (no read permission on the query, the
        cluster unreachable for the `RetryPolicy` deadline, ...) is raised, after
        leaving again."""
        try:
            await self._beat_all(strict=True)
        except BaseException as exc:
            await self.aclose(leave=not isinstance(exc, Unavailable))
            raise
        self._beats = asyncio.get_running_loop().create_task(self._beat_forever())

    async def _beat_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(min(BEAT_INTERVAL_S, self._timeout_ms / 3000))
            try:
                await self._beat_all()
            except SevenDBError as exc:  # unavailable for a while: beat again next time
                log.warning("group %s: beat failed: %s", self.group, exc)

    async def _beat_all(self, leaving: bool = False, *, strict: bool = False) -> None:
        async with self._lock:
            answers = await asyncio.gather(
                *(
                    self._client._group_beat(
                        self.query, b, self.group, self.member, self._timeout_ms, leaving
                    )
                    for b in self._buckets
                ),
                return_exceptions=True,
            )
            if leaving:
                return
            for bucket, answer in zip(self._buckets, answers, strict=True):
                if isinstance(answer, BaseException):
                    if strict:
                        raise answer
                    log.warning("group %s: bucket %d beat failed: %r", self.group, bucket, answer)
                    continue
                await self._assign(bucket, answer)

    async def _assign(self, bucket: int, now: Ownership) -> None:
        """Follow the bucket's owner: drop a term that ended, start one that began."""
        current = self._owned.get(bucket)
        mine = now.owner == self.member
        if current is not None and (not mine or current.generation != now.generation):
            await self._drop(current)
        if mine and (current is None or current.generation != now.generation):
            try:
                sub = await self._client._subscribe_owned(
                    self.query,
                    bucket,
                    self.group,
                    (self.member, now.generation),
                    self._inner_options,
                )
            except SevenDBError as exc:  # the term ended meanwhile (GROUP_FENCED), or
                # the bucket is unreachable for now: the next beat decides again
                log.info("group %s: bucket %d not taken: %s", self.group, bucket, exc)
                return
            owned = _Owned(bucket, now.generation, sub)
            owned.pump = asyncio.get_running_loop().create_task(self._pump(owned))
            self._owned[bucket] = owned
            self.stats.owned[bucket] = now.generation
            self.stats.rebalances += 1

    async def _drop(self, owned: _Owned, *, flush: bool = False) -> None:
        if self._owned.get(owned.bucket) is owned:
            del self._owned[owned.bucket]
            self.stats.owned.pop(owned.bucket, None)
            self.stats.rebalances += 1
        if owned.pump is not None:
            owned.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await owned.pump
        try:
            await owned.sub.aclose(flush=flush)  # durable: detached, kept for the next owner
        except SevenDBError as exc:
            log.info("group %s: bucket %d closed: %s", self.group, owned.bucket, exc)

    async def _pump(self, owned: _Owned) -> None:
        try:
            async for event in owned.sub:
                await self._queue.put((owned, event))
        except SevenDBError as exc:  # fenced or broken: the next beat decides the bucket
            log.info("group %s: bucket %d stream ended: %s", self.group, owned.bucket, exc)
            if self._owned.get(owned.bucket) is owned:
                del self._owned[owned.bucket]
                self.stats.owned.pop(owned.bucket, None)
                self.stats.rebalances += 1
            with contextlib.suppress(SevenDBError):
                await owned.sub.aclose(flush=False)

    # ---- the application side -------------------------------------------------------------

    def _current(self, owned: _Owned) -> bool:
        return self._owned.get(owned.bucket) is owned

    def _mark_processed(self) -> None:
        if self._last is not None:
            owned, event = self._last
            self._last = None
            if self._current(owned):
                owned.sub.ack(event)

    async def _next(self) -> Event:
        if self.options.ack is AckMode.AUTO:
            self._mark_processed()
        item = await self._next_item()
        self._hand(item)
        return item[1]

    async def _next_item(self) -> tuple[_Owned, Event]:
        """The next event of a bucket this member still owns, not handed out yet
        (StopAsyncIteration once closed)."""
        while True:
            if self._closed:
                raise StopAsyncIteration
            item = self._returned.pop() if self._returned else await self._queue.get()
            if item is _CLOSED:
                raise StopAsyncIteration
            assert isinstance(item, tuple)
            owned, event = item
            if not self._current(owned):
                self.stats.dropped += 1  # its bucket moved: the new owner has it
                continue
            return owned, event

    def _hand(self, item: tuple[_Owned, Event]) -> None:
        """`item`'s event is in the application's hands now: in hand until the next
        one is asked for (AUTO), or awaiting its ack (EXPLICIT)."""
        owned, event = item
        if self.options.ack is AckMode.AUTO:
            self._last = item
        else:
            self._given[_key(event)] = owned

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        return await self._next()

    async def apoll(self, timeout_s: float = 0.0) -> Event | None:
        """The next event, or None after `timeout_s` (or once closed)."""
        try:
            return await asyncio.wait_for(self._next(), timeout_s)
        except (TimeoutError, StopAsyncIteration):
            return None

    def ack(self, event: Event) -> None:
        """EXPLICIT: `event` is processed. `GroupFenced` if its bucket has moved to
        another member since it was handed out (the other member gets it again)."""
        owned = self._given.pop(_key(event), None)
        if owned is None:
            raise InvalidArgument(f"event {event.emit_seq} was not handed out, or is acked")
        if not self._current(owned):
            raise GroupFenced(
                f"group {self.group!r}: bucket {event.bucket} moved to another member "
                f"(this member's generation {owned.generation} ended); not acknowledged"
            )
        self._run_soon(lambda: owned.sub.ack(event))

    def _run_soon(self, fn: Callable[[], None]) -> None:
        if self._engine.on_loop_thread():
            fn()
        else:
            self._engine.loop.call_soon_threadsafe(fn)

    async def aclose(self, *, leave: bool = True) -> None:
        """Leave the group: the last processed event is acked (and the acks flushed)
        while this member still owns its buckets, then it leaves them to the others
        (`leave=False`: they move once its session times out)."""
        if self._closed:
            return
        if self.options.ack is AckMode.AUTO:
            self._mark_processed()
        self._closed = True
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
        async with self._lock:
            for owned in list(self._owned.values()):
                await self._drop(owned, flush=True)
        if leave:
            with contextlib.suppress(SevenDBError):
                await self._beat_all(leaving=True)
        self._queue.put_nowait(_CLOSED)

    async def __aenter__(self) -> GroupSubscription:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self._last = None  # the event in hand was not processed
        await self.aclose()

    # ---- from a `Client`'s threads -------------------------------------------------------

    def _blocking(self, make: Callable[[], Awaitable[object]], timeout: float | None) -> object:
        if self._engine.on_loop_thread():
            raise InvalidArgument("a blocking call on the client's own loop: use the coroutines")

        async def run() -> object:
            return await make()

        return self._engine.submit(run()).result(timeout)

    def poll(self, timeout_s: float = 0.0) -> Event | None:
        return self._blocking_next(timeout_s)

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        got = self._blocking_next(None)
        if got is None:
            raise StopIteration
        return got

    def _blocking_next(self, timeout_s: float | None) -> Event | None:
        """The next event for a blocking caller, or None (after `timeout_s`, or once
        closed). It is handed out only once this thread has it: a wait interrupted
        here (Ctrl-C: KeyboardInterrupt) stops taking events on the loop, and an event
        it took goes back to the front of the queue, so closing never marks processed
        an event the caller did not get."""
        if self._engine.on_loop_thread():
            raise InvalidArgument("a blocking call on the client's own loop: use the coroutines")
        token = object()

        async def take() -> bool:
            if self.options.ack is AckMode.AUTO:
                self._mark_processed()
            try:  # in this task (not wait_for's own): cancelled, it has taken nothing
                async with asyncio.timeout(timeout_s):
                    self._in_transit[token] = await self._next_item()
            except (TimeoutError, StopAsyncIteration):
                return False
            return True

        future = self._engine.submit(take())
        got: tuple[_Owned, Event] | None = None
        try:
            if not future.result():
                return None
            got = self._in_transit[token]
            self._run_soon(lambda: self._hand(self._in_transit.pop(token)))
            return got[1]
        except BaseException:
            future.cancel()
            self._run_soon(lambda: self._give_back(token, got))
            raise

    def _give_back(self, token: object, handed: tuple[_Owned, Event] | None) -> None:
        """Undo `_blocking_next` for a caller interrupted before it had the event."""
        item = self._in_transit.pop(token, None) or handed
        if item is None:
            return  # it took nothing
        if self._last is item:
            self._last = None
        elif self.options.ack is AckMode.EXPLICIT:
            self._given.pop(_key(item[1]), None)
        self._returned.append(item)

    def close(self) -> None:
        self._blocking(self.aclose, 60)

    def __enter__(self) -> GroupSubscription:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self._last = None
        self.close()


def _key(event: Event) -> tuple[int, EmitSeq, int]:
    return (event.bucket, event.emit_seq, event.position[1] if event.position else 0)


__all__ = [
    "SESSION_TIMEOUT_S_DEFAULT",
    "check_group",
    "GroupStats",
    "GroupSubscription",
    "Ownership",
]
