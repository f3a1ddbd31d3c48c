"""Client-side write batching: concurrent writes share `WriteMany` requests.

A write leaves at once while fewer than `eager_calls` requests are in flight to its
node: under light load nothing waits. Beyond that, since a gRPC call costs a node
more CPU than replicating a write, every write waiting goes out in the next request
(up to `batch_writes_max`) once an answer comes back; another request leaves
meanwhile only with `pipeline_min_writes` waiting.
Requests travel on one long-lived `WriteStream` per node and are answered by id; one
unanswered after `call_timeout_s`, or on a stream that breaks, fails like a call
(its writes are retried). The figures behind these choices: docs/performance.md
("stop 17" and "Durable writes").

Each write keeps its own outcome. UNAVAILABLE (no leader, a leader change, a dead
node) retries it, following the leader hint, with jittered backoff until the
`RetryPolicy` deadline; RESOURCE_EXHAUSTED (a rate limit) retries it after the wait
the node names in its `retry-after-ms` trailer; rejections (a failed precondition,
...) are never retried. A bucket's failed writes are retried together, in the order
they were submitted, in one *round* per bucket (later writes of that bucket join the
round instead of overtaking it): a producer's sequence must reach the log in order.

Writes with a producer (every `Client` write: `sevendb.sdk.producer`) are sequenced
here, on the loop, in submission order: a retry of a write whose answer was lost
returns the original commit instead of applying it again. At most
`SEQUENCES_IN_FLIGHT_MAX` sequences of a bucket are unanswered at once; later writes
of the bucket wait here (in the queue's bounds below) until earlier ones are
answered, so that a node still keeps the result of every write that may be retried.

The queue is bounded (`max_writes` unanswered writes, `max_bytes` of them): a
`submit` beyond it blocks until writes are answered, for up to `wait_s`, then raises
`ResourceExhausted` (at once on the loop's own thread, which must not block).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import grpc
from grpc import aio

from sevendb.outbox.errors import DuplicateSequence, ErrorCode, InvalidArgument, SevenDBError
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk.engine import (
    ERROR_CODE_KEY,
    RETRY_AFTER_KEY,
    Engine,
    leader_hint,
    status_code,
    trailer,
)
from sevendb.sdk.errors import (
    ClientClosed,
    ResourceExhausted,
    Unavailable,
    domain_error,
    retry_after_s,
)
from sevendb.sdk.producer import (
    IN_LOG_CODES,
    RESET_CODES,
    SEQUENCES_IN_FLIGHT_MAX,
    Producer,
    init_producer,
)

BATCH_WRITES_MAX: Final = 512
BATCH_BYTES_MAX: Final = 3 * 1024 * 1024
"""Below the node's 4 MiB message limit."""
CALLS_IN_FLIGHT: Final = 4
EAGER_CALLS: Final = 2
"""Requests in flight to a node below which a write leaves at once."""
PIPELINE_MIN_WRITES: Final = 64
"""A request leaves while `EAGER_CALLS` are in flight to the node only with this many
writes."""
QUEUE_WRITES_MAX: Final = 20_000
QUEUE_BYTES_MAX: Final = 64 * 1024 * 1024
QUEUE_WAIT_S: Final = 10.0
"""Defaults of `WriteQueue`: unanswered writes (and their bytes) a client holds, and
how long a write waits for room."""
_REF_BYTES: Final = 48
"""What a ProducerRef adds to a write's size, at most (four varints and its tag)."""
T = TypeVar("T")
_Key = tuple[Producer, int]
"""A producer in a bucket."""


@dataclass(eq=False)
class _Pending:
    request: pb.WriteRequest
    bucket: int
    deadline: float
    size: int
    producer: Producer | None = None
    future: Future[Any] | asyncio.Future[Any] = field(default_factory=Future)
    """Where its outcome goes: a thread-safe future for `submit`, or the loop's own
    for `submit_async` (the writes are settled on the loop)."""
    attempts: int = 0
    backoff_s: float = 0.0
    seq: int = -1
    """Its producer sequence (-1: not sequenced yet, or sequenced again after a reset)."""
    generation: int = -1
    """The producer generation `seq` belongs to."""
    ambiguous: bool = False
    """An attempt failed in a way that may have reached the log (its outcome unknown)."""
    settled: bool = False
    order: int = 0
    """Its place in submission order."""


