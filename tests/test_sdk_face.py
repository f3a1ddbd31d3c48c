"""The SDK's public face: the names `sevendb.sdk` exports, its error tree, and that
nothing public takes or returns a protobuf (or gRPC) type."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import sevendb.sdk
from sevendb.outbox.errors import ERROR_TYPES
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk import (
    Client,
    ExpectKind,
    InvalidArgument,
    LimitExceeded,
    OpKind,
    Recovery,
    SevenDBError,
    SubscribeOptions,
    delete_op,
    set_op,
)
from sevendb.sdk.client import _op_pb

PUBLIC = [
    "AbortPartialFailure",
    "AckMode",
    "AsyncClient",
    "AsyncIdempotentProducer",
    "AsyncTransaction",
    "BrokenReason",
    "BucketNotInTxn",
    "Change",
    "Client",
    "ClientClosed",
    "ClusterLayout",
    "ConcurrentTransactions",
    "CursorStore",
    "CursorStoreError",
    "DuplicateSequence",
    "EmitSeq",
    "EpochId",
    "ErrorCode",
    "Event",
    "ExpectKind",
    "Expected",
    "GroupFenced",
    "GroupStats",
    "GroupSubscription",
    "Handover",
    "IdempotentProducer",
    "InvalidArgument",
    "InvalidProducerEpoch",
    "InvalidTxnId",
    "InvalidTxnState",
    "LimitExceeded",
    "NodeStatus",
    "NotOwner",
    "Op",
    "OpKind",
    "OutOfOrderSequence",
    "PermissionDenied",
    "PreconditionFailed",
    "ProducerFenced",
    "Query",
    "QueryKind",
    "RangePage",
    "Record",
    "Recovery",
    "ReplicaStatus",
    "ResourceExhausted",
    "RetryPolicy",
    "SavedCursor",
    "SevenDBError",
    "StaleSequence",
    "StaleSubscription",
    "StreamReset",
    "StreamResetReason",
    "SubscribeOptions",
    "Subscription",
    "SubscriptionBroken",
    "SubscriptionExists",
    "SubscriptionNotFound",
    "SubscriptionStats",
    "TLS",
    "TooManyTransactions",
    "Transaction",
    "TransactionTimedOut",
    "Unauthenticated",
    "Unavailable",
    "UnknownProducer",
    "WriteQueue",
    "WriteResult",
    "delete_op",
    "set_op",
]

MADE_BY_THE_CLIENT = {
    "Subscription.__init__",
    "GroupSubscription.__init__",
    "AsyncTransaction.__init__",
}
"""Constructors an application never calls (`Client.subscribe` makes a Subscription):
they may take the SDK's internals, but no wire type either."""

WIRE_MODULES = ("sevendb.proto", "google.protobuf", "grpc")


def test_the_public_names_are_pinned() -> None:
    """Adding, renaming or dropping a public name is a decision: change this list."""
    assert sevendb.sdk.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(sevendb.sdk, name) is not None


def _signatures() -> Iterator[tuple[str, Callable[..., Any]]]:
    """(qualified name, callable) of every public function, method and property."""
    for name in sevendb.sdk.__all__:
        thing = getattr(sevendb.sdk, name)
        if not inspect.isclass(thing):
            yield name, thing
            continue
        for attr, value in vars(thing).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            if isinstance(value, property) and value.fget is not None:
                yield f"{name}.{attr}", value.fget
            elif isinstance(value, classmethod | staticmethod):
                yield f"{name}.{attr}", value.__func__
            elif inspect.isfunction(value):
                yield f"{name}.{attr}", value


def _classes_in(hint: object) -> Iterator[type]:
    for cls in (hint, typing.get_origin(hint)):
        if isinstance(cls, type):
            yield cls
    for arg in typing.get_args(hint):
        yield from _classes_in(arg)


def _hints(thing: Callable[..., Any] | type) -> dict[str, Any]:
    return typing.get_type_hints(thing)


def _public_types() -> Iterator[tuple[str, type]]:
    for name, fn in _signatures():
        for hint in _hints(fn).values():
            for cls in _classes_in(hint):
                yield name, cls
    for name in sevendb.sdk.__all__:  # fields of dataclasses and named tuples
        thing = getattr(sevendb.sdk, name)
        if inspect.isclass(thing) and not issubclass(thing, BaseException | enum.Enum):
            for hint in _hints(thing).values():
                for cls in _classes_in(hint):
                    yield name, cls


def test_no_public_signature_mentions_a_wire_type() -> None:
    found = [
        (where, f"{cls.__module__}.{cls.__qualname__}")
        for where, cls in _public_types()
        if cls.__module__.startswith(WIRE_MODULES)
    ]
    assert found == []


