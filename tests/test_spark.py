"""The PySpark jobs (cluster/archive/spark_jobs.py) on archives written by the real archive
writer from real `BucketStateMachine` applies, in one shared local SparkSession:
audit, stats, export, the incremental stream (with retention and compaction under it),
partition pruning, an archive from a real local cluster, and the same jobs on a real
Spark standalone cluster."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
import urllib.parse
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.dataset as pa_ds
import pyarrow.parquet as pq
import pytest
from cluster_harness import LocalCluster, wait_for
from helpers import Driver
from test_archive import Event, event, purge, purged

from sevendb.cluster.archive import format as fmt
from sevendb.cluster.archive.format import (
    FILE_SCHEMA,
    ConsumerMark,
    archive_root,
    partition_dir,
    spark_ddl,
)
from sevendb.cluster.archive.segments import rows_table
from sevendb.cluster.archive.spark_jobs import (
    ARCHIVE_SCHEMA,
    EVENT_KEY,
    EXPORT_SCHEMA,
    STREAM_LOG_DIR,
    GroupStats,
    Latency,
    SparkJobError,
    audit,
    deduplicated,
    export,
    load_archive,
    main,
    physical_plan,
    spark_session,
    stats,
    stream,
)
from sevendb.cluster.archive.writer import ArchiveWriter, read_archive
from sevendb.outbox.keys import bucket_of
from sevendb.outbox.model import Applied, OutboxRow
from sevendb.outbox.state import BucketStateMachine

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# PySpark is the optional `spark` extra: without it these tests are skipped (and say so).
pytest.importorskip("pyspark")

BUCKETS = {
    0: "5a4e0c52-6f0e-4b61-9d3c-0a7e1f2b3c4d",
    1: "c0ffee00-1234-4abc-8def-0123456789ab",
}
NODES = ("n1", "n2", "n3")


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    # tiny data: few shuffle partitions keep every job to a handful of tasks
    session = spark_session(
        "local[2]", app_name="sevendb-tests", conf={"spark.sql.shuffle.partitions": "2"}
    )
    try:
        yield session
    finally:
        session.stop()


# ---- archives from real applies -----------------------------------------------------------


def history(bucket_uuid: str, salt: int) -> tuple[list[Applied], list[Applied]]:
    """One bucket's applied entries in two phases: two subscriptions, SET/DEL changes,
    purges in epoch 1, then an epoch change and purges spanning epochs 1 and 2."""
    d = Driver(BucketStateMachine(bucket_uuid))
    one = [d.lease(), d.subscribe("s1", "prefix:k/"), d.subscribe("s2", "prefix:k/a")]
    for i in range(6):
        one += [d.set(f"k/{i}", f"v{i}".encode()), d.set(f"k/a{i}", b"x" * i)]
        d.tick(salt * i)
    one.append(d.outbox())  # type: ignore[arg-type]
    one.append(purge(d, ("s1", 2)))
    d.tick(40 + salt)
    one.append(purge(d, ("s1", 1), ("s2", 2)))
    two = [d.epoch()]
    for i in range(4):
        two += [d.set(f"k/b{i}"), d.set(f"k/a{i}", b"w")]
        d.tick(salt + 3)
    two.append(d.delete("k/0"))
    two.append(d.outbox())  # type: ignore[arg-type]
    two.append(purge(d, ("s2", -1)))
    d.tick(25)
    two.append(purge(d, ("s1", -1)))
    return one, two


HISTORY = {b: history(uuid, salt=b + 1) for b, uuid in BUCKETS.items()}


ALL_ROWS = [p for b in BUCKETS for phase in HISTORY[b] for p in purged(phase)]
EXPECTED = Counter(event(*p) for p in ALL_ROWS)
PHASE_ONE = Counter(event(*p) for b in BUCKETS for p in purged(HISTORY[b][0]))


class Archive:
    """One writer per node over a shared root, each fed every bucket's entries (as
    every replica of a bucket applies the same log)."""

    def __init__(self, root: Path | str, nodes: tuple[str, ...] = NODES, **settings: Any) -> None:
        self.root = root
        settings.setdefault("retention_age_s", 0)  # the log's times are from 1970
        self.writers = [ArchiveWriter(root, n, background=False, **settings) for n in nodes]

    def phase(self, phase: int) -> None:
        for w in self.writers:
            for bucket in BUCKETS:
                for applied in HISTORY[bucket][phase]:
                    w.on_applied(bucket, applied)
            w.flush()

    def close(self) -> None:
        for w in self.writers:
            w.close()


def build(root: Path, nodes: tuple[str, ...] = NODES, **settings: Any) -> Path:
    """Both phases of every bucket archived by each of `nodes` under `root`."""
    archive = Archive(root, nodes, **settings)
    archive.phase(0)
    archive.phase(1)
    archive.close()
    return root


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("clean") / "archive")


def spark_events(df: DataFrame) -> Counter[Event]:
    return Counter(
        (
            r.bucket_uuid,
            r.epoch,
            r.commit_index,
            r.sub_id,
            r.prev_bucket_uuid,
            r.prev_epoch,
            r.prev_commit_index,
            tuple((c.key, c.op, bytes(c.value), c.version) for c in r.changes),
            r.commit_time_ms,
            r.ack_time_ms,
            r.purge_index,
        )
        for r in df.collect()
    )


def write_segment(root: Path, node: str, rows: list[tuple[int, int, OutboxRow]], name: str) -> None:
    """A hand-made segment (what a buggy writer could have produced)."""
    by_partition: dict[tuple[str, int], list[tuple[int, int, OutboxRow]]] = defaultdict(list)
    for p in rows:
        by_partition[(p[2].emit_seq.bucket_uuid, p[2].emit_seq.epoch_counter)].append(p)
    for (bucket_uuid, epoch), part in by_partition.items():
        directory = partition_dir(root, bucket_uuid, epoch)
        directory.mkdir(parents=True, exist_ok=True)
        pq.write_table(rows_table(part, node), directory / f"{node}-{name}.parquet")


def rows_of(bucket: int, sub: str) -> list[tuple[int, int, OutboxRow]]:
    rows = [p for p in ALL_ROWS if p[2].emit_seq.bucket_uuid == BUCKETS[bucket]]
    return sorted((p for p in rows if p[2].sub_id == sub), key=lambda p: p[2].emit_seq)


# ---- audit ----------------------------------------------------------------------------


@pytest.mark.slow
def test_audit_passes_on_a_clean_archive_with_every_node_s_copy(
    spark: SparkSession, clean: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sum(EXPECTED.values()) == len(ALL_ROWS) > 40
    assert main(["audit", str(clean), "--progress-s", "0.1"], spark=spark) == 0
    out, err = capsys.readouterr()
    events = sum(EXPECTED.values())
    assert f"audit: {3 * events} archived rows from 3 node(s) = {events} events in 4 " in out
    assert "audit: OK" in out
    assert "audit: reading" in err and "audit: finished in" in err
    assert re.search(r"^audit: \d+s, ", err, re.M), "a progress line while the job runs"


@pytest.mark.slow
def test_audit_catches_a_gap_a_duplicate_and_out_of_order_rows(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "crafted"
    s1 = rows_of(0, "s1")
    s2 = rows_of(0, "s2")
    t1 = rows_of(1, "s1")
    t2 = rows_of(1, "s2")
    missing = s1[3]
    late = t1[5]
    reordered = (1, late[1], late[2])  # purged by entry 1, before its predecessor was
    for node in ("n1", "n2"):
        # bucket 0 s1: row 3 lost on every node (a gap); bucket 1 s1: purge order broken
        write_segment(root, node, [p for p in s1 if p is not missing] + s2 + t2, "a")
        write_segment(root, node, [p for p in t1 if p is not late] + [reordered], "b")
    write_segment(root, "n1", [s2[4]], "again")  # n1 archived one s2 row twice
    report = audit(spark, root)
    assert (report.gaps, report.duplicates, report.out_of_order, report.conflicts) == (1, 1, 1, 0)
    assert report.nodes == 2
    assert report.events == len(ALL_ROWS) - 1  # the duplicate counted once
    found = {(i.kinds, i.bucket_uuid, i.sub_id, i.commit_index) for i in report.examples}
    assert found == {
        (("gap",), BUCKETS[0], "s1", s1[4][2].emit_seq.commit_index),
        (("duplicate",), BUCKETS[0], "s2", s2[4][2].emit_seq.commit_index),
        (("out_of_order",), BUCKETS[1], "s1", late[2].emit_seq.commit_index),
    }
    assert main(["audit", str(root)], spark=spark) == 1
    out = capsys.readouterr().out
    assert "audit: FAILED" in out and "gap: bucket" in out and "is missing" in out


# ---- stats ----------------------------------------------------------------------------


def nearest_rank(values: list[int], p: float) -> int:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def expected_group(rows: list[tuple[int, int, OutboxRow]], **names: Any) -> GroupStats:
    latencies = [ack - row.delta.commit_time_ms for _, ack, row in rows]
    return GroupStats(
        deliveries=len(rows),
        changes=sum(len(row.delta.changes) for _, _, row in rows),
        first_commit_index=min(row.emit_seq.commit_index for _, _, row in rows),
        last_commit_index=max(row.emit_seq.commit_index for _, _, row in rows),
        latency=Latency(
            nearest_rank(latencies, 0.5),
            nearest_rank(latencies, 0.9),
            nearest_rank(latencies, 0.99),
            max(latencies),
        ),
        **names,
    )


@pytest.mark.slow
def test_stats_figures_are_right(spark: SparkSession, clean: Path) -> None:
    report = stats(spark, clean)
    assert report.total == expected_group(ALL_ROWS, bucket_uuid=None, epoch=None, sub_id=None)
    groups: dict[tuple[str, int], list[tuple[int, int, OutboxRow]]] = defaultdict(list)
    subs: dict[tuple[str, int, str], list[tuple[int, int, OutboxRow]]] = defaultdict(list)
    for p in ALL_ROWS:
        seq = p[2].emit_seq
        groups[(seq.bucket_uuid, seq.epoch_counter)].append(p)
        subs[(seq.bucket_uuid, seq.epoch_counter, p[2].sub_id)].append(p)
    assert report.by_bucket_epoch == tuple(
        expected_group(rows, bucket_uuid=b, epoch=e, sub_id=None)
        for (b, e), rows in sorted(groups.items())
    )
    assert report.by_subscription == tuple(
        expected_group(rows, bucket_uuid=b, epoch=e, sub_id=s)
        for (b, e, s), rows in sorted(subs.items())
    )
    assert len(report.by_subscription) == 8
    # the latencies are not all alike, so the percentiles are really checked
    assert len({g.latency for g in report.by_subscription}) > 4


# ---- export ---------------------------------------------------------------------------


def table_files(out: Path) -> dict[str, list[str]]:
    return {
        str(d.relative_to(out)): sorted(f.name for f in d.glob("*.parquet"))
        for d in sorted(out.glob("bucket_uuid=*/epoch=*"))
    }


@pytest.mark.slow
def test_export_is_deduplicated_and_idempotent(
    spark: SparkSession, clean: Path, tmp_path: Path
) -> None:
    out = tmp_path / "table"
    first = export(spark, clean, out)
    table = spark.read.schema(EXPORT_SCHEMA).parquet(str(out))
    assert spark_events(table) == EXPECTED and first.events == sum(EXPECTED.values())
    assert first.partitions == 4 and len(table_files(out)) == 4
    assert "node_id" not in spark.read.parquet(str(out)).columns
    # what Spark wrote, read back with pyarrow, has the one defined export schema
    written = pa_ds.dataset(
        str(out),
        format="parquet",
        partitioning=pa_ds.partitioning(fmt.PARTITION_SCHEMA, flavor="hive"),
        ignore_prefixes=["_", "."],
    )
    assert spark_ddl(written.schema) == spark_ddl(fmt.EXPORT_SCHEMA)

    again = export(spark, clean, out)  # a rerun changes nothing
    assert again == first
    assert spark_events(spark.read.schema(EXPORT_SCHEMA).parquet(str(out))) == EXPECTED
    files = table_files(out)

    only = export(spark, clean, out, bucket=BUCKETS[1])  # only bucket 1 is rewritten
    assert only.partitions == 2
    assert only.events == sum(n for e, n in EXPECTED.items() if e[0] == BUCKETS[1])
    after = table_files(out)
    assert after.keys() == files.keys()
    for partition, names in after.items():
        assert (names == files[partition]) == (BUCKETS[0] in partition), partition


# ---- stream ---------------------------------------------------------------------------


def local_path(uri: str) -> Path:
    return Path(urllib.parse.unquote(urllib.parse.urlparse(uri).path))


def segment_files(root: Path) -> set[Path]:
    return {p for p in root.glob("bucket_uuid=*/epoch=*/*.parquet")}


@pytest.mark.slow
def test_stream_resumes_from_its_checkpoint_without_skipping_or_repeating_a_segment(
    spark: SparkSession, tmp_path: Path
) -> None:
    root, out, checkpoint = tmp_path / "archive", tmp_path / "table", tmp_path / "checkpoint"
    archive = Archive(root, ("n1", "n2"))
    archive.phase(0)
    first_files = segment_files(root)

    run1 = stream(spark, root, out, checkpoint)
    assert [b.batch_id for b in run1.batches] == [0]
    assert {local_path(s) for s in run1.batches[0].segments} == first_files
    assert run1.new_events == sum(PHASE_ONE.values())  # two nodes' copies, once each

    archive.phase(1)  # more segments published
    archive.close()
    second_files = segment_files(root) - first_files
    assert second_files

    crashed: list[int] = []

    def crash(point: str, batch_id: int) -> None:
        if point != "events-written":
            return
        crashed.append(batch_id)
        raise RuntimeError("simulated crash after the batch's events were written")

    with pytest.raises(SparkJobError, match="simulated crash"):
        stream(spark, root, out, checkpoint, fault=crash)
    assert crashed == [1]

    run3 = stream(spark, root, out, checkpoint)
    # the unfinished batch is re-run with exactly its files; nothing else is read again
    assert [b.batch_id for b in run3.batches] == [1]
    assert {local_path(s) for s in run3.batches[0].segments} == second_files
    assert run3.new_events == 0  # its events were already in the table

    run4 = stream(spark, root, out, checkpoint)
    assert run4.batches == ()

    table = spark.read.schema(EXPORT_SCHEMA).parquet(str(out))
    assert spark_events(table) == EXPECTED
    assert table.groupBy(*EVENT_KEY).count().where("count > 1").count() == 0
    log = spark.read.parquet(str(out / STREAM_LOG_DIR)).collect()
    batches_of: dict[Path, set[int]] = defaultdict(set)
    for row in log:
        batches_of[local_path(row.segment)].add(row.batch_id)
    assert set(batches_of) == first_files | second_files
    assert all(len(ids) == 1 for ids in batches_of.values()), "a segment in two batches"


def consumer_marks(root: Path) -> list[ConsumerMark]:
    return [
        ConsumerMark.from_bytes(p.read_bytes(), str(p))
        for p in sorted((root / "_consumers").glob("*.json"))
    ]


@pytest.mark.slow
def test_a_registered_stream_holds_retention_and_compaction(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Retention and compaction take only what the stream has consumed; what it has
    not read waits for it, so the table ends complete."""
    root, out, checkpoint = tmp_path / "archive", tmp_path / "table", tmp_path / "checkpoint"
    archive = Archive(root, ("n1", "n2"), segment_rows_max=1, compact_min_files=2)
    archive.phase(0)
    first_files = segment_files(root)
    stream(spark, root, out, checkpoint)
    (mark,) = consumer_marks(root)
    assert mark.name.startswith("stream-")
    assert all(
        mark.covers(s.node_id, s.bucket_uuid, s.epoch, s.last_index)
        for w in archive.writers
        for s in w.segments()
    )
    archive.phase(1)
    second_files = segment_files(root) - first_files
    for w in archive.writers:
        w.settings = w.settings.replace(retention_age_s=1.0)  # the log's times are from 1970
        report = w.maintain()
        assert report.written > 0  # the consumed segments were merged, then deleted
        assert report.held == len([p for p in second_files if p.name.startswith(w.node_id + "-")])
    assert segment_files(root) == second_files  # only what the stream has not read
    run = stream(spark, root, out, checkpoint)
    assert {local_path(s) for b in run.batches for s in b.segments} == second_files
    table = spark.read.schema(EXPORT_SCHEMA).parquet(str(out))
    assert spark_events(table) == EXPECTED
    for w in archive.writers:  # consumed now: all of it goes
        assert w.maintain().held == 0
    archive.close()
    assert segment_files(root) == set()


