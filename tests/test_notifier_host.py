"""BucketNotifier, the notifier host, on a real replicated bucket.

Three replicas run in this process (see test_replica.py); the notifier is attached
to the leader. It gets a `Passes` runner instead of its thread: each test runs its
passes by hand, so what happens without them is what the tick thread did.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_replica import Cluster, wait_until, write

from sevendb.cluster.raft.replica import BucketReplica
from sevendb.notifier.core import AttachStatus, EmissionMode, NotifierConfig, NotifierCore
from sevendb.notifier.host import (
    INLINE_STREAMS_MAX,
    BucketNotifier,
    NotifierSettings,
    NotifierThread,
)
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import Subscribe, encode_entry
from sevendb.outbox.model import OutboxRow, SubscribeResult
from sevendb.outbox.query import Query, plan_query
from sevendb.outbox.state import BucketStateMachine

PRINCIPAL = "alice"


class Sink:
    """An attached stream that keeps what it is handed."""

    def __init__(self) -> None:
        self.rows: list[OutboxRow] = []
        self.closed: str | None = None
        self.lock = threading.Lock()

    def deliver(self, rows: tuple[OutboxRow, ...]) -> None:
        with self.lock:
            self.rows.extend(rows)

    def close(self, reason: str) -> None:
        self.closed = reason


class Passes:
    """A runner that runs nothing by itself: it counts the wake-ups (any thread)."""

    def __init__(self) -> None:
        self.wakes = 0
        self.started = False

    def start(self, step: Callable[[], bool]) -> None:
        self.started = True

    def wake(self) -> None:
        self.wakes += 1

    def stop(self) -> None:
        self.started = False


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[BucketReplica]:
    cluster = Cluster(tmp_path).start_all()
    try:
        yield cluster.leader()
    finally:
        cluster.close()


def holding_the_lease(
    replica: BucketReplica, runner: Passes | None = None, **settings_: object
) -> BucketNotifier:
    """A notifier that holds the committed lease, after passes of its loop run by hand."""
    # Nothing acks in these tests: no stream may be rewound for a resend meanwhile.
    settings = NotifierSettings(resend_after_ms=600_000, **settings_)  # type: ignore[arg-type]
    notifier = BucketNotifier(replica, settings, runner=runner or Passes())
    replica.on_applied = notifier.on_applied  # as a node wires them
    replica.after_applies = notifier.after_applies

    def holds() -> bool:
        notifier.step()  # one pass of the loop its thread would run
        return notifier.emitting

    wait_until(holds, what="the notifier to hold the lease")
    return notifier


def subscribe(replica: BucketReplica, sub_id: str, query: str) -> SubscribeResult:
    q = Query.parse(query)
    outcome = replica.propose(
        encode_entry(Subscribe(sub_id, PRINCIPAL, q, plan_query(q).plan_hash, int(time.time())))
    )
    assert outcome.applied is not None
    result = outcome.applied.result
    assert isinstance(result, SubscribeResult) and result.start is not None
    return result


def five_writes_on_one_stream(leader: BucketReplica, notifier: BucketNotifier) -> list[int]:
    """Attach one stream, commit five matching writes, and wait until the stream got
    their rows with nothing running the notifier's loop (the replica's tick thread
    alone): the rows' commit indexes."""
    start = subscribe(leader, "s1", "prefix:k/").start
    assert start is not None
    sink = Sink()
    attached, _ = notifier.attach("s1", PRINCIPAL, start, sink)
    assert attached.status is AttachStatus.ATTACHED

    committed = [leader.propose(write(f"k/{i}")).commit_index for i in range(5)]

    def all_sent() -> bool:
        with sink.lock:
            return len(sink.rows) == len(committed)

    wait_until(all_sent, what="the rows to reach the stream")
    assert [row.emit_seq.commit_index for row in sink.rows] == committed
    assert sink.closed is None
    return committed


def test_the_tick_thread_outboxes_and_sends_new_rows_itself(leader: BucketReplica) -> None:
    notifier = holding_the_lease(leader, emission_mode=EmissionMode.LITERAL)
    committed = five_writes_on_one_stream(leader, notifier)
    # The OUTBOX_WRITE for these rows was proposed, and the rows sent once it applied.
    assert leader.read(lambda sm: sm.outboxed_through) >= committed[-1]


def test_the_derived_mode_sends_rows_once_their_write_applied_before_any_outbox_write(
    leader: BucketReplica,
) -> None:
    """One Raft round: the tick thread hands each row to its stream right after the
    write applied. The one checkpoint allowed in this test covers only the first."""
    notifier = holding_the_lease(
        leader, emission_mode=EmissionMode.DERIVED, checkpoint_interval_ms=600_000
    )
    committed = five_writes_on_one_stream(leader, notifier)
    # Sent, though no OUTBOX_WRITE covers the last four: their write is their durability.
    assert leader.read(lambda sm: sm.outboxed_through) < committed[1]
    pending = leader.read(lambda sm: [r.emit_seq.commit_index for r in sm.pending.rows()])
    assert pending[-4:] == committed[1:]


