"""Transactions in the deterministic core (docs/transactions.md): the coordinator's
log of a transactional id, the participant's pending writes and markers, and the
new entries' validation, snapshot and digest."""

from __future__ import annotations

import msgpack
import pytest
from helpers import Driver

from sevendb.outbox import limits
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    Ack,
    EntryType,
    Isolation,
    Op,
    OpKind,
    OutboxPurge,
    Subscribe,
    Txn,
    TxnAction,
    TxnOutcome,
    TxnWrite,
    decode_entry,
    encode_entry,
)
from sevendb.outbox.errors import ErrorCode, InvalidArgument, MalformedEntry, SnapshotError
from sevendb.outbox.model import Change, TxnResult, TxnWriteResult
from sevendb.outbox.query import Query, plan_query
from sevendb.outbox.state import BucketStateMachine
from sevendb.outbox.txn import TxnPhase

TID = "orders-tx"


def txn(d: Driver, action: TxnAction, **kw: object) -> TxnResult:
    fields: dict[str, object] = {"principal": "alice", "now_ms": d.tick()}
    if action is TxnAction.INIT:
        fields["timeout_ms"] = 60_000
    fields.update(kw)
    result = d.apply(Txn(action, TID, **fields)).result  # type: ignore[arg-type]
    assert isinstance(result, TxnResult)
    return result


def twrite(
    d: Driver, number: int, *ops: Op, epoch: int = 0, who: str = "alice", seq: int = 0
) -> TxnWriteResult:
    if not seq:
        pending = d.sm.txns.pending.get((TID, number))
        seq = 1 if pending is None else pending.writes + 1
    result = d.apply(TxnWrite(TID, epoch, number, ops, who, d.tick(), seq)).result
    assert isinstance(result, TxnWriteResult)
    return result


def put(key: str, value: bytes = b"v") -> Op:
    return Op(OpKind.SET, key, value)


def begin(d: Driver, epoch: int = 0, buckets: tuple[int, ...] = (0,)) -> int:
    state = d.sm.txns.ids[TID]
    got = txn(d, TxnAction.ADD, epoch=epoch, number=state.last_number + 1, buckets=buckets)
    assert got.error is None, got.error
    return got.number


def code(result: TxnResult | TxnWriteResult) -> ErrorCode | None:
    return None if result.error is None else result.error.code


# ---- coordinator -----------------------------------------------------------------


def test_init_twice_bumps_the_epoch_and_fences_the_first_instance() -> None:
    d = Driver()
    assert txn(d, TxnAction.INIT).epoch == 0
    number = begin(d)
    again = txn(d, TxnAction.INIT)
    assert again.epoch == 1
    # the open transaction of the fenced instance is decided ABORT, markers due
    assert (again.number, again.outcome, again.buckets) == (number, TxnOutcome.ABORT_FENCED, (0,))
    stale = txn(d, TxnAction.END, epoch=0, number=number, outcome=TxnOutcome.COMMIT)
    assert code(stale) is ErrorCode.PRODUCER_FENCED
    assert code(txn(d, TxnAction.ADD, epoch=0, number=2, buckets=(1,))) is ErrorCode.PRODUCER_FENCED
    assert (
        code(txn(d, TxnAction.ADD, epoch=2, number=2, buckets=(1,)))
        is ErrorCode.INVALID_PRODUCER_EPOCH
    )


def test_another_principal_cannot_init_or_use_a_transactional_id() -> None:
    d = Driver()
    txn(d, TxnAction.INIT)
    assert code(txn(d, TxnAction.INIT, principal="mallory")) is ErrorCode.PERMISSION_DENIED
    got = txn(d, TxnAction.ADD, number=1, buckets=(0,), principal="mallory")
    assert code(got) is ErrorCode.PERMISSION_DENIED
    assert d.sm.txns.ids[TID].epoch == 0


def test_unknown_transactional_id_is_invalid_txn_id() -> None:
    d = Driver()
    assert code(txn(d, TxnAction.ADD, number=1, buckets=(0,))) is ErrorCode.INVALID_TXN_ID


