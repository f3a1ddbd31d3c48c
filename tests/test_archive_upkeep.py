"""The archive's format shared by the writer and the Spark jobs, its roots on pyarrow
filesystems (a `file://` URI, a `SubTreeFileSystem`), and each node's upkeep of its
own segments: retention by age and bytes, compaction of small segments, the holds
registered stream consumers put on both, and `kill -9` at every step of them
(cluster/archive/format.py, store.py, maintenance.py, recovery.py)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from cluster_harness import wait_for
from test_archive import (
    APPLIED,
    EXPECTED,
    PURGE_INDEXES,
    TOTAL,
    Event,
    archived,
    feed,
    kill_at,
    visible_files,
)

from sevendb.cluster.archive import format as fmt
from sevendb.cluster.archive import spark_jobs
from sevendb.cluster.archive.format import (
    ArchiveError,
    ConsumerMark,
    SegmentInfo,
    parse_segment_name,
    segment_name,
    spark_ddl,
)
from sevendb.cluster.archive.maintenance import compact
from sevendb.cluster.archive.manifest import Partial
from sevendb.cluster.archive.settings import ArchiveSettings
from sevendb.cluster.archive.writer import ArchiveWriter, read_archive, read_segment_info

REPO = Path(__file__).resolve().parents[1]
NOW_MS = 10**12  # the injected wall clock: long after the log's times


def writer(root: Path | str, node: str = "n1", **kwargs: Any) -> ArchiveWriter:
    kwargs.setdefault("background", False)
    kwargs.setdefault("wall_clock", lambda: NOW_MS / 1000)
    kwargs.setdefault("retention_age_s", 0)  # the log's times are from 1970
    return ArchiveWriter(root, node, **kwargs)


def small_segments(root: Path | str, node: str = "n1", **kwargs: Any) -> ArchiveWriter:
    """A writer that has published one segment per purge entry (7 files: 5 in epoch
    1, 2 in epoch 2), compaction of any two, retention off unless asked."""
    kwargs.setdefault("compact_min_files", 2)
    kwargs.setdefault("retention_age_s", 0)
    w = writer(root, node, segment_rows_max=1, **kwargs)
    for a in APPLIED:
        w.on_applied(0, a)
        w.publish_due()
    w.flush()
    return w


def seen_once(root: Path) -> set[Event]:
    """The events a reader that dedupes by the event key sees: every copy of an event
    (whichever file holds it) has the same content, so nothing is counted twice."""
    events = set(archived(root))
    assert len({(e[0], e[3], e[1], e[2]) for e in events}) == len(events)
    return events


def manifest(root: Path, node: str = "n1") -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / "_manifests" / f"{node}.json").read_text())
    return data


def write_mark(root: Path, name: str, consumed: dict[str, dict[str, dict[int, int]]]) -> None:
    (root / "_consumers").mkdir(exist_ok=True)
    mark = ConsumerMark(name, 1, consumed)
    (root / "_consumers" / f"{name}.json").write_bytes(mark.to_bytes())


# ---- one format, both sides ------------------------------------------------------------


def test_the_writer_the_pyarrow_reader_and_the_spark_jobs_share_one_schema(
    tmp_path: Path,
) -> None:
    root = tmp_path / "archive"
    with writer(root) as w:
        feed(w, APPLIED)
    for path in visible_files(root):
        # the files hold exactly the defined columns, types and nullability
        assert pq.read_schema(path).remove_metadata().equals(fmt.FILE_SCHEMA)
    assert read_archive(root).schema.equals(fmt.ARCHIVE_SCHEMA)
    # the Spark jobs read and write with DDL derived from the same definitions
    assert spark_ddl(fmt.ARCHIVE_SCHEMA) == spark_jobs.ARCHIVE_SCHEMA
    assert spark_ddl(fmt.EXPORT_SCHEMA) == spark_jobs.EXPORT_SCHEMA
    assert spark_jobs.ARCHIVE_SCHEMA.split(", ")[:2] == ["commit_index BIGINT", "sub_id STRING"]
    assert "changes ARRAY<STRUCT<key: STRING, op: STRING, value: BINARY, version: BIGINT>>" in (
        spark_jobs.ARCHIVE_SCHEMA
    )
    assert tuple(fmt.EXPORT_SCHEMA.names) == spark_jobs.EXPORT_COLUMNS
    assert "node_id" not in spark_jobs.EXPORT_COLUMNS
    assert spark_jobs.EVENT_KEY is fmt.EVENT_KEY


def test_spark_types_of_arrow_types() -> None:
    schema = pa.schema(
        [
            ("a", pa.int32()),
            ("b", pa.float64()),
            ("c", pa.bool_()),
            ("d", pa.timestamp("us")),
            ("e", pa.timestamp("us", tz="UTC")),
            ("f", pa.list_(pa.struct([("x", pa.large_string()), ("y", pa.large_binary())]))),
        ]
    )
    assert spark_ddl(schema) == (
        "a INT, b DOUBLE, c BOOLEAN, d TIMESTAMP_NTZ, e TIMESTAMP, "
        "f ARRAY<STRUCT<x: STRING, y: BINARY>>"
    )
    with pytest.raises(ArchiveError, match="no Spark type for Arrow type uint8"):
        spark_ddl(pa.schema([("z", pa.uint8())]))


def test_segment_names_round_trip_and_belong_to_one_node() -> None:
    for node in ("n1", "n1-2", "node.a-b_c"):
        for compacted in (False, True):
            name = segment_name(node, 7, 123_456, compacted=compacted)
            assert parse_segment_name(name) == fmt.SegmentName(node, 7, 123_456, compacted)
            assert re.search(fmt.SEGMENT_NAME_REGEX, name)
    assert segment_name("n1", 1, 2, compacted=True).endswith(".c.parquet")
    assert parse_segment_name("bucket_uuid=x/epoch=1/n1-000000000001-000000000002.parquet")
    for bad in ("n1-1-2.parquet", "n1-000000000001-000000000002.csv", "x.parquet", "-.parquet"):
        assert parse_segment_name(bad) is None


def test_a_node_whose_id_prefixes_another_s_leaves_its_files_alone(tmp_path: Path) -> None:
    """`n1` and `n1-2` share a root: reopening `n1` must not take `n1-2`'s segments
    for its own (the old prefix match adopted or quarantined them)."""
    root = tmp_path / "archive"
    for node in ("n1", "n1-2"):
        with writer(root, node) as w:
            feed(w, APPLIED)
    files = sorted(visible_files(root))
    with writer(root, "n1") as w:
        assert w.stats().segments_adopted == 0
    assert sorted(visible_files(root)) == files
    assert not (root / "_orphans").exists()
    assert archived(root, "n1-2") == EXPECTED


# ---- roots on pyarrow filesystems -----------------------------------------------------------


def test_a_file_uri_root_and_a_subtree_filesystem_see_the_same_archive(tmp_path: Path) -> None:
    root = tmp_path / "shared mount" / "archive"  # a space: the URI escapes it
    uri = root.as_uri()
    assert uri.startswith("file:///") and "%20" in uri
    w = writer(uri)
    feed(w, APPLIED[: len(APPLIED) // 2])
    w.flush()
    through = w.archived_through(0)
    w.close()
    assert (root / "_manifests" / "n1.json").is_file() and visible_files(root)
    # the same directory through a SubTreeFileSystem: the writer resumes where it was
    subtree = pafs.SubTreeFileSystem(str(tmp_path / "shared mount"), pafs.LocalFileSystem())
    with writer("archive", filesystem=subtree) as again:
        assert again.store.local == root  # on the local disk: fsync and flock apply
        with pytest.raises(ArchiveError, match="another archive writer"):
            writer(uri)
        assert again.archived_through(0) == through
        assert again.stats().segments_adopted == 0
        feed(again, APPLIED)
    assert archived(root) == EXPECTED
    assert read_archive(uri).num_rows == TOTAL
    assert read_archive("archive", filesystem=subtree).num_rows == TOTAL
    with pytest.raises(ArchiveError, match="is not a directory"):
        read_archive((tmp_path / "nowhere").as_uri())


def test_the_root_comes_from_the_environment(tmp_path: Path) -> None:
    uri = (tmp_path / "elsewhere").as_uri()
    env = {"SEVENDB_ARCHIVE_ROOT": uri, "SEVENDB_ARCHIVE_RETENTION_AGE_S": "3600"}
    with ArchiveWriter.from_env(tmp_path / "default", "n1", env, background=False) as w:
        feed(w, APPLIED)
        assert w.settings.retention_age_s == 3600.0
    assert archived(tmp_path / "elsewhere") == EXPECTED
    assert not (tmp_path / "default").exists()


def test_settings_defaults_are_the_documented_ones() -> None:
    """docs/spark.md's settings table names every setting, its variable and default."""
    doc = (REPO / "docs" / "spark.md").read_text()
    defaults = ArchiveSettings()
    for name in ArchiveSettings.__dataclass_fields__:
        variable = f"`SEVENDB_ARCHIVE_{name.upper()}`"
        row = next((ln for ln in doc.splitlines() if ln.startswith("|") and variable in ln), None)
        assert row is not None, f"docs/spark.md lacks SEVENDB_ARCHIVE_{name.upper()}"
        assert f"`{name}`" in row, row
        value = getattr(defaults, name)
        shown = {"root": "`<data_dir>/archive`"}.get(
            name, f"`{value:g}`" if isinstance(value, float) else f"`{value}`"
        )
        assert shown in row, (row, shown)
    assert defaults.retention_age_s == 7 * 24 * 3600 and defaults.retention_bytes == 0


