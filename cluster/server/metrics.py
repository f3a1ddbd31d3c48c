"""A node's Prometheus metrics (docs/emission.md, Metrics), served on its HTTP ``/metrics`` port.

* ``emit_latency_seconds{bucket}`` (histogram): commit (the write's timestamp) to the
  event being handed to the client's stream;
* ``ack_lag_commit_index{bucket}`` (gauge): the largest distance, in commit indexes,
  between a subscription's stream head and its acknowledged position;
* ``notifier_outbox_size_entries{bucket}`` (gauge): outboxed rows not yet purged;
* ``reconnect_status_total{status}`` (counter): Reconnect outcomes;
* ``plan_hash_mismatch_total`` (counter): replicas of this node whose plan hash or
  outbox digest disagreed with a committed entry (each quarantined itself);
* ``replica_disk_repairs_total{bucket}`` (counter): times this node's replica found
  its files damaged (each logged at ERROR and repaired, in place or by its leader);
  ``replica_repairing{bucket}`` (gauge, 0/1): it lost acknowledged entries and its
  leader is sending them again; ``bucket_data_loss{bucket}`` (gauge, 0/1): no
  reachable replica of the bucket holds every acknowledged entry, so it answers
  DATA_LOSS (docs/raft.md, "Disk faults");
* ``commits_total{bucket}`` (counter): entries this node's replica applied (the
  commit rate); ``purged_rows_total{bucket}``: rows removed by OUTBOX_PURGE (the
  purge rate); ``events_sent_total{bucket}``: events handed to client streams.

The gauges, ``events_sent_total`` and ``emit_latency_seconds`` come from the
bucket's lease holder; applied entries and purges are counted by every replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sevendb.outbox.model import OutboxRow

LATENCY_BUCKETS_S: Final = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


DiskState = tuple[int, int, bool, bool]
"""A replica's (bucket, disk repairs, repairing, bucket in DATA_LOSS)."""


class _ReplicaCounters(Collector):
    """Counters the replicas keep themselves, read at scrape time."""

    def __init__(
        self, plan_mismatches: Callable[[], int], disk: Callable[[], Iterable[DiskState]]
    ) -> None:
        self._plan_mismatches = plan_mismatches
        self._disk = disk

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        family = CounterMetricFamily(
            "plan_hash_mismatch",
            "Replicas of this node whose own plan hash or outbox digest disagreed with "
            "a committed entry (each quarantined itself)",
        )
        family.add_metric([], self._plan_mismatches())
        yield family
        repairs = CounterMetricFamily(
            "replica_disk_repairs",
            "Times this node's replica found its files damaged (each repaired)",
            labels=["bucket"],
        )
        repairing = GaugeMetricFamily(
            "replica_repairing",
            "1 while this node's replica waits for its leader to resend lost entries",
            labels=["bucket"],
        )
        data_loss = GaugeMetricFamily(
            "bucket_data_loss",
            "1 while no reachable replica of the bucket holds every acknowledged entry",
            labels=["bucket"],
        )
        for bucket, count, is_repairing, is_lost in self._disk():
            repairs.add_metric([str(bucket)], count)
            repairing.add_metric([str(bucket)], int(is_repairing))
            data_loss.add_metric([str(bucket)], int(is_lost))
        yield from (repairs, repairing, data_loss)


class NodeMetrics:
    """The metrics of one node process, on their own registry."""

    def __init__(
        self,
        plan_mismatches: Callable[[], int] = lambda: 0,
        disk: Callable[[], Iterable[DiskState]] = lambda: (),
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.emit_latency = Histogram(
            "emit_latency_seconds",
            "Commit to network send latency of emitted events",
            ["bucket"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ack_lag = Gauge(
            "ack_lag_commit_index",
            "Largest gap in commit indexes between a subscription's stream head and its ack",
            ["bucket"],
            registry=r,
        )
        self.outbox_size = Gauge(
            "notifier_outbox_size_entries",
            "Outboxed rows not yet acknowledged and purged",
            ["bucket"],
            registry=r,
        )
        self.reconnects = Counter("reconnect_status", "Reconnect outcomes", ["status"], registry=r)
        self.commits = Counter(
            "commits", "Raft entries this node's replica applied", ["bucket"], registry=r
        )
        self.purged = Counter(
            "purged_rows", "Outbox rows removed by OUTBOX_PURGE", ["bucket"], registry=r
        )
        self.events = Counter(
            "events_sent", "Events handed to client streams", ["bucket"], registry=r
        )
        r.register(_ReplicaCounters(plan_mismatches, disk))

    def serve(self, host: str, port: int) -> None:
        """Serve ``/metrics`` over HTTP on ``host:port`` (a daemon thread)."""
        start_http_server(port, addr=host, registry=self.registry)

    # ---- NotifierMetrics -------------------------------------------------------------

    def events_sent(self, bucket: int, rows: tuple[OutboxRow, ...], now_ms: int) -> None:
        label = str(bucket)
        histogram = self.emit_latency.labels(label)
        for row in rows:
            histogram.observe(max(0, now_ms - row.delta.commit_time_ms) / 1000)
        self.events.labels(label).inc(len(rows))

    def rows_purged(self, bucket: int, count: int) -> None:
        self.purged.labels(str(bucket)).inc(count)

    def gauges(self, bucket: int, outbox_rows: int, ack_lag: int) -> None:
        label = str(bucket)
        self.outbox_size.labels(label).set(outbox_rows)
        self.ack_lag.labels(label).set(ack_lag)

    def applied(self, bucket: int) -> None:
        self.commits.labels(str(bucket)).inc()

    def reconnected(self, status: str) -> None:
        self.reconnects.labels(status).inc()


__all__ = ["LATENCY_BUCKETS_S", "DiskState", "NodeMetrics"]
