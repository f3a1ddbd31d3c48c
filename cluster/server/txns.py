"""Transactions at the edge (docs/transactions.md): the `Txn` calls of a
transactional id's coordinator, `TxnMark` (a participant bucket joins a transaction
or takes its marker), `ListTransactions`, transactional writes, and the driver that
finishes what a coordinator decided.

The decisions are the core's (outbox/txn.py); this module only proposes entries and
moves markers between buckets. Markers are written only after the decision is
committed in the coordinator bucket, and are idempotent, so whoever leads the
coordinator bucket - the node that took the COMMIT call, or after a failover its
successor's driver - may write them again until the COMPLETE entry commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from typing import Final

from grpc import aio

from sevendb.cluster.common.acl import Permission
from sevendb.cluster.common.auth import NODE_PRINCIPAL, auth_metadata
from sevendb.cluster.server.edge import FORWARD_KEY, FORWARD_TIMEOUT_S, Call, Edge, now_ms
from sevendb.cluster.server.errors import Failure
from sevendb.cluster.server.faults import (
    KILL_AFTER_TXN_DECISION,
    KILL_BEFORE_TXN_DECISION,
    FaultPoints,
)
from sevendb.outbox.entries import (
    TXN_TIMEOUT_MS_DEFAULT,
    Ack,
    Txn,
    TxnAction,
    TxnOutcome,
    TxnWrite,
)
from sevendb.outbox.errors import ErrorCode, Rejection, SevenDBError
from sevendb.outbox.keys import bucket_of
from sevendb.outbox.model import TxnResult, TxnWriteResult
from sevendb.outbox.state import BucketStateMachine
from sevendb.outbox.txn import DueMarkers, TxnInfo
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb

log = logging.getLogger(__name__)

DRIVER_PERIOD_S: Final = 0.5
"""How often a coordinator's leader looks for decided transactions to finish and open
ones past their timeout."""
NODE_TOKEN_TTL_S: Final = 300


def _outcome_nobody_awaits(task: asyncio.Future[pb.TxnResponse]) -> None:
    """A Txn call finished after its caller left: its outcome is in the cluster's
    state; an error is logged, not raised to no one."""
    if not task.cancelled() and task.exception() is not None:
        log.info("a Txn call whose caller left ended with: %s", task.exception())


class Transactions:
    """The transaction handlers and driver of one node."""

    def __init__(self, edge: Edge, faults: FaultPoints | None = None) -> None:
        self._edge = edge
        self._faults = faults
        self._driver: asyncio.Task[None] | None = None
        self._finishing: set[tuple[str, int]] = set()

    # ---- routing -----------------------------------------------------------------

    def coordinator(self, request: pb.TxnRequest) -> int:
        """The coordinator bucket of the request's transactional id."""
        if not request.transactional_id:
            raise Failure.invalid("a transactional_id is needed")
        return bucket_of(request.transactional_id, len(self._edge.spec.buckets))

    # ---- Txn ---------------------------------------------------------------------------

    def _entry(self, request: pb.TxnRequest, call: Call) -> Txn:
        """The TXN entry a request asks for (raises Failure: bad input, not allowed)."""
        edge, action, now = self._edge, request.action, now_ms()
        tid, epoch, number = request.transactional_id, request.epoch, request.number
        who = call.principal
        try:
            if action == pb.TxnRequest.INIT:
                edge.allow(who, Permission.IDEMPOTENT_WRITE)
                timeout = request.timeout_ms or TXN_TIMEOUT_MS_DEFAULT
                return Txn(TxnAction.INIT, tid, principal=who, now_ms=now, timeout_ms=timeout)
            if action == pb.TxnRequest.ADD:
                buckets = tuple(sorted(set(request.buckets)))
                for one in buckets:
                    edge.check_bucket(one)
                return Txn(TxnAction.ADD, tid, epoch, number, buckets, principal=who, now_ms=now)
            if action in (pb.TxnRequest.COMMIT, pb.TxnRequest.ABORT):
                outcome = TxnOutcome.COMMIT if action == pb.TxnRequest.COMMIT else TxnOutcome.ABORT
                return Txn(
                    TxnAction.END, tid, epoch, number, outcome=outcome, principal=who, now_ms=now
                )
            if action == pb.TxnRequest.RESOLVE:
                if not call.admin:
                    raise Failure.denied(
                        f"principal {who!r} lacks the admin permission on the cluster "
                        "(resolving a transaction is administration)"
                    )
                outcome = TxnOutcome.COMMIT if request.resolve_commit else TxnOutcome.ABORT
                return Txn(
                    TxnAction.RESOLVE, tid, 0, number, outcome=outcome, principal=who, now_ms=now
                )
        except SevenDBError as exc:
            raise Failure.domain(exc) from None
        raise Failure.invalid(f"unknown transaction action {action}")

    async def txn(self, request: pb.TxnRequest, call: Call) -> pb.TxnResponse:
        """A Txn call, run to its end even if its caller goes away: grpc cancels a
        handler whose client disconnects, and a COMMIT cancelled between its decision
        and its markers left them to the driver (up to DRIVER_PERIOD_S later).
        Meanwhile the successor of a killed consume-transform-produce process could
        resume its durable subscription before the COMMIT marker moved the
        subscription's acknowledged position: the input was delivered again and its
        output written twice (tests/test_txn_eos.py, in CI)."""
        task = asyncio.ensure_future(self._txn(request, call))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_outcome_nobody_awaits)
            raise

    async def _txn(self, request: pb.TxnRequest, call: Call) -> pb.TxnResponse:
        edge, bucket = self._edge, self.coordinator(request)
        entry = self._entry(request, call)
        tid = entry.txn_id
        refused: list[str] = []
        if entry.action is TxnAction.END and entry.outcome is TxnOutcome.COMMIT:
            refused = await self._prepare(request, entry)
            if refused:  # a participant lacks what the producer wrote: abort instead
                entry = dataclasses.replace(entry, outcome=TxnOutcome.ABORT)
        if self._faults is not None and entry.action is TxnAction.END:
            self._faults.fire(KILL_BEFORE_TXN_DECISION)
        result, _ = await edge.commit(bucket, entry, TxnResult)
        response = pb.TxnResponse(epoch=result.epoch, number=result.number, coordinator=bucket)
        if entry.action is TxnAction.ADD:
            owner = call.principal  # the coordinator checked it owns the id
            await asyncio.gather(
                *(
                    self._mark(b, tid, result.epoch, result.number, TxnOutcome.NONE, owner)
                    for b in entry.buckets
                )
            )
            return response
        if result.outcome is not TxnOutcome.NONE:
            if self._faults is not None and entry.action is TxnAction.END:
                self._faults.fire(KILL_AFTER_TXN_DECISION)
            due = DueMarkers(tid, result.epoch, result.number, result.outcome, result.buckets)
            response.buckets.extend(result.buckets)
            failed = await self._finish(bucket, due)
            aborting = result.outcome is not TxnOutcome.COMMIT
            if failed and aborting and entry.action is not TxnAction.INIT:
                raise Failure.rejected(
                    Rejection(
                        ErrorCode.ABORT_PARTIAL_FAILURE,
                        f"transaction {result.number} of {tid!r} is aborted, but buckets "
                        f"{failed} did not take their ABORT marker yet (the coordinator "
                        "retries; their pending writes stay invisible)",
                    )
                )
        if refused:
            raise Failure.rejected(
                Rejection(
                    ErrorCode.INVALID_TXN_STATE,
                    f"transaction {result.number} of {tid!r} is aborted, not committed: "
                    + "; ".join(refused),
                )
            )
        return response

    async def _prepare(self, request: pb.TxnRequest, entry: Txn) -> list[str]:
        """A COMMIT naming the writes sent to each bucket: PREPARE every one of them
        before the decision. Returns the refusals (why the transaction cannot commit).
        Raises the Failure of a bucket that cannot be reached: nothing is decided, the
        transaction stays open (a retried commit or its timeout ends it)."""
        if not request.writes:
            return []  # a producer that does not count its writes: nothing to check
        if len(request.writes) != len(request.buckets):
            raise Failure.invalid("a COMMIT's writes and buckets are parallel lists")
        for bucket in request.buckets:
            self._edge.check_bucket(bucket)
        checks = sorted(zip(request.buckets, request.writes, strict=True))
        outcomes = await asyncio.gather(
            *(
                self._mark(b, entry.txn_id, entry.epoch, entry.number, TxnOutcome.NONE, "", w)
                for b, w in checks
            ),
            return_exceptions=True,
        )
        refused = []
        for (bucket, _), outcome in zip(checks, outcomes, strict=True):
            if isinstance(outcome, Failure) and outcome.error is not None:
                refused.append(f"bucket {bucket}: {outcome.message}")
            elif isinstance(outcome, BaseException):
                raise outcome
        return refused

    async def _finish(self, coordinator: int, due: DueMarkers) -> list[int]:
        """Write `due`'s markers, then COMPLETE it at its coordinator: the buckets that
        did not take their marker (then nothing is completed; the driver retries)."""
        key = (due.txn_id, due.number)
        failed: list[int] = []
        outcomes = await asyncio.gather(
            *(
                self._mark(b, due.txn_id, due.epoch, due.number, due.outcome, "")
                for b in due.buckets
            ),
            return_exceptions=True,
        )
        for bucket, outcome in zip(due.buckets, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                log.info("txn %s/%d: marker to bucket %d failed: %s", *key, bucket, outcome)
                failed.append(bucket)
        if failed:
            return failed
        complete = Txn(TxnAction.COMPLETE, due.txn_id, due.epoch, due.number, now_ms=now_ms())
        try:
            await self._edge.commit(coordinator, complete, TxnResult)
        except Failure as exc:
            log.info("txn %s/%d: COMPLETE not committed: %s", *key, exc)
        return []

    async def _mark(
        self,
        bucket: int,
        tid: str,
        epoch: int,
        number: int,
        outcome: TxnOutcome,
        owner: str,
        writes: int | None = None,
    ) -> None:
        """JOIN (`outcome` NONE), PREPARE (`writes` given) or MARK `bucket`: through
        this node's replica of it, or by the TxnMark of a node that has one."""
        edge = self._edge
        if bucket in edge.replicas:
            entry = _mark_entry(tid, epoch, number, outcome, owner, writes)
            await edge.commit(bucket, entry, TxnResult)
            return
        request = pb.TxnMarkRequest(
            bucket=bucket,
            txn=pb.TxnRef(transactional_id=tid, epoch=epoch, number=number),
            outcome=int(outcome),
            owner=owner,
            prepare=writes is not None,
            writes=writes or 0,
        )
        token = edge.node.keyring.mint(NODE_PRINCIPAL, now_ms=now_ms(), ttl_s=NODE_TOKEN_TTL_S)
        try:
            await edge.stub(edge.some_host(bucket)).TxnMark(
                request, timeout=FORWARD_TIMEOUT_S, metadata=auth_metadata(token)
            )
        except aio.AioRpcError as exc:
            error = dict(exc.trailing_metadata() or ()).get(codec.ERROR_CODE_KEY)
            raise Failure(
                exc.code(),
                f"bucket {bucket}: {exc.details()}",
                error=error if isinstance(error, str) else None,
            ) from None

    # ---- TxnMark -----------------------------------------------------------------------

    async def txn_mark(self, request: pb.TxnMarkRequest, call: Call) -> pb.TxnMarkResponse:
        if call.principal != NODE_PRINCIPAL and not call.admin:
            raise Failure.denied("TxnMark is for the cluster's nodes")
        ref = request.txn
        try:
            outcome = TxnOutcome(request.outcome)
            writes = request.writes if request.prepare else None
            entry = _mark_entry(
                ref.transactional_id, ref.epoch, ref.number, outcome, request.owner, writes
            )
        except (SevenDBError, ValueError) as exc:
            raise Failure.invalid(f"bad TxnMark: {exc}") from None
        await self._edge.commit(request.bucket, entry, TxnResult)
        return pb.TxnMarkResponse()

    @staticmethod
    def mark_bucket(request: pb.TxnMarkRequest) -> int:
        return request.bucket

    # ---- transactional writes -----------------------------------------------------------

    def _parse_write(self, request: pb.WriteRequest, principal: str) -> tuple[int, TxnWrite]:
        """A transactional write's bucket and entry (raises Failure)."""
        if request.HasField("producer"):
            raise Failure.invalid("a transactional write names no idempotent producer")
        ref = request.txn
        try:
            ops = tuple(codec.op_from_pb(op) for op in request.ops)
            acks = tuple(
                Ack(a.sub_id, principal, codec.seq_from_pb(a.up_to_emit_seq))
                for a in request.txn_acks
            )
            entry = TxnWrite(
                ref.transactional_id,
                ref.epoch,
                ref.number,
                ops,
                principal,
                now_ms(),
                ref.sequence,
                acks,
            )
        except SevenDBError as exc:
            raise Failure.domain(exc) from None
        except ValueError as exc:
            raise Failure.invalid(f"bad op or ack: {exc}") from None
        for op in ops:
            self._edge.allow(principal, Permission.WRITE, op.key)
        count = len(self._edge.spec.buckets)
        buckets = {bucket_of(op.key, count) for op in ops}
        for ack in acks:
            bucket = self._edge.bucket_of_uuid.get(ack.up_to.bucket_uuid)
            if bucket is None:
                raise Failure.invalid(f"ack of {ack.sub_id}: no bucket {ack.up_to.bucket_uuid}")
            buckets.add(bucket)
        if len(buckets) > 1:
            raise Failure.invalid(
                f"ops and acks route to buckets {sorted(buckets)}; send one Write per bucket"
            )
        return buckets.pop(), entry

    async def write(self, request: pb.WriteRequest, call: Call) -> pb.WriteResponse:
        """A transactional write, through this node's replica of its bucket or a node's
        that has one (never batched: each is its own entry)."""
        bucket, entry = self._parse_write(request, call.principal)
        edge = self._edge
        if bucket not in edge.replicas:
            answer: pb.WriteResponse = await edge.forward(
                call, bucket, request, pb.WriteResponse, to_leader=False, method="Write"
            )
            return answer
        _, index = await edge.commit(bucket, entry, TxnWriteResult)
        seq = edge.replicas[bucket].read(lambda sm: sm.emit_seq(index))
        return pb.WriteResponse(bucket=bucket, committed=codec.seq_to_pb(seq))

    # ---- ListTransactions -----------------------------------------------------------

    async def list_transactions(
        self, request: pb.ListTransactionsRequest, call: Call
    ) -> pb.ListTransactionsResponse:
        if not call.admin:
            raise Failure.denied(f"principal {call.principal!r} lacks the admin permission")
        edge = self._edge
        found: dict[int, list[TxnInfo]] = {}
        for bucket, replica in list(edge.replicas.items()):
            with contextlib.suppress(Exception):
                found[bucket] = replica.read(lambda sm: sm.txns.transactions())
        response = pb.ListTransactionsResponse()
        missing = [b for b in range(len(edge.spec.buckets)) if b not in found]
        if missing and not any(k == FORWARD_KEY for k, _ in call.metadata):
            others = {edge.some_host(b) for b in missing} - {edge.me}
            for address in sorted(others):
                token = edge.node.keyring.mint(
                    NODE_PRINCIPAL, now_ms=now_ms(), ttl_s=NODE_TOKEN_TTL_S
                )
                metadata = (*auth_metadata(token), (FORWARD_KEY, edge.node_id))
                with contextlib.suppress(aio.AioRpcError):
                    answer = await edge.stub(address).ListTransactions(
                        request, timeout=FORWARD_TIMEOUT_S, metadata=metadata
                    )
                    for info in answer.transactions:
                        if info.coordinator in missing:
                            response.transactions.append(info)
                    missing = [
                        b for b in missing if b not in {i.coordinator for i in answer.transactions}
                    ]
        for bucket, infos in sorted(found.items()):
            for info in infos:
                response.transactions.append(
                    pb.TransactionInfo(
                        transactional_id=info.txn_id,
                        owner=info.owner,
                        epoch=info.epoch,
                        number=info.number,
                        phase=info.phase.name,
                        outcome=info.outcome.name,
                        buckets=info.buckets,
                        started_ms=info.started_ms,
                        timeout_ms=info.timeout_ms,
                        coordinator=bucket,
                    )
                )
        return response

    # ---- the driver ---------------------------------------------------------------

    def start(self) -> None:
        """Start the driver on the running loop (once)."""
        if self._driver is None:
            self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def stop(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._driver
            self._driver = None

    async def _drive(self) -> None:
        while True:
            await asyncio.sleep(DRIVER_PERIOD_S)
            try:
                await self.drive_once()
            except Exception:
                log.exception("transaction driver round failed")

    async def drive_once(self) -> None:
        """One round: in every bucket this node leads, abort the open transactions past
        their timeout, and finish the decided ones."""
        edge = self._edge
        for bucket in sorted(edge.replicas):
            replica = edge.leader_replica(bucket)
            if replica is None:
                continue
            now = now_ms()
            late, due = replica.read(functools.partial(_work, now=now))
            for tid in late:
                with contextlib.suppress(Failure):
                    await edge.commit(bucket, Txn(TxnAction.EXPIRE, tid, now_ms=now), TxnResult)
            if late:
                due = replica.read(lambda sm: list(sm.txns.due()))
            for item in due:
                key = (item.txn_id, item.number)
                if key in self._finishing:
                    continue
                self._finishing.add(key)
                try:
                    await self._finish(bucket, item)
                finally:
                    self._finishing.discard(key)


def _work(sm: BucketStateMachine, now: int) -> tuple[list[str], list[DueMarkers]]:
    """What a coordinator's leader has to do at `now`: ids timed out, markers due."""
    return sm.txns.timed_out(now), list(sm.txns.due())


def _mark_entry(
    tid: str, epoch: int, number: int, outcome: TxnOutcome, owner: str, writes: int | None = None
) -> Txn:
    if writes is not None:
        if outcome is not TxnOutcome.NONE:
            raise ValueError("a PREPARE has no outcome")
        return Txn(TxnAction.PREPARE, tid, epoch, number, now_ms=now_ms(), writes=writes)
    if outcome is TxnOutcome.NONE:
        return Txn(TxnAction.JOIN, tid, epoch, number, principal=owner, now_ms=now_ms())
    return Txn(TxnAction.MARK, tid, epoch, number, outcome=outcome, now_ms=now_ms())


__all__ = ["DRIVER_PERIOD_S", "Transactions"]