@pytest.mark.slow
def test_a_stream_resumes_past_segments_compacted_under_it(
    spark: SparkSession, tmp_path: Path
) -> None:
    """An unregistered stream crashes in a batch; meanwhile the node compacts the
    segments that batch had listed. The rerun skips the vanished files and reads their
    rows from the compacted segments: nothing missing, nothing twice."""
    root, out, checkpoint = tmp_path / "archive", tmp_path / "table", tmp_path / "checkpoint"
    archive = Archive(root, ("n1",), segment_rows_max=1, compact_min_files=2)
    archive.phase(0)
    archive.phase(1)
    listed = segment_files(root)

    def crash(point: str, batch_id: int) -> None:
        if point == "batch-started":
            raise RuntimeError("simulated crash before the batch wrote anything")

    with pytest.raises(SparkJobError, match="simulated crash"):
        stream(spark, root, out, checkpoint, consumer=None, fault=crash)
    assert not (root / "_consumers").exists()
    (w,) = archive.writers
    assert w.maintain().written == 4  # two buckets x two epochs
    archive.close()
    assert segment_files(root).isdisjoint(listed)
    run = stream(spark, root, out, checkpoint, consumer=None)
    assert [b.batch_id for b in run.batches] == [0, 1]
    assert run.batches[0].rows == 0  # its files are gone
    assert all(local_path(s).name.endswith(".c.parquet") for s in run.batches[1].segments)
    table = spark.read.schema(EXPORT_SCHEMA).parquet(str(out))
    assert spark_events(table) == EXPECTED
    assert table.groupBy(*EVENT_KEY).count().where("count > 1").count() == 0