def test_every_first_party_type_in_a_public_signature_is_public() -> None:
    exported = {getattr(sevendb.sdk, name) for name in sevendb.sdk.__all__}
    hidden = {
        (where, f"{cls.__module__}.{cls.__qualname__}")
        for where, cls in _public_types()
        if cls.__module__.startswith("sevendb.")
        and cls not in exported
        and where not in MADE_BY_THE_CLIENT
    }
    assert hidden == set()


def test_the_check_sees_a_wire_type_where_there_is_one() -> None:
    """The signature walk is not vacuous: the pre-face signatures it would have caught."""

    def write(ops: list[pb.Op]) -> pb.StatusResponse:
        raise NotImplementedError

    classes = {cls for hint in _hints(write).values() for cls in _classes_in(hint)}
    assert classes == {pb.Op, pb.StatusResponse, list}
    assert any(name == "Client.write" for name, _ in _signatures())
    assert any(name == "Client.status" for name, _ in _signatures())


def test_every_public_error_derives_from_sevendb_error() -> None:
    errors = [
        getattr(sevendb.sdk, name)
        for name in sevendb.sdk.__all__
        if inspect.isclass(getattr(sevendb.sdk, name))
        and issubclass(getattr(sevendb.sdk, name), BaseException)
    ]
    # StaleSequence (a start older than the history), PermissionDenied, GroupFenced (a
    # deposed consumer group member), the seven of transactions (docs/transactions.md)
    assert len(errors) == 29
    assert all(issubclass(e, SevenDBError) for e in errors)
    assert all(issubclass(e, SevenDBError) for e in ERROR_TYPES.values())


def test_bad_input_to_the_client_is_invalid_argument() -> None:
    """Refused before anything is sent (nothing listens at the endpoint)."""
    with pytest.raises(InvalidArgument, match="at least one endpoint"):
        Client([])
    with Client(["127.0.0.1:1"]) as client:
        with pytest.raises(InvalidArgument, match="takes Op values"):
            client.write([pb.Op(key="a", value=b"1")])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="at least one op"):
            client.write([])
        with pytest.raises(InvalidArgument, match="query must be"):
            client.subscribe("orders/")
    with pytest.raises(InvalidArgument, match="key must not be empty"):
        set_op("", b"v")
    with pytest.raises(LimitExceeded):
        set_op("k", b"v" * (10 * 1024 * 1024))
    with pytest.raises(InvalidArgument, match="must be >= 0"):
        delete_op("k", expected_version=-5)


def test_ops_reach_the_wire_as_the_node_reads_them() -> None:
    assert _op_pb(set_op("a", b"1")) == pb.Op(kind=pb.Op.SET, key="a", value=b"1")
    assert _op_pb(set_op("a", b"1", expected_version=4)) == pb.Op(
        kind=pb.Op.SET, key="a", value=b"1", expected=pb.ExpectedVersion(exact=4)
    )
    assert _op_pb(set_op("a", b"", must_not_exist=True)) == pb.Op(
        kind=pb.Op.SET, key="a", expected=pb.ExpectedVersion(not_exists=True)
    )
    assert _op_pb(delete_op("b", expected_version=2)) == pb.Op(
        kind=pb.Op.DEL, key="b", expected=pb.ExpectedVersion(exact=2)
    )
    op = delete_op("b")
    assert (op.kind, op.expected.kind) == (OpKind.DEL, ExpectKind.ANY)


def test_recovery_policies_are_enums_and_their_values_are_accepted() -> None:
    options = SubscribeOptions(on_stale="raise", on_invalid="resubscribe")  # type: ignore[arg-type]
    assert options.on_stale is Recovery.RAISE and options.on_invalid is Recovery.RESUBSCRIBE
    assert SubscribeOptions().on_stale is Recovery.RESUBSCRIBE
    assert SubscribeOptions().on_invalid is Recovery.RAISE
    with pytest.raises(InvalidArgument, match="on_invalid must be 'resubscribe' or 'raise'"):
        SubscribeOptions(on_invalid="reset")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="ack_every_events"):
        SubscribeOptions(ack_every_events=0)


def test_status_mirrors_the_wire_message_field_for_field() -> None:
    """A field added to `ReplicaStatus` on the wire must be added to the SDK's too."""
    wire = [f.name for f in pb.ReplicaStatus.DESCRIPTOR.fields]
    assert [f.name for f in dataclasses.fields(sevendb.sdk.ReplicaStatus)] == wire