@dataclass(frozen=True, slots=True)
class _CallFailure:
    """Why a request on a write stream got no answer (the status a call would end with)."""

    code: grpc.StatusCode
    message: str
    error: str | None = None
    hint: str | None = None
    retry_after: float | None = None


@dataclass(eq=False)
class _Stream:
    """One WriteStream to a node: requests go out one at a time and are answered by id."""

    call: Any  # aio.StreamStreamCall
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    waiting: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    sending: asyncio.Lock = field(default_factory=asyncio.Lock)
    reader: asyncio.Task[None] | None = None


@dataclass
class _Quota:
    """How much of the write queue unanswered writes take (`WriteQueue`'s bounds)."""

    max_writes: int
    max_bytes: int
    writes: int = 0
    size: int = 0

    def fits(self, size: int) -> bool:
        """A write larger than `max_bytes` fits an empty queue."""
        if self.writes >= self.max_writes:
            return False
        return self.writes == 0 or self.size + size <= self.max_bytes

    def take(self, size: int) -> None:
        self.writes += 1
        self.size += size

    def give(self, size: int) -> None:
        self.writes -= 1
        self.size -= size

    def full(self) -> str:
        """Why a write does not fit."""
        return (
            f"the client's write queue is full ({self.writes} writes, {self.size} bytes "
            f"unanswered; WriteQueue(max_writes={self.max_writes}, "
            f"max_bytes={self.max_bytes}))"
        )


