"""Acks of every subscription of a client, coalesced into one `AckBatch` per node.

Acks are cumulative, so only the newest position per subscription matters: while an
Ack call to a node is in flight, later acks for that node wait and replace older
ones of the same subscription; when the call returns, everything waiting goes out
in the next call. A process with thousands of subscriptions therefore makes about
one Ack call per node per round trip, not one per subscription per flush.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from grpc import aio

from sevendb.outbox.emitseq import EmitSeq
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk.engine import Engine, leader_hint

log = logging.getLogger(__name__)

ACKS_PER_CALL_MAX: Final = 4096
"""The node's limit per AckBatch (limits.ACKS_PER_PURGE_MAX)."""
_SETTLED: Final = (pb.AckResult.ACCEPTED, pb.AckResult.DUPLICATE, pb.AckResult.REGRESSIVE)
_RETRY: Final = (pb.AckResult.NOT_HOLDER, pb.AckResult.PENDING)
_RETRY_PAUSE_S: Final = 0.05


@dataclass(slots=True)
class _Ack:
    position: EmitSeq
    confirmed: Callable[[EmitSeq], None]
    """Called on the loop when the node accepted it (or had already covered it)."""


class AckPipeline:
    """Per-node coalescing of cumulative acks. Loop only."""

    def __init__(self, engine: Engine, metadata: tuple[tuple[str, str], ...]) -> None:
        self._engine = engine
        self._metadata = metadata
        self._waiting: dict[str, dict[str, _Ack]] = {}
        self._busy: set[str] = set()
        self.calls = 0
        self.fences: dict[str, pb.GroupFence] = {}
        """sub_id -> the consumer group term its acks carry (sdk/groups.py)."""
        self.fenced = 0
        """Acks the nodes refused GROUP_FENCED (a deposed group member's)."""

    def ack(
        self, target: str, sub_id: str, position: EmitSeq, confirmed: Callable[[EmitSeq], None]
    ) -> None:
        waiting = self._waiting.setdefault(target, {})
        current = waiting.get(sub_id)
        if current is None or position > current.position:
            waiting[sub_id] = _Ack(position, confirmed)
        if target not in self._busy:
            # Busy from now, not from when the task starts: acks arriving in this
            # loop iteration join the first call instead of starting calls of their own.
            self._busy.add(target)
            self._engine.loop.create_task(self._send(target))

    async def _send(self, target: str) -> None:
        try:
            while waiting := self._waiting.get(target):
                batch = list(waiting.items())[:ACKS_PER_CALL_MAX]
                for sub_id, _ in batch:
                    del waiting[sub_id]
                request = pb.AckBatch()
                for sub_id, pending in batch:
                    self._client_ack(request, sub_id, pending.position)
                self.calls += 1
                try:
                    response = await self._engine.stub(target).Ack(
                        request, metadata=self._metadata, timeout=5
                    )
                except aio.AioRpcError:
                    continue  # unconfirmed acks are sent again later (sdk.progress)
                for (_, pending), result in zip(batch, response.results, strict=False):
                    if result.status in _SETTLED:
                        pending.confirmed(pending.position)
                    elif result.status == pb.AckResult.GROUP_FENCED:
                        self.fenced += 1
        finally:
            self._busy.discard(target)

    def _client_ack(self, request: pb.AckBatch, sub_id: str, position: EmitSeq) -> None:
        """Append the ack of `sub_id` to `request`, built in place (a `ClientAck` and
        its position made apart and then copied in cost three times as much)."""
        ack = request.acks.add(sub_id=sub_id)
        seq = ack.up_to_emit_seq
        seq.commit_index = position.commit_index
        epoch = seq.epoch_id
        epoch.bucket_uuid = position.bucket_uuid
        epoch.epoch_counter = position.epoch_counter
        fence = self.fences.get(sub_id)
        if fence is not None:
            ack.group.CopyFrom(fence)

    async def ack_applied(
        self,
        acks: Sequence[tuple[str, str, EmitSeq, Callable[[EmitSeq], None]]],
        timeout_s: float,
    ) -> int:
        """Send `(target, sub_id, position, confirmed)` acks with `wait_applied` until
        an applied purge covers each (then `confirmed` is called) or the time is up,
        following the lease holder when it moves. Returns how many stay unconfirmed.
        (For a closing subscription: nothing will resend its acks later.)"""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = {sub_id: (target, pos, done) for target, sub_id, pos, done in acks}

        async def call(target: str, sub_ids: list[str], timeout: float) -> None:
            request = pb.AckBatch(wait_applied=True)
            for s in sub_ids:
                self._client_ack(request, s, pending[s][1])
            try:
                response = await self._engine.stub(target).Ack(
                    request, metadata=self._metadata, timeout=timeout
                )
            except aio.AioRpcError as exc:
                hint = leader_hint(exc) or self._engine.any_endpoint()
                for s in sub_ids:
                    pending[s] = (hint, *pending[s][1:])
                return
            for s, result in zip(sub_ids, response.results, strict=False):
                _, pos, done = pending[s]
                if result.status in _SETTLED:
                    del pending[s]
                    done(pos)
                elif result.status == pb.AckResult.NOT_HOLDER:
                    pending[s] = (result.holder or self._engine.any_endpoint(), pos, done)
                elif result.status not in _RETRY:
                    del pending[s]  # moot (the subscription is gone): nothing to wait for
                    log.warning("final ack of %s: %s", s, result.message)

        while pending and (left := deadline - loop.time()) > 0:
            by_target: dict[str, list[str]] = {}
            for sub_id, (target, _, _) in pending.items():
                by_target.setdefault(target, []).append(sub_id)
            await asyncio.gather(*(call(t, ids, left) for t, ids in by_target.items()))
            if pending:
                await asyncio.sleep(min(_RETRY_PAUSE_S, max(0.0, deadline - loop.time())))
        return len(pending)


__all__ = ["AckPipeline"]
