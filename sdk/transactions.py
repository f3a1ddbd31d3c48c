"""Transactions in the SDK (docs/transactions.md): `AsyncClient.transaction` and
`Client.transaction` (which bridges to this one implementation).

A transactional id is registered with its coordinator once per client (`INIT`): that
fences any earlier instance of the id (another process, an earlier run), whose
open transaction is aborted and whose later calls get `ProducerFenced`. Each
transaction then adds the buckets it writes to, writes (kept pending in each bucket),
and commits or aborts: its writes become visible together, in each bucket at the
COMMIT marker's position, or never.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from sevendb.outbox.entries import Op, TxnWrite, check_txn_id
from sevendb.outbox.errors import InvalidArgument, InvalidTxnState
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk.models import ClusterLayout, delete_op, set_op
from sevendb.sdk.streams import Event

T = TypeVar("T")


class TxnHost(Protocol):
    """What a transaction needs of its client (`AsyncClient`)."""

    metadata: tuple[tuple[str, str], ...]

    async def _call(self, fn: Callable[[pb_grpc.SevenDBStub, float], Awaitable[T]]) -> T: ...

    async def layout(self, *, refresh: bool = False) -> ClusterLayout: ...

    async def _txn_session(self, transactional_id: str, timeout_ms: int = 0) -> TxnSession: ...


@dataclass(slots=True)
class TxnSession:
    """A client's registration of one transactional id: its epoch and the number of
    its last transaction."""

    txn_id: str
    epoch: int
    last_number: int


@dataclass(slots=True)
class _Open:
    number: int
    buckets: set[int] = field(default_factory=set)
    writes: dict[int, int] = field(default_factory=dict)
    """bucket -> sequence of the last write sent there."""


class AsyncTransaction:
    """One transaction of a transactional id (`AsyncClient.transaction`). Use it as
    ``async with``: it commits when the block ends normally and aborts when it raises;
    or call `commit` / `abort` yourself. Not for concurrent use by several tasks."""

    def __init__(self, client: TxnHost, txn_id: str, timeout_ms: int = 0) -> None:
        check_txn_id(txn_id)
        if timeout_ms < 0:
            raise InvalidArgument("timeout_ms must be >= 0 (0: the cluster's default, 60 s)")
        self._client = client
        self._txn_id = txn_id
        self._timeout_ms = timeout_ms
        self._open: _Open | None = None
        self._ended = False

    @property
    def transactional_id(self) -> str:
        return self._txn_id

    @property
    def number(self) -> int:
        """The transaction's number (0 until its first write begins it)."""
        return 0 if self._open is None else self._open.number

    async def _session(self) -> TxnSession:
        return await self._client._txn_session(self._txn_id, self._timeout_ms)

    async def _call(self, request: pb.TxnRequest) -> pb.TxnResponse:
        client = self._client
        response: pb.TxnResponse = await client._call(
            lambda s, t: s.Txn(request, timeout=t, metadata=client.metadata)
        )
        return response

    async def _add(self, session: TxnSession, buckets: set[int]) -> _Open:
        if self._ended:
            raise InvalidTxnState(f"transaction {self.number} of {self._txn_id!r} has ended")
        current = self._open or _Open(session.last_number + 1)
        new = buckets - current.buckets
        if new or self._open is None:
            await self._call(
                pb.TxnRequest(
                    action=pb.TxnRequest.ADD,
                    transactional_id=self._txn_id,
                    epoch=session.epoch,
                    number=current.number,
                    buckets=sorted(new),
                )
            )
            current.buckets |= new
            if self._open is None:
                self._open = current
                session.last_number = current.number
        return current

    async def write(self, ops: Sequence[Op]) -> None:
        """Write `ops` in this transaction (any keys, any buckets): kept pending until
        the commit. Keys of one bucket go in one request."""
        if not ops:
            raise InvalidArgument("a write needs at least one op")
        layout = await self._client.layout()
        by_bucket: dict[int, list[Op]] = {}
        for op in ops:
            by_bucket.setdefault(layout.bucket_of(op.key), []).append(op)
        session = await self._session()
        current = await self._add(session, set(by_bucket))
        for bucket, mine in sorted(by_bucket.items()):
            sequence = current.writes.get(bucket, 0) + 1
            TxnWrite(self._txn_id, session.epoch, current.number, tuple(mine), sequence=sequence)
            ref = pb.TxnRef(
                transactional_id=self._txn_id,
                epoch=session.epoch,
                number=current.number,
                sequence=sequence,
            )
            request = _write_request(mine)
            request.txn.CopyFrom(ref)
            await self._write_call(request)
            current.writes[bucket] = sequence

    async def _write_call(self, request: pb.WriteRequest) -> None:
        client = self._client
        await client._call(lambda s, t: s.Write(request, timeout=t, metadata=client.metadata))

    async def ack(self, event: Event) -> None:
        """Acknowledge `event` (and everything before it in its bucket's stream) as
        part of this transaction: the subscription's acknowledged position moves
        with the commit, or not at all (consume-transform-produce). Use it with
        `SubscribeOptions(ack="explicit")` and a durable name, and mark the event
        processed (`Subscription.ack`) only after the commit."""
        session = await self._session()
        current = await self._add(session, {event.bucket})
        sequence = current.writes.get(event.bucket, 0) + 1
        request = pb.WriteRequest(
            txn=pb.TxnRef(
                transactional_id=self._txn_id,
                epoch=session.epoch,
                number=current.number,
                sequence=sequence,
            ),
            txn_acks=[
                pb.ClientAck(sub_id=event.sub_id, up_to_emit_seq=codec.seq_to_pb(event.emit_seq))
            ],
        )
        await self._write_call(request)
        current.writes[event.bucket] = sequence

    async def put(
        self,
        key: str,
        value: bytes,
        *,
        expected_version: int | None = None,
        must_not_exist: bool = False,
    ) -> None:
        """Set one key in this transaction (a condition is checked against the
        committed value when the write reaches its bucket)."""
        op = set_op(key, value, expected_version=expected_version, must_not_exist=must_not_exist)
        await self.write([op])

    async def delete(self, key: str, *, expected_version: int | None = None) -> None:
        await self.write([delete_op(key, expected_version=expected_version)])

    async def _end(self, commit: bool) -> tuple[int, ...]:
        if self._ended:
            raise InvalidTxnState(f"transaction {self.number} of {self._txn_id!r} has ended")
        self._ended = True
        if self._open is None:
            return ()  # nothing was written: nothing to decide
        session = await self._session()
        request = pb.TxnRequest(
            action=pb.TxnRequest.COMMIT if commit else pb.TxnRequest.ABORT,
            transactional_id=self._txn_id,
            epoch=session.epoch,
            number=self._open.number,
        )
        if commit:  # every bucket is checked to hold exactly these writes first
            buckets = sorted(self._open.buckets)
            request.buckets.extend(buckets)
            request.writes.extend(self._open.writes.get(b, 0) for b in buckets)
        response = await self._call(request)
        return tuple(response.buckets)

    async def commit(self) -> tuple[int, ...]:
        """Commit: every write of the transaction becomes visible, or (an error) none.
        Returns the buckets it wrote to. `TransactionTimedOut` if it outlived its
        timeout, `ProducerFenced` if a newer instance of its id initialised."""
        return await self._end(True)

    async def abort(self) -> None:
        """Abort: no write of the transaction ever becomes visible."""
        await self._end(False)

    async def __aenter__(self) -> AsyncTransaction:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._ended:
            return
        if exc_type is None:
            await self.commit()
        else:
            # The block's own error matters more; if this abort fails, the timeout aborts.
            with contextlib.suppress(Exception):
                await self.abort()


def _write_request(ops: Sequence[Op]) -> pb.WriteRequest:
    from sevendb.sdk.async_client import write_request  # (it imports this module)

    return write_request(ops)


async def init_session(client: TxnHost, txn_id: str, timeout_ms: int) -> TxnSession:
    """Register `txn_id` with its coordinator (fencing its earlier instances)."""
    request = pb.TxnRequest(
        action=pb.TxnRequest.INIT, transactional_id=txn_id, timeout_ms=timeout_ms
    )
    response: pb.TxnResponse = await client._call(
        lambda s, t: s.Txn(request, timeout=t, metadata=client.metadata)
    )
    return TxnSession(txn_id, response.epoch, response.number)


__all__ = ["AsyncTransaction", "TxnSession", "init_session"]
