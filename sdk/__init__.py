"""sevendb.sdk: the client library.

    from sevendb.sdk import Client, set_op

    with Client(["127.0.0.1:7001"], token=token) as client:
        client.put("orders/1", b"paid")   # idempotent: a retry never applies twice
        client.write([set_op("orders/2", b"new", must_not_exist=True)])  # keys of one bucket
        with client.subscribe("prefix:orders/", cursor="orders.cursor") as sub:
            for event in sub:
                ...   # an exception here leaves the event unacked: it comes again

In a coroutine, `AsyncClient` offers the same calls as coroutines on the caller's
own loop (`await client.put(...)`, ``async for event in sub``): docs/sdk.md.

The names below (`__all__`) are the public API; the modules under this package are
how it is built and may change. Every error is a `SevenDBError` (the tree:
`sevendb.sdk.errors`); nothing public takes or returns a protobuf message.

May import: `sevendb.proto`, `sevendb.outbox`.
"""

from sevendb.outbox.emitseq import EmitSeq, EpochId
from sevendb.outbox.entries import Expected, ExpectKind, Op, OpKind
from sevendb.outbox.errors import (
    AbortPartialFailure,
    BucketNotInTxn,
    ConcurrentTransactions,
    DuplicateSequence,
    ErrorCode,
    GroupFenced,
    InvalidArgument,
    InvalidProducerEpoch,
    InvalidTxnId,
    InvalidTxnState,
    LimitExceeded,
    NotOwner,
    OutOfOrderSequence,
    PermissionDenied,
    PreconditionFailed,
    ProducerFenced,
    SevenDBError,
    StaleSequence,
    StaleSubscription,
    SubscriptionExists,
    SubscriptionNotFound,
    TooManyTransactions,
    TransactionTimedOut,
    UnknownProducer,
)
from sevendb.outbox.model import Change
from sevendb.outbox.query import Query, QueryKind
from sevendb.sdk.async_client import AsyncClient, AsyncIdempotentProducer
from sevendb.sdk.client import Client, IdempotentProducer, RetryPolicy, Transaction, WriteQueue
from sevendb.sdk.cursor_store import CursorStore, SavedCursor
from sevendb.sdk.errors import (
    BrokenReason,
    ClientClosed,
    CursorStoreError,
    ResourceExhausted,
    SubscriptionBroken,
    Unauthenticated,
    Unavailable,
)
from sevendb.sdk.groups import GroupStats, GroupSubscription
from sevendb.sdk.handover import Handover
from sevendb.sdk.models import (
    ClusterLayout,
    NodeStatus,
    RangePage,
    Record,
    ReplicaStatus,
    WriteResult,
    delete_op,
    set_op,
)
from sevendb.sdk.subscription import (
    AckMode,
    Event,
    Recovery,
    StreamReset,
    StreamResetReason,
    SubscribeOptions,
    Subscription,
    SubscriptionStats,
)
from sevendb.sdk.tls import TLS
from sevendb.sdk.transactions import AsyncTransaction

__all__ = [
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
