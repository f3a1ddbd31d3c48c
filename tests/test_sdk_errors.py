"""The SDK's errors carry the right codes, a node would map them to the right status,
and bad input to the op builders is refused with one clear error (docs/errors.md)."""

from __future__ import annotations

import grpc
import pytest

from sevendb.outbox.entries import NOT_EXISTS
from sevendb.proto.codec import STATUS_OF
from sevendb.sdk import (
    AckMode,
    BrokenReason,
    ClientClosed,
    CursorStoreError,
    ErrorCode,
    ExpectKind,
    InvalidArgument,
    LimitExceeded,
    ResourceExhausted,
    SevenDBError,
    SubscribeOptions,
    SubscriptionBroken,
    Unauthenticated,
    Unavailable,
    WriteQueue,
    delete_op,
    set_op,
)
from sevendb.sdk.errors import domain_error, retry_after_s


@pytest.mark.parametrize(
    ("error", "code", "status"),
    [
        (Unavailable("x"), ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
        (Unauthenticated("x"), ErrorCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED),
        (
            SubscriptionBroken("x", BrokenReason.FLUSH),
            ErrorCode.SUBSCRIPTION_BROKEN,
            grpc.StatusCode.ABORTED,
        ),
        (ResourceExhausted("x"), ErrorCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ClientClosed("x"), ErrorCode.CLIENT_CLOSED, grpc.StatusCode.CANCELLED),
        (CursorStoreError("x"), ErrorCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_the_client_s_errors_have_codes_of_their_own(
    error: SevenDBError, code: ErrorCode, status: grpc.StatusCode
) -> None:
    """`.code` of Unavailable, Unauthenticated and SubscriptionBroken read
    INVALID_ARGUMENT (the root's default); a node maps a `SevenDBError` to a status by
    its code, so the table must know the new ones."""
    assert error.code is code
    assert STATUS_OF[error.code] is status


def test_every_error_code_maps_to_a_status() -> None:
    assert set(STATUS_OF) == set(ErrorCode)


def test_resource_exhausted_is_retried_only_with_a_retry_after() -> None:
    assert retry_after_s("250") == 0.25
    assert retry_after_s(None) is None and retry_after_s("-1") is None
    assert retry_after_s("soon") is None
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert domain_error(exhausted, "slow down", None, 0.25) is None  # a rate limit: retry
    too_big = domain_error(exhausted, "message larger than max", None)
    assert isinstance(too_big, LimitExceeded)  # gRPC's own size limit: final
    assert isinstance(domain_error(grpc.StatusCode.UNAUTHENTICATED, "x", None), Unauthenticated)
    assert domain_error(grpc.StatusCode.UNAVAILABLE, "x", None) is None
    # A client-only code in the trailer (no node sends one) is not an unknown type.
    assert domain_error(grpc.StatusCode.UNAVAILABLE, "x", "UNAVAILABLE") is None


def test_expected_version_zero_means_must_not_exist() -> None:
    """etcd's reading: a key's versions start at 1, so 0 is "does not exist" (it was
    refused: "an exact expected version must be >= 1")."""
    assert set_op("k", b"v", expected_version=0).expected is NOT_EXISTS
    assert delete_op("k", expected_version=0).expected is NOT_EXISTS
    assert set_op("k", b"v", expected_version=0, must_not_exist=True).expected is NOT_EXISTS
    exact = set_op("k", b"v", expected_version=3).expected
    assert (exact.kind, exact.version) == (ExpectKind.EXACT, 3)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: set_op("k", b"v", expected_version=3, must_not_exist=True), "contradict"),
        (lambda: set_op("k", b"v", expected_version=-5), "must be >= 0"),
        (lambda: delete_op("k", expected_version=-1), "must be >= 0"),
        (lambda: set_op("k", b"v", expected_version=True), "must be an integer"),
        (lambda: set_op("k", b"v", expected_version="3"), "must be an integer"),  # type: ignore[arg-type]
    ],
)
def test_contradictory_or_malformed_conditions_are_refused(build: object, message: str) -> None:
    """`--if-absent --expect-version 3` was accepted (and wrote the key)."""
    with pytest.raises(InvalidArgument, match=message):
        build()  # type: ignore[operator]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="max_writes >= 1"):
        WriteQueue(max_writes=0)
    with pytest.raises(InvalidArgument, match="ack must be 'auto' or 'explicit'"):
        SubscribeOptions(ack="manual")  # type: ignore[arg-type]
    assert SubscribeOptions(ack="explicit").ack is AckMode.EXPLICIT  # type: ignore[arg-type]