def test_begin_add_commit_complete() -> None:
    d = Driver()
    txn(d, TxnAction.INIT)
    number = begin(d, buckets=(3,))
    added = txn(d, TxnAction.ADD, number=number, buckets=(1, 3, 5))
    assert added.buckets == (1, 5)  # only the new ones need joining
    decided = txn(d, TxnAction.END, number=number, outcome=TxnOutcome.COMMIT)
    assert (decided.outcome, decided.buckets) == (TxnOutcome.COMMIT, (1, 3, 5))
    (due,) = d.sm.txns.due()
    assert (due.number, due.outcome, due.buckets) == (number, TxnOutcome.COMMIT, (1, 3, 5))
    # a retried END answers as the first did
    again = txn(d, TxnAction.END, number=number, outcome=TxnOutcome.COMMIT)
    assert again.error is None and again.outcome is TxnOutcome.COMMIT
    wrong = txn(d, TxnAction.END, number=number, outcome=TxnOutcome.ABORT)
    assert code(wrong) is ErrorCode.INVALID_TXN_STATE
    txn(d, TxnAction.COMPLETE, number=number)
    assert list(d.sm.txns.due()) == [] and d.sm.txns.transactions() == []
    # the next one begins with the next number
    assert begin(d) == number + 1


def test_one_open_transaction_and_at_most_five_not_complete() -> None:
    d = Driver()
    txn(d, TxnAction.INIT)
    first = begin(d)
    concurrent = txn(d, TxnAction.ADD, number=first + 1, buckets=(0,))
    assert code(concurrent) is ErrorCode.CONCURRENT_TRANSACTIONS
    # a retried begin of the open one is an ADD to it
    assert txn(d, TxnAction.ADD, number=first, buckets=(0,)).error is None
    txn(d, TxnAction.END, number=first, outcome=TxnOutcome.COMMIT)
    for _ in range(limits.TXN_PENDING_PER_PRODUCER_MAX - 1):
        number = begin(d)
        txn(d, TxnAction.END, number=number, outcome=TxnOutcome.ABORT)
    refused = txn(d, TxnAction.ADD, number=d.sm.txns.ids[TID].last_number + 1, buckets=(0,))
    assert code(refused) is ErrorCode.TOO_MANY_TRANSACTIONS
    txn(d, TxnAction.COMPLETE, number=first)
    assert begin(d) == limits.TXN_PENDING_PER_PRODUCER_MAX + 1


def test_timeout_aborts_and_later_calls_get_transaction_timed_out() -> None:
    d = Driver()
    txn(d, TxnAction.INIT, timeout_ms=1_000)
    number = begin(d)
    started = d.now_ms
    assert d.sm.txns.timed_out(started + 1_000) == []
    early = txn(d, TxnAction.EXPIRE, now_ms=started + 500)
    assert early.outcome is TxnOutcome.NONE  # not yet: nothing changed
    assert d.sm.txns.timed_out(started + 1_001) == [TID]
    expired = txn(d, TxnAction.EXPIRE, now_ms=started + 1_001)
    assert expired.outcome is TxnOutcome.ABORT_TIMED_OUT
    late = txn(d, TxnAction.END, number=number, outcome=TxnOutcome.COMMIT)
    assert code(late) is ErrorCode.TRANSACTION_TIMED_OUT
    assert code(txn(d, TxnAction.ADD, number=number, buckets=(2,))) is (
        ErrorCode.TRANSACTION_TIMED_OUT
    )
    # an abort of it is answered as done
    assert txn(d, TxnAction.END, number=number, outcome=TxnOutcome.ABORT).error is None


def test_resolve_decides_an_open_transaction_whoever_owns_it() -> None:
    d = Driver()
    txn(d, TxnAction.INIT)
    number = begin(d)
    got = txn(d, TxnAction.RESOLVE, number=number, outcome=TxnOutcome.ABORT, principal="admin")
    assert got.outcome is TxnOutcome.ABORT
    (info,) = d.sm.txns.transactions()
    assert info.phase is TxnPhase.PREPARE_ABORT


