"""Domain errors → gRPC status codes: the one table, applied at the edge."""

from __future__ import annotations

from typing import Final

import grpc

from sevendb.outbox.errors import ErrorCode

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
    ErrorCode.REGRESSIVE_ACK: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.DUPLICATE_ACK: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.FUTURE_ACK: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.STALE_LEASE: grpc.StatusCode.ABORTED,
    ErrorCode.STALE_RANGE: grpc.StatusCode.ABORTED,
    ErrorCode.STALE_EPOCH: grpc.StatusCode.ABORTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.CLIENT_CLOSED: grpc.StatusCode.CANCELLED,
    ErrorCode.SUBSCRIPTION_BROKEN: grpc.StatusCode.ABORTED,
}
"""Not-leader / no-quorum / quarantined replicas map to UNAVAILABLE, with the
leader's client address (when known) in the `sevendb-leader` trailing metadata."""

LEADER_HINT_KEY: Final = "sevendb-leader"
ERROR_CODE_KEY: Final = "sevendb-error"
RETRY_AFTER_KEY: Final = "retry-after-ms"
