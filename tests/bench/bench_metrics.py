"""What a node's metrics cost on its hot paths (docs/operations.md, "Metrics"):

    python tests/bench/bench_metrics.py

per call of the notifier's hooks (events sent, rows purged, entries applied) with
the series bound once per bucket, against a label lookup per call as before; a gRPC
call's accounting (a counter and a latency observation); a journal fsync's
(one bisect). Prints microseconds per call; asserts nothing."""

from __future__ import annotations

import timeit
from collections.abc import Callable

import grpc

from sevendb.cluster.raft.journal import Durations
from sevendb.cluster.server.metrics import MethodMetrics, NodeMetrics
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.model import Delta, OutboxRow

N = 200_000


def per_call_us(fn: Callable[[], object]) -> float:
    return timeit.timeit(fn, number=N) / N * 1e6


def main() -> None:
    metrics = NodeMetrics("bench")
    seq = EmitSeq("bucket", 1, 5)
    row = OutboxRow("s", seq, seq, Delta((), 1000))
    bound = per_call_us(lambda: metrics.events_sent(3, (row,), 1005))

    def with_lookups() -> None:
        metrics.emit_latency.labels("3").observe(0.005)
        metrics.events.labels("3").inc()

    lookup = per_call_us(with_lookups)
    print(f"events_sent, 1 row:  {bound:.2f} us bound, {lookup:.2f} us with label lookups")
    ten = per_call_us(lambda: metrics.events_sent(3, (row,) * 10, 1005))
    print(f"events_sent, 10 rows: {ten:.2f} us")
    applied = per_call_us(lambda: metrics.applied(3))
    applied_lookup = per_call_us(lambda: metrics.commits.labels("3").inc())
    print(f"applied: {applied:.2f} us bound, {applied_lookup:.2f} us with a label lookup")
    print(f"rows_purged: {per_call_us(lambda: metrics.rows_purged(3, 4)):.2f} us")
    method = MethodMetrics(metrics, "Write", streaming=False)
    call = per_call_us(lambda: method.finished(grpc.StatusCode.OK, 0.001))
    print(f"a unary gRPC call: {call:.2f} us")
    durations = Durations()
    print(f"an fsync's timing: {per_call_us(lambda: durations.observe(0.003)):.2f} us")


if __name__ == "__main__":
    main()
