"""Benchmark: the CPU cost of each in-process stage from a committed write to the
application, per event, with nothing else running in the process.

    .venv/bin/python tests/bench/bench_stages.py [--events 3000] [--subs 1,10000]

The stages are the production code, driven the way a node and the SDK drive them,
one write at a time (no threads, no network: what each stage costs, not what it
waits for):

1. apply: `BucketStateMachine.apply` of a one-key WRITE, its rows included;
2. rows: the part of (1) spent on the rows (the same writes applied to a bucket
   without subscriptions, subtracted);
3. notifier: the lease holder's part once the write applied: `on_applied`, then the
   tick thread's `after_applies` (and, with more than `INLINE_STREAMS_MAX` streams, a
   pass of the notifier's loop), until the row reached its stream; in the literal
   emission mode this includes proposing the OUTBOX_WRITE and applying it (digest
   and all) on this replica; in the derived mode, the share of a checkpoint every
   50 ms at 500 writes/s;
4. encode: the node's `DataEvent` for the row, in a Session item (the service's
   `Encoder` and `EventEncoder`, cluster/server/sinks.py);
5. sdk: decoding the event and offering it to the subscription's `StreamCursor`
   (`sevendb.sdk.subscription.offer_events`).

With `--subs 10000`, 10,000 one-key subscriptions each have a stream attached, and
every write matches one of them (workload 4 of side_by_side.py). The collector runs
with a node's thresholds. Figures are CPU time of the thread (so other processes
on the host do not inflate them), medians over batches of 100 events, in
microseconds per event. Not a test: nothing
is asserted. docs/performance.md has the end-to-end stage table these complement.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Final, TypeVar

from bench_writes import machine

from sevendb.cluster.server.node import GC_THRESHOLDS
from sevendb.cluster.server.sinks import Encoder, EventEncoder, session_batch
from sevendb.notifier.core import EmissionMode
from sevendb.notifier.host import INLINE_STREAMS_MAX, BucketNotifier, NotifierSettings
from sevendb.outbox.entries import Lease, Op, OpKind, Subscribe, Write, encode_entry
from sevendb.outbox.model import Applied, OutboxRow
from sevendb.outbox.query import Query, plan_query
from sevendb.outbox.replica import ApplyOutcome, Connectivity
from sevendb.outbox.state import BucketStateMachine
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk.cursor import StreamCursor
from sevendb.sdk.subscription import Event, offer_events

T = TypeVar("T")
BATCH: Final = 100
ME: Final = "node-0"
WRITE_EVERY_MS: Final = 2
"""The simulated clock between writes: 500 writes/s."""
COLUMNS: Final = ("apply", "data", "rows", "notifier", "encode", "sdk")


class LocalReplica:
    """The replica contract over a state machine in this process. Proposals wait in
    `proposed` until `apply_proposed` applies them, as the tick thread would."""

    bucket = 0
    bucket_uuid = "bench"
    self_addr = ME
    is_leader = True
    quarantined = None

    def __init__(self, sm: BucketStateMachine) -> None:
        self.sm = sm
        self.lock = threading.Lock()
        self.proposed: list[tuple[bytes, Future[ApplyOutcome]]] = []
        self.on_applied: Callable[[Applied], None] | None = None

    def read(self, fn: Callable[[BucketStateMachine], T]) -> T:
        with self.lock:
            return fn(self.sm)

    def submit(self, entry: bytes) -> Future[ApplyOutcome]:
        future: Future[ApplyOutcome] = Future()
        self.proposed.append((entry, future))
        return future

    def connectivity(self) -> Connectivity:
        return Connectivity(ME, True, ())

    def apply(self, data: bytes) -> Applied:
        with self.lock:
            return self.sm.apply(self.sm.applied_index + 1, data)

    def apply_proposed(self) -> None:
        proposed, self.proposed = self.proposed, []
        for data, future in proposed:
            applied = self.apply(data)
            if self.on_applied is not None:
                self.on_applied(applied)
            future.set_result(ApplyOutcome(applied.commit_index, applied, None))


class NoRunner:
    """The notifier's runner: passes run only when the benchmark calls `step`."""

    def __init__(self) -> None:
        self.step: Callable[[], bool] = lambda: False

    def start(self, step: Callable[[], bool]) -> None:
        self.step = step

    def wake(self) -> None:
        pass

    def stop(self) -> None:
        pass


class Sink:
    def __init__(self) -> None:
        self.rows: list[OutboxRow] = []

    def deliver(self, rows: tuple[OutboxRow, ...]) -> None:
        self.rows.extend(rows)

    def close(self, reason: str) -> None:
        pass


def write(key: str, i: int) -> bytes:
    value = f"{i:012d}".encode() + b"x" * 88
    return encode_entry(Write((Op(OpKind.SET, key, value),), None, i))


