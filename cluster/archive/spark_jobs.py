"""PySpark jobs over the drained-outbox archive (`sevendb.cluster.archive.writer`,
docs/spark.md): `audit`, `stats`, `export` and an incremental `stream`.

Every node archives its own copy of each purged row, so every job reads the union of
all copies and deduplicates explicitly by `(bucket_uuid, sub_id, epoch, commit_index)`:
no event is ever counted twice, and none is missed when one node's copy is absent (a
replica that installed a snapshot never saw the purges inside it).

`local[*]` by default, any master by `--master`. Mounted as `sevendb spark ...`;
`main(argv)` returns the exit code: 0 fine, 1 the audit found problems (or a stream
failed), 2 bad arguments or an unusable archive path.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from sevendb.cluster.archive import format as fmt
from sevendb.cluster.archive.format import (
    EVENT_KEY,
    PARTITION_COLUMNS,
    SEGMENT_NAME_REGEX,
    ConsumerMark,
    consumer_path,
    parse_segment_name,
    spark_ddl,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: The archive as Spark reads it: the segment columns plus the hive partition
#: columns, derived from the one definition in `fmt.ARCHIVE_SCHEMA`. Given explicitly, so
#: partition values are never inferred (a bucket uuid is always a string, an epoch
#: always a bigint).
ARCHIVE_SCHEMA: Final = spark_ddl(fmt.ARCHIVE_SCHEMA)
#: The exported (and streamed) warehouse table: one row per event, deduplicated.
EXPORT_SCHEMA: Final = spark_ddl(fmt.EXPORT_SCHEMA)
EXPORT_COLUMNS: Final = tuple(fmt.EXPORT_SCHEMA.names)
STREAM_LOG_DIR: Final = "_stream_log"
STREAM_LOG_SCHEMA: Final = (
    "run_id STRING, batch_id BIGINT, segment STRING, node_id STRING, "
    "bucket_uuid STRING, epoch BIGINT, rows BIGINT, new_events BIGINT"
)
PERCENTILES: Final = (0.5, 0.9, 0.99)
PERCENTILE_ACCURACY: Final = 10_000
DEFAULT_MASTER: Final = "local[*]"

Echo = Callable[[str], None]


class SparkJobError(Exception):
    """A job cannot run as asked (bad path, no Java, no PySpark); the message says why."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _stdout(line: str) -> None:
    print(line, flush=True)


# ------------------------------------------------------------------------------ session