@pytest.mark.slow
def test_the_jobs_on_an_archive_caught_mid_compaction(
    spark: SparkSession, clean: Path, tmp_path: Path
) -> None:
    """A node crashed after publishing a compacted segment and before deleting its
    sources: both are visible. Nothing is counted twice, and the audit does not call
    the overlap a duplicate."""

    class Crash(BaseException):
        pass

    def fault(point: str) -> None:
        if point == "compacted-published":
            raise Crash

    root = (tmp_path / "archive").as_uri()  # a file:// root, for both sides
    archive = Archive(root, NODES, segment_rows_max=1, compact_min_files=2)
    archive.phase(0)
    archive.phase(1)
    n1 = archive.writers[0]
    n1._fault = fault
    with pytest.raises(Crash):
        n1.maintain()
    n1._release.close()  # the crashed process's lock goes with it
    for w in archive.writers[1:]:
        w.close()
    local = tmp_path / "archive"
    compacted = [p for p in segment_files(local) if p.name.endswith(".c.parquet")]
    assert len(compacted) == 1
    assert sum(archived_rows(local).values()) > 3 * len(ALL_ROWS)  # the overlap is there
    report = audit(spark, root)
    assert report.ok, report.examples
    assert report.events == len(ALL_ROWS) and report.duplicates == 0
    assert stats(spark, root) == stats(spark, clean)
    assert export(spark, root, tmp_path / "table").events == len(ALL_ROWS)
    assert (
        spark_events(spark.read.schema(EXPORT_SCHEMA).parquet(str(tmp_path / "table"))) == EXPECTED
    )
    # ...but the same rows once more in a plain segment (a writer that archived them
    # twice) are a duplicate: only a compacted segment's cover excuses an overlap
    (merged,) = compacted
    twice = merged.with_name(merged.name.replace(".c.parquet", ".parquet"))
    twice.write_bytes(merged.read_bytes())
    assert audit(spark, root).duplicates == pq.read_metadata(twice).num_rows > 0