# ---- participant -------------------------------------------------------------------


def join(d: Driver, number: int, epoch: int = 0) -> TxnResult:
    return txn(d, TxnAction.JOIN, number=number, epoch=epoch)


def mark(d: Driver, number: int, outcome: TxnOutcome) -> TxnResult:
    return txn(d, TxnAction.MARK, number=number, outcome=outcome)


def prepare(d: Driver, number: int, writes: int) -> TxnResult:
    return txn(d, TxnAction.PREPARE, number=number, writes=writes)


def test_prepare_checks_the_participant_holds_exactly_the_writes_sent() -> None:
    """Before a COMMIT is decided each participant is asked whether it holds what the
    producer wrote to it: a bucket that never joined, or holds fewer or more writes,
    refuses (the transaction is then aborted, docs/transactions.md); nothing changes."""
    d = Driver()
    join(d, 1)
    twrite(d, 1, put("k1"))
    twrite(d, 1, put("k2"))
    before = d.sm.txns.pack()
    assert prepare(d, 1, 2).error is None
    for wrong in (0, 1, 3):
        refused = prepare(d, 1, wrong)
        assert code(refused) is ErrorCode.INVALID_TXN_STATE
        assert f"holds 2 of the {wrong} writes sent to it (joined it)" in str(refused.error)
    never = prepare(d, 2, 1)  # never joined here: its writes are not here
    assert "holds 0 of the 1 writes sent to it (never joined it)" in str(never.error)
    assert prepare(d, 2, 0).error is None  # added but never written to: nothing to hold
    assert d.sm.txns.pack() == before
    mark(d, 1, TxnOutcome.COMMIT)
    assert prepare(d, 1, 5).error is None  # ended here: the coordinator answers for it


def test_write_to_a_bucket_not_added_is_refused_and_changes_nothing() -> None:
    d = Driver()
    assert code(twrite(d, 1, put("k"))) is ErrorCode.BUCKET_NOT_IN_TXN
    assert not d.sm.txns and d.sm.get("k") is None


def test_pending_writes_are_invisible_until_the_commit_marker() -> None:
    d = Driver()
    d.subscribe("s1", "prefix:k")
    join(d, 1)
    assert twrite(d, 1, put("k1", b"a")).error is None
    assert twrite(d, 1, put("k2", b"b"), Op(OpKind.DEL, "k1")).error is None
    assert d.sm.get("k1") is None and d.rows("s1") == ()
    marker = d.index + 1
    mark(d, 1, TxnOutcome.COMMIT)
    assert d.sm.get("k2") is not None and d.sm.get("k1") is None
    (row,) = d.rows("s1")  # one event, at the marker's position
    assert row.emit_seq.commit_index == marker
    assert list(row.delta.changes) == [
        Change("k1", OpKind.SET, b"a", 1),
        Change("k2", OpKind.SET, b"b", 1),
        Change("k1", OpKind.DEL, b"", 1),
    ]
    # markers are idempotent
    mark(d, 1, TxnOutcome.COMMIT)
    assert len(d.rows("s1")) == 1


def test_abort_marker_discards_and_a_later_write_is_refused() -> None:
    d = Driver()
    d.subscribe("s1", "prefix:k")
    join(d, 1)
    twrite(d, 1, put("k1"))
    mark(d, 1, TxnOutcome.ABORT_TIMED_OUT)
    assert d.sm.get("k1") is None and d.rows("s1") == ()
    assert code(twrite(d, 1, put("k2"))) is ErrorCode.TRANSACTION_TIMED_OUT
    assert code(join(d, 1)) is ErrorCode.TRANSACTION_TIMED_OUT  # a late JOIN leaks nothing
    assert d.sm.txns.pending == {}


