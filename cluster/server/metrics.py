"""A node's Prometheus metrics, every family in the ``sevendb_`` namespace (plus the
client library's usual ``process_*`` and ``python_*``), served on its metrics port
with ``/healthz`` and ``/readyz`` (`sevendb.cluster.server.health`).
docs/operations.md lists every family with its labels; in short:

* **Emission** (docs/contract.md §11: the first five keep their meaning):
  ``sevendb_emit_latency_seconds{bucket}`` (histogram, commit time to the event
  handed to a client's stream), ``sevendb_ack_lag_commit_index{bucket}``,
  ``sevendb_notifier_outbox_size_entries{bucket}``,
  ``sevendb_reconnect_status_total{status}``, ``sevendb_plan_hash_mismatch_total``;
  then ``sevendb_commits_total``, ``sevendb_purged_rows_total``,
  ``sevendb_events_sent_total`` and ``sevendb_subscriptions`` /
  ``sevendb_subscriptions_stalled`` (all ``{bucket}``). The gauges,
  ``events_sent`` and ``emit_latency`` come from the bucket's lease holder (the
  subscription counts from its leader); applied entries and purges are counted by
  every replica.
* **Idempotent producers** (seed 003): ``sevendb_idempotent_producers{bucket}``
  (the producers the bucket remembers, from its leader: each initialised and not yet
  forgotten for idleness) and ``sevendb_producer_duplicates_total{bucket}`` (writes
  this node answered as duplicates of a sequence already committed: a client's
  retry, applied once).
* **Transactions** (docs/transactions.md), from each coordinator bucket's leader:
  ``sevendb_transactions_total{bucket,outcome}`` (outcome ``started``,
  ``committed``, ``aborted``, ``timed_out``, ``fenced``) and
  ``sevendb_transactions_active{bucket}``.
* **Raft**, per local replica (``bucket`` is the bucket's number, or ``meta`` for
  the metadata group): ``sevendb_raft_term``, ``_is_leader``, ``_has_leader``,
  ``_has_quorum``, ``_quarantined``, ``_leader_changes_total``,
  ``_proposals_failed_total``, ``_commit_index``, ``_applied_index``,
  ``_apply_lag_entries``, ``_snapshots_total``, ``_compactions_total``,
  ``_journal_fsync_duration_seconds`` (histogram), ``_journal_bytes_written_total``,
  ``_log_entries``; disk faults: ``sevendb_replica_disk_repairs_total``,
  ``sevendb_replica_repairing``, ``sevendb_bucket_data_loss``.
* **gRPC**, per method of ``sevendb.v1.SevenDB``:
  ``sevendb_grpc_server_handled_total{method,code}``,
  ``sevendb_grpc_server_handling_seconds{method}`` (histogram, unary methods),
  ``sevendb_grpc_server_streams_in_flight{method}`` (streaming methods).
* **Archive**: ``sevendb_archive_segments_written_total``,
  ``sevendb_archive_rows_written_total``, ``sevendb_archive_segments``,
  ``sevendb_archive_bytes``, ``sevendb_archive_rows_buffered``,
  ``sevendb_archive_publish_failures_total``, ``sevendb_archive_lag_entries{bucket}``.
* **Process**: ``process_cpu_seconds_total``, ``process_resident_memory_bytes``,
  ``process_open_fds``, ... (prometheus-client's process collector),
  ``sevendb_process_threads``, ``sevendb_node_info{node,version}``.

Cost on the hot paths: the emission counters and histograms of a bucket are bound
once (`_BucketSeries`) and reached through a dict by bucket number; a gRPC method's
series are bound when its handler is built (`MethodMetrics`). Everything about Raft
and the archive is read when Prometheus scrapes, never counted per event here.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

import grpc
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from sevendb.cluster.archive.writer import ArchiveWriter
from sevendb.cluster.raft.replica import BucketReplica, ReplicaUnavailable
from sevendb.outbox.lifecycle import stalled_subscriptions
from sevendb.outbox.model import OutboxRow

NAMESPACE: Final = "sevendb"

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

_B: Final = ("bucket",)

FAMILIES: Final[Mapping[str, tuple[str, tuple[str, ...]]]] = {
    # emission (docs/contract.md §11: the first five keep their meaning)
    "sevendb_emit_latency_seconds": ("histogram", _B),
    "sevendb_ack_lag_commit_index": ("gauge", _B),
    "sevendb_notifier_outbox_size_entries": ("gauge", _B),
    "sevendb_reconnect_status_total": ("counter", ("status",)),
    "sevendb_plan_hash_mismatch_total": ("counter", ()),
    "sevendb_commits_total": ("counter", _B),
    "sevendb_purged_rows_total": ("counter", _B),
    "sevendb_events_sent_total": ("counter", _B),
    "sevendb_subscriptions": ("gauge", _B),
    "sevendb_subscriptions_stalled": ("gauge", _B),
    # idempotent producers (seed 003)
    "sevendb_idempotent_producers": ("gauge", _B),
    "sevendb_producer_duplicates_total": ("counter", _B),
    # transactions (docs/transactions.md)
    "sevendb_transactions_total": ("counter", ("bucket", "outcome")),
    "sevendb_transactions_active": ("gauge", _B),
    # Raft, per local replica
    "sevendb_raft_term": ("gauge", _B),
    "sevendb_raft_is_leader": ("gauge", _B),
    "sevendb_raft_has_leader": ("gauge", _B),
    "sevendb_raft_has_quorum": ("gauge", _B),
    "sevendb_raft_quarantined": ("gauge", _B),
    "sevendb_raft_commit_index": ("gauge", _B),
    "sevendb_raft_applied_index": ("gauge", _B),
    "sevendb_raft_apply_lag_entries": ("gauge", _B),
    "sevendb_raft_log_entries": ("gauge", _B),
    "sevendb_raft_leader_changes_total": ("counter", _B),
    "sevendb_raft_proposals_failed_total": ("counter", _B),
    "sevendb_raft_snapshots_total": ("counter", _B),
    "sevendb_raft_compactions_total": ("counter", _B),
    "sevendb_raft_journal_bytes_written_total": ("counter", _B),
    "sevendb_raft_journal_fsync_duration_seconds": ("histogram", _B),
    "sevendb_replica_disk_repairs_total": ("counter", _B),
    "sevendb_replica_repairing": ("gauge", _B),
    "sevendb_bucket_data_loss": ("gauge", _B),
    # gRPC, per method
    "sevendb_grpc_server_handled_total": ("counter", ("method", "code")),
    "sevendb_grpc_server_handling_seconds": ("histogram", ("method",)),
    "sevendb_grpc_server_streams_in_flight": ("gauge", ("method",)),
    # archive
    "sevendb_archive_segments_written_total": ("counter", ()),
    "sevendb_archive_rows_written_total": ("counter", ()),
    "sevendb_archive_publish_failures_total": ("counter", ()),
    "sevendb_archive_segments": ("gauge", ()),
    "sevendb_archive_bytes": ("gauge", ()),
    "sevendb_archive_rows_buffered": ("gauge", ()),
    "sevendb_archive_lag_entries": ("gauge", _B),
    # process
    "sevendb_node_info": ("gauge", ("node", "version")),
    "sevendb_process_threads": ("gauge", ()),
    "process_cpu_seconds_total": ("counter", ()),
    "process_resident_memory_bytes": ("gauge", ()),
    "process_virtual_memory_bytes": ("gauge", ()),
    "process_open_fds": ("gauge", ()),
    "process_max_fds": ("gauge", ()),
    "process_start_time_seconds": ("gauge", ()),
}
"""Every family a node exports (beside prometheus-client's ``python_*``): its type
and label names, as a scrape shows them (a counter with its ``_total``).
tests/test_metrics.py checks a real node against it, and the dashboard and alert
rules in deploy/ against it."""

ReplicaSource = Callable[[], Iterable[tuple[str, BucketReplica]]]
"""The node's local replicas now, each with its ``bucket`` label (a number, or
``meta`` for the metadata group's member)."""


def sevendb_version() -> str:
    """The installed package's version (``0+unknown`` when run from a bare tree)."""
    try:
        return importlib.metadata.version("sevendb")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _int(value: object) -> int:
    """A number of `BucketReplica.status()` (a flag: 0 or 1; missing: 0)."""
    return int(value) if isinstance(value, int) else 0


def _name(short: str) -> str:
    return f"{NAMESPACE}_{short}"


def _per_bucket(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily], short: str, text: str
) -> GaugeMetricFamily | CounterMetricFamily:
    """A family of this scrape with a ``bucket`` label."""
    return kind(_name(short), text, labels=["bucket"])