def archived_rows(root: Path) -> Counter[Event]:
    return Counter(
        (r["bucket_uuid"], r["epoch"], r["commit_index"], r["sub_id"], r["node_id"])
        for r in read_archive(root).to_pylist()
    )


# ---- partition pruning ------------------------------------------------------------------


@pytest.mark.slow
def test_partition_pruning_by_bucket_and_epoch(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = build(tmp_path / "archive", ("n1",))
    df = load_archive(spark, root, bucket=BUCKETS[0], epoch=2)
    plan = physical_plan(df)
    (filters,) = re.findall(r"PartitionFilters: \[([^\]]*)\]", plan)
    assert re.search(rf"\(bucket_uuid#\d+ = {BUCKETS[0]}\)", filters), plan
    assert re.search(r"\(epoch#\d+L = 2\)", filters), plan
    # A damaged file in another partition is never opened by the pruned read...
    damaged = partition_dir(root, BUCKETS[1], 1) / "n1-damaged.parquet"
    damaged.write_bytes(b"not parquet at all")
    wanted = Counter(e for e in EXPECTED if e[0] == BUCKETS[0] and e[1] == 2)
    assert spark_events(df) == wanted
    argv = ["audit", str(root), "--bucket", BUCKETS[0], "--epoch", "2", "--explain"]
    assert main(argv, spark=spark) == 0
    out = capsys.readouterr().out
    assert "PartitionFilters: [" in out
    assert f"= {sum(wanted.values())} events in 2 subscriptions" in out
    # ...but breaks a full read
    with pytest.raises(Exception, match=r"(?i)parquet|footer|corrupt"):
        load_archive(spark, root).count()


@pytest.mark.slow
def test_the_spark_schema_matches_the_segment_files(spark: SparkSession, clean: Path) -> None:
    inferred = spark.read.parquet(str(clean)).schema
    declared = load_archive(spark, clean).schema
    names = FILE_SCHEMA.names
    assert [(f.name, f.dataType.simpleString()) for f in inferred.fields if f.name in names] == [
        (f.name, f.dataType.simpleString()) for f in declared.fields if f.name in names
    ]
    assert (
        declared.simpleString() == spark.createDataFrame([], ARCHIVE_SCHEMA).schema.simpleString()
    )


@pytest.mark.slow
def test_an_empty_archive(spark: SparkSession, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    ArchiveWriter(root, "n1", background=False).close()  # only _manifests/ exists
    report = audit(spark, root)
    assert report.ok and (report.rows, report.events, report.nodes) == (0, 0, 0)
    assert stats(spark, root).total is None
    assert export(spark, root, tmp_path / "table").events == 0


# ---- arguments ----------------------------------------------------------------------------


def test_bad_arguments_are_reported_before_spark_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit"]) == 2
    assert "no archive path given" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["export", str(tmp_path)])  # --out is required
    assert exc.value.code == 2


@pytest.mark.slow
def test_bad_paths_are_reported(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", str(tmp_path / "nowhere")], spark=spark) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "archive").mkdir()
    assert (
        main(
            ["export", str(tmp_path / "archive"), "--out", str(tmp_path / "archive" / "x")],
            spark=spark,
        )
        == 2
    )
    assert "must not overlap the archive root" in capsys.readouterr().err


# ---- a real cluster ----------------------------------------------------------------------


@pytest.mark.slow
def test_audit_passes_on_an_archive_from_a_real_cluster(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nodes started by `cluster_up` archive purged rows under the root
    `SEVENDB_ARCHIVE_ROOT` names (a `file://` URI here: a shared mount); every node
    replicates both buckets, so each row is archived three times and counted once. A
    committed transaction across both buckets is archived as one event per bucket,
    recorded as such; an aborted one is not archived."""
    monkeypatch.setenv("SEVENDB_ARCHIVE_SEGMENT_AGE_S_MAX", "0.2")
    root = tmp_path / "shared mount" / "archive"
    monkeypatch.setenv("SEVENDB_ARCHIVE_ROOT", root.as_uri())
    cluster = LocalCluster.start(tmp_path / "data", nodes=3, buckets=2)
    keys = [f"orders/{i:03d}" for i in range(40)]
    try:
        with cluster.client() as client, client.subscribe("prefix:orders/") as sub:
            producer = client.producer()
            for key in keys:
                producer.put(key, key.encode())
            tkeys = [f"orders/t{i}" for i in range(4)]
            with client.transaction("archived-app") as txn:
                for key in tkeys:
                    txn.put(key, b"t")
            doomed = client.transaction("archived-app")
            doomed.put("orders/aborted", b"x")
            doomed.abort()
            keys = [*keys, *tkeys]
            seen: set[str] = set()

            def delivered() -> bool:
                event = sub.poll(0.2)
                if event is not None:
                    seen.update(c.key for c in event.changes)
                return seen >= set(keys)

            wait_for(delivered, 60, "every write delivered", interval_s=0)
        # closing the subscription acked everything: purged rows reach every node's archive
        assert not archive_root(cluster.data_dir).exists()

        def archived_everywhere() -> bool:
            if not root.is_dir():
                return False
            table = read_archive(root)
            per_node: dict[str, set[str]] = defaultdict(set)
            for node, changes in zip(
                table.column("node_id").to_pylist(),
                table.column("changes").to_pylist(),
                strict=True,
            ):
                per_node[node].update(c["key"] for c in changes)
            return all(per_node[n.node_id] >= set(keys) for n in cluster.spec.nodes)

        wait_for(archived_everywhere, 60, "every node to archive every purged row")
    finally:
        cluster.stop()
    report = audit(spark, root.as_uri())
    assert report.ok, report.examples
    events = len(keys) - len(tkeys) + 2  # the transaction: one event in each bucket
    assert report.events == events and report.nodes == 3 and report.rows == 3 * events
    assert report.transactions == 2
    table = read_archive(root)
    archived = {c["key"] for changes in table.column("changes").to_pylist() for c in changes}
    assert "orders/aborted" not in archived and set(tkeys) <= archived
    assert {bucket_of(k, 2) for k in tkeys} == {0, 1}


# ---- a real Spark cluster ------------------------------------------------------------------

CLUSTER_DRIVER = """
import sys, time
from sevendb.cluster.archive.spark_jobs import main, spark_session

master, jobs = sys.argv[1], [line.split("\\t") for line in sys.argv[2].splitlines()]
conf = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.memory": "512m",
    "spark.executor.memory": "512m",
    "spark.executor.cores": "1",
    "spark.cores.max": "2",
    "spark.sql.shuffle.partitions": "2",
}
spark = spark_session(master, app_name="sevendb-standalone-test", conf=conf)
sc = spark.sparkContext
deadline = time.monotonic() + 180
while sc._jsc.sc().getExecutorMemoryStatus().size() < 3:  # the driver and two executors
    if time.monotonic() > deadline:
        raise SystemExit("the executors did not register")
    time.sleep(0.2)
print("MASTER", sc.master, flush=True)
for argv in jobs:  # one session for every job, each as the CLI runs it
    print("== " + argv[0], flush=True)
    print("EXIT", main([*argv, "--master", master], spark=spark), flush=True)
spark.stop()
"""


def cluster_jobs(root: str, work: Path) -> list[list[str]]:
    quiet = ["--progress-s", "600"]
    return [
        ["audit", root, *quiet],
        ["stats", root, "--out", str(work / "stats"), *quiet],
        ["export", root, "--out", str(work / "export"), *quiet],
        [
            "stream",
            root,
            "--out",
            str(work / "stream"),
            "--checkpoint",
            str(work / "checkpoint"),
            "--available-now",
            *quiet,
        ],
    ]


def job_outputs(stdout: str, work: Path) -> dict[str, str]:
    """Each job's stdout, with its work directory written as WORK."""
    outputs: dict[str, str] = {}
    job = ""
    for line in stdout.replace(str(work), "WORK").splitlines():
        if line.startswith("== "):
            job = line[3:]
            outputs[job] = ""
        elif job:
            outputs[job] += line + "\n"
    return outputs


@pytest.mark.slow
def test_the_jobs_on_a_standalone_spark_cluster_give_the_local_results(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A master and two workers from the installed pyspark (`spark-class`), the four
    jobs in one driver session against `spark://...` over a `file://` archive root,
    and the same jobs in local mode: the same output, tables and figures."""
    from spark_standalone import SPARK_HOME, StandaloneCluster, spark_env

    from sevendb.cluster.archive import spark_jobs as spark_jobs_module

    root = build(tmp_path / "archive").as_uri()
    remote, local = tmp_path / "remote", tmp_path / "local"
    remote.mkdir()
    started = time.monotonic()
    cluster = StandaloneCluster.start(tmp_path / "spark")
    try:
        up = time.monotonic() - started
        jobs = cluster_jobs(root, remote)
        driver = subprocess.run(
            [
                sys.executable,
                "-c",
                CLUSTER_DRIVER,
                cluster.url,
                "\n".join("\t".join(j) for j in jobs),
            ],
            env=spark_env(tmp_path / "spark"),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert driver.returncode == 0, driver.stderr[-4000:]
        # the same jobs file as docs/spark.md submits it: master and settings from spark-submit
        submit = subprocess.run(
            [
                str(SPARK_HOME / "bin" / "spark-submit"),
                *("--master", cluster.url, "--driver-memory", "512m"),
                *("--conf", "spark.executor.memory=512m", "--conf", "spark.cores.max=2"),
                *("--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.ui.enabled=false"),
                str(Path(spark_jobs_module.__file__)),
                *cluster_jobs(root, remote)[0],
            ],
            env=spark_env(tmp_path / "spark"),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert submit.returncode == 0, submit.stderr[-4000:]
        ran = cluster.executor_logs()
    finally:
        cluster.stop()
    print(f"standalone cluster up in {up:.1f}s, whole test {time.monotonic() - started:.1f}s")
    assert f"MASTER {cluster.url}" in driver.stdout
    assert len(ran) == 2 and all("Running task" in log for log in ran.values()), ran.keys()
    on_cluster = job_outputs(driver.stdout, remote)

    capsys.readouterr()
    lines = []
    for argv in cluster_jobs(root, local):
        lines.append(f"== {argv[0]}")
        code = main(argv, spark=spark)
        lines += capsys.readouterr().out.splitlines()
        lines.append(f"EXIT {code}")
    # spark-submit merges the driver's stderr into its stdout
    assert f"audit: Spark {spark.version} at {cluster.url}" in submit.stdout + submit.stderr
    expected = on_cluster["audit"].splitlines()[:-1]  # all but its EXIT line
    assert [line for line in submit.stdout.splitlines() if line in expected] == expected
    assert on_cluster == job_outputs("\n".join(lines), local)
    assert [o.splitlines()[-1] for o in on_cluster.values()] == ["EXIT 0"] * 4
    assert "audit: OK" in on_cluster["audit"]
    assert (remote / "stats" / "stats.json").read_text() == (
        local / "stats" / "stats.json"
    ).read_text()
    for table in ("export", "stream"):
        got = spark_events(spark.read.schema(EXPORT_SCHEMA).parquet(str(remote / table)))
        assert got == EXPECTED, table


# ---- transactions (archive format 2) --------------------------------------------------

TXN_BUCKETS = {
    0: "7f3b1e2a-0c4d-4e5f-8a9b-1c2d3e4f5a6b",
    1: "0d1e2f3a-4b5c-4d6e-9f70-8192a3b4c5d6",
}


def txn_history(bucket_uuid: str, keys: tuple[str, ...]) -> list[Applied]:
    """One participant bucket of two transactions of "tx": number 1 writes `keys` in two
    writes and commits, number 2 writes `o/aborted` and aborts. Subscriptions: "rc"
    (read_committed, every key), "ra" (read_committed, only `o/a...`), "ru"
    (read_uncommitted); then every row is acknowledged."""
    from sevendb.outbox.entries import (
        Isolation,
        Op,
        OpKind,
        Subscribe,
        Txn,
        TxnAction,
        TxnOutcome,
        TxnWrite,
    )
    from sevendb.outbox.query import Query, plan_query

    d = Driver(BucketStateMachine(bucket_uuid))
    log = [d.lease()]
    for sub_id, query, isolation in (
        ("rc", "prefix:o/", Isolation.READ_COMMITTED),
        ("ra", "prefix:o/a", Isolation.READ_COMMITTED),
        ("ru", "prefix:o/", Isolation.READ_UNCOMMITTED),
    ):
        q = Query.parse(query)
        log.append(
            d.apply(
                Subscribe(
                    sub_id, "alice", q, plan_query(q).plan_hash, d.tick(), "", isolation=isolation
                )
            )
        )

    def step(action: TxnAction, number: int, outcome: TxnOutcome = TxnOutcome.NONE) -> None:
        log.append(
            d.apply(
                Txn(
                    action, "tx", number=number, outcome=outcome, principal="alice", now_ms=d.tick()
                )
            )
        )

    def write(number: int, seq: int, *names: str) -> None:
        ops = tuple(Op(OpKind.SET, k, k.encode()) for k in names)
        log.append(d.apply(TxnWrite("tx", 0, number, ops, "alice", d.tick(), seq)))

    log.append(d.set("o/plain"))
    step(TxnAction.JOIN, 1)
    write(1, 1, *keys[:1])
    write(1, 2, *keys[1:])
    step(TxnAction.MARK, 1, TxnOutcome.COMMIT)
    step(TxnAction.JOIN, 2)
    write(2, 1, "o/aborted")
    step(TxnAction.MARK, 2, TxnOutcome.ABORT)
    log.append(d.set("o/after"))
    log.append(d.outbox())  # type: ignore[arg-type]
    log.append(purge(d, ("rc", -1), ("ra", -1), ("ru", -1)))
    return log


TXN_HISTORY = {
    0: txn_history(TXN_BUCKETS[0], ("o/a1", "o/b1", "o/a2")),
    1: txn_history(TXN_BUCKETS[1], ("o/a3", "o/b3")),
}


def build_txn_archive(root: Path) -> Path:
    writers = [ArchiveWriter(root, n, background=False, retention_age_s=0) for n in NODES[:2]]
    for w in writers:
        for bucket, log in TXN_HISTORY.items():
            for applied in log:
                w.on_applied(bucket, applied)
        w.close()
    return root


def rewrite_segments(root: Path, change: Any) -> None:
    """Corrupt every segment file under `root` in place: `change(table) -> table`."""
    for path in root.rglob("*.parquet"):
        if any(part.startswith(("_", ".")) for part in path.relative_to(root).parts):
            continue
        table = pq.read_table(path, partitioning=None)
        pq.write_table(change(table).replace_schema_metadata(table.schema.metadata), path)


def each_row(change: Any) -> Any:
    """A `rewrite_segments` edit: `change(row) -> row, or None to drop it` per row."""

    def edit(t: Any) -> Any:
        import pyarrow as pa

        rows = [change(row) for row in t.to_pylist()]
        return pa.Table.from_pylist([r for r in rows if r is not None], schema=t.schema)

    return edit


def txn_events(spark: SparkSession, root: Path) -> dict[tuple[str, str, int], Any]:
    rows = deduplicated(load_archive(spark, root)).collect()
    return {(r.bucket_uuid, r.sub_id, r.commit_index): r for r in rows}


@pytest.mark.slow
def test_the_archive_records_transactions_and_the_audit_passes(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = build_txn_archive(tmp_path / "archive")
    events = txn_events(spark, root)
    for bucket, keys in ((0, ("o/a1", "o/b1", "o/a2")), (1, ("o/a3", "o/b3"))):
        uuid = TXN_BUCKETS[bucket]
        by_sub: dict[str, list[Any]] = defaultdict(list)
        for (b, sub, _), r in sorted(events.items()):
            if b == uuid and r.txn_id is not None:
                by_sub[sub].append(r)
        (rc,) = by_sub["rc"]  # the commit: one event, at the marker, every change
        assert (rc.txn_id, rc.txn_epoch, rc.txn_number, rc.txn_committed) == ("tx", 0, 1, True)
        assert [c.key for c in rc.changes] == list(keys) and rc.txn_changes == len(keys)
        (ra,) = by_sub["ra"]  # the part its query selects
        assert [c.key for c in ra.changes] == [k for k in keys if k.startswith("o/a")]
        assert ra.txn_changes == len(ra.changes)
        # read_uncommitted: each write as it applied, the aborted one's included
        ru = by_sub["ru"]
        assert [(r.txn_number, r.txn_committed, r.read_uncommitted) for r in ru] == [
            (1, False, True),
            (1, False, True),
            (2, False, True),
        ]
        assert "o/aborted" not in {c.key for r in by_sub["rc"] + by_sub["ra"] for c in r.changes}
        plain = [r for (b, _, _), r in events.items() if b == uuid and r.txn_id is None]
        assert plain and all(r.txn_changes is None for r in plain)
    report = audit(spark, root)
    assert report.ok, report.examples
    assert report.transactions == 4  # rc and ra, in both buckets
    assert main(["audit", str(root)], spark=spark) == 0
    out = capsys.readouterr().out
    assert "audit: 4 committed transaction events; uncommitted deliveries 0, incomplete" in out


@pytest.mark.slow
def test_the_audit_catches_an_aborted_transaction_s_delivery(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow as pa

    root = build_txn_archive(tmp_path / "archive")
    # What a read_committed subscription that got the writes as they applied would have
    # archived: "ru"'s rows, recorded as a read_committed subscription's.
    rewrite_segments(
        root,
        lambda t: t.set_column(
            t.schema.get_field_index("read_uncommitted"),
            "read_uncommitted",
            pa.array([False] * t.num_rows, pa.bool_()),
        ),
    )
    report = audit(spark, root)
    assert not report.ok
    assert (report.uncommitted, report.incomplete, report.gaps, report.conflicts) == (6, 0, 0, 0)
    flagged = {(i.bucket_uuid, i.sub_id, i.kinds) for i in report.examples}
    assert flagged == {(TXN_BUCKETS[b], "ru", ("uncommitted",)) for b in (0, 1)}
    assert any("transaction 2 of 'tx'" in i.detail for i in report.examples)  # the aborted one
    assert main(["audit", str(root)], spark=spark) == 1
    assert "uncommitted: bucket" in capsys.readouterr().out


@pytest.mark.slow
def test_the_audit_catches_a_committed_transaction_delivered_incompletely(
    spark: SparkSession, tmp_path: Path
) -> None:
    root = build_txn_archive(tmp_path / "archive")
    events = txn_events(spark, root)
    (target,) = [
        r
        for (b, sub, _), r in events.items()
        if b == TXN_BUCKETS[1] and sub == "rc" and r.txn_committed
    ]

    def drop_a_change(row: dict[str, Any]) -> dict[str, Any]:
        """Bucket 1's commit event for "rc" loses its last change on every node."""
        if row["sub_id"] == "rc" and row["commit_index"] == target.commit_index:
            row["changes"] = row["changes"][:-1]
        return row

    rewrite_segments(root / fmt.partition_path(TXN_BUCKETS[1], 1), each_row(drop_a_change))
    report = audit(spark, root)
    assert (report.incomplete, report.uncommitted, report.conflicts) == (1, 0, 0)
    (issue,) = report.examples
    assert (issue.kinds, issue.bucket_uuid, issue.sub_id, issue.commit_index) == (
        ("incomplete",),
        TXN_BUCKETS[1],
        "rc",
        target.commit_index,
    )
    assert "carries 1 of its 2 changes" in issue.detail


@pytest.mark.slow
def test_the_audit_catches_a_committed_transaction_split_or_missing_in_a_bucket(
    spark: SparkSession, tmp_path: Path
) -> None:
    root = build_txn_archive(tmp_path / "archive")
    events = txn_events(spark, root)

    def rc_events(bucket: int) -> list[Any]:
        return sorted(
            (r for (u, sub, _), r in events.items() if u == TXN_BUCKETS[bucket] and sub == "rc"),
            key=lambda r: r.commit_index,
        )

    gone = next(r for r in rc_events(0) if r.txn_committed)
    after_gone = rc_events(0)[rc_events(0).index(gone) + 1]
    split = next(r for r in rc_events(1) if r.txn_committed)
    forged = rc_events(1)[rc_events(1).index(split) + 1]  # "o/after", a plain write's

    def edit(drop: int | None, tag: int | None) -> Any:
        def change(row: dict[str, Any]) -> dict[str, Any] | None:
            if row["sub_id"] == "rc" and row["commit_index"] == drop:
                return None
            if row["sub_id"] == "rc" and row["commit_index"] == tag:
                row.update(txn_id="tx", txn_epoch=0, txn_number=1, txn_committed=True)
                row["txn_changes"] = len(row["changes"])
            return row

        return each_row(change)

    # bucket 0: "rc"'s commit event lost on every node; bucket 1: a second event of
    # the same transaction for "rc" (its commit split in two)
    rewrite_segments(root / fmt.partition_path(TXN_BUCKETS[0], 1), edit(gone.commit_index, None))
    rewrite_segments(root / fmt.partition_path(TXN_BUCKETS[1], 1), edit(None, forged.commit_index))
    report = audit(spark, root)
    assert (report.gaps, report.incomplete, report.uncommitted, report.conflicts) == (1, 2, 0, 0)
    found = {(i.kinds, i.bucket_uuid, i.commit_index) for i in report.examples}
    assert found == {
        (("gap",), TXN_BUCKETS[0], after_gone.commit_index),
        (("incomplete",), TXN_BUCKETS[1], split.commit_index),
        (("incomplete",), TXN_BUCKETS[1], forged.commit_index),
    }


@pytest.mark.slow
def test_the_audit_reads_format_1_segments_next_to_format_2_ones(
    spark: SparkSession, tmp_path: Path
) -> None:
    import json

    import pyarrow as pa

    root = build_txn_archive(tmp_path / "archive")

    def as_format_1(t: pa.Table) -> pa.Table:
        footer = json.loads(t.schema.metadata[fmt.SEGMENT_METADATA_KEY])
        footer["format"] = 1
        return t.drop_columns(list(fmt.TXN_COLUMNS)).replace_schema_metadata(
            {fmt.SEGMENT_METADATA_KEY: json.dumps(footer).encode()}
        )

    for path in (root / fmt.partition_path(TXN_BUCKETS[0], 1)).glob("*.parquet"):
        pq.write_table(as_format_1(pq.read_table(path, partitioning=None)), path)
    events = txn_events(spark, root)
    old = [r for (b, _, _), r in events.items() if b == TXN_BUCKETS[0]]
    assert old and all(r.txn_id is None and r.read_uncommitted is None for r in old)
    report = audit(spark, root)
    # bucket 0's rows carry no transaction (format 1): only bucket 1's are checked
    assert report.ok and report.transactions == 2
