"""The wire codec: protobuf messages to and from the core's types, and how an error
travels (gRPC status, `sevendb-error`, `sevendb-leader` and `sevendb-retry-after-ms`
trailers).

The one place both ends of the wire convert: the nodes (`cluster/server`), the SDK
and the tests import these functions instead of building messages field by field.
Decoding validates through the core's constructors, so a bad message raises the
core's `InvalidArgument` (or `ValueError` for an unknown enum value), never a half
built value. docs/wire.md describes the contract itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import grpc
import msgpack

from sevendb.outbox.emitseq import EmitSeq, EpochId
from sevendb.outbox.entries import (
    ANY,
    OP_KIND_OF,
    Expected,
    ExpectKind,
    Op,
    ProducerRef,
    Start,
    StartKind,
    check_key,
    op_kind,
)
from sevendb.outbox.errors import ErrorCode, InvalidArgument
from sevendb.outbox.model import AckStatus, Change, Delta, ReconnectStatus
from sevendb.outbox.query import Query, QueryKind
from sevendb.proto import sevendb_pb2 as pb

# ---- errors and trailers -----------------------------------------------------------------

LEADER_HINT_KEY: Final = "sevendb-leader"
"""Trailer: the client address of the node to try next (a leader or lease holder)."""
ERROR_CODE_KEY: Final = "sevendb-error"
"""Trailer: the domain error (an `ErrorCode` name, or one of the values below)."""
STREAM_SUPERSEDED: Final = "STREAM_SUPERSEDED"
"""`sevendb-error` of a subscription stream fenced by a newer stream of the same
subscription (status FAILED_PRECONDITION): another consumer resumed it."""
DURABLE_IN_USE: Final = "DURABLE_IN_USE"
"""`sevendb-error` of a Subscribe naming a durable subscription that has a stream
attached (status FAILED_PRECONDITION): a second live consumer is refused."""
RETRY_AFTER_KEY: Final = "sevendb-retry-after-ms"
"""Trailer of a RESOURCE_EXHAUSTED answer: wait this many milliseconds (a decimal
integer) before trying again."""
RATE_LIMITED: Final = "RATE_LIMITED"
"""`sevendb-error` of a request over its principal's rate (RESOURCE_EXHAUSTED, with
`sevendb-retry-after-ms`)."""
OVERLOADED: Final = "OVERLOADED"
"""`sevendb-error` of a request refused because a server queue is full
(RESOURCE_EXHAUSTED, with `sevendb-retry-after-ms`)."""
TOO_MANY_SUBSCRIPTIONS: Final = "TOO_MANY_SUBSCRIPTIONS"
"""`sevendb-error` of a Subscribe over its principal's subscriptions in the bucket
(RESOURCE_EXHAUSTED; no retry-after: one must end first)."""
SLOW_SUBSCRIBER: Final = "SLOW_SUBSCRIBER"
"""`sevendb-error` of a subscription stream the node ended because its subscriber
acknowledged nothing for too long with events in flight (status UNAVAILABLE):
resume from the cursor."""

STATUS_OF: Final[dict[ErrorCode, grpc.StatusCode]] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.LIMIT_EXCEEDED: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.PRECONDITION_FAILED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.UNKNOWN_PRODUCER: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.PRODUCER_FENCED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.INVALID_PRODUCER_EPOCH: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.OUT_OF_ORDER_SEQUENCE: grpc.StatusCode.OUT_OF_RANGE,
    ErrorCode.DUPLICATE_SEQUENCE: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.SUBSCRIPTION_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.SUBSCRIPTION_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.NOT_OWNER: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.STALE_SUBSCRIPTION: grpc.StatusCode.OUT_OF_RANGE,
    ErrorCode.STALE_SEQUENCE: grpc.StatusCode.OUT_OF_RANGE,
    ErrorCode.REGRESSIVE_ACK: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.DUPLICATE_ACK: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.FUTURE_ACK: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.STALE_LEASE: grpc.StatusCode.ABORTED,
    ErrorCode.STALE_RANGE: grpc.StatusCode.ABORTED,
    ErrorCode.STALE_EPOCH: grpc.StatusCode.ABORTED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.GROUP_FENCED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.INVALID_TXN_ID: grpc.StatusCode.NOT_FOUND,
    ErrorCode.INVALID_TXN_STATE: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.CONCURRENT_TRANSACTIONS: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.BUCKET_NOT_IN_TXN: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.TRANSACTION_TIMED_OUT: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.TOO_MANY_TRANSACTIONS: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.ABORT_PARTIAL_FAILURE: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.CLIENT_CLOSED: grpc.StatusCode.CANCELLED,
    ErrorCode.SUBSCRIPTION_BROKEN: grpc.StatusCode.ABORTED,
}
"""The gRPC status of each domain error. Not-leader / no-quorum / quarantined
replicas answer UNAVAILABLE, with the leader's client address (when known) in the
`sevendb-leader` trailer."""


def trailers(
    leader: str | None, error: str | None, retry_after_ms: int | None = None
) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a failed call (or of a Session's `StreamEnd`)."""
    out: list[tuple[str, str]] = []
    if leader:
        out.append((LEADER_HINT_KEY, leader))
    if error:
        out.append((ERROR_CODE_KEY, error))
    if retry_after_ms:
        out.append((RETRY_AFTER_KEY, str(retry_after_ms)))
    return tuple(out)