def submitted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process was started by `spark-submit` (which passes its JVM)."""
    return "PYSPARK_GATEWAY_PORT" in environ


def spark_session(
    master: str | None = None,
    *,
    app_name: str = "sevendb",
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A SparkSession for the jobs. Without `master`: spark-submit's when this process
    was started by `spark-submit` (its `--master` and `--conf` settings win over the
    defaults here), else `local[*]`. Outside spark-submit, Python workers run this
    interpreter (PySpark otherwise starts `python3` from PATH, which may lack
    pyarrow) and a local master stays on loopback; existing `PYSPARK_PYTHON` /
    `SPARK_LOCAL_IP` settings win."""
    try:
        from pyspark import SparkConf
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise SparkJobError(
            f"PySpark is not installed ({exc}); install the extra: pip install 'sevendb[spark]'"
        ) from None
    if not submitted():
        master = master or DEFAULT_MASTER
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if master is not None and master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "8",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.sources.partitionOverwriteMode": "dynamic",
        # the export's timestamps as standard Parquet (not the legacy INT96)
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        # show whole partition filters in explain() output
        "spark.sql.maxMetadataStringLength": "1000",
    }
    if submitted():  # spark-submit's settings (--conf, spark-defaults.conf) win
        given = SparkConf()
        settings = {k: v for k, v in settings.items() if not given.contains(k)}
    settings.update(conf or {})
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        try:
            spark = builder.getOrCreate()
        except Exception as exc:
            if "JAVA_GATEWAY_EXITED" not in str(exc):
                raise
            # Seen once in CI (stop 22): the JVM launcher exited without a word
            # right after a test had used gRPC in the same process. A second start
            # is cheap next to failing the job; a persistent cause fails it again.
            print(f"sevendb: Spark's JVM did not start ({exc}); trying once more", file=sys.stderr)
            spark = builder.getOrCreate()
    except Exception as exc:
        raise SparkJobError(
            f"cannot start Spark (master {master}): {type(exc).__name__}: {exc}. PySpark 4 "
            "needs Java 17 or newer on PATH (or JAVA_HOME)"
        ) from exc
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _jvm_fs(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """Spark's (Hadoop's) filesystem for `path`, and the path as a Hadoop Path."""
    sc: Any = spark.sparkContext
    jpath = sc._jvm.org.apache.hadoop.fs.Path(path)
    return jpath.getFileSystem(sc._jsc.hadoopConfiguration()), jpath


def _jvm_path_exists(spark: SparkSession, path: str) -> bool:
    fs, jpath = _jvm_fs(spark, path)
    return bool(fs.exists(jpath))


def _spark_path(path: str | Path) -> str:
    """A URL (scheme://...) unchanged; a local path made absolute. A `file:` URI is
    given to Spark unescaped (`file:///a b`, not `file:///a%20b`): Hadoop's paths do
    not decode percent-escapes, pyarrow's `from_uri` does, and both must name one
    directory."""
    text = str(path)
    local = _local(text)
    if text.startswith("file:") and local is not None:
        return "file://" + str(local)
    if "://" in text:
        return text
    return str(Path(text).expanduser().resolve())


def _local(path: str) -> Path | None:
    """The local path a `file:` URI (percent-escapes decoded) or a plain path names;
    None for any other URL."""
    if path.startswith("file:"):
        return Path(urllib.parse.unquote(urllib.parse.urlparse(path).path))
    return None if "://" in path else Path(path)


def _check_root(spark: SparkSession, root: str) -> None:
    local = _local(root)
    if local is not None:
        if not local.exists():
            raise SparkJobError(f"archive root {root} does not exist")
        if not local.is_dir():
            raise SparkJobError(f"archive root {root} is not a directory")
    elif not _jvm_path_exists(spark, root):
        raise SparkJobError(f"archive root {root} does not exist")


def _check_out(root: str, out: str, what: str) -> None:
    a, b = _local(root), _local(out)
    if a is not None and b is not None:
        a, b = a.resolve(), b.resolve()
        if a == b or a in b.parents or b in a.parents:
            raise SparkJobError(f"{what} {out} must not overlap the archive root {root}")


# ----------------------------------------------------------------------------- progress


@contextlib.contextmanager
def progress(
    spark: SparkSession, label: str, echo: Echo = _stderr, interval_s: float = 5.0
) -> Iterator[None]:
    """Print `label: ...` progress lines (running stages and their tasks) every
    `interval_s` while the body runs, and a final line with the elapsed time."""
    tracker = spark.sparkContext.statusTracker()
    stop = threading.Event()
    start = time.monotonic()

    def report() -> None:
        last = ""
        while not stop.wait(interval_s):
            stages = []
            for stage_id in sorted(tracker.getActiveStageIds()):
                info = tracker.getStageInfo(stage_id)
                if info is not None:
                    stages.append(f"stage {stage_id} {info.numCompletedTasks}/{info.numTasks}")
            line = ", ".join(stages) or "planning"
            if line != last:
                echo(f"{label}: {time.monotonic() - start:.0f}s, {line} tasks done")
                last = line

    thread = threading.Thread(target=report, name=f"progress-{label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        echo(f"{label}: finished in {time.monotonic() - start:.1f}s")


# -------------------------------------------------------------------------------- reads


def load_archive(
    spark: SparkSession,
    root: str | Path,
    *,
    bucket: str | None = None,
    epoch: int | None = None,
) -> DataFrame:
    """Every archived copy under `root` (not deduplicated), pruned to one bucket and/or
    epoch by partition filters (the directories of other partitions are never read)."""
    from pyspark.sql import functions as F

    path = _spark_path(root)
    _check_root(spark, path)
    df = spark.read.schema(ARCHIVE_SCHEMA).parquet(path)
    if bucket is not None:
        df = df.where(F.col("bucket_uuid") == F.lit(bucket))
    if epoch is not None:
        df = df.where(F.col("epoch") == F.lit(epoch))
    return df


def deduplicated(df: DataFrame) -> DataFrame:
    """One row per event: the nodes' copies are identical but for `node_id`."""
    return df.drop("node_id").dropDuplicates(list(EVENT_KEY))


def physical_plan(df: DataFrame) -> str:
    """The physical plan as `DataFrame.explain()` prints it."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        df.explain()
    return buffer.getvalue()


def _export_frame(events: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    times = {name: F.timestamp_millis(src).alias(name) for name, src in fmt.EXPORT_TIMES.items()}
    return events.select(*[times.get(c, F.col(c)) for c in EXPORT_COLUMNS])


# -------------------------------------------------------------------------------- audit


#: What the audit flags; each is a boolean column of `_chain_checks` (see `audit`).
AUDIT_KINDS: Final = ("duplicate", "conflict", "gap", "out_of_order", "uncommitted", "incomplete")


@dataclass(frozen=True, slots=True)
class AuditIssue:
    kinds: tuple[str, ...]  # of AUDIT_KINDS
    bucket_uuid: str
    sub_id: str
    epoch: int
    commit_index: int
    detail: str


@dataclass(frozen=True, slots=True)
class AuditReport:
    rows: int  # archived rows, every node's copy
    events: int  # distinct events
    subscriptions: int
    nodes: int
    duplicates: int  # events a node archived more than once
    conflicts: int  # events whose copies differ
    gaps: int  # events whose predecessor is missing
    out_of_order: int  # chain or purge order contradicted
    examples: tuple[AuditIssue, ...] = ()
    uncommitted: int = 0  # read_committed deliveries of a transaction not committed then
    incomplete: int = 0  # a committed transaction's events short of changes, or split
    transactions: int = 0  # events made at a COMMIT marker

    @property
    def ok(self) -> bool:
        return not (
            self.duplicates
            or self.conflicts
            or self.gaps
            or self.out_of_order
            or self.uncommitted
            or self.incomplete
        )


def _audit_frame(raw: DataFrame) -> DataFrame:
    """One row per event with its copies and the chain checks as boolean columns.

    One shuffle: rows are hashed (content) and slimmed first, partitioned by
    `(bucket_uuid, sub_id)`, and both aggregations and the chain window reuse that
    partitioning. Copies one node holds in several files are not duplicates when one
    of them is in a compacted segment whose range covers the others' (a compaction
    caught between publishing its segment and deleting the sources)."""
    from pyspark.sql import functions as F

    content = F.xxhash64(
        "prev_bucket_uuid",
        "prev_epoch",
        "prev_commit_index",
        "changes",
        "commit_time_ms",
        "ack_time_ms",
        "purge_index",
        *fmt.TXN_COLUMNS,
    )
    prev_struct = F.struct("prev_bucket_uuid", "prev_epoch", "prev_commit_index", "purge_index")
    name = F.col("_metadata.file_name")
    first = F.regexp_extract(name, SEGMENT_NAME_REGEX, 1).try_cast("bigint")
    last = F.regexp_extract(name, SEGMENT_NAME_REGEX, 2).try_cast("bigint")
    compacted = F.regexp_extract(name, SEGMENT_NAME_REGEX, 3) != F.lit("")
    slim = raw.select(
        *EVENT_KEY,
        "node_id",
        content.alias("h"),
        prev_struct.alias("p"),
        F.struct(first.alias("first"), last.alias("last")).alias("file"),
        F.when(compacted, last - first).alias("cover"),
        _txn_struct().alias("t"),
    )
    per_node = (
        slim.repartition("bucket_uuid", "sub_id")
        .groupBy(*EVENT_KEY, "node_id")
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.min("h").alias("h_min"),
            F.max("h").alias("h_max"),
            F.min("p").alias("p"),  # min over a struct: one whole copy, deterministically
            F.size(F.collect_set("file")).alias("files"),
            (F.max("file.last") - F.min("file.first")).alias("span"),
            F.max("cover").alias("cover"),
            F.min("t").alias("t"),
        )
        .withColumn(
            "extra",
            F.when((F.col("files") == F.col("n")) & (F.col("cover") == F.col("span")), 0).otherwise(
                F.col("n") - 1
            ),
        )
    )
    events = per_node.groupBy(*EVENT_KEY).agg(
        F.sum("n").alias("copies"),
        F.count(F.lit(1)).alias("nodes"),
        F.max("extra").alias("extra"),
        F.min("h_min").alias("hash_min"),
        F.max("h_max").alias("hash_max"),
        F.min("p").alias("p"),
        F.min("t").alias("t"),
    )
    return _chain_checks(events)


def _txn_struct() -> Any:
    """An event's transaction columns (format 2; null in format 1) and how many
    changes it carries."""
    from pyspark.sql import functions as F

    return F.struct(
        *fmt.TXN_COLUMNS[:-1],
        F.coalesce(F.col("read_uncommitted"), F.lit(False)).alias("read_uncommitted"),
        F.size("changes").alias("carried"),
    )


def _txn_checks(t: Any, events_of_txn: Any) -> tuple[Any, Any]:
    """The two transaction flags of an event (docs/spark.md): *uncommitted*, a change
    of a transaction delivered to a read_committed subscription before the
    transaction's COMMIT marker (so of a transaction open, or later aborted, then);
    *incomplete*, an event made at a COMMIT marker that does not carry every change of
    the transaction its subscription selected in the bucket, or a subscription that
    received one transaction's changes in a bucket in more than one event."""
    from pyspark.sql import functions as F

    uncommitted = t["txn_id"].isNotNull() & ~t["txn_committed"] & ~t["read_uncommitted"]
    incomplete = F.coalesce(t["txn_committed"], F.lit(False)) & (
        (t["carried"] != t["txn_changes"]) | (events_of_txn > 1)
    )
    return uncommitted, incomplete


def _chain_checks(events: DataFrame) -> DataFrame:
    """The duplicate, conflict, gap, out-of-order, uncommitted and incomplete flags over
    one row per event."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy("bucket_uuid", "sub_id").orderBy("epoch", "commit_index")
    txn = F.col("t")
    one_txn = Window.partitionBy(
        "bucket_uuid", "sub_id", txn["txn_id"], txn["txn_epoch"], txn["txn_number"]
    )
    uncommitted, incomplete = _txn_checks(
        txn, F.count(F.when(txn["txn_committed"], 1)).over(one_txn)
    )
    seq = F.struct(F.col("epoch").alias("e"), F.col("commit_index").alias("c"))
    prev = F.struct(F.col("p.prev_epoch").alias("e"), F.col("p.prev_commit_index").alias("c"))
    return (
        events.withColumn("before", F.lag(seq).over(order))
        .withColumn("purge_before", F.lag("p.purge_index").over(order))
        .select(
            *EVENT_KEY,
            "copies",
            "nodes",
            F.col("p.prev_bucket_uuid").alias("prev_bucket_uuid"),
            F.col("p.prev_epoch").alias("prev_epoch"),
            F.col("p.prev_commit_index").alias("prev_commit_index"),
            F.col("p.purge_index").alias("purge_index"),
            F.col("before.e").alias("before_epoch"),
            F.col("before.c").alias("before_commit_index"),
            "purge_before",
            "t",
            (F.col("extra") > 0).alias("duplicate"),
            (F.col("hash_min") != F.col("hash_max")).alias("conflict"),
            (F.col("before").isNotNull() & (prev > F.col("before"))).alias("gap"),
            (
                (prev >= seq)
                | (F.col("p.prev_bucket_uuid") != F.col("bucket_uuid"))
                | (F.col("before").isNotNull() & (prev < F.col("before")))
                | (
                    F.col("purge_before").isNotNull()
                    & (F.col("p.purge_index") < F.col("purge_before"))
                )
            ).alias("out_of_order"),
            uncommitted.alias("uncommitted"),
            incomplete.alias("incomplete"),
        )
    )


def _issue(row: Any) -> AuditIssue:
    kinds = tuple(k for k in AUDIT_KINDS if row[k])
    at = f"({row.epoch}, {row.commit_index})"
    prev = f"({row.prev_epoch}, {row.prev_commit_index})"
    before = (
        "none" if row.before_epoch is None else f"({row.before_epoch}, {row.before_commit_index})"
    )
    notes = []
    if row.duplicate:
        notes.append(f"{row.copies} copies from {row.nodes} node(s)")
    if row.conflict:
        notes.append("the nodes' copies differ")
    if row.gap:
        notes.append(f"prev_emit_seq {prev} is missing: the previous archived row is {before}")
    if row.out_of_order:
        notes.append(
            f"prev_emit_seq {prev} (bucket {row.prev_bucket_uuid}), previous row {before}, "
            f"purged at entry {row.purge_index} after {row.purge_before}"
        )
    t = row.t
    txn = "" if t is None else f"transaction {t.txn_number} of {t.txn_id!r} (epoch {t.txn_epoch})"
    if row.uncommitted:
        notes.append(f"a change of {txn} delivered to a read_committed subscription uncommitted")
    if row.incomplete:
        notes.append(
            f"{txn}: this event carries {t.carried} of its {t.txn_changes} changes, or the "
            "subscription received the transaction in more than one event"
        )
    return AuditIssue(
        kinds,
        row.bucket_uuid,
        row.sub_id,
        row.epoch,
        row.commit_index,
        f"{at}: " + "; ".join(notes),
    )


def audit(
    spark: SparkSession,
    root: str | Path,
    *,
    bucket: str | None = None,
    epoch: int | None = None,
    examples: int = 20,
    echo: Echo = _stderr,
    progress_s: float = 5.0,
) -> AuditReport:
    """Check every subscription's `prev_emit_seq` chain over the deduplicated archive.

    Per `(bucket_uuid, sub_id)`, events ordered by emit_seq: a *gap* is an event whose
    `prev_emit_seq` is after the previous archived event (its predecessor is missing);
    *out of order* is a `prev_emit_seq` not before the event itself, in another bucket,
    or before the previous archived event (two events claim one predecessor), or an
    event purged by an earlier OUTBOX_PURGE than its predecessor. A *duplicate* is an
    event one node archived more than once (copies from different nodes are expected
    and are not duplicates); a *conflict* is an event whose copies differ. The first
    archived event of a subscription has no checkable predecessor (its stream start is
    not archived), nor has the first event inside an `--epoch` filter.

    Transactions (format-2 segments): *uncommitted* is a read_committed subscription's
    event carrying a transaction's changes made before its COMMIT marker (a change of
    an open or aborted transaction); *incomplete* is an event made at a COMMIT marker
    short of the changes the transaction had for the subscription in the bucket, or a
    transaction a subscription received in more than one event in a bucket.
    """
    from pyspark.sql import functions as F

    echo(f"audit: reading {root}" + _filters(bucket, epoch))
    raw = load_archive(spark, root, bucket=bucket, epoch=epoch)
    checked = _audit_frame(raw)
    flag = F.lit(False)
    for kind in AUDIT_KINDS:
        flag = flag | F.col(kind)
    with progress(spark, "audit", echo, progress_s):
        (summary,) = checked.agg(
            F.coalesce(F.sum("copies"), F.lit(0)).alias("rows"),
            F.count(F.lit(1)).alias("events"),
            # a subscription's first event is the one without a predecessor
            F.count(F.when(F.col("before_epoch").isNull(), 1)).alias("subscriptions"),
            F.count(F.when(F.col("t.txn_committed"), 1)).alias("transactions"),
            *[F.count(F.when(F.col(k), 1)).alias(k) for k in AUDIT_KINDS],
        ).collect()
        nodes = raw.select("node_id").distinct().count()
        found: tuple[AuditIssue, ...] = ()
        if any(summary[k] for k in AUDIT_KINDS):
            rows = (
                checked.where(flag)
                .orderBy("bucket_uuid", "sub_id", "epoch", "commit_index")
                .limit(examples)
                .collect()
            )
            found = tuple(_issue(r) for r in rows)
    return AuditReport(
        rows=int(summary.rows),
        events=int(summary.events),
        subscriptions=int(summary.subscriptions),
        nodes=nodes,
        duplicates=int(summary.duplicate),
        conflicts=int(summary.conflict),
        gaps=int(summary.gap),
        out_of_order=int(summary.out_of_order),
        examples=found,
        uncommitted=int(summary.uncommitted),
        incomplete=int(summary.incomplete),
        transactions=int(summary.transactions),
    )


def _filters(bucket: str | None, epoch: int | None) -> str:
    parts = [f"bucket {bucket}"] if bucket is not None else []
    parts += [f"epoch {epoch}"] if epoch is not None else []
    return f" ({', '.join(parts)})" if parts else ""


def print_audit(report: AuditReport, out: Echo = _stdout) -> None:
    out(
        f"audit: {report.rows} archived rows from {report.nodes} node(s) = "
        f"{report.events} events in {report.subscriptions} subscriptions"
    )
    out(
        f"audit: gaps {report.gaps}, duplicates {report.duplicates}, out of order "
        f"{report.out_of_order}, conflicting copies {report.conflicts}"
    )
    out(
        f"audit: {report.transactions} committed transaction events; uncommitted "
        f"deliveries {report.uncommitted}, incomplete transactions {report.incomplete}"
    )
    for issue in report.examples:
        out(
            f"  {'+'.join(issue.kinds)}: bucket {issue.bucket_uuid} sub {issue.sub_id} "
            f"{issue.detail}"
        )
    out("audit: OK" if report.ok else "audit: FAILED")


# -------------------------------------------------------------------------------- stats


@dataclass(frozen=True, slots=True)
class Latency:
    """Commit to ack, in milliseconds (nearest-rank percentiles)."""

    p50: int
    p90: int
    p99: int
    max: int


@dataclass(frozen=True, slots=True)
class GroupStats:
    bucket_uuid: str | None  # None: all buckets
    epoch: int | None  # None: all epochs of the bucket
    sub_id: str | None  # None: all subscriptions
    deliveries: int  # events delivered and acknowledged
    changes: int
    first_commit_index: int
    last_commit_index: int
    latency: Latency


@dataclass(frozen=True, slots=True)
class StatsReport:
    total: GroupStats | None  # None: an empty archive
    by_bucket_epoch: tuple[GroupStats, ...] = ()
    by_subscription: tuple[GroupStats, ...] = ()  # per bucket, epoch and subscription

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def stats(
    spark: SparkSession,
    root: str | Path,
    *,
    bucket: str | None = None,
    epoch: int | None = None,
    echo: Echo = _stderr,
    progress_s: float = 5.0,
) -> StatsReport:
    """Deliveries (deduplicated events) and commit-to-ack latency per bucket/epoch, per
    subscription and overall, in one pass (a rollup)."""
    from pyspark.sql import functions as F

    echo(f"stats: reading {root}" + _filters(bucket, epoch))
    raw = load_archive(spark, root, bucket=bucket, epoch=epoch)
    events = raw.select(
        *EVENT_KEY,
        F.size("changes").alias("n_changes"),
        (F.col("ack_time_ms") - F.col("commit_time_ms")).alias("latency"),
    ).dropDuplicates(list(EVENT_KEY))
    latency = F.col("latency")
    rolled = (
        events.rollup("bucket_uuid", "epoch", "sub_id")
        .agg(
            F.count(F.lit(1)).alias("deliveries"),
            F.sum("n_changes").alias("changes"),
            F.min("commit_index").alias("first"),
            F.max("commit_index").alias("last"),
            F.percentile_approx(latency, list(PERCENTILES), PERCENTILE_ACCURACY).alias("pct"),
            F.max(latency).alias("max_latency"),
            F.grouping_id().alias("level"),
        )
        .where(F.col("level").isin(0, 1, 7))  # (b, e, s), (b, e) and the grand total
    )
    with progress(spark, "stats", echo, progress_s):
        rows = rolled.collect()
    total: GroupStats | None = None
    per_bucket: list[GroupStats] = []
    per_sub: list[GroupStats] = []
    for row in rows:
        if row.deliveries == 0:
            continue
        pct = [int(v) for v in row.pct]
        group = GroupStats(
            bucket_uuid=row.bucket_uuid if row.level != 7 else None,
            epoch=row.epoch if row.level != 7 else None,
            sub_id=row.sub_id if row.level == 0 else None,
            deliveries=int(row.deliveries),
            changes=int(row.changes),
            first_commit_index=int(row.first),
            last_commit_index=int(row.last),
            latency=Latency(pct[0], pct[1], pct[2], int(row.max_latency)),
        )
        if row.level == 7:
            total = group
        elif row.level == 1:
            per_bucket.append(group)
        else:
            per_sub.append(group)
    per_bucket.sort(key=lambda g: (g.bucket_uuid or "", g.epoch or 0))
    per_sub.sort(key=lambda g: (g.bucket_uuid or "", g.epoch or 0, g.sub_id or ""))
    return StatsReport(total, tuple(per_bucket), tuple(per_sub))


def print_stats(report: StatsReport, top: int = 20, out: Echo = _stdout) -> None:
    if report.total is None:
        out("stats: the archive holds no events")
        return

    def line(g: GroupStats, name: str) -> str:
        lat = g.latency
        return (
            f"{name:<58} {g.deliveries:>10} {g.changes:>10} "
            f"{lat.p50:>8} {lat.p90:>8} {lat.p99:>8} {lat.max:>8}"
        )

    header = (
        f"{'bucket / epoch / subscription':<58} {'deliveries':>10} {'changes':>10} "
        f"{'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}"
    )
    out(header)
    for g in report.by_bucket_epoch:
        out(line(g, f"{g.bucket_uuid} epoch {g.epoch}"))
    out(line(report.total, "all"))
    if top and report.by_subscription:
        busiest = sorted(report.by_subscription, key=lambda g: -g.deliveries)[:top]
        out(f"top {len(busiest)} of {len(report.by_subscription)} subscriptions:")
        for g in busiest:
            out(line(g, f"{g.sub_id} ({(g.bucket_uuid or '')[:8]} e{g.epoch})"))


# ------------------------------------------------------------------------------- export


@dataclass(frozen=True, slots=True)
class ExportResult:
    out: str
    events: int
    partitions: int


def export(
    spark: SparkSession,
    root: str | Path,
    out: str | Path,
    *,
    bucket: str | None = None,
    epoch: int | None = None,
    echo: Echo = _stderr,
    progress_s: float = 5.0,
) -> ExportResult:
    """Write the deduplicated archive to `out` as a Parquet table partitioned by
    `bucket_uuid` and `epoch`, sorted by subscription and emit_seq within each
    partition. Idempotent: the partitions it covers are replaced (dynamic overwrite)
    by the same rows, so a rerun - or a rerun after a crash mid-export - leaves the
    same table; with `--bucket`/`--epoch` only those partitions are rewritten."""
    from pyspark.sql import functions as F

    path, dest = _spark_path(root), _spark_path(out)
    _check_out(path, dest, "--out")
    echo(f"export: reading {path}" + _filters(bucket, epoch) + f", writing {dest}")
    events = _export_frame(deduplicated(load_archive(spark, path, bucket=bucket, epoch=epoch)))
    with progress(spark, "export", echo, progress_s):
        (
            events.repartition(*PARTITION_COLUMNS)
            .sortWithinPartitions("sub_id", "epoch", "commit_index")
            .write.mode("overwrite")
            .option("partitionOverwriteMode", "dynamic")
            .partitionBy(*PARTITION_COLUMNS)
            .parquet(dest)
        )
        if not _jvm_path_exists(spark, dest):
            return ExportResult(dest, 0, 0)
        written = spark.read.schema(EXPORT_SCHEMA).parquet(dest)
        if bucket is not None:
            written = written.where(F.col("bucket_uuid") == F.lit(bucket))
        if epoch is not None:
            written = written.where(F.col("epoch") == F.lit(epoch))
        (row,) = written.agg(
            F.count(F.lit(1)).alias("events"),
            F.countDistinct(*PARTITION_COLUMNS).alias("partitions"),
        ).collect()
    return ExportResult(dest, int(row.events), int(row.partitions))


# ------------------------------------------------------------------------------- stream


@dataclass(frozen=True, slots=True)
class BatchReport:
    batch_id: int
    segments: tuple[str, ...]
    rows: int
    new_events: int


@dataclass(frozen=True, slots=True)
class StreamResult:
    run_id: str
    batches: tuple[BatchReport, ...] = field(default_factory=tuple)

    @property
    def new_events(self) -> int:
        return sum(b.new_events for b in self.batches)


#: `fault(point, batch_id)` is called at ``batch-started`` (nothing of the batch is
#: written yet) and ``events-written`` (the batch's new events are in the table, its
#: log entry and consumer mark not yet): a crash test raises there.
StreamFault = Callable[[str, int], None]


def default_consumer(checkpoint: str) -> str:
    """The consumer name a stream registers under unless told: one per checkpoint."""
    return "stream-" + hashlib.sha1(checkpoint.encode()).hexdigest()[:12]


def _jvm_read(spark: SparkSession, path: str) -> bytes | None:
    fs, jpath = _jvm_fs(spark, path)
    if not fs.exists(jpath):
        return None
    sc: Any = spark.sparkContext
    stream = fs.open(jpath)
    try:
        data: bytes = sc._jvm.org.apache.commons.io.IOUtils.toByteArray(stream)
        return data
    finally:
        stream.close()


def _jvm_write(spark: SparkSession, path: str, data: bytes) -> None:
    """Write (replace) a small file through Spark's filesystem. Not atomic: a reader
    of a torn mark treats it as holding everything, which is safe."""
    fs, jpath = _jvm_fs(spark, path)
    out = fs.create(jpath, True)
    try:
        out.write(bytearray(data))
    finally:
        out.close()


class _StreamRun:
    """One `stream` run's `foreachBatch` function and what it reports."""

    def __init__(
        self,
        spark: SparkSession,
        root: str,
        dest: str,
        consumer: str | None,
        echo: Echo,
        fault: StreamFault | None,
    ) -> None:
        self.spark, self.dest, self.echo, self.fault = spark, dest, echo, fault
        self.log_path = dest.rstrip("/") + "/" + STREAM_LOG_DIR
        self.run_id = str(uuid.uuid4())
        self.batches: list[BatchReport] = []
        self.mark: ConsumerMark | None = None
        self.mark_path = ""
        if consumer is not None:
            self.mark_path = root.rstrip("/") + "/" + consumer_path(consumer)
            data = _jvm_read(spark, self.mark_path)
            self.mark = (
                ConsumerMark(consumer, 0, {})
                if data is None
                else ConsumerMark.from_bytes(data, self.mark_path)
            )
            self._save_mark()  # registered before the first batch lists a file

    def _save_mark(self) -> None:
        if self.mark is not None:
            self.mark = replace(self.mark, updated_ms=int(time.time() * 1000))
            _jvm_write(self.spark, self.mark_path, self.mark.to_bytes())

    def process(self, batch: DataFrame, batch_id: int) -> None:
        from pyspark.sql import functions as F

        started = time.monotonic()
        if self.fault is not None:
            self.fault("batch-started", batch_id)
        batch.persist()
        try:
            segments = (
                batch.groupBy("segment", "node_id", "bucket_uuid", "epoch")
                .agg(F.count(F.lit(1)).alias("rows"))
                .orderBy("segment")
                .collect()
            )
            new = self._append_new(batch.drop("segment"), segments)
            if self.fault is not None:
                self.fault("events-written", batch_id)
            self._record(batch_id, segments, new)
        finally:
            batch.unpersist()
        rows = sum(int(s.rows) for s in segments)
        self.batches.append(BatchReport(batch_id, tuple(s.segment for s in segments), rows, new))
        self.echo(
            f"stream: batch {batch_id}: {len(segments)} segments, {rows} rows, "
            f"{new} new events ({time.monotonic() - started:.1f}s)"
        )

    def _append_new(self, batch: DataFrame, segments: Sequence[Any]) -> int:
        """Append the batch's events not yet in the table; returns how many."""
        from pyspark.sql import functions as F

        spark, dest = self.spark, self.dest
        events = _export_frame(deduplicated(batch))
        partitions = sorted({(s.bucket_uuid, int(s.epoch)) for s in segments})
        if partitions and _jvm_path_exists(spark, dest):
            existing = spark.read.schema(EXPORT_SCHEMA).parquet(dest)
            wanted = F.lit(False)
            for b, e in partitions:
                wanted = wanted | ((F.col("bucket_uuid") == b) & (F.col("epoch") == e))
            keys = existing.where(wanted).select(*EVENT_KEY)
            events = events.join(keys, list(EVENT_KEY), "left_anti")
        events = events.persist()
        try:
            new = events.count()
            if new:
                (
                    events.repartition(*PARTITION_COLUMNS)
                    .sortWithinPartitions("sub_id", "epoch", "commit_index")
                    .write.mode("append")
                    .partitionBy(*PARTITION_COLUMNS)
                    .parquet(dest)
                )
            return int(new)
        finally:
            events.unpersist()

    def _record(self, batch_id: int, segments: Sequence[Any], new: int) -> None:
        """The batch's `_stream_log` rows, then the consumer mark."""
        log_rows = [
            (
                self.run_id,
                batch_id,
                s.segment,
                s.node_id,
                s.bucket_uuid,
                int(s.epoch),
                int(s.rows),
                new,
            )
            for s in segments
        ]
        if log_rows:
            self.spark.createDataFrame(log_rows, STREAM_LOG_SCHEMA).coalesce(1).write.mode(
                "append"
            ).parquet(self.log_path)
        if self.mark is not None and segments:
            for s in segments:
                name = parse_segment_name(s.segment)
                if name is not None:
                    self.mark = self.mark.advanced(
                        s.node_id, s.bucket_uuid, int(s.epoch), name.last_index
                    )
            self._save_mark()