class _RaftCollector(Collector):
    """Every local replica's Raft state and counters, read at scrape time from
    `BucketReplica.status()` (nothing is counted here per entry)."""

    _GAUGES: Final = (
        ("term", "term", "The replica's current Raft term"),
        ("is_leader", "is_leader", "1 if this replica leads its group"),
        (
            "has_leader",
            "has_leader",
            "1 if this replica leads or heard from a leader within the election timeout",
        ),
        ("has_quorum", "has_quorum", "1 if this replica reaches a majority of its group"),
        ("commit_index", "commit_index", "The replica's Raft commit index"),
        ("applied_index", "applied_index", "The last log index this replica applied"),
        ("log_entries", "log_len", "Entries in the replica's Raft log (since its snapshot)"),
    )
    _COUNTERS: Final = (
        ("leader_changes", "leader_changes", "Times this replica saw a new leader"),
        ("proposals_failed", "proposals_failed", "Proposals made here that failed"),
        ("snapshots", "snapshots_written", "Snapshots this replica wrote"),
        ("compactions", "compactions", "Times the log was cut after a snapshot"),
        ("journal_bytes_written", "journal_bytes_written", "Bytes the Raft journal wrote"),
    )

    def __init__(self, replicas: ReplicaSource) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        gauges = {
            key: GaugeMetricFamily(_name(f"raft_{name}"), text, labels=["bucket"])
            for name, key, text in self._GAUGES
        }
        counters = {
            key: CounterMetricFamily(_name(f"raft_{name}"), text, labels=["bucket"])
            for name, key, text in self._COUNTERS
        }
        lag = _per_bucket(
            GaugeMetricFamily,
            "raft_apply_lag_entries",
            "Entries the leader committed that this replica has not applied yet",
        )
        quarantined = _per_bucket(
            GaugeMetricFamily,
            "raft_quarantined",
            "1 while this replica does not serve: quarantined, repairing or DATA_LOSS",
        )
        fsync = HistogramMetricFamily(
            _name("raft_journal_fsync_duration_seconds"),
            "How long the Raft journal's fsyncs took",
            labels=["bucket"],
        )
        for label, replica in self._replicas():
            status = replica.status()
            for key, family in gauges.items():
                family.add_metric([label], _int(status.get(key)))
            for key, counter in counters.items():
                counter.add_metric([label], _int(status.get(key)))
            behind = _int(status.get("leader_commit_index")) - _int(status.get("applied_index"))
            lag.add_metric([label], max(0, behind))
            quarantined.add_metric([label], int(replica.quarantined is not None))
            durations = status.get("fsync_durations")
            if isinstance(durations, tuple):
                bounds, counts, total_s = durations
                cumulative, buckets = 0, []
                for bound, count in zip((*map(str, bounds), "+Inf"), counts, strict=True):
                    cumulative += count
                    buckets.append((bound, cumulative))
                fsync.add_metric([label], buckets, total_s)
        yield from gauges.values()
        yield from counters.values()
        yield from (lag, quarantined, fsync)