def bucket(subs: int) -> tuple[LocalReplica, list[str]]:
    """A bucket with `subs` subscriptions: one on a prefix, or that many one-key ones
    (keys k/0 ...); and the keys the writes cycle over."""
    replica = LocalReplica(BucketStateMachine("bench"))
    replica.apply(encode_entry(Lease(ME, 0)))
    queries = ["prefix:k/"] if subs == 1 else [f"key:k/{i}" for i in range(subs)]
    for i, text in enumerate(queries):
        query = Query.parse(text)
        replica.apply(encode_entry(Subscribe(f"s{i}", "p", query, plan_query(query).plan_hash, 0)))
    return replica, ["k/0"] if subs == 1 else [f"k/{i}" for i in range(subs)]


class Holder:
    """The lease holder's notifier over `replica`, a stream attached to every
    subscription."""

    def __init__(self, replica: LocalReplica, subs: int, mode: EmissionMode) -> None:
        self.replica = replica
        self.clock = 0
        self.runner = NoRunner()
        settings = NotifierSettings(
            emission_mode=mode,
            resend_after_ms=10**9,
            window_events=10**6,
            purge_interval_ms=10**9,
        )
        self.host = BucketNotifier(replica, settings, runner=self.runner, clock_ms=self.now)
        replica.on_applied = self.host.on_applied
        self.host.start()
        self.runner.step()  # takes the lease
        self.sinks: dict[str, Sink] = {}
        self.cursors: dict[str, StreamCursor[Event]] = {}
        for i in range(subs):
            sub = replica.sm.subs.get(f"s{i}")
            assert sub is not None
            self.sinks[sub.sub_id] = Sink()
            self.cursors[sub.sub_id] = StreamCursor(sub.start)
            self.host.attach(sub.sub_id, "p", sub.start, self.sinks[sub.sub_id])
        self.many = subs > INLINE_STREAMS_MAX
        self.runner.step()

    def now(self) -> int:
        return self.clock

    def settle(self, applied: Applied) -> None:
        """What the node does once `applied` applied, until its row is on its stream."""
        self.clock += WRITE_EVERY_MS
        self.host.on_applied(applied)
        self.host.after_applies()
        if self.many:
            self.runner.step()
        while self.replica.proposed:
            self.replica.apply_proposed()
            self.host.after_applies()
            if self.many:
                self.runner.step()

    def take_rows(self) -> list[OutboxRow]:
        rows = [row for sink in self.sinks.values() for row in sink.rows]
        for sink in self.sinks.values():
            sink.rows.clear()
        return sorted(rows, key=lambda row: row.emit_seq)


def run(subs: int, mode: EmissionMode, events: int) -> dict[str, float]:
    replica, keys = bucket(subs)
    holder = Holder(replica, subs, mode)
    bare = BucketStateMachine("bench")
    encode = Encoder(EventEncoder(), "s", None, session_batch(1))
    stages: dict[str, list[int]] = {name: [] for name in COLUMNS if name != "rows"}
    for n in range(0, events, BATCH):
        datas = [write(keys[(n + j) % len(keys)], n + j) for j in range(BATCH)]
        spent = {"apply": 0, "notifier": 0}
        for data in datas:
            t0 = time.thread_time_ns()
            applied = replica.apply(data)
            t1 = time.thread_time_ns()
            holder.settle(applied)
            spent["apply"] += t1 - t0
            spent["notifier"] += time.thread_time_ns() - t1
        for name, ns in spent.items():
            stages[name].append(ns)
        t0 = time.thread_time_ns()
        for data in datas:
            bare.apply(bare.applied_index + 1, data)
        stages["data"].append(time.thread_time_ns() - t0)
        rows = holder.take_rows()
        assert len(rows) == BATCH, (len(rows), mode)
        t0 = time.thread_time_ns()
        items = [encode((row,))[0] for row in rows]
        stages["encode"].append(time.thread_time_ns() - t0)
        t0 = time.thread_time_ns()
        for row, item in zip(rows, items, strict=True):
            assert isinstance(item, pb.SessionItem)
            offer_events(holder.cursors[row.sub_id], 0, item.message.events.events)
        stages["sdk"].append(time.thread_time_ns() - t0)
    out = {name: statistics.median(ns) / BATCH / 1000 for name, ns in stages.items()}
    out["rows"] = out["apply"] - out["data"]
    return out


def main() -> None:
    # The collector as a node runs it: what start-up made frozen, a larger young
    # generation (the subscriptions made later are walked by full collections).
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=3000)
    p.add_argument("--subs", default="1,10000", help="subscription counts, comma-separated")
    args = p.parse_args()
    print(machine())
    print(f"{'subscriptions':>13} {'mode':>8} " + " ".join(f"{k:>9}" for k in COLUMNS))
    for subs in (int(s) for s in args.subs.split(",")):
        for mode in EmissionMode:
            figures = run(subs, mode, args.events)
            cells = " ".join(f"{figures[k]:>9.1f}" for k in COLUMNS)
            print(f"{subs:>13,} {mode.value:>8} {cells}")
    print("(CPU us per event, median over batches of 100; apply = data + rows)")


if __name__ == "__main__":
    main()