def stream(
    spark: SparkSession,
    root: str | Path,
    out: str | Path,
    checkpoint: str | Path,
    *,
    available_now: bool = True,
    interval_s: float = 30.0,
    max_files_per_trigger: int = 1000,
    consumer: str | None = "",
    echo: Echo = _stderr,
    fault: StreamFault | None = None,
    until: threading.Event | None = None,
) -> StreamResult:
    """Structured Streaming over new segments: each micro-batch reads the segment files
    published since the last one (the file source's log in `checkpoint` records which
    files each batch read, so a rerun after a crash re-runs the unfinished batch with the
    same files and then continues: no segment skipped or read twice by two batches),
    deduplicates them, drops events already in `out` (the same event from another
    node's segment, a compacted segment, or the unfinished batch's partial write) and
    appends the rest to `out` - the same table `export` writes. `out/_stream_log`
    records which batch read which segment.

    The stream registers as `consumer` (default: one name per checkpoint; None: not
    registered) in `<root>/_consumers/`, and after each batch records there what it
    has consumed: nodes neither compact nor delete a segment it has not consumed. A
    segment a node deleted after a batch listed it (compacted into another, whose rows
    come in a later batch) is skipped, not an error.

    `available_now` processes what is there and returns; otherwise it runs every
    `interval_s` until `until` is set (or Ctrl-C)."""
    if max_files_per_trigger < 1:
        raise SparkJobError(f"--max-files-per-trigger must be >= 1, got {max_files_per_trigger}")
    if interval_s <= 0:
        raise SparkJobError(f"--interval must be > 0 seconds, got {interval_s}")
    path, dest, ckpt = _spark_path(root), _spark_path(out), _spark_path(checkpoint)
    _check_root(spark, path)
    _check_out(path, dest, "--out")
    _check_out(path, ckpt, "--checkpoint")
    name = default_consumer(ckpt) if consumer == "" else consumer
    try:
        run = _StreamRun(spark, path, dest, name, echo, fault)
    except fmt.ArchiveError as exc:
        raise SparkJobError(str(exc)) from None
    echo(f"stream: run {run.run_id[:8]}: {path} -> {dest} (checkpoint {ckpt}, consumer {name})")
    query = _start_query(spark, path, ckpt, run, available_now, interval_s, max_files_per_trigger)
    failure = _await_query(query, available_now, until, echo)
    if failure is not None:
        raise SparkJobError(
            f"stream failed (a rerun with the same --checkpoint resumes): {failure}"
        ) from None
    echo(f"stream: run {run.run_id[:8]} done: {len(run.batches)} batches")
    return StreamResult(run.run_id, tuple(run.batches))


