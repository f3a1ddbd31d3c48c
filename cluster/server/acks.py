"""Acknowledgements and the end of a subscription: `Ack` (cumulative, many
subscriptions a call, answered by the bucket's lease holder, and optionally held
until applied) and `Unsubscribe` (a committed entry, forwarded to a node with a
replica of the bucket)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Final

from sevendb.cluster.server.edge import Call, Edge, now_ms
from sevendb.cluster.server.errors import Failure
from sevendb.cluster.server.groups import check_fences
from sevendb.notifier.host import AckWait, BucketNotifier
from sevendb.outbox import limits
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import Unsubscribe
from sevendb.outbox.errors import SevenDBError
from sevendb.outbox.model import AckOutcome, UnsubscribeResult
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb

ACK_WAIT_S_MAX: Final = 10.0
"""The longest an `AckBatch` with `wait_applied` is held (less if its deadline is sooner)."""
_ACK_WAIT_POLL_S: Final = 0.005
_ACK_WAIT_POLL_MAX_S: Final = 0.05
_ACK_TAKEN: Final = (pb.AckResult.ACCEPTED, pb.AckResult.DUPLICATE, pb.AckResult.REGRESSIVE)


class Acks:
    """The Ack and Unsubscribe handlers of one node."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge

    async def ack(self, request: pb.AckBatch, call: Call) -> pb.AckResponse:
        if len(request.acks) > limits.ACKS_PER_PURGE_MAX:
            raise Failure.invalid(
                f"{len(request.acks)} acks in one batch; the limit is {limits.ACKS_PER_PURGE_MAX}"
            )
        results = self._take(call.principal, request.acks)
        if request.wait_applied:
            await self._wait_applied(call, request.acks, results)
        return pb.AckResponse(results=results)

    async def _wait_applied(
        self, call: Call, acks: Sequence[pb.ClientAck], results: list[pb.AckResult]
    ) -> None:
        """Hold the answers of acks this node took until OUTBOX_PURGEs covering them
        are applied here. Polled (`Subscription.close` asks, rarely): one lock round
        per bucket and poll, every 5 ms at first and less often as the wait grows."""
        waiting: dict[int, list[int]] = {}  # bucket -> places in `acks`
        for i, result in enumerate(results):
            if result.status in _ACK_TAKEN:  # _ack_one found the bucket
                bucket = self._edge.bucket_of_uuid[acks[i].up_to_emit_seq.epoch_id.bucket_uuid]
                waiting.setdefault(bucket, []).append(i)
        remaining = call.context.time_remaining()
        budget = ACK_WAIT_S_MAX if remaining is None else min(ACK_WAIT_S_MAX, remaining * 0.8)
        started = time.monotonic()
        while waiting:
            for bucket, places in list(waiting.items()):
                still = self._settle(call.principal, bucket, acks, places, results)
                if still:
                    waiting[bucket] = still
                else:
                    del waiting[bucket]
            waited = time.monotonic() - started
            if waiting and waited >= budget:
                for i in itertools.chain.from_iterable(waiting.values()):
                    results[i] = pb.AckResult(
                        sub_id=acks[i].sub_id,
                        status=pb.AckResult.PENDING,
                        message=f"queued, but not applied within {budget:.2f}s; send it again",
                    )
                return
            if waiting:
                pause = min(_ACK_WAIT_POLL_MAX_S, _ACK_WAIT_POLL_S + waited / 10)
                await asyncio.sleep(min(pause, budget - waited))

    def _settle(
        self,
        principal: str,
        bucket: int,
        acks: Sequence[pb.ClientAck],
        places: list[int],
        results: list[pb.AckResult],
    ) -> list[int]:
        """Answer the acks at `places` (all of `bucket`) whose purge is applied, or
        whose lease moved; the places still waiting."""
        notifier = self._edge.notifiers.get(bucket)
        states: list[AckOutcome | AckWait] = (
            [AckWait.LOST] * len(places)
            if notifier is None
            else notifier.acks_applied(
                principal,
                [(acks[i].sub_id, codec.seq_from_pb(acks[i].up_to_emit_seq)) for i in places],
            )
        )
        still = []
        for i, state in zip(places, states, strict=True):
            if state is AckWait.QUEUED:
                still.append(i)
            elif state is AckWait.LOST:
                results[i] = self._not_holder(bucket, notifier, acks[i].sub_id)
            else:
                assert isinstance(state, AckOutcome)
                results[i] = pb.AckResult(
                    sub_id=acks[i].sub_id,
                    status=codec.ACK_STATUS[state.status],
                    message=state.message,
                )
        return still

    def _take(self, principal: str, acks: Sequence[pb.ClientAck]) -> list[pb.AckResult]:
        """Each ack's answer; those of one bucket are checked and queued together (a
        lock round per bucket and batch, not per ack)."""
        results: list[pb.AckResult | None] = [None] * len(acks)
        by_bucket: dict[int, list[tuple[int, EmitSeq]]] = {}
        for i, ack in enumerate(acks):
            if not ack.sub_id or not ack.HasField("up_to_emit_seq"):
                results[i] = pb.AckResult(
                    sub_id=ack.sub_id,
                    status=pb.AckResult.SUBSCRIPTION_NOT_FOUND,
                    message="an ack needs sub_id and up_to_emit_seq",
                )
                continue
            up_to = codec.seq_from_pb(ack.up_to_emit_seq)
            bucket = self._edge.bucket_of_uuid.get(up_to.bucket_uuid)
            if bucket is None:
                results[i] = pb.AckResult(
                    sub_id=ack.sub_id,
                    status=pb.AckResult.FUTURE,
                    message=f"no bucket {up_to.bucket_uuid} in this cluster",
                )
                continue
            by_bucket.setdefault(bucket, []).append((i, up_to))
        for bucket, places in by_bucket.items():
            self._take_bucket(principal, bucket, acks, places, results)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _take_bucket(
        self,
        principal: str,
        bucket: int,
        acks: Sequence[pb.ClientAck],
        places: list[tuple[int, EmitSeq]],
        results: list[pb.AckResult | None],
    ) -> None:
        """Answer the acks at `places` (all of `bucket`): a consumer group's from a
        deposed member are fenced, the rest go to the bucket's notifier."""
        notifier = self._edge.notifiers.get(bucket)
        if notifier is None:
            for i, _ in places:
                results[i] = self._not_holder(bucket, None, acks[i].sub_id)
            return
        fenced = check_fences(
            self._edge,
            notifier,
            principal,
            [
                (acks[i].sub_id, acks[i].group if acks[i].HasField("group") else None)
                for i, _ in places
            ],
        )
        taken = []
        for (i, up_to), reason in zip(places, fenced, strict=True):
            if reason is None:
                taken.append((i, up_to))
            else:
                results[i] = pb.AckResult(
                    sub_id=acks[i].sub_id, status=pb.AckResult.GROUP_FENCED, message=reason
                )
        if not taken:
            return
        outcomes = notifier.ack(principal, [(acks[i].sub_id, up_to) for i, up_to in taken])
        for n, (i, _) in enumerate(taken):
            if outcomes is None:
                results[i] = self._not_holder(bucket, notifier, acks[i].sub_id)
            else:
                outcome = outcomes[n]
                results[i] = pb.AckResult(
                    sub_id=outcome.sub_id,
                    status=codec.ACK_STATUS[outcome.status],
                    message=outcome.message,
                )

    def _not_holder(
        self, bucket: int, notifier: BucketNotifier | None, sub_id: str
    ) -> pb.AckResult:
        holder = None if notifier is None else notifier.holder()
        where = self._edge.client_address(bucket, holder)
        return pb.AckResult(
            sub_id=sub_id,
            status=pb.AckResult.NOT_HOLDER,
            message=f"bucket {bucket}: this node does not hold the notifier lease "
            f"(holder: {where or 'unknown yet'})",
            holder=where or "",
        )

    async def unsubscribe(
        self, request: pb.UnsubscribeRequest, call: Call
    ) -> pb.UnsubscribeResponse:
        bucket = request.bucket
        try:
            entry = Unsubscribe(request.sub_id, call.principal, now_ms())
        except SevenDBError as exc:
            raise Failure.domain(exc) from None
        await self._edge.commit(bucket, entry, UnsubscribeResult)
        return pb.UnsubscribeResponse()


__all__ = ["ACK_WAIT_S_MAX", "Acks"]