def test_writes_of_a_fenced_epoch_or_another_principal_are_refused() -> None:
    d = Driver()
    join(d, 1, epoch=2)
    assert code(twrite(d, 1, put("k"), epoch=1)) is ErrorCode.PRODUCER_FENCED
    assert code(twrite(d, 1, put("k"), epoch=2, who="mallory")) is ErrorCode.PERMISSION_DENIED
    mark(d, 1, TxnOutcome.ABORT_FENCED)
    assert code(twrite(d, 1, put("k"), epoch=2)) is ErrorCode.PRODUCER_FENCED


def test_a_retried_write_is_taken_once() -> None:
    d = Driver()
    join(d, 1)
    assert twrite(d, 1, put("a"), seq=1).error is None
    assert twrite(d, 1, put("a"), seq=1).error is None  # the retry: answered, not taken
    assert code(twrite(d, 1, put("b"), seq=3)) is ErrorCode.OUT_OF_ORDER_SEQUENCE
    assert d.sm.txns.pending[TID, 1].ops == [put("a")]


def test_a_precondition_is_checked_against_committed_data() -> None:
    d = Driver()
    d.set("k", b"old")
    join(d, 1)
    from sevendb.outbox.entries import Expected

    stale = Op(OpKind.SET, "k", b"new", Expected.exact(2))
    assert code(twrite(d, 1, stale)) is ErrorCode.PRECONDITION_FAILED
    fresh = Op(OpKind.SET, "k", b"new", Expected.exact(1))
    assert twrite(d, 1, fresh).error is None


# ---- entries, snapshots, digests ------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"action": TxnAction.ADD},  # no buckets
        {"action": TxnAction.INIT},  # no timeout
        {"action": TxnAction.END, "number": 1},  # no outcome
        {"action": TxnAction.END, "number": 0, "outcome": TxnOutcome.COMMIT},
        {"action": TxnAction.MARK, "number": 1, "outcome": TxnOutcome.NONE},
        {"action": TxnAction.ADD, "buckets": (2, 1)},  # not in order
        {"action": TxnAction.JOIN, "number": 1, "buckets": (1,)},
        {"action": TxnAction.JOIN, "number": 1, "writes": 2},  # writes: PREPARE's only
        {"action": TxnAction.PREPARE, "number": 0, "writes": 2},
        {"action": TxnAction.PREPARE, "number": 1, "writes": -1},
    ],
)
def test_bad_txn_entries_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        Txn(txn_id=TID, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        [99, TID, 0, 0, [], 0, "", 0, 0],  # unknown action
        [int(TxnAction.ADD), TID, 0, 0, [], 0, "", 0, 0],  # ADD without buckets
        [int(TxnAction.ADD), TID, 0, 1, [1], 0, "", 0],  # a field short
        [int(TxnAction.ADD), TID, 0, 0, [1], 0, "", 0, 0],  # ADD of number 0
        [int(TxnAction.INIT), "", 0, 0, [], 0, "", 0, 10],  # empty id
        [int(TxnAction.MARK), TID, 0, 1, [], 9, "", 0, 0],  # unknown outcome
        [int(TxnAction.PREPARE), TID, 0, 1, [], 0, "", 0, 0],  # PREPARE without writes
        [int(TxnAction.JOIN), TID, 0, 1, [], 0, "", 0, 0, 0],  # a tenth field: PREPARE's
        [],
    ],
)
def test_bad_txn_bytes_are_malformed_and_change_nothing(fields: list[object]) -> None:
    d = Driver()
    before = d.sm.snapshot()
    data = msgpack.packb([1, int(EntryType.TXN), *fields])
    with pytest.raises(MalformedEntry):
        d.sm.apply(1, data)
    assert d.sm.snapshot() == before


def test_bad_txn_write_bytes_are_malformed() -> None:
    d = Driver()
    with pytest.raises(MalformedEntry):
        d.sm.apply(1, msgpack.packb([1, int(EntryType.TXN_WRITE), TID, 0, 0, [], "", 0, 1]))
    with pytest.raises(MalformedEntry):
        d.sm.apply(1, msgpack.packb([1, int(EntryType.TXN_WRITE), TID, 0, 1, [], "", 0, 1]))
    with pytest.raises(MalformedEntry):  # sequence 0
        op = [0, "k", b"", 0, 0]
        d.sm.apply(1, msgpack.packb([1, int(EntryType.TXN_WRITE), TID, 0, 1, [op], "", 0, 0]))