def _start_query(
    spark: SparkSession,
    path: str,
    checkpoint: str,
    run: _StreamRun,
    available_now: bool,
    interval_s: float,
    max_files_per_trigger: int,
) -> Any:
    from pyspark.sql import functions as F

    source = (
        spark.readStream.schema(ARCHIVE_SCHEMA)
        .option("maxFilesPerTrigger", max_files_per_trigger)
        # Segments are judged by the file log, not their age: never skip an old file.
        .option("maxFileAge", "36500d")
        # A listed segment compacted away before its batch ran: its rows are in the
        # compacted segment, which a later batch reads.
        .option("ignoreMissingFiles", "true")
        .parquet(path)
        .select("*", F.col("_metadata.file_path").alias("segment"))
    )
    writer = source.writeStream.foreachBatch(run.process).option("checkpointLocation", checkpoint)
    writer = (
        writer.trigger(availableNow=True)
        if available_now
        else writer.trigger(processingTime=f"{interval_s} seconds")
    )
    return writer.queryName(f"sevendb_archive_{run.run_id[:8]}").start()


def _await_query(
    query: Any, available_now: bool, until: threading.Event | None, echo: Echo
) -> Exception | None:
    """Wait for the query to finish (or `until`, or Ctrl-C); returns its failure."""
    failure: Exception | None = None
    try:
        if available_now:
            query.awaitTermination()
        else:
            while query.isActive and not (until is not None and until.is_set()):
                query.awaitTermination(1)
    except KeyboardInterrupt:
        echo("stream: interrupted; the checkpoint resumes from the unfinished batch")
    except Exception as exc:  # StreamingQueryException: a batch failed
        failure = exc
    finally:
        if query.isActive:
            query.stop()
    if failure is None:
        failure = query.exception()
    return failure