# ---- retention ------------------------------------------------------------------------------


def test_retention_by_age_deletes_the_segments_acknowledged_before_the_cut(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    w = small_segments(root, compact_target_bytes=0)
    before = w.segments()
    assert len(before) == 7 and all(s.ack_ms_max > 0 for s in before)
    cut = sorted({s.ack_ms_max for s in before})[2]  # the first two ack times are older
    old = [s for s in before if s.ack_ms_max < cut]
    w.close()
    age_s = (NOW_MS - cut) / 1000
    w = writer(root, retention_age_s=age_s, compact_target_bytes=0)
    report = w.maintain()
    assert report.deleted == len(old) and report.held == 0
    assert {s.path for s in w.segments()} == {s.path for s in before} - {s.path for s in old}
    assert all(not (root / s.path).exists() for s in old)
    assert {s["path"] for s in manifest(root)["segments"]} == {s.path for s in w.segments()}
    assert "retired" not in manifest(root)
    assert w.stats().segments_deleted == len(old)
    assert w.stats().bytes_deleted == sum(s.bytes for s in old)
    assert w.maintain().deleted == 0  # nothing else is past the cut
    kept = archived(root)
    assert kept == Counter({e: n for e, n in EXPECTED.items() if e[9] >= cut})
    w.close()


def test_retention_by_bytes_deletes_the_oldest_until_under_the_budget(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    w = small_segments(root, compact_target_bytes=0)
    by_age = sorted(w.segments(), key=lambda s: (s.ack_ms_max, s.path))
    budget = sum(s.bytes for s in by_age[3:])  # room for all but the three oldest
    w.close()
    w = writer(root, retention_bytes=budget, retention_age_s=0, compact_target_bytes=0)
    assert w.maintain().deleted == 3
    assert sorted(s.path for s in w.segments()) == sorted(s.path for s in by_age[3:])
    assert w.stats().bytes_live <= budget
    w.close()


def test_segments_listed_before_ack_times_were_recorded_are_not_taken_for_ancient(
    tmp_path: Path,
) -> None:
    """A manifest written before `ack_ms_max` existed: the restart reads each file's
    newest ack time from its statistics, so retention by age keeps recent segments."""
    root = tmp_path / "archive"
    w = small_segments(root)
    newest = {s.path: s.ack_ms_max for s in w.segments()}
    w.close()
    old = manifest(root)
    for entry in old["segments"]:
        del entry["ack_ms_max"]
    (root / "_manifests" / "n1.json").write_text(json.dumps(old))
    a_day_later = (max(newest.values()) + 86_400_000) / 1000
    with writer(root, wall_clock=lambda: a_day_later, retention_age_s=7 * 86_400) as again:
        assert {s.path: s.ack_ms_max for s in again.segments()} == newest
        assert again.maintain().deleted == 0
    assert all(s["ack_ms_max"] for s in manifest(root)["segments"])
    assert archived(root) == EXPECTED


def test_a_stream_consumer_holds_what_it_has_not_consumed(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    w = small_segments(root, compact_target_bytes=0, retention_age_s=1.0)
    segments = sorted(w.segments(), key=lambda s: s.last_index)
    epoch1 = [s for s in segments if s.epoch == 1]
    consumed = epoch1[2].last_index  # this consumer has read epoch 1 up to here
    uuid = segments[0].bucket_uuid
    write_mark(root, "reports", {"n1": {uuid: {1: consumed}}})
    report = w.maintain()
    deleted = {s.path for s in epoch1 if s.last_index <= consumed}
    assert report.deleted == len(deleted) == 3
    assert report.held == len(segments) - 3 and w.stats().segments_held == report.held
    assert {s.path for s in w.segments()} == {s.path for s in segments} - deleted
    # a second consumer that has read nothing holds everything left
    write_mark(root, "audit-feed", {})
    assert w.maintain().deleted == 0
    # an unreadable mark holds everything (safe), and says so
    (root / "_consumers" / "audit-feed.json").write_text("{torn")
    write_mark(root, "reports", {"n1": {uuid: {1: 10**9, 2: 10**9}}})
    assert w.maintain().deleted == 0
    # Hadoop's hidden checksum files are not marks; a removed mark releases its hold
    (root / "_consumers" / ".reports.json.crc").write_text("crc")
    (root / "_consumers" / "audit-feed.json").unlink()
    assert w.maintain().deleted == len(segments) - 3
    assert w.segments() == [] and visible_files(root) == []
    w.close()


def test_maintenance_runs_in_the_background(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    w = ArchiveWriter(
        root,
        "n1",
        segment_age_s_max=0.05,
        maintenance_s=0.05,
        retention_age_s=1.0,  # the log's ack times are from 1970
    )
    try:
        feed(w, APPLIED)
        assert w.wait_archived(0, PURGE_INDEXES[-1], timeout_s=30)
        wait_for(
            lambda: w.stats().segments_deleted > 0 and not w.segments() and not visible_files(root),
            30,
            "the background maintenance to delete every segment past retention",
        )
    finally:
        w.close()


# ---- compaction -----------------------------------------------------------------------------


def test_compaction_merges_runs_of_small_segments_per_partition(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    w = small_segments(root)
    before = w.segments()
    assert len(visible_files(root)) == 7
    report = w.maintain()
    assert (report.compacted, report.written) == (7, 2)  # epoch 1: 5 -> 1, epoch 2: 2 -> 1
    after = w.segments()
    assert len(after) == 2 and len(visible_files(root)) == 2
    assert archived(root) == EXPECTED  # the same rows, once each
    for s in after:
        assert s.compacted and parse_segment_name(s.path) == fmt.SegmentName(
            "n1", s.first_index, s.last_index, True
        )
        sources = [b for b in before if b.epoch == s.epoch]
        assert s.compacted_from == tuple(b.path.rsplit("/", 1)[-1] for b in sources)
        assert (s.first_index, s.last_index) == (sources[0].first_index, sources[-1].last_index)
        assert s.rows == sum(b.rows for b in sources)
        assert s.ack_ms_max == max(b.ack_ms_max for b in sources)
        assert read_segment_info(root / s.path).compacted_from == s.compacted_from
        assert s.bytes == (root / s.path).stat().st_size
    assert w.maintain() == type(report)(0, 0, 0, 0)  # nothing left to merge
    w.close()
    with writer(root) as again:  # restart: nothing adopted, the hold point unchanged
        assert again.stats().segments_adopted == 0
        assert {s.path for s in again.segments()} == {s.path for s in after}
        assert again.archived_through(0) == APPLIED[-1].commit_index


_POOLS: list[pa.MemoryPool] = []
"""Every pool a test made pyarrow's default, kept alive: buffers allocated from one
must not outlive it."""


def _peak_arrow_bytes(run: Callable[[], object]) -> int:
    """The most memory pyarrow held at once while `run` ran (a pool of its own, made
    the default for that time)."""
    before = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(pa.system_memory_pool())
    _POOLS.append(pool)
    pa.set_memory_pool(pool)
    try:
        run()
    finally:
        pa.set_memory_pool(before)
    return pool.max_memory()


def test_compaction_holds_a_batch_not_its_sources(tmp_path: Path) -> None:
    """A compaction streams its rows: the memory it takes is bounded by its buffer, not
    by its largest source (a compacted segment merged again at every pass until it
    reaches half the target). Reading each source whole made a node's memory grow
    with it for hours (the soak, docs/performance.md)."""
    root = tmp_path / "archive"
    w = small_segments(root)
    first, *rest = [s for s in w.segments() if s.epoch == 1]
    table = w.store.read_table(first.path, fmt.FILE_SCHEMA)
    big = pa.concat_tables([table] * (40_000 // table.num_rows + 1))
    pq.write_table(big, root / first.path)
    group = [dataclasses.replace(first, rows=big.num_rows), *rest]
    merged: list[SegmentInfo] = []
    buffer = 256 * 1024
    peak = _peak_arrow_bytes(
        lambda: merged.append(compact(w.store, group, "zstd", lambda _: None, buffer))
    )
    assert merged[0].rows == sum(s.rows for s in group)
    assert pq.read_metadata(root / merged[0].path).num_rows == merged[0].rows
    assert big.nbytes > 8 * buffer  # the source is much larger than the buffer...
    assert peak < big.nbytes // 2, (peak, big.nbytes)  # ...and was never held whole
    w.close()


def as_format_1(path: Path) -> None:
    """Rewrite a segment as format 1 wrote it: no transaction columns, footer format 1."""
    table = pq.read_table(path, partitioning=None)
    footer = json.loads(table.schema.metadata[fmt.SEGMENT_METADATA_KEY])
    footer["format"] = 1
    old = table.drop_columns(list(fmt.TXN_COLUMNS)).replace_schema_metadata(
        {fmt.SEGMENT_METADATA_KEY: json.dumps(footer).encode()}
    )
    pq.write_table(old, path)


def test_format_1_segments_are_read_and_compacted_with_format_2_ones(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    w = small_segments(root)
    old = [s for s in w.segments() if s.epoch == 1][:3]
    for s in old:
        as_format_1(root / s.path)
        assert pq.read_schema(root / s.path).names == [
            n for n in fmt.FILE_SCHEMA.names if n not in fmt.TXN_COLUMNS
        ]
        assert read_segment_info(root / s.path).path == s.path  # the footer still read
    assert fmt.SEGMENT_FORMAT == 2
    table = read_archive(root)
    assert archived(root) == EXPECTED  # the old rows read, the new columns null
    assert table.column("txn_id").null_count == table.num_rows
    assert table.column("read_uncommitted").null_count == sum(s.rows for s in old)
    report = w.maintain()  # merges old and new segments into one format-2 file
    assert report.compacted == 7
    assert archived(root) == EXPECTED
    for s in w.segments():
        assert pq.read_schema(root / s.path).names == fmt.FILE_SCHEMA.names
        footer = json.loads(pq.read_schema(root / s.path).metadata[fmt.SEGMENT_METADATA_KEY])
        assert footer["format"] == 2
    w.close()


def test_a_segment_missing_a_format_1_column_is_refused() -> None:
    batch = pa.RecordBatch.from_pylist([], schema=fmt.FILE_SCHEMA).drop_columns(["purge_index"])
    with pytest.raises(ArchiveError, match=r"lacks the columns \['purge_index'"):
        fmt.conform(batch)


def test_compaction_respects_the_target_the_minimum_and_consumers(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    w = small_segments(root, compact_min_files=3)
    sizes = sorted(s.bytes for s in w.segments() if s.epoch == 1)
    uuid = w.segments()[0].bucket_uuid
    epoch1 = sorted((s for s in w.segments() if s.epoch == 1), key=lambda s: s.first_index)
    write_mark(root, "reports", {"n1": {uuid: {1: epoch1[2].last_index}}})
    report = w.maintain()
    # only the three consumed epoch-1 segments form a run; epoch 2 has only two
    assert (report.compacted, report.written) == (3, 1)
    assert [s.compacted_from for s in w.segments() if s.compacted] == [
        tuple(s.path.rsplit("/", 1)[-1] for s in epoch1[:3])
    ]
    (root / "_consumers" / "reports.json").unlink()
    w.close()
    # a target smaller than two small segments merges nothing
    w = writer(root, compact_min_files=2, compact_target_bytes=sizes[0] + 1, retention_age_s=0)
    assert w.maintain().written == 0
    w.close()
    assert archived(root) == EXPECTED


def test_compaction_leaves_what_is_not_yet_archived_through(tmp_path: Path) -> None:
    """A half-published batch's segments are not rewritten until replay completes it."""
    root = tmp_path / "archive"
    w = small_segments(root)
    held = {s.path for s in w.segments()}
    with w._lock:
        w._buckets[0].partial = Partial(PURGE_INDEXES[0], PURGE_INDEXES[-1], frozenset({1}))
    assert w.maintain().written == 0
    assert {s.path for s in w.segments()} == held
    w.close()


# ---- kill -9 during upkeep --------------------------------------------------------------------

UPKEEP_CRASHES = [
    ("compacted-written", 1),
    ("compacted-published", 1),
    ("retire-recorded", 1),  # the manifest lists the merged segment, the sources retired
    ("retired-deleted", 2),  # some sources deleted, some not
    ("compacted-published", 2),  # the second partition's merge
]


def _upkeep_child(root: str, point: str, hit: int, retention: bool) -> None:
    """A node that has published small segments runs a maintenance pass and SIGKILLs
    itself at the `hit`-th time it reaches `point`."""
    w = small_segments(root)
    w._fault = kill_at(point, hit)
    if retention:
        w.settings = w.settings.replace(compact_target_bytes=0, retention_age_s=1.0)
    w.maintain()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "hit"), UPKEEP_CRASHES, ids=[f"{p}-{h}" for p, h in UPKEEP_CRASHES]
)
def test_kill_9_mid_compaction_loses_and_counts_nothing_twice(
    tmp_path: Path, point: str, hit: int
) -> None:
    root = tmp_path / "archive"
    proc = multiprocessing.get_context("spawn").Process(
        target=_upkeep_child, args=(str(root), point, hit, False)
    )
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    # Before any restart: a reader that dedupes by the event key sees every row once.
    assert seen_once(root) == set(EXPECTED)
    assert not +(archived(root) - EXPECTED - EXPECTED), "at most a source and its merge"
    with writer(root) as w:  # the restart finishes or undoes the merge
        assert w.stats().rows_buffered == 0
        paths = {s.path for s in w.segments()}
        assert paths == {str(p.relative_to(root)) for p in visible_files(root)}
    assert archived(root) == EXPECTED  # each row exactly once again
    assert not list(root.rglob("*.tmp")) and not (root / "_orphans").exists()
    assert "retired" not in manifest(root)
    with writer(root, compact_min_files=2) as w:  # and the next pass completes the merge
        w.maintain()
        assert len(w.segments()) == 2
    assert archived(root) == EXPECTED


@pytest.mark.slow
@pytest.mark.parametrize("point", ["retire-recorded", "retired-deleted"])
def test_kill_9_mid_retention_finishes_the_deletion_at_restart(tmp_path: Path, point: str) -> None:
    root = tmp_path / "archive"
    proc = multiprocessing.get_context("spawn").Process(
        target=_upkeep_child, args=(str(root), point, 1, True)
    )
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert manifest(root)["segments"] == [] and len(manifest(root)["retired"]) == 7
    with writer(root, retention_age_s=0) as w:
        assert w.segments() == []
    assert visible_files(root) == [] and "retired" not in manifest(root)


def test_a_compacted_segment_whose_sources_are_unknown_is_set_aside(tmp_path: Path) -> None:
    """Damage from outside (a compacted segment whose sources the manifest does not
    list) is moved to `_orphans/`, not adopted: the manifest's rows stay as they are."""
    root = tmp_path / "archive"
    w = small_segments(root)
    w.close()
    info = w.segments()[0]
    stray = SegmentInfo(
        **{
            **info.to_json(),
            "path": info.path.rsplit("/", 1)[0] + "/" + segment_name("n1", 1, 2, compacted=True),
            "batch_epochs": (info.epoch,),
            "compacted_from": ("n1-000000000999-000000000999.parquet",),
        }
    )
    table = pq.read_table(root / info.path).replace_schema_metadata(fmt.segment_footer(stray))
    pq.write_table(table, root / stray.path)
    with writer(root) as again:
        assert stray.path not in {s.path for s in again.segments()}
    assert (root / "_orphans").is_dir() and not (root / stray.path).exists()
    assert archived(root) == EXPECTED
