"""The results a bucket keeps per idempotent producer, and the SDK's window over them.

A bucket keeps the results of a producer's last `PRODUCER_RESULTS_CACHED` sequences
and the SDK never has more than `SEQUENCES_IN_FLIGHT_MAX` of a bucket unanswered, so
every retry the SDK can make is answered with its original result (with 5 kept, a
failover with more writes in flight answered the older ones DUPLICATE_SEQUENCE).
"""

from __future__ import annotations

import collections

import msgpack
import pytest
from helpers import BUCKET, Driver

from sevendb.outbox import limits
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import NOT_EXISTS, Op, OpKind, ProducerRef, Write
from sevendb.outbox.errors import ErrorCode, SnapshotError
from sevendb.outbox.model import WriteResult
from sevendb.outbox.producer_results import ProducerResults
from sevendb.outbox.state import BucketStateMachine
from sevendb.sdk.producer import SEQUENCES_IN_FLIGHT_MAX, Producer

PID = 7
K = limits.PRODUCER_RESULTS_CACHED


def write(d: Driver, seq: int, *keys: str) -> WriteResult:
    ops = tuple(Op(OpKind.SET, key, b"v") for key in keys)
    result = d.apply(Write(ops, ProducerRef(PID, 0, seq), d.tick())).result
    assert isinstance(result, WriteResult)
    return result


def producer_with(writes: int) -> tuple[Driver, list[WriteResult]]:
    d = Driver()
    d.init_producer(PID)
    return d, [write(d, i, f"k{i}", f"also{i}") for i in range(writes)]


def test_the_node_keeps_a_result_for_every_sequence_the_sdk_may_retry() -> None:
    assert limits.PRODUCER_RESULTS_CACHED >= SEQUENCES_IN_FLIGHT_MAX >= 64
    kept = limits.PRODUCER_RESULTS_CACHED
    d, originals = producer_with(kept + 2)
    before = d.sm.snapshot()
    for seq in range(2, kept + 2):  # the oldest kept first: a retry evicts nothing
        again = write(d, seq, f"k{seq}", f"also{seq}")
        assert again == WriteResult(originals[seq].commit, originals[seq].versions, duplicate=True)
    for seq in (0, 1):
        gone = write(d, seq, f"k{seq}", f"also{seq}")
        assert gone.error is not None and gone.error.code is ErrorCode.DUPLICATE_SEQUENCE
        assert f"last {kept} results kept" in gone.error.message
    # Nothing applied twice; only the producer's last activity moved.
    assert d.sm.get("k2").version == 1  # type: ignore[union-attr]
    assert [r[:3] for r in msgpack.unpackb(d.sm.snapshot())[7]] == [
        r[:3] for r in msgpack.unpackb(before)[7]
    ]