# ---------------------------------------------------------------------------------- CLI


def build_parser(prog: str = "sevendb spark") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="PySpark jobs over the drained-outbox archive (docs/spark.md)"
    )
    jobs = parser.add_subparsers(dest="job", required=True, metavar="JOB")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("path", nargs="?", help="archive root (a directory or a Spark URL)")
        p.add_argument(
            "--master",
            help=f"Spark master (default: spark-submit's, else {DEFAULT_MASTER})",
        )
        p.add_argument(
            "--conf", action="append", default=[], metavar="KEY=VALUE", help="a Spark setting"
        )
        p.add_argument(
            "--progress-s", type=float, default=5.0, help="seconds between progress lines"
        )

    def filters(p: argparse.ArgumentParser) -> None:
        p.add_argument("--bucket", metavar="UUID", help="only this bucket (partition pruning)")
        p.add_argument("--epoch", type=int, metavar="N", help="only this epoch (partition pruning)")
        p.add_argument("--explain", action="store_true", help="print the physical read plan")

    p = jobs.add_parser("audit", help="check every subscription's prev_emit_seq chain")
    common(p)
    filters(p)
    p.add_argument("--examples", type=int, default=20, help="problems to print (default 20)")

    p = jobs.add_parser("stats", help="deliveries and commit-to-ack latency")
    common(p)
    filters(p)
    p.add_argument("--top", type=int, default=20, help="busiest subscriptions to print")
    p.add_argument("--out", metavar="DIR", help="also write DIR/stats.json (local directory)")

    p = jobs.add_parser("export", help="write the deduplicated warehouse table")
    common(p)
    filters(p)
    p.add_argument("--out", metavar="DIR", required=True, help="the table's directory")

    p = jobs.add_parser("stream", help="incrementally append new segments to a table")
    common(p)
    p.add_argument("--out", metavar="DIR", required=True, help="the table's directory")
    p.add_argument("--checkpoint", metavar="DIR", required=True, help="the stream's checkpoint")
    p.add_argument(
        "--available-now",
        action="store_true",
        help="process every segment published so far, then exit",
    )
    p.add_argument("--interval", type=float, default=30.0, help="seconds between micro-batches")
    p.add_argument("--max-files-per-trigger", type=int, default=1000)
    p.add_argument(
        "--consumer",
        metavar="NAME",
        help="register in the archive as NAME (default: stream-<hash of the checkpoint>): "
        "nodes keep every segment this stream has not consumed",
    )
    p.add_argument(
        "--no-hold",
        action="store_true",
        help="do not register: nodes may compact or delete segments before this stream reads them",
    )
    return parser