def test_txn_entries_round_trip() -> None:
    for entry in (
        Txn(TxnAction.INIT, TID, principal="a", timeout_ms=5),
        Txn(TxnAction.ADD, TID, 1, 1, (0, 4)),
        Txn(TxnAction.MARK, TID, 1, 3, outcome=TxnOutcome.ABORT_FENCED, now_ms=9),
        Txn(TxnAction.PREPARE, TID, 1, 3, now_ms=9, writes=4),
        Txn(TxnAction.PREPARE, TID, 1, 3, now_ms=9),
        TxnWrite(TID, 1, 2, (put("a"), Op(OpKind.DEL, "b")), "p", 7, 3),
    ):
        assert decode_entry(encode_entry(entry)) == entry


def test_snapshot_restores_both_halves_and_digest_covers_them() -> None:
    d = Driver()
    empty_digest = BucketStateMachine("bucket-0000").digest()
    txn(d, TxnAction.INIT)
    number = begin(d, buckets=(0, 2))
    join(d, number)
    twrite(d, number, put("k", b"x"))
    txn(d, TxnAction.END, number=number, outcome=TxnOutcome.COMMIT)
    restored = BucketStateMachine.restore(d.sm.snapshot())
    assert restored.snapshot() == d.sm.snapshot()
    assert restored.txns.transactions() == d.sm.txns.transactions()
    assert restored.txns.pending[TID, number].ops == [put("k", b"x")]
    # the digest sees the pending write
    other = Driver()
    txn(other, TxnAction.INIT)
    begin(other, buckets=(0, 2))
    join(other, number)
    other.now_ms = d.now_ms - 20
    twrite(other, number, put("k", b"y"))
    assert other.sm.digest() != empty_digest
    # the committed marker then applies on the restored copy as on the original
    for sm in (d.sm, restored):
        sm.apply(
            d.index + 1,
            encode_entry(Txn(TxnAction.MARK, TID, 0, number, outcome=TxnOutcome.COMMIT)),
        )
    assert restored.digest() == d.sm.digest()
    assert restored.get("k") is not None


def test_a_bucket_without_transactions_snapshots_as_before() -> None:
    d = Driver()
    d.set("k")
    raw = msgpack.unpackb(d.sm.snapshot())
    assert len(raw) == 14


# ---- isolation levels -----------------------------------------------------------------


def subscribe(d: Driver, sub_id: str, isolation: Isolation) -> None:
    query = Query.parse("prefix:k")
    entry = Subscribe(
        sub_id, "alice", query, plan_query(query).plan_hash, d.tick(), isolation=isolation
    )
    d.apply(entry)


def test_read_uncommitted_gets_writes_as_they_apply_read_committed_at_the_marker() -> None:
    d = Driver()
    subscribe(d, "committed", Isolation.READ_COMMITTED)
    subscribe(d, "dirty", Isolation.READ_UNCOMMITTED)
    join(d, 1)
    join(d, 2)
    write_at = d.index + 1
    twrite(d, 1, put("k1", b"a"))
    twrite(d, 2, put("k2", b"b"))
    assert d.rows("committed") == ()
    dirty = d.rows("dirty")
    assert [(r.emit_seq.commit_index, r.delta.changes) for r in dirty] == [
        (write_at, (Change("k1", OpKind.SET, b"a", 0),)),
        (write_at + 1, (Change("k2", OpKind.SET, b"b", 0),)),
    ]
    marker = d.index + 1
    mark(d, 1, TxnOutcome.COMMIT)
    mark(d, 2, TxnOutcome.ABORT)
    (row,) = d.rows("committed")  # the commit, at its marker; the abort never
    assert (row.emit_seq.commit_index, row.delta.changes) == (
        marker,
        (Change("k1", OpKind.SET, b"a", 1),),
    )
    assert d.rows("dirty") == dirty  # nothing more at the markers
    # the chain stays gapless for both
    assert row.prev_emit_seq == d.sm.subs.get("committed").start  # type: ignore[union-attr]
    assert dirty[1].prev_emit_seq == dirty[0].emit_seq
    # plain writes reach both
    d.set("k3")
    assert len(d.rows("committed")) == 2 and len(d.rows("dirty")) == 3
    # the retained history holds only what committed
    assert [c.key for kept in d.sm.history for c in kept.changes] == ["k1", "k3"]


