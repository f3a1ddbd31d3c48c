"""Entry encoding: round trips, and bad bytes raise a typed error and change nothing."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from helpers import Driver
from hypothesis import given
from hypothesis import strategies as st

from sevendb.outbox import limits
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    ENTRY_FORMAT_VERSION,
    NOT_EXISTS,
    Ack,
    Entry,
    EntryType,
    EpochCreate,
    Expected,
    HistoryTrim,
    InitProducer,
    Lease,
    Op,
    OpKind,
    OutboxPurge,
    OutboxWrite,
    ProducerRef,
    Start,
    StartKind,
    Subscribe,
    SubscribeBatch,
    Txn,
    TxnAction,
    TxnOutcome,
    TxnWrite,
    Unsubscribe,
    Write,
    WriteBatch,
    decode_entry,
    encode_entry,
)
from sevendb.outbox.errors import (
    EntryError,
    InvalidArgument,
    LimitExceeded,
    MalformedEntry,
    UnknownEntryType,
    UnsupportedEntryVersion,
)
from sevendb.outbox.groups import GroupBeat
from sevendb.outbox.query import Query

SAMPLES: list[Entry] = [
    Write(
        (Op(OpKind.SET, "k", b"v", Expected.exact(3)), Op(OpKind.DEL, "j", b"", NOT_EXISTS)),
        ProducerRef(9, 1, 4),
        123,
    ),
    Write((Op(OpKind.SET, "k"),)),
    Subscribe("s", "alice", Query.parse("prefix:a/"), 42, 7),
    Subscribe("s", "alice", Query.parse("all"), 42, 7, "billing"),
    Subscribe("s", "alice", Query.parse("all"), 42, 7, "", Start(StartKind.EARLIEST)),
    Subscribe("s", "alice", Query.parse("all"), 42, 7, "n", Start(StartKind.TIME, time_ms=5)),
    Subscribe(
        "s", "alice", Query.parse("all"), 42, 7, "", Start(StartKind.AFTER, EmitSeq("b", 1, 4))
    ),
    Unsubscribe("s", "alice", 8),
    HistoryTrim(40, 9),
    GroupBeat("alice", "workers", "m-1", 3, 10_000, False, 77),
    OutboxWrite(3, 10, 20, 5, 2**64 - 1, 9),
    OutboxPurge(3, (Ack("s", "alice", EmitSeq("b", 1, 4)),), ("t",), 60_000, 10),
    EpochCreate(2, 11),
    Lease("node-1", 12),
    InitProducer(77, 13),
    InitProducer(77, 13, "alice"),
    Write((Op(OpKind.SET, "k"),), ProducerRef(9, 1, 4), 123, "alice"),
    Write((Op(OpKind.SET, "k"),), ProducerRef(9, 1, 4, 2), 123, "alice"),
    WriteBatch(
        (
            Write((Op(OpKind.SET, "a"),), ProducerRef(1, 0, 0), 5, "alice"),
            Write((Op(OpKind.DEL, "b"),), None, 6),
        )
    ),
    SubscribeBatch(
        (
            Subscribe("s", "alice", Query.parse("prefix:a/"), 42, 7),
            Subscribe("t", "bob", Query.parse("all"), 43, 8),
        )
    ),
    Txn(TxnAction.INIT, "tx", principal="alice", now_ms=5, timeout_ms=60_000),
    Txn(TxnAction.ADD, "tx", 1, 1, (0, 3), principal="alice", now_ms=6),
    Txn(TxnAction.MARK, "tx", 1, 2, outcome=TxnOutcome.COMMIT, now_ms=7),
    TxnWrite("tx", 1, 2, (Op(OpKind.SET, "k", b"v", Expected.exact(3)),), "alice", 8, 2),
]


@pytest.mark.parametrize("entry", SAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip_is_exact_and_canonical(entry: Entry) -> None:
    data = encode_entry(entry)
    assert decode_entry(data) == entry
    assert encode_entry(decode_entry(data)) == data


def test_every_entry_type_has_a_sample() -> None:
    from sevendb.outbox.entries import entry_type

    assert {entry_type(e) for e in SAMPLES} == set(EntryType)


def _raw(*items: object) -> bytes:
    data = msgpack.packb(list(items), use_bin_type=True)
    assert isinstance(data, bytes)
    return data


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", MalformedEntry),
        (b"\xc1", MalformedEntry),
        (_raw(ENTRY_FORMAT_VERSION), MalformedEntry),
        (_raw(99, 1), UnsupportedEntryVersion),
        (_raw(ENTRY_FORMAT_VERSION, 250), UnknownEntryType),
        (_raw(ENTRY_FORMAT_VERSION, 1, [], None, 0), MalformedEntry),  # no ops
        (_raw(ENTRY_FORMAT_VERSION, 1, [[0, "k", "not-bytes", 0, 0]], None, 0), MalformedEntry),
        (_raw(ENTRY_FORMAT_VERSION, 1, [[0, "", b"", 0, 0]], None, 0), MalformedEntry),
        (_raw(ENTRY_FORMAT_VERSION, 1, [[0, "k", b"", 2, 0]], None, 0), MalformedEntry),
        (
            _raw(
                ENTRY_FORMAT_VERSION,
                1,
                [[0, "k", b"x" * (limits.VALUE_BYTES_MAX + 1), 0, 0]],
                None,
                0,
            ),
            MalformedEntry,
        ),
        (
            _raw(ENTRY_FORMAT_VERSION, 1, [[0, "k", b"", 0, 0], [0, "k", b"", 0, 0]], None, 0),
            MalformedEntry,
        ),
        (_raw(ENTRY_FORMAT_VERSION, 2, "s", "alice", 7, "", 0, 0), MalformedEntry),
        (_raw(ENTRY_FORMAT_VERSION, 10, []), MalformedEntry),  # an empty SUBSCRIBE_BATCH
        (_raw(ENTRY_FORMAT_VERSION, 10, [["s", "alice", 2, "x", 0, 0]]), MalformedEntry),
        (_raw(ENTRY_FORMAT_VERSION, 6, 0, 0), MalformedEntry),
        (_raw(ENTRY_FORMAT_VERSION, 7, "node", -1), MalformedEntry),
        (_raw(ENTRY_FORMAT_VERSION, True, 1), UnknownEntryType),
        (encode_entry(Lease("n")) + b"\x00", MalformedEntry),
    ],
)
def test_bad_entries_raise_typed_errors_and_change_nothing(
    data: bytes, error: type[EntryError]
) -> None:
    d = Driver()
    d.lease()
    d.subscribe("s", "all")
    d.set("k")
    before, index = d.sm.digest(), d.sm.applied_index
    with pytest.raises(error):
        d.sm.apply(index + 1, data)
    assert d.sm.digest() == before and d.sm.applied_index == index


def test_oversize_entry_is_refused_before_parsing() -> None:
    with pytest.raises(MalformedEntry, match="limit"):
        decode_entry(b"\x00" * (limits.ENTRY_BYTES_MAX + 1))


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (lambda: Op(OpKind.SET, "k" * (limits.KEY_BYTES_MAX + 1)), LimitExceeded),
        # The limit is in UTF-8 bytes, not characters (2 bytes each here).
        (lambda: Op(OpKind.SET, "é" * (limits.KEY_BYTES_MAX // 2 + 1)), LimitExceeded),
        (lambda: Op(OpKind.SET, "k\ud800"), InvalidArgument),  # a lone surrogate
        (lambda: Op(OpKind.SET, "k", b"x" * (limits.VALUE_BYTES_MAX + 1)), LimitExceeded),
        (lambda: Op(OpKind.DEL, "k", b"x"), InvalidArgument),
        (
            lambda: Write(
                tuple(Op(OpKind.SET, f"k{i}") for i in range(limits.OPS_PER_WRITE_MAX + 1))
            ),
            LimitExceeded,
        ),
        (
            lambda: Write(
                tuple(
                    Op(OpKind.SET, f"k{i}", b"x" * limits.VALUE_BYTES_MAX)
                    for i in range(limits.WRITE_VALUE_BYTES_MAX // limits.VALUE_BYTES_MAX + 1)
                )
            ),
            LimitExceeded,
        ),
        (lambda: Expected.exact(0), InvalidArgument),
        (lambda: Subscribe("s", "alice", Query.parse("all"), -1), InvalidArgument),
        (lambda: ProducerRef(0, 0, 0), InvalidArgument),
        (lambda: ProducerRef(1, 0, 3, 4), InvalidArgument),  # answered beyond itself
        (lambda: OutboxWrite(1, 5, 5, 0, 0), InvalidArgument),
    ],
)
def test_construction_validates_with_client_facing_errors(
    build: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        build()  # type: ignore[operator]


def test_a_key_at_the_byte_limit_is_accepted() -> None:
    assert Op(OpKind.SET, "é" * (limits.KEY_BYTES_MAX // 2)).key.startswith("é")
    assert Op(OpKind.SET, "k" * limits.KEY_BYTES_MAX).key.startswith("k")


_keys = st.text(min_size=1, max_size=12)
_ops = st.builds(
    Op,
    st.sampled_from(list(OpKind)),
    _keys,
    st.just(b""),
    st.sampled_from([Expected(), NOT_EXISTS, Expected.exact(1), Expected.exact(2**64 - 1)]),
).map(
    lambda op: (
        op if op.kind is OpKind.DEL else dataclasses.replace(op, value=b"v" + op.key.encode())
    )
)
_writes = st.builds(
    Write,
    st.lists(_ops, min_size=1, max_size=4, unique_by=lambda op: op.key).map(tuple),
    st.none()
    | st.builds(
        ProducerRef, st.integers(1, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
    ),
    st.integers(0, 2**64 - 1),
)


@given(
    st.one_of(
        _writes, st.lists(_writes, min_size=1, max_size=5).map(lambda w: WriteBatch(tuple(w)))
    )
)
def test_every_valid_write_round_trips_exactly(entry: Entry) -> None:
    """The leader applies the writes it built without decoding its own entry
    (`BucketReplica.submit`); followers decode the bytes. They agree only because
    decoding what was encoded gives back an equal entry."""
    data = encode_entry(entry)
    assert decode_entry(data) == entry
    assert encode_entry(decode_entry(data)) == data


def test_query_parse() -> None:
    assert str(Query.parse("key:a")) == "key:a"
    assert str(Query.parse("prefix:")) == "prefix:"
    assert str(Query.parse("all")) == "all"
    for bad in ("key:", "nope", "all:x", ""):
        with pytest.raises(ValueError):
            Query.parse(bad)