class _DiskCollector(Collector):
    """Disk-fault recovery and plan divergence, counted by the replicas themselves
    (docs/raft.md, "Disk faults")."""

    def __init__(self, replicas: ReplicaSource) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        mismatches = CounterMetricFamily(
            _name("plan_hash_mismatch"),
            "Replicas of this node whose own plan hash or outbox digest disagreed with "
            "a committed entry (each quarantined itself)",
        )
        repairs = _per_bucket(
            CounterMetricFamily,
            "replica_disk_repairs",
            "Times this node's replica found its files damaged (each repaired)",
        )
        repairing = _per_bucket(
            GaugeMetricFamily,
            "replica_repairing",
            "1 while this node's replica waits for its leader to resend lost entries",
        )
        data_loss = _per_bucket(
            GaugeMetricFamily,
            "bucket_data_loss",
            "1 while no reachable replica of the bucket holds every acknowledged entry",
        )
        total = 0
        for label, replica in self._replicas():
            if label == "meta":
                continue
            status = replica.status()
            total += replica.plan_mismatches
            repairs.add_metric([label], _int(status.get("disk_repairs")))
            repairing.add_metric([label], int(bool(status.get("repairing"))))
            data_loss.add_metric([label], int(status.get("data_loss") is not None))
        mismatches.add_metric([], total)
        yield from (mismatches, repairs, repairing, data_loss)


