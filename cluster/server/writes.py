"""Writes: `Write`, `WriteMany`, `WriteStream` and `InitProducer`.

A write is validated by the core's constructors, routed to its bucket, and handed
to that bucket's `WriteBatcher` when this node has a replica of it (the batcher
shares Raft entries among concurrent writes), or forwarded to a node that has one.
The answer names the bucket's leader when it is elsewhere, so clients go there
next. A write handed to a batcher is first charged to its principal's rate
(`overload.RateLimiter`), and refused RESOURCE_EXHAUSTED with a retry-after over it
or when the batcher's queue is full.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

import grpc

from sevendb.cluster.common.acl import Permission
from sevendb.cluster.raft.replica import BucketReplica, ReplicaUnavailable
from sevendb.cluster.server.batcher import (
    BatcherFull,
    Batchers,
    Outcome,
    WriteBatcher,
    write_size,
)
from sevendb.cluster.server.edge import PROPOSE_TIMEOUT_S, Call, Edge, now_ms
from sevendb.cluster.server.errors import Failure
from sevendb.outbox import limits
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import InitProducer, Write
from sevendb.outbox.errors import SevenDBError
from sevendb.outbox.keys import bucket_of
from sevendb.outbox.model import InitProducerResult, WriteResult
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb

log = logging.getLogger(__name__)

TransactionalWrite = Callable[[pb.WriteRequest, Call], Awaitable[pb.WriteResponse]]

STREAM_WRITES_IN_FLIGHT: Final = 16
"""WriteMany requests one WriteStream has handled at once."""


class Writes:
    """The write handlers of one node."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge
        self._batchers = Batchers(self._new_batcher)
        self.transactional: TransactionalWrite | None = None
        """Where a transactional write goes (cluster/server/txns.py)."""

    def close(self) -> None:
        self._batchers.close()

    def _parse(self, request: pb.WriteRequest, principal: str) -> tuple[int, Write]:
        """Validate one write, check that `principal` may write its keys, and find its
        bucket (raises Failure). A producer's write carries its principal: only the
        producer's owner may use it (the core checks)."""
        try:
            if request.HasField("txn"):
                raise Failure.invalid("a transactional write is sent alone, with Write")
            ops = tuple(codec.op_from_pb(op) for op in request.ops)
            producer = (
                codec.producer_from_pb(request.producer) if request.HasField("producer") else None
            )
            entry = Write(ops, producer, now_ms(), principal if producer is not None else "")
        except SevenDBError as exc:
            raise Failure.domain(exc) from None
        except ValueError as exc:
            raise Failure.invalid(f"bad op: {exc}") from None
        for op in ops:
            self._edge.allow(principal, Permission.WRITE, op.key)
        count = len(self._edge.spec.buckets)
        bucket = bucket_of(ops[0].key, count)
        if len(ops) > 1:
            buckets = {bucket_of(op.key, count) for op in ops}
            if len(buckets) > 1:
                raise Failure.invalid(
                    f"ops route to buckets {sorted(buckets)}; a write is atomic within one bucket"
                )
        return bucket, entry

    def _batcher(self, bucket: int) -> WriteBatcher | None:
        """The batcher of this node's replica of `bucket` (None: no replica here)."""
        replica = self._edge.replicas.get(bucket)
        return None if replica is None else self._batchers.of(replica)

    def _new_batcher(self, replica: BucketReplica) -> WriteBatcher:
        limits = self._edge.limits
        return WriteBatcher(
            replica,
            asyncio.get_running_loop(),
            timeout_s=PROPOSE_TIMEOUT_S,
            writes_max=limits.batcher_writes_max,
            bytes_max=limits.batcher_bytes_max,
            retry_after_ms=limits.overloaded_retry_after_ms,
        )

    def _submit(
        self, principal: str, bucket: int, batcher: WriteBatcher, writes: list[Write]
    ) -> asyncio.Future[list[Outcome]]:
        """Charge `writes` to `principal`'s rate and queue them (raises the Failure:
        RESOURCE_EXHAUSTED over the rate or with the queue full, UNAVAILABLE)."""
        self._edge.rates.charge_writes(principal, len(writes), sum(map(write_size, writes)))
        try:
            return batcher.submit(writes)
        except BatcherFull as exc:
            raise Failure.exhausted(str(exc), codec.OVERLOADED, exc.retry_after_ms) from None
        except ReplicaUnavailable as exc:
            raise self._edge.unavailable(bucket, exc) from None

    def _forward(
        self, call: Call, bucket: int, request: pb.WriteRequest
    ) -> Awaitable[pb.WriteResponse]:
        return self._edge.forward(
            call, bucket, request, pb.WriteResponse, to_leader=False, method="Write"
        )

    def _committed(self, bucket: int, done: object) -> WriteResult | pb.WriteResponse:
        """A started write's committed result (raises Failure for a failed one)."""
        if isinstance(done, ReplicaUnavailable):
            raise self._edge.unavailable(bucket, done)
        if isinstance(done, BaseException):
            raise done
        if isinstance(done, WriteResult) and done.error is not None:
            raise Failure.rejected(done.error)
        if isinstance(done, WriteResult) and done.duplicate and self._edge.metrics is not None:
            self._edge.metrics.duplicates_answered(bucket, 1)  # counted where it was batched
        assert isinstance(done, WriteResult | pb.WriteResponse), done
        return done

    @staticmethod
    def _fill(
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
            committed = seqs[done.commit] = codec.seq_to_pb(done.commit)
        out.bucket = bucket
        out.committed.CopyFrom(committed)
        out.duplicate = done.duplicate
        for key, version in done.versions:
            out.versions.add(key=key, version=version)

    async def write(self, request: pb.WriteRequest, call: Call) -> pb.WriteResponse:
        if request.HasField("txn") and self.transactional is not None:
            return await self.transactional(request, call)
        bucket, entry = self._parse(request, call.principal)
        batcher = self._batcher(bucket)
        done: Outcome | pb.WriteResponse
        if batcher is None:
            done = await self._forward(call, bucket, request)
        else:
            (done,) = await self._submit(call.principal, bucket, batcher, [entry])
        response = pb.WriteResponse()
        self._fill(response, bucket, self._committed(bucket, done), {})
        return response

    async def write_many(self, request: pb.WriteManyRequest, call: Call) -> pb.WriteManyResponse:
        if len(request.writes) > limits.WRITES_PER_BATCH_MAX:
            raise Failure.invalid(
                f"{len(request.writes)} writes in one call; the limit is "
                f"{limits.WRITES_PER_BATCH_MAX}"
            )
        # Per write: refused up front, or (bucket, place): its place in the bucket's
        # group here, or -1 - its place among the writes forwarded elsewhere.
        plan: list[Failure | tuple[int, int]] = []
        groups: dict[int, list[Write]] = {}
        forwards: list[Awaitable[pb.WriteResponse]] = []
        for write in request.writes:
            try:
                bucket, entry = self._parse(write, call.principal)
            except Failure as failure:
                plan.append(failure)
                continue
            if bucket in self._edge.replicas:
                group = groups.setdefault(bucket, [])
                plan.append((bucket, len(group)))
                group.append(entry)
            else:
                plan.append((bucket, -1 - len(forwards)))
                forwards.append(self._forward(call, bucket, write))
        submitted: dict[int, Awaitable[list[Outcome]]] = {}
        refused: dict[int, Failure] = {}
        for bucket, group in groups.items():
            batcher = self._batcher(bucket)
            assert batcher is not None  # the bucket has a replica here
            try:
                submitted[bucket] = self._submit(call.principal, bucket, batcher, group)
            except Failure as failure:
                refused[bucket] = failure
        done = await asyncio.gather(*submitted.values(), *forwards, return_exceptions=True)
        outcomes = dict(zip(submitted, done, strict=False))
        forwarded = done[len(submitted) :]
        return self._answers(plan, refused, outcomes, forwarded)

    def _answers(
        self,
        plan: list[Failure | tuple[int, int]],
        refused: dict[int, Failure],
        outcomes: dict[int, object],
        forwarded: list[object],
    ) -> pb.WriteManyResponse:
        """The WriteMany answer, one outcome per write in request order (see
        `write_many` for `plan`)."""
        response = pb.WriteManyResponse()
        leaders: dict[int, str] = {}
        seqs: dict[EmitSeq, pb.EmitSeq] = {}
        for item in plan:
            out = response.outcomes.add()
            try:
                if isinstance(item, Failure):
                    raise item
                bucket, place = item
                if bucket in refused:
                    raise refused[bucket]
                got = outcomes[bucket] if place >= 0 else forwarded[-1 - place]
                ok = self._committed(bucket, got[place] if isinstance(got, list) else got)
            except Failure as failure:
                failure.fill(out)
                continue
            self._fill(out.ok, bucket, ok, seqs)
            # Name the leader when it is elsewhere: the SDK sends there next time.
            if bucket not in leaders:
                address = self._edge.leader_address(bucket)
                leaders[bucket] = address if address and address != self._edge.me else ""
            out.leader = leaders[bucket]
        return response

    async def write_stream(
        self, requests: AsyncIterator[pb.WriteManyRequest], call: Call
    ) -> AsyncIterator[pb.WriteStreamResponse]:
        """WriteMany on one stream: up to `STREAM_WRITES_IN_FLIGHT` requests are
        handled at once (the next is read only when the answer to one is sent: HTTP/2
        flow control holds the client back, and a client that stops reading answers
        stops being served), each answered under its id as it commits.
        Answers ready together leave in one message, so that the client sees them
        together (and sends the writes they prompt together). A caller without a
        valid token gets every request answered UNAUTHENTICATED rather than the
        stream ended: ending it races with the client's write, and grpc then reports
        INTERNAL to the client instead (seen in CI). A malformed request ends the
        stream INVALID_ARGUMENT (its id cannot be read to answer it)."""
        try:
            call = dataclasses.replace(
                call, principal=self._edge.principal(call.metadata, call.context)
            )
            refused = None
        except Failure as failure:
            refused = failure
        answers: asyncio.Queue[pb.WriteManyResponse | Failure | None] = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_WRITES_IN_FLIGHT)
        handling: set[asyncio.Task[None]] = set()

        async def answer(request: pb.WriteManyRequest) -> None:
            try:
                if refused is not None:
                    raise refused
                response = await self.write_many(request, call)
            except Exception as exc:
                if not isinstance(exc, Failure):
                    log.exception("WriteStream: request %d failed", request.id)
                    exc = Failure(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
                response = pb.WriteManyResponse()
                for _ in request.writes:
                    exc.fill(response.outcomes.add())
            response.id = request.id
            answers.put_nowait(response)  # its slot is freed once the answer is sent

        async def read() -> None:
            end: Failure | None = None
            try:
                async for request in requests:
                    await slots.acquire()
                    task = asyncio.create_task(answer(request))
                    handling.add(task)
                    task.add_done_callback(handling.discard)
                await asyncio.gather(*handling)
            except Failure as failure:  # a malformed request
                end = failure
            finally:
                answers.put_nowait(end)  # the client is done, or gone

        reader = asyncio.create_task(read())
        try:
            async for message in _batched(answers, slots):
                yield message
        finally:
            reader.cancel()
            for task in handling:
                task.cancel()

    async def init_producer(
        self, request: pb.InitProducerRequest, call: Call
    ) -> pb.InitProducerResponse:
        bucket = request.bucket
        self._edge.allow(call.principal, Permission.IDEMPOTENT_WRITE)
        # Ids are minted at the edge (randomness stays out of the core).
        pid = request.producer_id or (secrets.randbits(62) | 1)
        entry = InitProducer(pid, now_ms(), call.principal)
        result, _ = await self._edge.commit(bucket, entry, InitProducerResult)
        return pb.InitProducerResponse(producer_id=pid, producer_epoch=result.epoch, bucket=bucket)


async def _batched(
    answers: asyncio.Queue[pb.WriteManyResponse | Failure | None], slots: asyncio.Semaphore
) -> AsyncIterator[pb.WriteStreamResponse]:
    """A WriteStream's answers as they come, those ready together in one message,
    until the end (None) or the Failure that ends the stream."""
    while isinstance(response := await answers.get(), pb.WriteManyResponse):
        message = pb.WriteStreamResponse(answers=[response])
        while not answers.empty() and isinstance(
            response := answers.get_nowait(), pb.WriteManyResponse
        ):
            message.answers.append(response)
        yield message  # returns once grpc took it: a client that does not read
        for _ in message.answers:  # its answers stops being read from
            slots.release()
        if not isinstance(response, pb.WriteManyResponse):
            break
    if isinstance(response, Failure):
        raise response


__all__ = ["STREAM_WRITES_IN_FLIGHT", "Writes"]