# ---- sequences -------------------------------------------------------------------------


def epoch_to_pb(epoch: EpochId) -> pb.EmitSeq.EpochId:
    return pb.EmitSeq.EpochId(bucket_uuid=epoch.bucket_uuid, epoch_counter=epoch.epoch_counter)


def seq_to_pb(seq: EmitSeq) -> pb.EmitSeq:
    return pb.EmitSeq(
        epoch_id=pb.EmitSeq.EpochId(bucket_uuid=seq.bucket_uuid, epoch_counter=seq.epoch_counter),
        commit_index=seq.commit_index,
    )


def seq_from_pb(msg: pb.EmitSeq) -> EmitSeq:
    epoch = msg.epoch_id  # each nested read builds a wrapper: read it once
    return EmitSeq(epoch.bucket_uuid, epoch.epoch_counter, msg.commit_index)


# ---- changes, ops, queries ---------------------------------------------------------------


def start_to_pb(start: Start) -> pb.StartPosition | None:
    """A start position on the wire (None for LATEST: the field is left unset)."""
    if start.kind is StartKind.EARLIEST:
        return pb.StartPosition(earliest=True)
    if start.kind is StartKind.AFTER:
        assert start.after is not None
        return pb.StartPosition(after=seq_to_pb(start.after))
    if start.kind is StartKind.TIME:
        return pb.StartPosition(time_ms=start.time_ms)
    return None


def start_from_pb(msg: pb.StartPosition) -> Start:
    """A `Start` (validated: an empty position is `InvalidArgument`)."""
    which = msg.WhichOneof("at")
    if which == "earliest" and msg.earliest:
        return Start(StartKind.EARLIEST)
    if which == "after":
        return Start(StartKind.AFTER, seq_from_pb(msg.after))
    if which == "time_ms":
        return Start(StartKind.TIME, time_ms=msg.time_ms)
    raise InvalidArgument("a StartPosition names earliest, after or time_ms")


def change_to_pb(c: Change) -> pb.Change:
    return pb.Change(key=c.key, op=int(c.op), value=c.value, version=c.version)  # type: ignore[arg-type]


def change_from_pb(c: pb.Change) -> Change:
    return Change(c.key, op_kind(c.op), c.value, c.version)


_change: Final = Change._make


def changes_from_pb(changes: Sequence[pb.Change]) -> tuple[Change, ...]:
    """`change_from_pb` of each (ValueError for an unknown op), at a subscriber's
    rate: a dict lookup and `Change._make` per change, no call of its own."""
    kinds = OP_KIND_OF
    try:
        if len(changes) == 1:
            c = changes[0]
            return (_change((c.key, kinds[c.op], c.value, c.version)),)
        return tuple([_change((c.key, kinds[c.op], c.value, c.version)) for c in changes])
    except KeyError:  # an op this build does not know: op_kind raises its ValueError
        return tuple(change_from_pb(c) for c in changes)


def pack_changes(changes: tuple[Change, ...]) -> bytes:
    """`DataEvent.packed_changes` (docs/wire.md, "Packed changes"): a msgpack array of
    `[key, op, value, version]` arrays (a Change packs as its fields, in order)."""
    return msgpack.packb(changes, use_bin_type=True)


def unpack_changes(data: bytes) -> tuple[Change, ...]:
    """The changes `pack_changes` packed; ValueError for anything else (not msgpack,
    not an array of 4-item arrays, a field of the wrong type, an unknown op)."""
    try:
        items = msgpack.unpackb(data, use_list=False, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"packed changes are not valid msgpack: {exc!r}") from None
    if type(items) is not tuple:
        raise ValueError("packed changes must be an array")
    kinds = OP_KIND_OF
    out = []
    for item in items:
        if type(item) is not tuple or len(item) != 4:
            raise ValueError(f"a packed change must be a [key, op, value, version] array: {item!r}")
        key, op, value, version = item
        if (
            type(key) is not str
            or type(op) is not int
            or type(value) is not bytes
            or type(version) is not int
            or version < 0
        ):
            raise ValueError(f"a packed change has a field of the wrong type: {item!r}")
        kind = kinds.get(op)
        if kind is None:
            raise ValueError(f"a packed change has an unknown op: {op}")
        out.append(_change((key, kind, value, version)))
    return tuple(out)