def test_rows_record_their_transaction_through_snapshots_and_purges() -> None:
    """Each row's delta names its transaction (the archive records it, docs/spark.md):
    committed at the marker, uncommitted at the write; kept by snapshots; and the
    purge effect names the read_uncommitted subscriptions."""
    from sevendb.outbox.model import RowsPurged, TxnTag

    d = Driver()
    d.lease()
    subscribe(d, "committed", Isolation.READ_COMMITTED)
    subscribe(d, "dirty", Isolation.READ_UNCOMMITTED)
    join(d, 1)
    twrite(d, 1, put("k1", b"a"), put("k2", b"b"))
    mark(d, 1, TxnOutcome.COMMIT)
    d.set("k3")
    assert [r.delta.txn for r in d.rows("dirty")] == [TxnTag(TID, 0, 1, committed=False), None]
    assert [r.delta.txn for r in d.rows("committed")] == [TxnTag(TID, 0, 1, committed=True), None]
    restored = BucketStateMachine.restore(d.sm.snapshot())
    assert restored.snapshot() == d.sm.snapshot()
    for sub_id in ("dirty", "committed"):
        assert Driver(restored).rows(sub_id) == d.rows(sub_id)
    d.outbox()
    acks = tuple(Ack(s, "alice", d.rows(s)[-1].emit_seq) for s in ("committed", "dirty"))
    applied = d.apply(OutboxPurge(d.sm.lease_index, acks, now_ms=d.tick()))
    (purged,) = [e for e in applied.effects if isinstance(e, RowsPurged)]
    assert len(purged.rows) == 4 and purged.read_uncommitted == frozenset({"dirty"})


def test_isolation_survives_snapshot_and_encoding() -> None:
    d = Driver()
    subscribe(d, "dirty", Isolation.READ_UNCOMMITTED)
    restored = BucketStateMachine.restore(d.sm.snapshot())
    assert restored.snapshot() == d.sm.snapshot()
    assert restored.subs.get("dirty").isolation is Isolation.READ_UNCOMMITTED  # type: ignore[union-attr]
    query = Query.parse("all")
    entry = Subscribe("s", "a", query, 1, 2, isolation=Isolation.READ_UNCOMMITTED)
    assert decode_entry(encode_entry(entry)) == entry
    raw = msgpack.unpackb(encode_entry(entry))
    for bad in (0, 2, "x"):  # the default spelled out, unknown levels
        with pytest.raises(MalformedEntry):
            decode_entry(msgpack.packb([*raw[:-1], bad]))
    d2 = Driver()
    before = d2.sm.snapshot()
    with pytest.raises(MalformedEntry):
        d2.sm.apply(1, msgpack.packb([*raw[:-1], 7]))
    assert d2.sm.snapshot() == before


# ---- acks in a transaction (consume-transform-produce) ---------------------------------


def ack_write(
    d: Driver, number: int, up_to: EmitSeq, *ops: Op, sub_id: str = "in"
) -> TxnWriteResult:
    pending = d.sm.txns.pending.get((TID, number))
    seq = 1 if pending is None else pending.writes + 1
    entry = TxnWrite(TID, 0, number, ops, "alice", d.tick(), seq, (Ack(sub_id, "alice", up_to),))
    result = d.apply(entry).result
    assert isinstance(result, TxnWriteResult)
    return result