def _conf(pairs: Sequence[str]) -> dict[str, str]:
    conf = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SparkJobError(f"--conf {pair!r}: expected KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


def main(argv: Sequence[str] | None = None, *, spark: SparkSession | None = None) -> int:
    """`sevendb spark audit|stats|export|stream [PATH] ...`; returns the exit code. A
    given `spark` session is used (and not stopped) instead of starting one."""
    args = build_parser().parse_args(argv)
    if not args.path:
        _stderr(f"sevendb spark {args.job}: no archive path given")
        return 2
    own = spark is None
    try:
        if spark is None:
            _stderr(f"{args.job}: starting Spark ({args.master or 'default master'})")
            session = spark_session(
                args.master, app_name=f"sevendb-{args.job}", conf=_conf(args.conf)
            )
            _stderr(f"{args.job}: Spark {session.version} at {session.sparkContext.master}")
        else:
            session = spark
    except SparkJobError as exc:
        _stderr(f"sevendb spark {args.job}: {exc}")
        return 2
    try:
        return _run(session, args)
    except SparkJobError as exc:
        _stderr(f"sevendb spark {args.job}: {exc}")
        return 1 if args.job == "stream" else 2
    finally:
        if own:
            session.stop()


def _run(spark: SparkSession, args: argparse.Namespace) -> int:
    every = float(args.progress_s)
    if getattr(args, "explain", False):
        plan = physical_plan(load_archive(spark, args.path, bucket=args.bucket, epoch=args.epoch))
        _stdout(plan.rstrip())
    if args.job == "audit":
        report = audit(
            spark,
            args.path,
            bucket=args.bucket,
            epoch=args.epoch,
            examples=args.examples,
            progress_s=every,
        )
        print_audit(report)
        return 0 if report.ok else 1
    if args.job == "stats":
        result = stats(spark, args.path, bucket=args.bucket, epoch=args.epoch, progress_s=every)
        print_stats(result, top=args.top)
        if args.out:
            target = Path(args.out)
            target.mkdir(parents=True, exist_ok=True)
            (target / "stats.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
            _stderr(f"stats: wrote {target / 'stats.json'}")
        return 0
    if args.job == "export":
        done = export(
            spark, args.path, args.out, bucket=args.bucket, epoch=args.epoch, progress_s=every
        )
        _stdout(f"export: {done.events} events in {done.partitions} partitions at {done.out}")
        return 0
    result_stream = stream(
        spark,
        args.path,
        args.out,
        args.checkpoint,
        available_now=args.available_now,
        interval_s=args.interval,
        max_files_per_trigger=args.max_files_per_trigger,
        consumer=None if args.no_hold else (args.consumer or ""),
    )
    _stdout(
        f"stream: {len(result_stream.batches)} batches, "
        f"{sum(len(b.segments) for b in result_stream.batches)} segments, "
        f"{result_stream.new_events} new events"
    )
    return 0


__all__ = [
    "ARCHIVE_SCHEMA",
    "EVENT_KEY",
    "EXPORT_COLUMNS",
    "EXPORT_SCHEMA",
    "AuditIssue",
    "AuditReport",
    "BatchReport",
    "ExportResult",
    "GroupStats",
    "Latency",
    "SparkJobError",
    "StatsReport",
    "StreamResult",
    "audit",
    "build_parser",
    "deduplicated",
    "default_consumer",
    "export",
    "load_archive",
    "main",
    "physical_plan",
    "print_audit",
    "print_stats",
    "progress",
    "spark_session",
    "stats",
    "stream",
]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
