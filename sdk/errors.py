"""Every error the SDK raises derives from `SevenDBError` (`sevendb.outbox.errors`),
so ``except SevenDBError`` catches them all:

    SevenDBError
    ├── InvalidArgument ── LimitExceeded     refused by a node (or by the client before
    ├── PreconditionFailed                    sending): `code` names the rejection; the
    ├── UnknownProducer, ProducerFenced,      same request gets the same answer, so
    │   InvalidProducerEpoch,                 these are never retried
    │   OutOfOrderSequence, DuplicateSequence
    ├── SubscriptionNotFound, SubscriptionExists, NotOwner, StaleSubscription
    ├── PermissionDenied    the principal lacks the permission the message names
    ├── InvalidTxnId, InvalidTxnState, ConcurrentTransactions, BucketNotInTxn,
    │   TransactionTimedOut, TooManyTransactions, AbortPartialFailure
    │                        a transaction's refusals (docs/transactions.md)
    ├── (acks and node-internal entries: RegressiveAck, DuplicateAck, FutureAck,
    │    StaleLease, StaleRange, StaleEpoch; an application does not meet them)
    ├── Unavailable          no node answered within the retry budget (may have committed)
    ├── Unauthenticated      the cluster refused the token
    ├── ResourceExhausted    the client's write queue stayed full, or the cluster kept
    │                        refusing with RESOURCE_EXHAUSTED past the retry budget
    ├── ClientClosed         the Client closed before the answer (may have committed)
    ├── SubscriptionBroken   a subscription cannot go on; `reason` says why
    └── CursorStoreError     the cursor file exists but cannot be read

The last six are the client's own. Their `code` is a code of their own (UNAVAILABLE,
UNAUTHENTICATED, RESOURCE_EXHAUSTED, CLIENT_CLOSED, SUBSCRIPTION_BROKEN), except
`CursorStoreError`, which is bad input (a corrupt file): INVALID_ARGUMENT. The table
of bad inputs and their answers is docs/errors.md.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

import grpc

from sevendb.outbox.errors import (
    ERROR_TYPES,
    ErrorCode,
    InvalidArgument,
    LimitExceeded,
    NotOwner,
    SevenDBError,
)

_RETRYABLE: Final = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
)


class Unavailable(SevenDBError):
    """No node could serve the request within the `RetryPolicy`. A write may still
    have committed (`Client` writes are idempotent: retrying the same write through
    the same client never applies it twice while the cluster remembers its producer)."""

    code = ErrorCode.UNAVAILABLE


class Unauthenticated(SevenDBError):
    """The cluster refused the token (missing, malformed, or minted elsewhere)."""

    code = ErrorCode.UNAUTHENTICATED


class ResourceExhausted(SevenDBError):
    """Backpressure: the client's write queue stayed full for `WriteQueue.wait_s`, or
    the cluster answered RESOURCE_EXHAUSTED (a rate limit) until the retry budget ran
    out. `retry_after_s` is the wait the cluster last asked for (None if it named
    none). Nothing was written by the refused request."""

    code = ErrorCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClientClosed(SevenDBError):
    """The `Client` closed while the request was unanswered (a write may still commit)."""

    code = ErrorCode.CLIENT_CLOSED


class BrokenReason(StrEnum):
    """Why a subscription cannot go on (`SubscriptionBroken.reason`)."""

    STALE_SEQUENCE = "STALE_SEQUENCE"
    INVALID_SEQUENCE = "INVALID_SEQUENCE"
    SUBSCRIPTION_NOT_FOUND = "SUBSCRIPTION_NOT_FOUND"
    """A bucket's stream cannot resume from the saved position and the options say
    `Recovery.RAISE` (see `StreamResetReason`)."""
    UNAVAILABLE = "UNAVAILABLE"
    """A bucket's stream was not established in time by `Client.subscribe`."""
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    """The node refused the stream with this gRPC status (a token it does not accept,
    another principal's subscription, a malformed request, a node without `Session`)."""
    FLUSH = "FLUSH"
    """Persisting the cursor (or sending its acks) failed."""
    INTERNAL = "INTERNAL"
    """A defect in the SDK's stream code (logged with its traceback)."""


class SubscriptionBroken(SevenDBError):
    """The subscription cannot continue; `reason` says why."""

    code = ErrorCode.SUBSCRIPTION_BROKEN

    def __init__(self, message: str, reason: BrokenReason) -> None:
        super().__init__(message)
        self.reason = reason


class CursorStoreError(SevenDBError):
    """The cursor file exists but cannot be read: refuse rather than start over.
    Bad input (the file), so its `code` is INVALID_ARGUMENT."""

    code = ErrorCode.INVALID_ARGUMENT


def retry_after_s(value: str | None) -> float | None:
    """The wait a `sevendb-retry-after-ms` trailer asks for, in seconds (None if absent or
    not a non-negative whole number of milliseconds)."""
    if value is None or not value.isdigit():
        return None
    return int(value) / 1000


def domain_error(
    code: grpc.StatusCode, message: str, error: str | None, retry_after: float | None = None
) -> SevenDBError | None:
    """The typed exception a failed call maps to (`error`: the node's error-code
    trailer), or None if the call is worth retrying: UNAVAILABLE and the like, and
    RESOURCE_EXHAUSTED with a `retry_after` (a rate limit: retry after that long).
    RESOURCE_EXHAUSTED without one is gRPC's own message-size limit: `LimitExceeded`."""
    typed = ERROR_TYPES.get(ErrorCode(error)) if error and error in ErrorCode.__members__ else None
    if typed is not None:
        return typed(message)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None if retry_after is not None else LimitExceeded(message)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(message)
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(message)
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return NotOwner(message)
    if code not in _RETRYABLE:
        return SevenDBError(f"{code.name}: {message}")
    return None


__all__ = [
    "BrokenReason",
    "ClientClosed",
    "CursorStoreError",
    "ResourceExhausted",
    "SubscriptionBroken",
    "Unauthenticated",
    "Unavailable",
    "domain_error",
    "retry_after_s",
]
