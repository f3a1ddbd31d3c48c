"""The error tree.

Two families, kept apart because callers must treat them differently:

* `Rejection` values and the `SevenDBError` subclasses named by an `ErrorCode`:
  operating errors (bad input, a failed precondition, a stale sequence). They are
  deterministic: every replica reaches the same one for the same entry, so they are
  results, never reasons to stop. `SevenDBError` is also the root of every error the
  SDK raises: `sevendb.sdk` re-exports it with the SDK's own subclasses
  (`sevendb.sdk.errors` draws the whole tree).
* `EntryError`: the log entry itself cannot be decoded. Every replica rejects it
  identically and nothing changes. `ReplicaDivergence`: *this* replica disagrees
  with what the leader computed; it must quarantine itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    PRECONDITION_FAILED = "PRECONDITION_FAILED"
    UNKNOWN_PRODUCER = "UNKNOWN_PRODUCER"
    PRODUCER_FENCED = "PRODUCER_FENCED"
    INVALID_PRODUCER_EPOCH = "INVALID_PRODUCER_EPOCH"
    OUT_OF_ORDER_SEQUENCE = "OUT_OF_ORDER_SEQUENCE"
    DUPLICATE_SEQUENCE = "DUPLICATE_SEQUENCE"
    SUBSCRIPTION_NOT_FOUND = "SUBSCRIPTION_NOT_FOUND"
    SUBSCRIPTION_EXISTS = "SUBSCRIPTION_EXISTS"
    NOT_OWNER = "NOT_OWNER"
    STALE_SUBSCRIPTION = "STALE_SUBSCRIPTION"
    REGRESSIVE_ACK = "REGRESSIVE_ACK"
    DUPLICATE_ACK = "DUPLICATE_ACK"
    FUTURE_ACK = "FUTURE_ACK"
    STALE_LEASE = "STALE_LEASE"
    STALE_RANGE = "STALE_RANGE"
    STALE_EPOCH = "STALE_EPOCH"
    STALE_SEQUENCE = "STALE_SEQUENCE"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    GROUP_FENCED = "GROUP_FENCED"
    INVALID_TXN_ID = "INVALID_TXN_ID"
    INVALID_TXN_STATE = "INVALID_TXN_STATE"
    CONCURRENT_TRANSACTIONS = "CONCURRENT_TRANSACTIONS"
    BUCKET_NOT_IN_TXN = "BUCKET_NOT_IN_TXN"
    TRANSACTION_TIMED_OUT = "TRANSACTION_TIMED_OUT"
    TOO_MANY_TRANSACTIONS = "TOO_MANY_TRANSACTIONS"
    ABORT_PARTIAL_FAILURE = "ABORT_PARTIAL_FAILURE"
    # The client's own errors (sevendb.sdk.errors); a node never sends these.
    UNAVAILABLE = "UNAVAILABLE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    CLIENT_CLOSED = "CLIENT_CLOSED"
    SUBSCRIPTION_BROKEN = "SUBSCRIPTION_BROKEN"


@dataclass(frozen=True, slots=True)
class Rejection:
    """A deterministic refusal, carried in results (never raised inside apply)."""

    code: ErrorCode
    message: str

    def exception(self) -> SevenDBError:
        """The typed exception an edge (SDK, gRPC, CLI) raises for this rejection."""
        return ERROR_TYPES[self.code](self.message)


class SevenDBError(Exception):
    """Root of every error sevendb raises on purpose (the core's rejections and the
    SDK's errors). `code` names the error: the rejection a node reports, or one of the
    client's own codes (`Unavailable` is UNAVAILABLE, ...). A node maps any
    `SevenDBError` to a status by its `code`; an error made with no code of its own
    keeps the INVALID_ARGUMENT default."""

    code: ErrorCode = ErrorCode.INVALID_ARGUMENT


class InvalidArgument(SevenDBError):
    """The request is malformed; the caller must fix it. Nothing changed."""

    code = ErrorCode.INVALID_ARGUMENT


class LimitExceeded(InvalidArgument):
    """The request is over a limit in `sevendb.outbox.limits`. Nothing changed."""

    code = ErrorCode.LIMIT_EXCEEDED


class PreconditionFailed(SevenDBError):
    """An expected version did not hold (optimistic concurrency). Re-read and retry."""

    code = ErrorCode.PRECONDITION_FAILED


class UnknownProducer(SevenDBError):
    """The producer id was never initialised in this bucket: call InitProducer."""

    code = ErrorCode.UNKNOWN_PRODUCER


class ProducerFenced(SevenDBError):
    """A newer instance of this producer exists (its epoch is higher)."""

    code = ErrorCode.PRODUCER_FENCED


class InvalidProducerEpoch(SevenDBError):
    """The producer epoch is ahead of anything this bucket granted."""

    code = ErrorCode.INVALID_PRODUCER_EPOCH


class OutOfOrderSequence(SevenDBError):
    """A producer sequence skipped ahead: retry from the last acknowledged one."""

    code = ErrorCode.OUT_OF_ORDER_SEQUENCE


class DuplicateSequence(SevenDBError):
    """A retried sequence too old for the result cache; it was committed before."""

    code = ErrorCode.DUPLICATE_SEQUENCE


class SubscriptionNotFound(SevenDBError):
    """No such subscription in the bucket (ended, dropped, or never made)."""

    code = ErrorCode.SUBSCRIPTION_NOT_FOUND


class SubscriptionExists(SevenDBError):
    """The sub_id is taken by a different query."""

    code = ErrorCode.SUBSCRIPTION_EXISTS


class NotOwner(SevenDBError):
    """The subscription belongs to another principal."""

    code = ErrorCode.NOT_OWNER


class PermissionDenied(SevenDBError):
    """The principal lacks the permission the message names (an access-control rule,
    or a producer id another principal owns). Nothing changed."""

    code = ErrorCode.PERMISSION_DENIED


class StaleSubscription(SevenDBError):
    """The subscription was dropped for stalling past the window: resubscribe."""

    code = ErrorCode.STALE_SUBSCRIPTION


class StaleSequence(SevenDBError):
    """A start or history position older than the retained history (docs/contract.md
    §5.2): read the current state (Sync) and go on from there."""

    code = ErrorCode.STALE_SEQUENCE


class RegressiveAck(SevenDBError):
    """An ack below the subscription's acknowledged position."""

    code = ErrorCode.REGRESSIVE_ACK


class DuplicateAck(SevenDBError):
    """An ack of exactly the acknowledged position."""

    code = ErrorCode.DUPLICATE_ACK


class FutureAck(SevenDBError):
    """An ack beyond anything emitted to this subscription."""

    code = ErrorCode.FUTURE_ACK


class StaleLease(SevenDBError):
    """Proposed by a notifier whose lease was superseded (fencing)."""

    code = ErrorCode.STALE_LEASE


class StaleRange(SevenDBError):
    """An OUTBOX_WRITE for a range another proposal already moved past."""

    code = ErrorCode.STALE_RANGE


class StaleEpoch(SevenDBError):
    """An EPOCH_CREATE that is not exactly the next epoch."""

    code = ErrorCode.STALE_EPOCH


class GroupFenced(SevenDBError):
    """A consumer group member acted on a bucket it no longer owns (or with an old
    generation): a rebalance moved the bucket's stream to another member."""

    code = ErrorCode.GROUP_FENCED


class InvalidTxnId(SevenDBError):
    """No such transactional id (or transaction) at its coordinator: initialise it."""

    code = ErrorCode.INVALID_TXN_ID


class InvalidTxnState(SevenDBError):
    """The transaction is not in a state that allows the call (already decided,
    another transaction's number, ...)."""

    code = ErrorCode.INVALID_TXN_STATE


class ConcurrentTransactions(SevenDBError):
    """The transactional id has an open transaction: commit or abort it first."""

    code = ErrorCode.CONCURRENT_TRANSACTIONS


class BucketNotInTxn(SevenDBError):
    """A transactional write to a bucket that was not added to the transaction (the
    bucket form of Kafka's partition-not-in-transaction)."""

    code = ErrorCode.BUCKET_NOT_IN_TXN


class TransactionTimedOut(SevenDBError):
    """The transaction outlived its timeout and the coordinator aborted it: begin a
    new one."""

    code = ErrorCode.TRANSACTION_TIMED_OUT


class TooManyTransactions(SevenDBError):
    """The transactional id has `TXN_PENDING_PER_PRODUCER_MAX` transactions not yet
    complete: wait for their markers."""

    code = ErrorCode.TOO_MANY_TRANSACTIONS


class AbortPartialFailure(SevenDBError):
    """The abort is decided and durable, but some participant buckets (named in the
    message) did not take their marker yet; the coordinator keeps retrying. Their
    pending writes are never visible meanwhile."""

    code = ErrorCode.ABORT_PARTIAL_FAILURE


ERROR_TYPES: dict[ErrorCode, type[SevenDBError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        LimitExceeded,
        PreconditionFailed,
        UnknownProducer,
        ProducerFenced,
        InvalidProducerEpoch,
        OutOfOrderSequence,
        DuplicateSequence,
        SubscriptionNotFound,
        SubscriptionExists,
        NotOwner,
        PermissionDenied,
        StaleSubscription,
        StaleSequence,
        RegressiveAck,
        DuplicateAck,
        FutureAck,
        StaleLease,
        StaleRange,
        StaleEpoch,
        GroupFenced,
        InvalidTxnId,
        InvalidTxnState,
        ConcurrentTransactions,
        BucketNotInTxn,
        TransactionTimedOut,
        TooManyTransactions,
        AbortPartialFailure,
    )
}


class EntryError(Exception):
    """A log entry that cannot be applied at all; state is unchanged."""


class MalformedEntry(EntryError):
    """The bytes are not a valid entry (bad msgpack, wrong shape, over a limit)."""


class UnknownEntryType(EntryError):
    """A well-formed entry of a type this version does not know."""


class UnsupportedEntryVersion(EntryError):
    """An entry written by a newer (or unknown) encoding version."""


class ApplyOrderError(Exception):
    """The adapter fed entries out of order: a programming error, not an input error."""


class ReplicaDivergence(Exception):
    """This replica's own computation disagrees with the committed entry.

    The replica must stop serving and quarantine itself; the others go on.
    """


class PlanMismatch(ReplicaDivergence):
    """A subscription's plan_hash or an OUTBOX_WRITE digest differs from ours."""


class SnapshotError(Exception):
    """Snapshot bytes that cannot be restored (corrupt or from another version)."""