def test_an_unknown_emission_mode_is_refused() -> None:
    assert NotifierSettings(emission_mode="literal").emission_mode is EmissionMode.LITERAL  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="emission_mode must be one of derived, literal"):
        NotifierSettings(emission_mode="eager")  # type: ignore[arg-type]


def test_a_notifier_with_many_streams_leaves_them_to_its_thread(
    leader: BucketReplica,
) -> None:
    runner = Passes()
    notifier = holding_the_lease(leader, runner)
    sinks: dict[str, Sink] = {}
    for i in range(INLINE_STREAMS_MAX + 1):
        start = subscribe(leader, f"s{i}", "prefix:k/").start
        assert start is not None
        sinks[f"s{i}"] = sink = Sink()
        attached, _ = notifier.attach(f"s{i}", PRINCIPAL, start, sink)
        assert attached.status is AttachStatus.ATTACHED
    woken = runner.wakes  # attaching woke it

    committed = [leader.propose(write(f"k/{i}")).commit_index for i in range(5)]

    # The tick thread leaves the work to the thread, and wakes it for it.
    wait_until(lambda: runner.wakes > woken, what="the notifier thread to be woken")

    def delivered() -> bool:
        notifier.step()  # the passes the woken thread runs
        return all(len(sink.rows) == len(committed) for sink in sinks.values())

    wait_until(delivered, what="every row on every stream")
    for sub_id, sink in sinks.items():
        assert [row.emit_seq.commit_index for row in sink.rows] == committed, sub_id


def test_the_notifier_thread_runs_passes_when_woken_and_again_while_more_is_ready() -> None:
    """The node's runner: idle until woken (or its idle period), a pass at once after
    one that says more is ready, a failing pass logged and retried, then stopped."""
    results: Iterator[bool | Exception] = iter(
        [True, True, False, RuntimeError("a bug in a pass"), False]
    )
    names: list[str] = []
    four = threading.Event()

    def step() -> bool:
        names.append(threading.current_thread().name)
        if len(names) == 4:
            four.set()
        result = next(results, False)
        if isinstance(result, Exception):
            raise result
        return result

    runner = NotifierThread("notifier-b7", idle_wait_s=3600)
    runner.start(step)
    runner.wake()
    wait_until(lambda: len(names) == 3, what="three passes from one wake-up")
    assert names == ["notifier-b7"] * 3
    runner.wake()
    assert four.wait(10)  # the failing pass ...
    runner.wake()
    wait_until(lambda: len(names) == 5, what="a pass after the failing one")
    runner.stop()
    assert not any(t.name == "notifier-b7" for t in threading.enumerate())


class CountingCore(NotifierCore):
    """Records the streams its passes looked at."""

    looked: list[str]

    def _rows_after(
        self, sm: BucketStateMachine, sub_id: str, position: EmitSeq, through: int | None
    ) -> tuple[OutboxRow, ...]:
        self.looked.append(sub_id)
        return super()._rows_after(sm, sub_id, position, through)


def test_housekeeping_looks_at_no_idle_stream(leader: BucketReplica) -> None:
    """The holder's once-a-second pass looked at every attached stream for the
    resend timers (10,000 idle ones: 85 ms a second on the 2-core host,
    docs/performance.md, "Idle subscriptions"). It looks at the streams with events
    in flight (only they have a timer) and those with new rows, not the idle ones."""
    cores: list[CountingCore] = []

    def counting(me: str, config: NotifierConfig, sm: BucketStateMachine) -> NotifierCore:
        core = CountingCore(me, config)
        core.looked = []
        cores.append(core)
        return core

    now = [1_000_000]
    settings = NotifierSettings(resend_after_ms=600_000)
    notifier = BucketNotifier(
        leader, settings, runner=Passes(), clock_ms=lambda: now[0], new_core=counting
    )
    leader.on_applied = notifier.on_applied
    leader.after_applies = notifier.after_applies

    def holds() -> bool:
        now[0] += 10
        notifier.step()
        return notifier.emitting

    wait_until(holds, what="the notifier to hold the lease")
    sinks = {}
    for i in range(20):
        start = subscribe(leader, f"s{i}", f"key:k/{i}").start
        assert start is not None
        sinks[f"s{i}"] = Sink()
        attached, _ = notifier.attach(f"s{i}", PRINCIPAL, start, sinks[f"s{i}"])
        assert attached.status is AttachStatus.ATTACHED
    leader.propose(write("k/7"))
    wait_until(lambda: (notifier.step(), len(sinks["s7"].rows) == 1)[1], what="s7's event")
    (core,) = cores
    core.looked.clear()
    for _ in range(3):  # housekeeping passes, a second apart
        now[0] += 1_000
        notifier.step()
    assert set(core.looked) == {"s7"}  # in flight (nothing acks here); the others idle