class _SubscriptionCollector(Collector):
    """Live and stalled subscriptions, and idempotent producers, of the buckets this
    node leads, read from the core at scrape time (stalled: rows to acknowledge and
    no ack within the stall window, docs/core.md)."""

    def __init__(self, replicas: ReplicaSource, stall_window_ms: int) -> None:
        self._replicas = replicas
        self._window_ms = stall_window_ms

    def collect(self) -> Iterator[Metric]:
        live = GaugeMetricFamily(
            _name("subscriptions"), "Live subscriptions (from the leader)", labels=["bucket"]
        )
        stalled = _per_bucket(
            GaugeMetricFamily,
            "subscriptions_stalled",
            "Subscriptions with rows to acknowledge and no ack within the stall window "
            "(from the leader)",
        )
        producers = _per_bucket(
            GaugeMetricFamily,
            "idempotent_producers",
            "Idempotent producers the bucket remembers (from the leader)",
        )
        txns = CounterMetricFamily(
            _name("transactions"),
            "Transactions the bucket coordinates: started, and decided by outcome (from the "
            "leader)",
            labels=["bucket", "outcome"],
        )
        active = _per_bucket(
            GaugeMetricFamily,
            "transactions_active",
            "Transactions the bucket coordinates not complete: open, or decided with markers "
            "outstanding (from the leader)",
        )
        now_ms = time.time_ns() // 1_000_000
        window = self._window_ms
        for label, replica in self._replicas():
            if label == "meta" or not replica.is_leader:
                continue
            try:
                count, stuck, producing, counts, open_ = replica.read(
                    lambda sm: (
                        len(sm.subs.by_id()),
                        len(stalled_subscriptions(sm, now_ms, window)),
                        len(sm.producers),
                        dict(sm.txns.counts),
                        sm.txns.active(),
                    )
                )
            except ReplicaUnavailable:
                continue
            live.add_metric([label], count)
            stalled.add_metric([label], stuck)
            producers.add_metric([label], producing)
            for outcome, total in counts.items():
                txns.add_metric([label, outcome], total)
            active.add_metric([label], open_)
        yield from (live, stalled, producers, txns, active)