def test_an_ack_in_a_transaction_applies_at_its_commit_only() -> None:
    d = Driver()
    d.subscribe("in", "prefix:in/")
    d.set("in/1")
    d.set("in/2")
    first, second = (row.emit_seq for row in d.rows("in"))
    join(d, 1)
    assert ack_write(d, 1, first, put("out/1")).error is None
    assert d.sm.subs.get("in").acked < first  # type: ignore[union-attr]
    mark(d, 1, TxnOutcome.COMMIT)
    assert d.sm.subs.get("in").acked == first  # type: ignore[union-attr]
    assert [r.emit_seq for r in d.rows("in")] == [second]
    assert d.sm.get("out/1") is not None
    # aborted: neither the output nor the ack
    join(d, 2)
    assert ack_write(d, 2, second, put("out/2")).error is None
    mark(d, 2, TxnOutcome.ABORT)
    assert d.sm.subs.get("in").acked == first  # type: ignore[union-attr]
    assert d.sm.get("out/2") is None


def test_an_ack_that_would_not_be_accepted_is_refused_at_the_write() -> None:
    d = Driver()
    d.subscribe("in", "prefix:in/")
    d.set("in/1")
    (first,) = (row.emit_seq for row in d.rows("in"))
    join(d, 1)
    ahead = EmitSeq(first.bucket_uuid, first.epoch_counter, first.commit_index + 50)
    assert code(ack_write(d, 1, ahead)) is ErrorCode.FUTURE_ACK
    assert code(ack_write(d, 1, first, sub_id="nope")) is ErrorCode.SUBSCRIPTION_NOT_FOUND
    assert ack_write(d, 1, first).error is None
    assert code(ack_write(d, 1, first)) is ErrorCode.REGRESSIVE_ACK  # held already
    restored = BucketStateMachine.restore(d.sm.snapshot())
    assert restored.snapshot() == d.sm.snapshot()
    assert restored.txns.pending[TID, 1].acks == d.sm.txns.pending[TID, 1].acks


def test_the_coordinator_counts_transactions_by_outcome() -> None:
    d = Driver()
    txn(d, TxnAction.INIT, timeout_ms=1_000)
    first = begin(d)
    txn(d, TxnAction.END, number=first, outcome=TxnOutcome.COMMIT)
    second = begin(d)
    txn(d, TxnAction.END, number=second, outcome=TxnOutcome.ABORT)
    begin(d)
    txn(d, TxnAction.EXPIRE, now_ms=d.now_ms + 5_000)
    begin(d)
    txn(d, TxnAction.INIT, timeout_ms=1_000)  # fences the open one
    assert d.sm.txns.counts == {
        "started": 4,
        "committed": 1,
        "aborted": 1,
        "timed_out": 1,
        "fenced": 1,
    }
    assert d.sm.txns.active() == 4  # all decided, none completed
    assert BucketStateMachine.restore(d.sm.snapshot()).txns.counts == d.sm.txns.counts


def test_a_state_with_transactions_and_consumer_groups_snapshots_both() -> None:
    """Transactions are the snapshot's 16th field, consumer groups its 15th (there,
    empty, when a bucket has transactions and no group): each combination restores
    to the same bytes, and a 16-field snapshot is read only with transactions."""
    from sevendb.outbox.groups import GroupBeat

    d = Driver()
    txn(d, TxnAction.INIT)
    assert len(msgpack.unpackb(d.sm.snapshot())) == 16
    assert msgpack.unpackb(d.sm.snapshot())[14] == []
    d.apply(GroupBeat("alice", "workers", "m1", 0, 1000, False, d.tick()))
    for sm in (d.sm, BucketStateMachine.restore(d.sm.snapshot())):
        assert sm.snapshot() == d.sm.snapshot() and sm.digest() == d.sm.digest()
        assert sm.groups.owner("alice", "workers") == ("m1", 1)
        assert TID in sm.txns.ids
    raw = msgpack.unpackb(d.sm.snapshot())
    raw[15] = [[], [], [], [0] * len(raw[15][3])]  # an empty transaction state
    with pytest.raises(SnapshotError, match="not canonical"):
        BucketStateMachine.restore(msgpack.packb(raw))
