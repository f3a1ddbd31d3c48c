"""Every error the SDK raises derives from `SevenDBError` (`sevendb.outbox.errors`),
so ``except SevenDBError`` catches them all:

    SevenDBError
    ├── InvalidArgument ── LimitExceeded     refused by a node (or by the client before
    ├── PreconditionFailed                    sending): `code` names the rejection; the
    ├── UnknownProducer, ProducerFenced,      same request gets the same answer, so
    │   InvalidProducerEpoch,                 these are never retried
    │   OutOfOrderSequence, DuplicateSequence
    ├── SubscriptionNotFound, SubscriptionExists, NotOwner, StaleSubscription
    ├── (acks and node-internal entries: RegressiveAck, DuplicateAck, FutureAck,
    │    StaleLease, StaleRange, StaleEpoch; an application does not meet them)
    ├── Unavailable          no node answered within the retry budget (may have committed)
    ├── Unauthenticated      the cluster refused the token
    ├── ClientClosed         the Client closed before the answer (may have committed)
    ├── SubscriptionBroken   a subscription cannot go on; `reason` says why
    └── CursorStoreError     the cursor file exists but cannot be read

The last five are the client's own; they carry no rejection `code` of their own
(the attribute keeps the root's default).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

import grpc

from sevendb.outbox.errors import ERROR_TYPES, ErrorCode, InvalidArgument, NotOwner, SevenDBError

_RETRYABLE: Final = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
)


class Unavailable(SevenDBError):
    """No node could serve the request within the `RetryPolicy`. A write may still
    have committed: retry it through an idempotent producer where that matters."""


class Unauthenticated(SevenDBError):
    """The cluster refused the token (missing, malformed, or minted elsewhere)."""


class ClientClosed(SevenDBError):
    """The `Client` closed while the request was unanswered (a write may still commit)."""


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

    def __init__(self, message: str, reason: BrokenReason) -> None:
        super().__init__(message)
        self.reason = reason


class CursorStoreError(SevenDBError):
    """The cursor file exists but cannot be read: refuse rather than start over."""


def domain_error(code: grpc.StatusCode, message: str, error: str | None) -> SevenDBError | None:
    """The typed exception a failed call maps to (`error`: the node's error-code
    trailer), or None if the call is worth retrying."""
    if error and error in ErrorCode.__members__:
        return ERROR_TYPES[ErrorCode(error)](message)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
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
    "SubscriptionBroken",
    "Unauthenticated",
    "Unavailable",
    "domain_error",
]