class _ArchiveCollector(Collector):
    """The archive writer's counters (`ArchiveWriter.stats`) and, per local bucket,
    how far the archive trails what the replica applied."""

    def __init__(self, archive: ArchiveWriter, replicas: ReplicaSource) -> None:
        self._archive = archive
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        stats = self._archive.stats()
        yield CounterMetricFamily(
            _name("archive_segments_written"),
            "Segments this node published to the archive",
            value=stats.segments_published,
        )
        yield CounterMetricFamily(
            _name("archive_rows_written"),
            "Purged rows this node published to the archive",
            value=stats.rows_published,
        )
        yield CounterMetricFamily(
            _name("archive_publish_failures"),
            "Failed attempts to publish a segment (retried)",
            value=stats.publish_failures,
        )
        yield GaugeMetricFamily(
            _name("archive_segments"), "This node's segments in the archive", stats.segments_live
        )
        yield GaugeMetricFamily(
            _name("archive_bytes"), "Bytes of this node's segments in the archive", stats.bytes_live
        )
        yield GaugeMetricFamily(
            _name("archive_rows_buffered"),
            "Purged rows waiting to be published",
            stats.rows_buffered,
        )
        lag = _per_bucket(
            GaugeMetricFamily,
            "archive_lag_entries",
            "Log entries this replica applied past the archive's published point "
            "(the log keeps them until it catches up)",
        )
        for label, replica in self._replicas():
            if label == "meta":
                continue
            applied = _int(replica.status().get("applied_index"))
            through = self._archive.archived_through(replica.bucket)
            lag.add_metric([label], max(0, applied - through))
        yield lag


def _threads() -> float:
    """OS threads of this process (gRPC's and pysyncobj's included)."""
    try:
        return float(len(os.listdir("/proc/self/task")))
    except OSError:
        return float(threading.active_count())


@dataclass(slots=True)
class _BucketSeries:
    """One bucket's emission series, bound once (no label lookup per event)."""

    latency: Histogram
    events: Counter
    commits: Counter
    purged: Counter
    outbox: Gauge
    ack_lag: Gauge


class MethodMetrics:
    """One gRPC method's series, bound when its handler is built: `finished` per
    call with its status code, `opened`/`closed` around a stream."""

    def __init__(self, metrics: NodeMetrics | None, method: str, streaming: bool) -> None:
        self._metrics = metrics
        self._method = method
        self._codes: dict[grpc.StatusCode, Counter] = {}
        self._latency: Histogram | None = None
        self._in_flight: Gauge | None = None
        if metrics is not None:
            self._codes[grpc.StatusCode.OK] = metrics.grpc_handled.labels(method, "OK")
            if streaming:
                self._in_flight = metrics.grpc_streams.labels(method)
            else:
                self._latency = metrics.grpc_latency.labels(method)

    def opened(self) -> None:
        if self._in_flight is not None:
            self._in_flight.inc()

    def closed(self) -> None:
        if self._in_flight is not None:
            self._in_flight.dec()

    def finished(self, code: grpc.StatusCode, seconds: float) -> None:
        if self._metrics is None:
            return
        counter = self._codes.get(code)
        if counter is None:
            counter = self._codes[code] = self._metrics.grpc_handled.labels(self._method, code.name)
        counter.inc()
        if self._latency is not None:
            self._latency.observe(seconds)