def delta_to_pb(delta: Delta) -> pb.Delta:
    return pb.Delta(
        changes=[change_to_pb(c) for c in delta.changes], commit_time_ms=delta.commit_time_ms
    )


def op_to_pb(op: Op) -> pb.Op:
    msg = pb.Op(kind=int(op.kind), key=op.key, value=op.value)  # type: ignore[arg-type]
    if op.expected.kind is ExpectKind.NOT_EXISTS:
        msg.expected.not_exists = True
    elif op.expected.kind is ExpectKind.EXACT:
        msg.expected.exact = op.expected.version
    return msg


def op_from_pb(msg: pb.Op) -> Op:
    """Raises `InvalidArgument` (a bad key, value or precondition) or ValueError (an
    unknown kind)."""
    expected = ANY
    if msg.HasField("expected"):
        which = msg.expected.WhichOneof("kind")
        if which == "not_exists":
            expected = Expected(ExpectKind.NOT_EXISTS)
        elif which == "exact":
            expected = Expected.exact(msg.expected.exact)
    return Op(op_kind(msg.kind), msg.key, msg.value, expected)


def producer_from_pb(msg: pb.ProducerRef) -> ProducerRef:
    return ProducerRef(msg.producer_id, msg.producer_epoch, msg.sequence, msg.answered_below)


def query_to_pb(query: Query) -> pb.Query:
    return pb.Query(kind=int(query.kind), arg=query.arg)  # type: ignore[arg-type]


def query_from_pb(msg: pb.Query) -> Query:
    """Raises ValueError for an unknown kind, `InvalidArgument` for a bad key."""
    kind = QueryKind(msg.kind)
    if kind is QueryKind.KEY or (kind is QueryKind.PREFIX and msg.arg):
        check_key(msg.arg)
    return Query(kind, msg.arg)


# ---- verdicts and requests -------------------------------------------------------------

ACK_STATUS: Final[dict[AckStatus, pb.AckResult.Status]] = {
    AckStatus.ACCEPTED: pb.AckResult.ACCEPTED,
    AckStatus.REGRESSIVE: pb.AckResult.REGRESSIVE,
    AckStatus.DUPLICATE: pb.AckResult.DUPLICATE,
    AckStatus.FUTURE: pb.AckResult.FUTURE,
    AckStatus.NOT_OWNER: pb.AckResult.NOT_OWNER,
    AckStatus.SUBSCRIPTION_NOT_FOUND: pb.AckResult.SUBSCRIPTION_NOT_FOUND,
    AckStatus.STALE: pb.AckResult.STALE,
}
RECONNECT_STATUS: Final[dict[ReconnectStatus, pb.ReconnectAck.Status]] = {
    ReconnectStatus.OK: pb.ReconnectAck.OK,
    ReconnectStatus.STALE_SEQUENCE: pb.ReconnectAck.STALE_SEQUENCE,
    ReconnectStatus.INVALID_SEQUENCE: pb.ReconnectAck.INVALID_SEQUENCE,
    ReconnectStatus.SUBSCRIPTION_NOT_FOUND: pb.ReconnectAck.SUBSCRIPTION_NOT_FOUND,
}


def reconnect_request(sub_id: str, bucket: int, after: EmitSeq) -> pb.ReconnectRequest:
    """Resume `sub_id`, which lives on `bucket`, after `after`."""
    return pb.ReconnectRequest(
        sub_id=sub_id, last_processed_emit_seq=seq_to_pb(after), bucket=bucket
    )


__all__ = [
    "ACK_STATUS",
    "DURABLE_IN_USE",
    "ERROR_CODE_KEY",
    "LEADER_HINT_KEY",
    "OVERLOADED",
    "RATE_LIMITED",
    "RECONNECT_STATUS",
    "RETRY_AFTER_KEY",
    "SLOW_SUBSCRIBER",
    "TOO_MANY_SUBSCRIPTIONS",
    "STATUS_OF",
    "STREAM_SUPERSEDED",
    "change_from_pb",
    "change_to_pb",
    "delta_to_pb",
    "epoch_to_pb",
    "op_from_pb",
    "op_to_pb",
    "producer_from_pb",
    "query_from_pb",
    "query_to_pb",
    "reconnect_request",
    "seq_from_pb",
    "start_from_pb",
    "start_to_pb",
    "seq_to_pb",
    "trailers",
]
