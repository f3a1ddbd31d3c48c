"""Client-side write batching: concurrent writes share `WriteMany` requests.

A gRPC call costs a node more CPU than replicating a write, so every write waiting
while a request is in flight to a node goes out in the next request to it (up to
`batch_writes_max`); a second request leaves meanwhile only with
`pipeline_min_writes` waiting, since the answer in flight usually brings more.
Requests travel on one long-lived `WriteStream` per node and are answered by id; one
unanswered after `call_timeout_s`, or on a stream that breaks, fails like a call
(its writes are retried). The figures behind these choices: docs/performance.md
("stop 17" and "Durable writes").

Each write keeps its own outcome. UNAVAILABLE (no leader, a leader change, a dead
node) retries that write alone, following the leader hint, with jittered backoff
until the `RetryPolicy` deadline; rejections (a failed precondition, a fenced
producer, ...) are never retried. A retried unconditional write can apply twice if
its first answer was lost: use an idempotent producer (`Client.producer()`) where
that matters.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import grpc
from grpc import aio

from sevendb.outbox.errors import InvalidArgument, SevenDBError
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk.engine import ERROR_CODE_KEY, Engine, leader_hint, status_code, trailer
from sevendb.sdk.errors import ClientClosed, Unavailable, domain_error

BATCH_WRITES_MAX: Final = 512
BATCH_BYTES_MAX: Final = 3 * 1024 * 1024
"""Below the node's 4 MiB message limit."""
CALLS_IN_FLIGHT: Final = 4
PIPELINE_MIN_WRITES: Final = 64
"""A request leaves while another is in flight to the node only with this many writes."""
T = TypeVar("T")


@dataclass(eq=False)
class _Pending:
    request: pb.WriteRequest
    bucket: int
    deadline: float
    size: int
    future: Future[Any] = field(default_factory=Future)
    attempts: int = 0
    backoff_s: float = 0.0


@dataclass(frozen=True, slots=True)
class _CallFailure:
    """Why a request on a write stream got no answer (the status a call would end with)."""

    code: grpc.StatusCode
    message: str
    error: str | None = None
    hint: str | None = None