class NodeMetrics:
    """The metrics of one node process, on their own registry (module docstring)."""

    def __init__(self, node_id: str = "") -> None:
        # No `_created` series beside each counter and histogram (half the output, and
        # Prometheus ignores them): process-wide, and a node process has one registry.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r, ns = self.registry, NAMESPACE
        self.emit_latency = Histogram(
            "emit_latency_seconds",
            "Commit to network send latency of emitted events",
            ["bucket"],
            namespace=ns,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ack_lag = Gauge(
            "ack_lag_commit_index",
            "Largest gap in commit indexes between a subscription's stream head and its ack",
            ["bucket"],
            namespace=ns,
            registry=r,
        )
        self.outbox_size = Gauge(
            "notifier_outbox_size_entries",
            "Outboxed rows not yet acknowledged and purged",
            ["bucket"],
            namespace=ns,
            registry=r,
        )
        self.reconnects = Counter(
            "reconnect_status", "Reconnect outcomes", ["status"], namespace=ns, registry=r
        )
        self.commits = Counter(
            "commits",
            "Raft entries this node's replica applied",
            ["bucket"],
            namespace=ns,
            registry=r,
        )
        self.purged = Counter(
            "purged_rows",
            "Outbox rows removed by OUTBOX_PURGE",
            ["bucket"],
            namespace=ns,
            registry=r,
        )
        self.events = Counter(
            "events_sent", "Events handed to client streams", ["bucket"], namespace=ns, registry=r
        )
        self.duplicates = Counter(
            "producer_duplicates",
            "Writes answered as duplicates of a producer sequence already committed",
            ["bucket"],
            namespace=ns,
            registry=r,
        )
        self._add_grpc_and_process(node_id)
        self._buckets: dict[int, _BucketSeries] = {}
        self._lock = threading.Lock()

    def _add_grpc_and_process(self, node_id: str) -> None:
        r, ns = self.registry, NAMESPACE
        self.grpc_handled = Counter(
            "grpc_server_handled",
            "gRPC calls finished, by method and status code",
            ["method", "code"],
            namespace=ns,
            registry=r,
        )
        self.grpc_latency = Histogram(
            "grpc_server_handling_seconds",
            "Time to answer a unary gRPC call, by method",
            ["method"],
            namespace=ns,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.grpc_streams = Gauge(
            "grpc_server_streams_in_flight",
            "Open streams of a streaming gRPC method",
            ["method"],
            namespace=ns,
            registry=r,
        )
        Gauge(
            "node_info", "This node's id and version", ["node", "version"], namespace=ns, registry=r
        ).labels(node_id, sevendb_version()).set(1)
        Gauge(
            "process_threads", "OS threads of the node process", namespace=ns, registry=r
        ).set_function(_threads)
        ProcessCollector(registry=r)
        r.register(GC_COLLECTOR)
        r.register(PLATFORM_COLLECTOR)

    def watch(
        self,
        replicas: ReplicaSource,
        archive: ArchiveWriter | None = None,
        stall_window_ms: int = 60_000,
    ) -> None:
        """Read the node's replicas (and archive) at every scrape."""
        r = self.registry
        r.register(_RaftCollector(replicas))
        r.register(_DiskCollector(replicas))
        r.register(_SubscriptionCollector(replicas, stall_window_ms))
        if archive is not None:
            r.register(_ArchiveCollector(archive, replicas))

    def method(self, name: str, streaming: bool) -> MethodMetrics:
        """The series of gRPC method `name` (see `MethodMetrics`)."""
        return MethodMetrics(self, name, streaming)

    def _bucket(self, bucket: int) -> _BucketSeries:
        series = self._buckets.get(bucket)
        if series is None:
            with self._lock:
                label = str(bucket)
                series = self._buckets.setdefault(
                    bucket,
                    _BucketSeries(
                        self.emit_latency.labels(label),
                        self.events.labels(label),
                        self.commits.labels(label),
                        self.purged.labels(label),
                        self.outbox_size.labels(label),
                        self.ack_lag.labels(label),
                    ),
                )
        return series

    # ---- NotifierMetrics -------------------------------------------------------------

    def events_sent(self, bucket: int, rows: tuple[OutboxRow, ...], now_ms: int) -> None:
        series = self._bucket(bucket)
        observe = series.latency.observe
        for row in rows:
            observe(max(0, now_ms - row.delta.commit_time_ms) / 1000)
        series.events.inc(len(rows))

    def rows_purged(self, bucket: int, count: int) -> None:
        self._bucket(bucket).purged.inc(count)

    def gauges(self, bucket: int, outbox_rows: int, ack_lag: int) -> None:
        series = self._bucket(bucket)
        series.outbox.set(outbox_rows)
        series.ack_lag.set(ack_lag)

    def applied(self, bucket: int) -> None:
        self._bucket(bucket).commits.inc()

    def reconnected(self, status: str) -> None:
        self.reconnects.labels(status).inc()

    def duplicates_answered(self, bucket: int, count: int) -> None:
        self.duplicates.labels(str(bucket)).inc(count)


__all__ = [
    "FAMILIES",
    "LATENCY_BUCKETS_S",
    "NAMESPACE",
    "MethodMetrics",
    "NodeMetrics",
    "ReplicaSource",
    "sevendb_version",
]