@pytest.mark.parametrize("writes", [1, K - 1, K, K + 1, K + K // 4, K + K // 4 + 1, 3 * K + 7])
def test_the_kept_results_are_the_last_ones_whatever_was_evicted(writes: int) -> None:
    kept = limits.PRODUCER_RESULTS_CACHED
    results = ProducerResults()
    made = [WriteResult(EmitSeq(BUCKET, 1, 10 + 3 * i), (("k", i),)) for i in range(writes)]
    for result in made:
        results.add(result)
    retry = Write((Op(OpKind.SET, "k", b"v"),), None, 0)
    restored = ProducerResults.restore(results.packed(), writes - 1)
    for those in (results, restored):
        assert len(those) == min(writes, kept)
        for back in range(len(those)):
            original = made[-1 - back]
            assert those.original(back, BUCKET, retry) == WriteResult(
                original.commit, original.versions, duplicate=True
            )
        assert those.original(len(those), BUCKET, retry) is None
    assert restored.packed() == results.packed()


def test_a_bucket_forgets_the_results_its_producer_reports_answered() -> None:
    """Each write names the producer's oldest unanswered sequence (answered_below):
    the bucket keeps the results from there on, not the last PRODUCER_RESULTS_CACHED,
    so a producer costs about its writes in flight. Unanswered ones keep theirs."""
    d = Driver()
    d.init_producer(PID)
    originals = []
    for seq in range(40):  # answers come back 3 writes behind
        ref = ProducerRef(PID, 0, seq, max(0, seq - 3))
        result = d.apply(Write((Op(OpKind.SET, f"k{seq}", b"v"),), ref, d.tick())).result
        assert isinstance(result, WriteResult)
        originals.append(result)
    assert len(d.sm.producers[PID].results) == 4  # sequences 36 to 39
    for seq in (36, 39):
        again = write(d, seq, f"k{seq}")
        assert again == WriteResult(originals[seq].commit, originals[seq].versions, duplicate=True)
    gone = write(d, 35, "k35")
    assert gone.error is not None and gone.error.code is ErrorCode.DUPLICATE_SEQUENCE
    restored = Driver(BucketStateMachine.restore(d.sm.snapshot()))
    assert restored.sm.digest() == d.sm.digest()
    assert len(restored.sm.producers[PID].results) == 4
    # Everything answered: only the write itself is kept.
    write_all = ProducerRef(PID, 0, 40, 40)
    d.apply(Write((Op(OpKind.SET, "k40", b"v"),), write_all, d.tick()))
    assert len(d.sm.producers[PID].results) == 1


@pytest.mark.parametrize("answered", [0, 1, 5, K - 1, K, K + 3])
def test_forgetting_keeps_exactly_the_results_from_the_answered_point(answered: int) -> None:
    writes = K + 3
    results = ProducerResults()
    made = [WriteResult(EmitSeq(BUCKET, 1, 10 + i), (("k", i),)) for i in range(writes)]
    for result in made:
        results.add(result)
    results.forget_before(answered, writes - 1)
    retry = Write((Op(OpKind.SET, "k"),), None, 0)
    kept = min(K, writes - answered)
    restored = ProducerResults.restore(results.packed(), writes - 1)
    for those in (results, restored):
        assert len(those) == kept
        assert [those.original(back, BUCKET, retry) for back in range(kept)] == [
            WriteResult(r.commit, r.versions, duplicate=True) for r in made[::-1][:kept]
        ]
    results.add(made[0])  # still appends behind what is kept
    assert len(results) == min(K, kept + 1)


def test_a_producer_reports_its_oldest_unanswered_sequence() -> None:
    producer = Producer(PID)
    producer.bucket(0)
    assert producer.granted(0, 0)
    taken = [producer.take(0)[1] for _ in range(4)]
    assert taken == [0, 1, 2, 3] and producer.buckets[0].answered_below == 0
    producer.answered(0, 1, 0)  # out of order: 0 is still unanswered
    assert producer.buckets[0].answered_below == 0
    producer.answered(0, 0, 0)
    assert producer.buckets[0].answered_below == 2
    producer.answered(0, 2, 0)
    producer.answered(0, 3, 0)
    assert producer.buckets[0].answered_below == 4  # all answered: the next sequence


def test_a_refused_write_is_answered_with_its_refusal_again() -> None:
    d = Driver()
    d.init_producer(PID)
    d.set("taken")
    conditional = (Op(OpKind.SET, "taken", b"x", NOT_EXISTS),)
    first = d.apply(Write(conditional, ProducerRef(PID, 0, 0), d.tick())).result
    write(d, 1, "after")
    again = d.apply(Write(conditional, ProducerRef(PID, 0, 0), d.tick())).result
    assert isinstance(first, WriteResult) and first.error is not None
    assert again == WriteResult(first.commit, (), duplicate=True, error=first.error)


def test_results_survive_a_snapshot_compactly() -> None:
    d, originals = producer_with(limits.PRODUCER_RESULTS_CACHED)
    restored = Driver(BucketStateMachine.restore(d.sm.snapshot()))
    restored.index = d.index
    assert restored.sm.digest() == d.sm.digest()
    oldest = write(restored, 0, "k0", "also0")
    assert oldest == WriteResult(originals[0].commit, originals[0].versions, duplicate=True)
    # Each result is its commit and versions, packed (the keys come with the retry):
    # ~12 bytes in the snapshot, not the ~60 of the whole result with its keys.
    (producer,) = msgpack.unpackb(d.sm.snapshot())[8]
    assert len(msgpack.packb(producer)) <= 16 * len(originals) + 32


def test_a_snapshot_with_whole_results_is_still_read() -> None:
    """Builds that kept 5 results wrote each as [sequence, [commit, [[key, version],
    ...], error]]."""
    d, originals = producer_with(3)
    raw = msgpack.unpackb(d.sm.snapshot(), raw=False)
    ((pid, epoch, last_seq, _, active),) = raw[8]
    whole = [
        [i, [r.commit.pack(), [list(kv) for kv in r.versions], None]]
        for i, r in enumerate(originals)
    ]
    raw[8] = [[pid, epoch, last_seq, whole, active]]
    old = Driver(BucketStateMachine.restore(msgpack.packb(raw, use_bin_type=True)))
    old.index = d.index
    assert old.sm.digest() == d.sm.digest()
    assert write(old, 1, "k1", "also1").commit == originals[1].commit
    raw[8] = [[pid, epoch, last_seq + 1, whole, active]]  # not ending at last_seq
    with pytest.raises(SnapshotError, match="do not end at"):
        BucketStateMachine.restore(msgpack.packb(raw, use_bin_type=True))


@pytest.mark.parametrize(
    "kept",
    [
        b"\x93\x01\x02",  # three fields, not four
        b"\xc1",  # not msgpack
        msgpack.packb([1, 2, [3], None]) + b"\x94\x01",  # a result cut short
        msgpack.packb([1, 2, [True], None]),  # a version that is no integer
        msgpack.packb([1, 2, [3], ["NO_SUCH_CODE", "x"]]),
        7,
        [[1, 2, "x", None]],  # an old-style result of the wrong shape
    ],
)
def test_a_snapshot_with_malformed_results_is_refused(kept: object) -> None:
    d, _ = producer_with(1)
    raw = msgpack.unpackb(d.sm.snapshot(), raw=False)
    raw[8][0][3] = kept
    with pytest.raises(SnapshotError, match="snapshot content is invalid"):
        BucketStateMachine.restore(msgpack.packb(raw, use_bin_type=True))


# ---- the SDK's window --------------------------------------------------------------------


def granted() -> Producer:
    producer = Producer(9)
    producer.bucket(0)
    assert producer.granted(0, 0)
    return producer


def test_a_bucket_takes_no_sequence_beyond_the_window_of_the_oldest_unanswered() -> None:
    producer = granted()
    taken = [producer.take(0)[1] for _ in range(4)]
    assert taken == [0, 1, 2, 3] and not producer.has_room(0, window=4)
    producer.answered(0, 2, 0)  # out of order: 0 is still unanswered
    assert not producer.has_room(0, window=4)
    producer.answered(0, 0, 0)
    assert producer.has_room(0, window=4)  # 1 is the oldest now
    assert producer.take(0)[1] == 4 and not producer.has_room(0, window=4)
    producer.answered(0, 1, 0)  # 2 was answered already: 3 is the oldest
    assert producer.bucket(0).unanswered == collections.deque([3, 4])
    assert producer.has_room(0, window=4)


def test_a_sequence_given_back_or_a_new_generation_frees_the_window() -> None:
    producer = granted()
    _, seq, generation = producer.take(0)
    assert (
        producer.give_back(0, seq, generation)
        and producer.bucket(0).unanswered == collections.deque()
    )
    producer.take(0)
    producer.take(0)
    producer.new_generation(0, generation)
    assert producer.granted(0, 1)
    assert producer.bucket(0).unanswered == collections.deque() and producer.has_room(0, window=1)
    producer.answered(0, 1, generation)  # an answer of the old generation changes nothing
    assert producer.bucket(0).answered == set()