@dataclass(eq=False)
class _Stream:
    """One WriteStream to a node: requests go out one at a time and are answered by id."""

    call: Any  # aio.StreamStreamCall
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    waiting: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    sending: asyncio.Lock = field(default_factory=asyncio.Lock)
    reader: asyncio.Task[None] | None = None


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
        pipeline_min_writes: int = PIPELINE_MIN_WRITES,
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
        self._pipeline_min = pipeline_min_writes
        self._leaders: dict[int, str] = {}
        self._queues: dict[str, collections.deque[_Pending]] = {}
        self._calls: dict[str, int] = {}
        self._streams: dict[str, _Stream] = {}
        self._inbox: collections.deque[_Pending] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._drain_scheduled = False
        self._closed = False
        self._retrying: set[_Pending] = set()
        """Writes waiting out a retry backoff (in no queue until it ends)."""
        self._sending: dict[asyncio.Task[None], list[_Pending]] = {}
        """Requests in flight (or about to leave) and their writes."""
        self.calls = 0
        self.writes = 0

    def submit(self, request: pb.WriteRequest, bucket: int) -> Future[T]:
        """Queue a write (any thread); the future holds its converted response or error.
        A write too large for a request is refused here: sent, it would end the stream
        (RESOURCE_EXHAUSTED) for every write in flight on it."""
        size = request.ByteSize()
        if size > BATCH_BYTES_MAX:
            raise InvalidArgument(f"a write of {size} bytes; the limit is {BATCH_BYTES_MAX}")
        pending = _Pending(
            request,
            bucket,
            time.monotonic() + self._deadline_s,
            size,
            backoff_s=self._backoff_initial_s,
        )
        with self._inbox_lock:
            if self._closed:
                raise _closing()
            self._inbox.append(pending)
            if self._drain_scheduled:
                return pending.future
            self._drain_scheduled = True
        try:
            self._engine.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: fail this write, not the next ones
            with self._inbox_lock:
                self._drain_scheduled = False
            raise
        return pending.future

    async def close(self) -> None:
        """On the loop, before the client's channels close: every write not answered
        yet (queued, waiting out a backoff, or in flight) fails with "the client is
        closing" instead of waiting forever on a loop that is about to stop."""
        with self._inbox_lock:
            self._closed = True
            waiting = [*self._inbox, *self._retrying]
            self._inbox.clear()
        self._retrying.clear()
        for queue in self._queues.values():
            waiting.extend(queue)
            queue.clear()
        for pending in waiting:
            if not pending.future.done():
                pending.future.set_exception(_closing())
        sending = list(self._sending.items())
        for task, _ in sending:
            task.cancel()  # `_send` settles its batch on the way out, if it started
        await asyncio.gather(*(task for task, _ in sending), return_exceptions=True)
        for _, batch in sending:  # a task cancelled before it ran settled nothing
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(_closing())
        for stream in list(self._streams.values()):
            if stream.reader is not None:
                stream.reader.cancel()
            stream.call.cancel()

    # ---- the loop side ---------------------------------------------------------------

    def _drain(self) -> None:
        with self._inbox_lock:
            self._drain_scheduled = False
        targets = set()
        while self._inbox:
            targets.add(self._queue(self._inbox.popleft()))
        for target in targets:
            self._kick(target)

    def _queue(self, pending: _Pending) -> str:
        target = self._leaders.get(pending.bucket) or self._engine.any_endpoint()
        self._queues.setdefault(target, collections.deque()).append(pending)
        return target

    def _enqueue(self, pending: _Pending) -> None:
        """A retry's backoff is over."""
        self._retrying.discard(pending)
        if not self._closed:
            self._kick(self._queue(pending))

    def _kick(self, target: str) -> None:
        queue = self._queues.get(target)
        while queue and (calls := self._calls.get(target, 0)) < self._calls_max:
            if calls and len(queue) < self._pipeline_min:
                break  # wait for the answer in flight: it brings more writes to join these
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
                code, exc.details() or "", trailer(exc, ERROR_CODE_KEY), leader_hint(exc)
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
                    self._failed(
                        pending,
                        response.code,
                        response.message,
                        response.error,
                        response.hint,
                        target,
                    )
            else:
                self._answered(target, batch, response)
        except BaseException as exc:  # never strand a batch: settle what is left, loudly
            closing = isinstance(exc, asyncio.CancelledError)
            failure = _closing() if closing else SevenDBError(f"write failed: {exc!r}")
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(failure)
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
                if not pending.future.done():
                    pending.future.set_result(self._convert(outcome.ok))
            else:
                code = status_code(outcome.code)
                self._failed(pending, code, outcome.message, outcome.error, outcome.leader, target)

    def _failed(
        self,
        pending: _Pending,
        code: grpc.StatusCode,
        message: str,
        error: str | None,
        hint: str | None,
        target: str,
    ) -> None:
        if pending.future.done():
            return
        if self._closed and code is grpc.StatusCode.CANCELLED:
            pending.future.set_exception(_closing())
            return
        typed = domain_error(code, message, error)
        if typed is not None:
            pending.future.set_exception(typed)
            return
        if hint:
            self._leaders[pending.bucket] = hint
        elif self._leaders.get(pending.bucket) == target:
            del self._leaders[pending.bucket]  # it failed there: try another node
        pending.attempts += 1
        now = time.monotonic()
        if now + pending.backoff_s > pending.deadline:
            pending.future.set_exception(
                Unavailable(
                    f"write not committed after {pending.attempts} attempts: {code.name}: {message}"
                )
            )
            return
        if self._closed:
            pending.future.set_exception(_closing())
            return
        delay = 0.0 if hint and pending.attempts == 1 else pending.backoff_s
        pending.backoff_s = min(pending.backoff_s * 2, self._backoff_max_s)
        self._retrying.add(pending)
        self._engine.loop.call_later(delay * (0.5 + random.random()), self._enqueue, pending)


def _closing() -> ClientClosed:
    return ClientClosed("the client is closing")


__all__ = ["WritePipeline"]