class WritePipeline(Generic[T]):
    """Per-node queues of writes on the SDK's loop; see the module docstring. A
    committed write's future holds `convert(WriteResponse)`: one future per write."""

    def __init__(
        self,
        engine: Engine,
        metadata: tuple[tuple[str, str], ...],
        convert: Callable[[pb.WriteResponse], T],
        *,
        deadline_s: float,
        call_timeout_s: float,
        backoff_initial_s: float,
        backoff_max_s: float,
        batch_writes_max: int = BATCH_WRITES_MAX,
        calls_in_flight: int = CALLS_IN_FLIGHT,
        eager_calls: int = EAGER_CALLS,
        pipeline_min_writes: int = PIPELINE_MIN_WRITES,
        max_writes: int = QUEUE_WRITES_MAX,
        max_bytes: int = QUEUE_BYTES_MAX,
        wait_s: float = QUEUE_WAIT_S,
        sequences_in_flight: int = SEQUENCES_IN_FLIGHT_MAX,
    ) -> None:
        self._engine = engine
        self._metadata = metadata
        self._convert = convert
        self._deadline_s = deadline_s
        self._call_timeout_s = call_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._batch_max = batch_writes_max
        self._calls_max = calls_in_flight
        self._eager_calls = eager_calls
        self._pipeline_min = pipeline_min_writes
        self._wait_s = wait_s
        self._window = sequences_in_flight
        self._leaders: dict[int, str] = {}
        self._queues: dict[str, collections.deque[_Pending]] = {}
        self._calls: dict[str, int] = {}
        self._streams: dict[str, _Stream] = {}
        self._inbox: collections.deque[_Pending] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._room = threading.Condition(self._inbox_lock)
        """Signalled when writes are answered while a `submit` waits for room."""
        self._quota = _Quota(max_writes, max_bytes)
        """Under `_inbox_lock`: the queue's room taken by unanswered writes."""
        self._waiters = 0
        self._room_async: list[asyncio.Future[None]] = []
        """Coroutines of `submit_async` awaiting room (loop only)."""
        self._drain_scheduled = False
        self._closed = False
        self._parked: dict[int, list[_Pending]] = {}
        """A bucket's writes waiting for its next retry round (in no queue until then)."""
        self._rounds: dict[int, asyncio.TimerHandle] = {}
        self._initialising: dict[tuple[Producer, int], list[_Pending]] = {}
        """Writes waiting for their producer's InitProducer in their bucket."""
        self._held: dict[_Key, list[tuple[int, _Pending]]] = {}
        """Writes waiting for a sequence: their bucket has `sequences_in_flight`
        unanswered (a heap in submission order)."""
        self._releasing: set[_Key] = set()
        self._orders = itertools.count()
        self._inits: set[asyncio.Task[None]] = set()
        self._sending: dict[asyncio.Task[None], list[_Pending]] = {}
        """Requests in flight (or about to leave) and their writes."""
        self.calls = 0
        self.writes = 0

    def submit(
        self, request: pb.WriteRequest, bucket: int, producer: Producer | None = None
    ) -> Future[T]:
        """Queue a write (any thread); the future holds its converted response or error.
        A write too large for a request is refused here: sent, it would end the stream
        (RESOURCE_EXHAUSTED) for every write in flight on it. With `producer`, the
        write is sequenced (idempotent). Blocks while the queue is full (see the
        module docstring)."""
        future: Future[T] = Future()
        pending = self._pending(request, bucket, producer, future, _size(request, producer))
        self._admit(pending, on_loop=False)
        return future

    def _pending(
        self,
        request: pb.WriteRequest,
        bucket: int,
        producer: Producer | None,
        future: Future[Any] | asyncio.Future[Any],
        size: int,
    ) -> _Pending:
        return _Pending(
            request,
            bucket,
            time.monotonic() + self._deadline_s,
            size,
            producer,
            future,
            backoff_s=self._backoff_initial_s,
        )

    def _admit(self, pending: _Pending, *, on_loop: bool) -> None:
        """Take the write's room in the queue (waiting for it off the loop) and have
        the loop drain the inbox: from the loop itself without waking it through its
        self-pipe."""
        with self._inbox_lock:
            if self._closed:
                raise _closing()
            if not self._quota.fits(pending.size):
                self._wait_for_room(pending.size)
            self._quota.take(pending.size)
            pending.order = next(self._orders)
            self._inbox.append(pending)
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        if on_loop:
            self._engine.loop.call_soon(self._drain)
            return
        try:
            self._engine.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: fail this write, not the next ones
            with self._inbox_lock:
                self._drain_scheduled = False
                self._inbox.remove(pending)
                self._quota.give(pending.size)
            raise

    async def submit_async(
        self, request: pb.WriteRequest, bucket: int, producer: Producer | None = None
    ) -> T:
        """`submit` from a coroutine on the pipeline's own loop (an `AsyncClient`),
        answered when the write is: while the queue is full it *awaits* room, for up
        to `wait_s`, instead of blocking the loop, then raises `ResourceExhausted`."""
        size = _size(request, producer)
        loop = self._engine.loop
        deadline = loop.time() + self._wait_s
        while True:
            with self._inbox_lock:
                if self._closed or self._quota.fits(size):
                    break
                full = self._quota.full()
            left = deadline - loop.time()
            if left <= 0:
                raise ResourceExhausted(f"{full} for {self._wait_s} s")
            room: asyncio.Future[None] = loop.create_future()
            self._room_async.append(room)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room, left)
        # The pipeline settles writes on this loop: the answer is set right there, in
        # the loop's own future (a thread-safe one with a callback handing its outcome
        # over cost ~5 us more per write: docs/performance.md, "tenth session").
        answer: asyncio.Future[T] = loop.create_future()
        self._admit(self._pending(request, bucket, producer, answer, size), on_loop=True)
        return await answer

    def _wait_for_room(self, size: int) -> None:
        """Under `_inbox_lock`: wait until the write fits, or raise."""
        full = self._quota.full()
        if self._engine.on_loop_thread():
            raise ResourceExhausted(f"{full}: a write from the client's own loop cannot wait")
        deadline = time.monotonic() + self._wait_s
        self._waiters += 1
        try:
            while not self._closed and not self._quota.fits(size):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResourceExhausted(f"{full} for {self._wait_s} s")
                self._room.wait(left)
        finally:
            self._waiters -= 1
        if self._closed:
            raise _closing()

    def _settle(
        self, pending: _Pending, result: Any = None, error: BaseException | None = None
    ) -> None:
        """Answer a write (once), and give its room in the queue back."""
        if pending.settled:
            return
        pending.settled = True
        producer = pending.producer
        if producer is not None and pending.seq >= 0:
            producer.answered(pending.bucket, pending.seq, pending.generation)
            self._release_soon((producer, pending.bucket))
        with self._inbox_lock:
            self._quota.give(pending.size)
            if self._waiters:
                self._room.notify_all()
        if self._room_async:  # coroutines awaiting room (`submit_async`): on the loop
            waiting, self._room_async = self._room_async, []
            for room in waiting:
                if not room.done():
                    room.set_result(None)
        # The caller cancelled its future (a coroutine awaiting it was cancelled).
        with contextlib.suppress(InvalidStateError, asyncio.InvalidStateError):
            if error is not None:
                pending.future.set_exception(error)
            else:
                pending.future.set_result(result)

    async def close(self) -> None:
        """On the loop, before the client's channels close: every write not answered
        yet (queued, waiting out a backoff or an InitProducer, or in flight) fails
        with "the client is closing" instead of waiting forever on a loop that is
        about to stop; so does a `submit` waiting for room."""
        with self._inbox_lock:
            self._closed = True
            waiting = list(self._inbox)
            self._inbox.clear()
            self._room.notify_all()
        for room in self._room_async:  # `submit_async` waiting for room: it raises now
            if not room.done():
                room.set_result(None)
        self._room_async.clear()
        for timer in self._rounds.values():
            timer.cancel()
        for task in self._inits:
            task.cancel()
        for group in (*self._parked.values(), *self._initialising.values(), *self._queues.values()):
            waiting.extend(group)
        for held in self._held.values():
            waiting.extend(pending for _, pending in sorted(held))
        self._held.clear()
        self._rounds.clear()
        self._parked.clear()
        self._initialising.clear()
        self._queues.clear()
        for pending in waiting:
            self._settle(pending, error=_closing())
        sending = list(self._sending.items())
        for task, _ in sending:
            task.cancel()  # `_send` settles its batch on the way out, if it started
        await asyncio.gather(*(task for task, _ in sending), return_exceptions=True)
        for _, batch in sending:  # a task cancelled before it ran settled nothing
            for pending in batch:
                self._settle(pending, error=_closing())
        for stream in list(self._streams.values()):
            if stream.reader is not None:
                stream.reader.cancel()
            stream.call.cancel()

    # ---- the loop side ---------------------------------------------------------------

    def _drain(self) -> None:
        with self._inbox_lock:
            self._drain_scheduled = False
            taken = list(self._inbox)
            self._inbox.clear()
        targets: set[str] = set()
        for pending in taken:
            self._route(pending, targets)
        for target in targets:
            self._kick(target)

    def _route(self, pending: _Pending, targets: set[str]) -> None:
        """Send a write next: sequenced first if it has a producer (after its
        InitProducer), behind its bucket's retry round if one is due."""
        if self._closed:
            self._settle(pending, error=_closing())
            return
        producer = pending.producer
        if producer is not None and pending.seq < 0:
            key = (producer, pending.bucket)
            if key in self._held or not producer.has_room(pending.bucket, self._window):
                heapq.heappush(self._held.setdefault(key, []), (pending.order, pending))
                self._release_soon(key)
                return
            if not producer.ready(pending.bucket):
                self._await_init(producer, pending)
                return
            self._sequence(producer, pending)
        self._enqueue(pending, targets)

    def _sequence(self, producer: Producer, pending: _Pending) -> None:
        epoch, pending.seq, pending.generation = producer.take(pending.bucket)
        ref = pending.request.producer
        ref.producer_id, ref.producer_epoch, ref.sequence, ref.answered_below = (
            producer.producer_id,
            epoch,
            pending.seq,
            producer.buckets[pending.bucket].answered_below,
        )

    def _release_soon(self, key: _Key) -> None:
        """Release held writes once the loop is done with what answered (or reset)
        the writes before them."""
        if key in self._held and key not in self._releasing:
            self._releasing.add(key)
            self._engine.loop.call_soon(self._release, key)

    def _release(self, key: _Key) -> None:
        """Send the writes held for `key`, in submission order, while there is room."""
        self._releasing.discard(key)
        held = self._held.get(key)
        if held is None or self._closed:
            return
        producer, bucket = key
        targets: set[str] = set()
        while held and producer.has_room(bucket, self._window):
            _, pending = heapq.heappop(held)
            if producer.ready(bucket):
                self._sequence(producer, pending)
                self._enqueue(pending, targets)
            else:
                self._await_init(producer, pending)
        if not held:
            del self._held[key]
        for target in targets:
            self._kick(target)

    def _enqueue(self, pending: _Pending, targets: set[str]) -> None:
        """Into its node's queue, or behind its bucket's retry round if one is due."""
        if pending.bucket in self._rounds:
            self._parked[pending.bucket].append(pending)  # in order, after the retries
            return
        target = self._leaders.get(pending.bucket)
        if target is None:  # one guess per bucket: its writes leave in order to one node
            target = self._leaders[pending.bucket] = self._engine.any_endpoint()
        self._queues.setdefault(target, collections.deque()).append(pending)
        targets.add(target)

    def _await_init(self, producer: Producer, pending: _Pending) -> None:
        key = (producer, pending.bucket)
        waiting = self._initialising.get(key)
        if waiting is not None:
            waiting.append(pending)
            return
        self._initialising[key] = [pending]
        producer.bucket(pending.bucket).initialising = True
        task = self._engine.loop.create_task(self._init(producer, pending.bucket))
        self._inits.add(task)
        task.add_done_callback(self._inits.discard)

    async def _init(self, producer: Producer, bucket: int) -> None:
        """InitProducer for the writes waiting in `_initialising`, then send them.
        Those whose deadline passes first fail; a refusal fails them all."""
        key = (producer, bucket)
        request = pb.InitProducerRequest(producer_id=producer.producer_id, bucket=bucket)
        try:
            while waiting := self._initialising.get(key):
                try:
                    epoch = await init_producer(
                        self._engine,
                        self._metadata,
                        request,
                        first_target=lambda: (
                            self._leaders.get(bucket) or self._engine.any_endpoint()
                        ),
                        deadline=min(p.deadline for p in waiting),
                        call_timeout_s=self._call_timeout_s,
                        backoff_initial_s=self._backoff_initial_s,
                        backoff_max_s=self._backoff_max_s,
                    )
                except (Unavailable, ResourceExhausted) as exc:
                    now = time.monotonic()
                    self._initialising[key] = [p for p in waiting if p.deadline > now]
                    for p in waiting:
                        if p.deadline <= now:
                            self._settle(p, error=exc)
                    continue
                except SevenDBError as exc:
                    for p in self._initialising.pop(key, []):
                        self._settle(p, error=exc)
                    return
                if producer.granted(bucket, epoch):
                    break
        finally:
            producer.bucket(bucket).initialising = False
        targets: set[str] = set()
        for pending in sorted(self._initialising.pop(key, []), key=lambda p: p.order):
            self._route(pending, targets)
        for target in targets:
            self._kick(target)

    def _park(self, pending: _Pending, delay_s: float) -> None:
        """Retry `pending` in its bucket's next round, no sooner than `delay_s`."""
        loop = self._engine.loop
        when = loop.time() + delay_s
        self._parked.setdefault(pending.bucket, []).append(pending)
        timer = self._rounds.get(pending.bucket)
        if timer is not None:
            if timer.when() >= when:
                return
            timer.cancel()
        self._rounds[pending.bucket] = loop.call_at(when, self._round, pending.bucket)

    def _round(self, bucket: int) -> None:
        """A bucket's retry round: its parked writes leave again, in sequence order
        (the unsequenced ones last, in the order they came)."""
        self._rounds.pop(bucket, None)
        parked = self._parked.pop(bucket, [])
        parked.sort(key=lambda p: (p.seq < 0, p.generation, p.seq))
        targets: set[str] = set()
        for pending in parked:
            self._route(pending, targets)
        for target in targets:
            self._kick(target)

    def _kick(self, target: str) -> None:
        queue = self._queues.get(target)
        while queue and (calls := self._calls.get(target, 0)) < self._calls_max:
            if calls >= self._eager_calls and len(queue) < self._pipeline_min:
                break  # wait for an answer in flight: it brings more writes to join these
            batch: list[_Pending] = []
            size = 0
            while queue and len(batch) < self._batch_max:
                if batch and size + queue[0].size > BATCH_BYTES_MAX:
                    break
                pending = queue.popleft()
                batch.append(pending)
                size += pending.size
            self._calls[target] = self._calls.get(target, 0) + 1
            task = self._engine.loop.create_task(self._send(target, batch))
            self._sending[task] = batch
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.pop(task, None)

    def _stream(self, target: str) -> _Stream:
        stream = self._streams.get(target)
        if stream is None:
            call = self._engine.stub(target).WriteStream(metadata=self._metadata)
            stream = self._streams[target] = _Stream(call)
            stream.reader = self._engine.loop.create_task(self._read(target, stream))
        return stream

    async def _read(self, target: str, stream: _Stream) -> None:
        """Hand each answer to its request; when the stream ends, fail the rest."""
        ended = _CallFailure(grpc.StatusCode.UNAVAILABLE, "the write stream ended")
        try:
            async for message in stream.call:
                for response in message.answers:
                    answer = stream.waiting.pop(response.id, None)
                    if answer is not None and not answer.done():
                        answer.set_result(response)
        except aio.AioRpcError as exc:
            code = exc.code()
            if code is grpc.StatusCode.INTERNAL:
                # What grpc reports when a write races with the end of the stream
                # (the node stopping, say): the transport broke, so like UNAVAILABLE.
                code = grpc.StatusCode.UNAVAILABLE
            ended = _CallFailure(
                code,
                exc.details() or "",
                trailer(exc, ERROR_CODE_KEY),
                leader_hint(exc),
                retry_after_s(trailer(exc, RETRY_AFTER_KEY)),
            )
        except asyncio.CancelledError:
            # The client closing, or the call cancelled here for any other reason (a
            # reset, or grpc itself): only closing is final, the rest is retried.
            ended = (
                _CallFailure(grpc.StatusCode.CANCELLED, "the client is closing")
                if self._closed
                else _CallFailure(grpc.StatusCode.UNAVAILABLE, "the write stream was reset")
            )
            raise
        finally:
            # Not held by the stream: the task's exception's traceback holds this frame,
            # and the call with it (a call keeps its connection open on both ends).
            stream.reader = None
            if self._streams.get(target) is stream:
                del self._streams[target]
            for answer in stream.waiting.values():
                if not answer.done():
                    answer.set_result(ended)
            stream.waiting.clear()

    def _expire(self, target: str, stream: _Stream, answer: asyncio.Future[Any]) -> None:
        """A request got no answer in time: fail it and reset its stream (a node
        answers every request within its own timeout, so the stream is broken)."""
        if answer.done():
            return
        answer.set_result(
            _CallFailure(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer from {target} within {self._call_timeout_s} s",
            )
        )
        if self._streams.get(target) is stream:
            del self._streams[target]
        stream.call.cancel()

    async def _send(self, target: str, batch: list[_Pending]) -> None:
        self.calls += 1
        self.writes += len(batch)
        try:
            response = await self._request(target, batch)
            if isinstance(response, _CallFailure):
                for pending in batch:
                    self._failed(pending, response, target)
            else:
                self._answered(target, batch, response)
        except BaseException as exc:  # never strand a batch: settle what is left, loudly
            closing = isinstance(exc, asyncio.CancelledError)
            failure = _closing() if closing else SevenDBError(f"write failed: {exc!r}")
            for pending in batch:
                self._settle(pending, error=failure)
            raise
        finally:
            self._calls[target] -= 1
            # After the inbox drain that writes made by the callbacks above scheduled,
            # so that those leave with the ones already waiting.
            self._engine.loop.call_soon(self._kick, target)

    async def _request(
        self, target: str, batch: list[_Pending]
    ) -> pb.WriteManyResponse | _CallFailure:
        """Send `batch` on the stream to `target`; its answer, or why there is none.
        Bounded by `call_timeout_s` in every case, also when the write itself hangs
        (a node that accepts connections but does not answer)."""
        loop = self._engine.loop
        try:
            stream = self._stream(target)
        except Exception as exc:  # e.g. the channel is closing
            return _CallFailure(grpc.StatusCode.UNAVAILABLE, f"no write stream to {target}: {exc}")
        request_id = next(stream.ids)
        answer: asyncio.Future[pb.WriteManyResponse | _CallFailure] = loop.create_future()
        stream.waiting[request_id] = answer
        timer = loop.call_later(self._call_timeout_s, self._expire, target, stream, answer)
        request = pb.WriteManyRequest(id=request_id, writes=[p.request for p in batch])
        writing = loop.create_task(self._write(stream, request, answer))
        try:
            await asyncio.wait((writing, answer), return_when=asyncio.FIRST_COMPLETED)
            return await answer  # written (or failed): the reader or the timer answers
        finally:
            timer.cancel()
            stream.waiting.pop(request_id, None)
            if not answer.done() or isinstance(answer.result(), _CallFailure):
                # The write may be stuck (a node that never reads): let it go. Never
                # after a real answer: the write task may not have resumed from a
                # write that did complete, and cancelling a task inside `call.write`
                # makes grpc cancel the whole call, failing every request on it.
                writing.cancel()

    @staticmethod
    async def _write(
        stream: _Stream, request: pb.WriteManyRequest, answer: asyncio.Future[Any]
    ) -> None:
        async with stream.sending:  # one message at a time on a stream
            try:
                await stream.call.write(request)
            except (aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the stream has failed: its reader answers with the status
            except Exception as exc:
                if not answer.done():
                    answer.set_result(
                        _CallFailure(grpc.StatusCode.UNKNOWN, f"write stream: {exc!r}")
                    )

    def _answered(self, target: str, batch: list[_Pending], response: pb.WriteManyResponse) -> None:
        for pending, outcome in zip(batch, response.outcomes, strict=True):
            if outcome.HasField("ok"):
                # A node names the leader only when it is another node.
                self._leaders[pending.bucket] = outcome.leader or target
                if not pending.settled:
                    self._settle(pending, self._convert(outcome.ok))
                continue
            code = status_code(outcome.code)
            failure = _CallFailure(
                code,
                outcome.message,
                outcome.error,
                outcome.leader,
                # A write's own RESOURCE_EXHAUSTED is a node refusing it for now (gRPC's
                # size limit ends the whole stream instead): retry after the backoff.
                0.0 if code is grpc.StatusCode.RESOURCE_EXHAUSTED else None,
            )
            self._failed(pending, failure, target)

    def _failed(self, pending: _Pending, failure: _CallFailure, target: str) -> None:
        if pending.settled:
            return
        code = failure.code
        if self._closed and code is grpc.StatusCode.CANCELLED:
            self._settle(pending, error=_closing())
            return
        typed = domain_error(code, failure.message, failure.error, failure.retry_after)
        if typed is not None:
            if pending.producer is None:
                self._settle(pending, error=typed)
            else:
                self._refused(pending, typed)
            return
        pending.ambiguous = True  # it may have reached the log before the failure
        hint = failure.hint
        if hint:
            self._leaders[pending.bucket] = hint
        elif self._leaders.get(pending.bucket) == target:
            del self._leaders[pending.bucket]  # it failed there: try another node
        pending.attempts += 1
        if failure.retry_after:  # the node named its wait (a rate limit)
            delay = failure.retry_after
        else:
            delay = 0.0 if hint and pending.attempts == 1 else pending.backoff_s
            delay *= 0.5 + random.random()
        pending.backoff_s = min(pending.backoff_s * 2, self._backoff_max_s)
        if time.monotonic() + delay > pending.deadline:
            self._give_up(pending, failure)
        else:
            self._park(pending, delay)

    def _give_up(self, pending: _Pending, failure: _CallFailure) -> None:
        """A write out of time: it fails, and (its outcome unknown) its producer's
        sequence in the bucket cannot continue past it."""
        if pending.producer is not None and pending.seq >= 0:
            pending.producer.new_generation(pending.bucket, pending.generation)
        detail = f"{failure.code.name}: {failure.message}"
        if failure.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._settle(
                pending,
                error=ResourceExhausted(
                    f"write refused for now after {pending.attempts} attempts: {detail}",
                    failure.retry_after or None,
                ),
            )
        else:
            self._settle(
                pending,
                error=Unavailable(
                    f"write not committed after {pending.attempts} attempts: {detail}"
                ),
            )

    def _refused(self, pending: _Pending, typed: SevenDBError) -> None:
        """A producer's write refused with `typed` (see `sevendb.sdk.producer`)."""
        producer = pending.producer
        assert producer is not None
        code = typed.code
        state = producer.bucket(pending.bucket)
        if code is ErrorCode.OUT_OF_ORDER_SEQUENCE and pending.generation == state.generation:
            # An earlier sequence is still on its way (being retried): after it.
            pending.attempts += 1
            if time.monotonic() + self._backoff_initial_s > pending.deadline:
                self._give_up(pending, _CallFailure(grpc.StatusCode.OUT_OF_RANGE, str(typed)))
            else:
                self._park(pending, self._backoff_initial_s)
        elif code in RESET_CODES or code is ErrorCode.OUT_OF_ORDER_SEQUENCE:
            producer.new_generation(pending.bucket, pending.generation)
            self._sequence_again(pending, typed)
        elif code is ErrorCode.DUPLICATE_SEQUENCE:
            self._result_lost(pending, typed)
        else:
            if code not in IN_LOG_CODES:  # refused before the log: its sequence is unused
                if pending.ambiguous:  # ... unless an earlier attempt used it
                    producer.new_generation(pending.bucket, pending.generation)
                else:
                    producer.give_back(pending.bucket, pending.seq, pending.generation)
                pending.seq = -1  # it holds no sequence any more
            self._settle(pending, error=typed)

    def _result_lost(self, pending: _Pending, typed: SevenDBError) -> None:
        """A retry answered DUPLICATE_SEQUENCE: an earlier attempt of the write reached
        the log (once: never twice), and the node no longer keeps its result. Within
        `sequences_in_flight` this cannot happen (a node keeps as many results); a
        node keeping fewer could. An unconditional write then committed: success,
        its position unknown. A conditional one may have been refused by its
        preconditions instead: `DuplicateSequence`, saying so (docs/errors.md)."""
        if _conditional(pending.request):
            self._settle(
                pending,
                error=DuplicateSequence(
                    "the write reached the log once (it is never applied twice), but its "
                    "result is no longer kept: whether its preconditions held, and so "
                    f"whether it applied, is unknown; read its keys to find out ({typed})"
                ),
            )
        else:
            unknown = pb.WriteResponse(bucket=pending.bucket, duplicate=True)  # no `committed`
            self._settle(pending, self._convert(unknown))

    def _sequence_again(self, pending: _Pending, typed: SevenDBError) -> None:
        """A write of a producer generation that ended: never applied unless an
        attempt of it may have reached the log. Then its outcome is unknown and it
        fails; otherwise it is sent again with a sequence of the new generation."""
        if pending.ambiguous:
            self._settle(
                pending,
                error=Unavailable(
                    "the write's outcome is unknown: an attempt may have committed before "
                    f"its producer's sequence had to start again ({typed})"
                ),
            )
            return
        if time.monotonic() > pending.deadline:
            self._settle(pending, error=Unavailable(f"write not committed in time: {typed}"))
            return
        pending.seq = pending.generation = -1
        targets: set[str] = set()
        self._route(pending, targets)
        for target in targets:
            self._kick(target)


def _size(request: pb.WriteRequest, producer: Producer | None) -> int:
    """What a write adds to the queue; one too large for a request is refused here:
    sent, it would end the stream (RESOURCE_EXHAUSTED) for every write in flight."""
    size = request.ByteSize() + (_REF_BYTES if producer is not None else 0)
    if size > BATCH_BYTES_MAX:
        raise InvalidArgument(f"a write of {size} bytes; the limit is {BATCH_BYTES_MAX}")
    return size


def _conditional(request: pb.WriteRequest) -> bool:
    """Has any op of the write a precondition?"""
    return any(op.expected.WhichOneof("kind") in ("not_exists", "exact") for op in request.ops)


def _closing() -> ClientClosed:
    return ClientClosed("the client is closing")


__all__ = ["WritePipeline"]
