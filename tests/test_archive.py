"""The drained-outbox archive writer (cluster/archive/writer.py) with real files, fed by real
`BucketStateMachine` applies: atomic publication, rotation by size and age, the
manifest, the compaction hold point, restart (and kill -9 at every publication step)
without loss or duplication, and configuration errors."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.dataset as pa_ds
import pyarrow.parquet as pq
import pytest
from helpers import Driver, replay

from sevendb.cluster.archive.format import FILE_SCHEMA, ArchiveError, escape_partition_value
from sevendb.cluster.archive.settings import ArchiveSettings
from sevendb.cluster.archive.store import ArchiveConfigError
from sevendb.cluster.archive.writer import ArchiveWriter, read_archive, read_segment_info
from sevendb.outbox.entries import Ack, OutboxPurge
from sevendb.outbox.model import Applied, OutboxRow, RowsPurged
from sevendb.outbox.state import BucketStateMachine

Event = tuple[Any, ...]


# ---- a bucket's log with purges -------------------------------------------------------


def purge(d: Driver, *acks: tuple[str, int]) -> Applied:
    """One OUTBOX_PURGE acking each `(sub_id, row position)` of the current outbox."""
    return d.apply(
        OutboxPurge(
            d.sm.lease_index,
            tuple(Ack(sub, "alice", d.rows(sub)[pos].emit_seq) for sub, pos in acks),
            now_ms=d.tick(7),
        )
    )


def build_log() -> tuple[list[tuple[int, bytes]], list[Applied]]:
    """Two subscriptions, SET and DEL changes, five purges (one acking two
    subscriptions, two whose rows span epochs 1 and 2), and entries without purges."""
    d = Driver()
    applied = [d.lease(), d.subscribe("s1", "prefix:k/"), d.subscribe("s2", "prefix:k/a")]
    for i in range(6):
        applied += [d.set(f"k/{i}", f"v{i}".encode()), d.set(f"k/a{i}", b"x" * i)]
    applied.append(d.outbox())  # type: ignore[arg-type]
    applied.append(purge(d, ("s1", 2)))
    applied.append(purge(d, ("s1", 1), ("s2", 1)))
    applied.append(d.epoch())
    for i in range(4):
        applied += [d.set(f"k/b{i}"), d.set(f"k/a{i}", b"w")]
    applied.append(d.delete("k/0"))
    applied.append(d.outbox())  # type: ignore[arg-type]
    applied.append(purge(d, ("s2", -1)))  # epochs 1 and 2
    applied.append(d.set("k/z"))
    applied.append(d.outbox())  # type: ignore[arg-type]
    applied.append(purge(d, ("s1", -2)))  # epochs 1 and 2
    applied.append(purge(d, ("s1", -1)))
    applied.append(d.set("k/tail"))  # no purge after the last one
    return d.log, applied


LOG, APPLIED = build_log()


def purged(applied: list[Applied]) -> list[tuple[int, int, OutboxRow]]:
    return [
        (a.commit_index, e.ack_time_ms, row)
        for a in applied
        for e in a.effects
        if isinstance(e, RowsPurged)
        for row in e.rows
    ]


def event(purge_index: int, ack_ms: int, row: OutboxRow) -> Event:
    seq, prev = row.emit_seq, row.prev_emit_seq
    return (
        seq.bucket_uuid,
        seq.epoch_counter,
        seq.commit_index,
        row.sub_id,
        prev.bucket_uuid,
        prev.epoch_counter,
        prev.commit_index,
        tuple((c.key, c.op.name, c.value, c.version) for c in row.delta.changes),
        row.delta.commit_time_ms,
        ack_ms,
        purge_index,
    )


EXPECTED = Counter(event(*p) for p in purged(APPLIED))
TOTAL = sum(EXPECTED.values())
PURGE_INDEXES = sorted({p for p, _, _ in purged(APPLIED)})
ROWS_AT = Counter(p for p, _, _ in purged(APPLIED))  # rows purged by each entry
TWO_EPOCHS = [
    p
    for p in PURGE_INDEXES
    if len({r.emit_seq.epoch_counter for q, _, r in purged(APPLIED) if q == p}) == 2
]


def up_to(index: int) -> list[Applied]:
    return [a for a in APPLIED if a.commit_index <= index]


def at(index: int) -> Applied:
    (a,) = [a for a in APPLIED if a.commit_index == index]
    return a


def archived(root: Path, node_id: str | None = None) -> Counter[Event]:
    table = read_archive(root, node_id=node_id)
    return Counter(
        (
            r["bucket_uuid"],
            r["epoch"],
            r["commit_index"],
            r["sub_id"],
            r["prev_bucket_uuid"],
            r["prev_epoch"],
            r["prev_commit_index"],
            tuple((c["key"], c["op"], c["value"], c["version"]) for c in r["changes"]),
            r["commit_time_ms"],
            r["ack_time_ms"],
            r["purge_index"],
        )
        for r in table.to_pylist()
    )


def visible_files(root: Path) -> list[Path]:
    """What a Spark or pyarrow reader lists: no hidden (. or _) files or folders."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and not any(part.startswith((".", "_")) for part in p.relative_to(root).parts)
    )


def feed(writer: ArchiveWriter, applied: list[Applied], bucket: int = 0) -> None:
    for a in applied:
        writer.on_applied(bucket, a)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "archive"


def writer(root: Path, node: str = "n1", **kwargs: Any) -> ArchiveWriter:
    kwargs.setdefault("background", False)
    return ArchiveWriter(root, node, **kwargs)


# ---- what is written --------------------------------------------------------------------


def test_every_purged_row_is_archived_once_with_its_chain_and_delta(root: Path) -> None:
    assert len(PURGE_INDEXES) == 5 and TWO_EPOCHS and len({e[1] for e in EXPECTED}) == 2
    with writer(root) as w:
        feed(w, APPLIED)
        w.flush()
        assert archived(root) == EXPECTED
        stats = w.stats()
        assert stats.rows_published == TOTAL and stats.rows_buffered == 0
    table = read_archive(root)
    assert table.schema.names == [*FILE_SCHEMA.names, "bucket_uuid", "epoch"]
    assert set(table.column("node_id").to_pylist()) == {"n1"}
    assert {r["op"] for c in table.column("changes").to_pylist() for r in c} == {"SET", "DEL"}
    # hive layout: one directory per bucket and epoch, files named node-first-last
    for path in visible_files(root):
        info = read_segment_info(path)
        assert path.parent == root / "bucket_uuid=bucket-0000" / f"epoch={info.epoch}"
        assert path.name == f"n1-{info.first_index:012d}-{info.last_index:012d}.parquet"
        assert pq.read_metadata(path).num_rows == info.rows


def test_segments_are_published_atomically(root: Path) -> None:
    """At every step a reader sees whole files or nothing: the data is written under a
    hidden tmp name and fsynced, then renamed."""
    seen: list[tuple[str, int, int, int]] = []  # point, tmp files, visible files, rows read

    def observe(point: str) -> None:
        hidden = len(list(root.rglob(".*.tmp")))
        seen.append((point, hidden, len(visible_files(root)), read_archive(root).num_rows))

    first = PURGE_INDEXES[0]
    with writer(root, fault=observe) as w:
        feed(w, up_to(first))
        assert visible_files(root) == []  # buffered: nothing published yet
        assert w.flush() == 1
    assert seen == [
        ("segment-written", 1, 0, 0),  # fsynced under a hidden name: readers see nothing
        ("part-published", 0, 1, ROWS_AT[first]),  # renamed: the whole segment at once
        ("segments-published", 0, 1, ROWS_AT[first]),
        ("manifest-written", 0, 1, ROWS_AT[first]),
    ]


def test_rotation_by_rows_cuts_at_purge_entry_boundaries(root: Path) -> None:
    with writer(root, segment_rows_max=5) as w:
        for a in APPLIED:
            w.on_applied(0, a)
            w.publish_due()
        w.flush()
        segments = w.segments()
    assert archived(root) == EXPECTED
    per_batch: dict[tuple[int, int], int] = Counter()
    for s in segments:
        per_batch[(s.first_index, s.last_index)] += s.rows
    sizes = {p: sum(1 for q, _, _ in purged(APPLIED) if q == p) for p in PURGE_INDEXES}
    for (first, last), rows in per_batch.items():
        # whole entries only, and a batch closes at the first entry reaching the limit
        assert rows == sum(n for p, n in sizes.items() if first <= p <= last)
        entries = [sizes[p] for p in PURGE_INDEXES if first <= p <= last]
        assert sum(entries[:-1]) < 5
    assert len(per_batch) >= 3


def test_rotation_by_bytes(root: Path) -> None:
    with writer(root, segment_bytes_max=1) as w:
        for a in APPLIED:
            w.on_applied(0, a)
            w.publish_due()
        # every purge entry is over the limit on its own: one batch each, no flush needed
        assert sorted({(s.first_index, s.last_index) for s in w.segments()}) == [
            (p, p) for p in PURGE_INDEXES
        ]
        assert w.stats().rows_buffered == 0
    assert archived(root) == EXPECTED


def test_rotation_by_age(root: Path) -> None:
    clock = Clock()
    first = PURGE_INDEXES[0]
    with writer(root, segment_age_s_max=5.0, clock=clock) as w:
        feed(w, up_to(first))
        assert w.publish_due() == 0
        clock.now += 4.9
        assert w.publish_due() == 0 and visible_files(root) == []
        clock.now += 0.1
        assert w.publish_due() == 1
        assert w.archived_through(0) == first


def test_the_background_thread_publishes_by_age(root: Path) -> None:
    with ArchiveWriter(root, "n1", segment_age_s_max=0.05) as w:
        feed(w, APPLIED)
        assert w.wait_archived(0, PURGE_INDEXES[-1], timeout_s=30)
        assert archived(root) == EXPECTED


def test_the_manifest_records_segments_and_archived_through(root: Path) -> None:
    with writer(root, segment_rows_max=8) as w:
        for a in APPLIED:
            w.on_applied(0, a)
            w.publish_due()
        w.flush()
        through = w.archived_through(0)
    manifest = json.loads((root / "_manifests" / "n1.json").read_text())
    assert manifest["buckets"] == {"0": {"bucket_uuid": "bucket-0000", "archived_through": through}}
    assert through == APPLIED[-1].commit_index  # the tail entry without a purge counts too
    listed = {root / s["path"] for s in manifest["segments"]}
    assert listed == set(visible_files(root))
    assert sum(s["rows"] for s in manifest["segments"]) == TOTAL
    assert all(s["bytes"] == (root / s["path"]).stat().st_size for s in manifest["segments"])
    assert not list((root / "_manifests").glob(".*"))  # no tmp manifest left behind
    with writer(root) as again:  # reopened: the same hold point, nothing adopted
        assert again.archived_through(0) == through
        assert again.stats().segments_adopted == 0


def test_archived_through_holds_compaction_below_unpublished_rows(root: Path) -> None:
    holds: list[int] = []
    with writer(root, on_archived=lambda bucket, value: holds.append(value)) as w:
        assert w.archived_through(0) == 0
        first = PURGE_INDEXES[0]
        before_purge = up_to(first - 1)
        feed(w, before_purge)
        # nothing purged yet: every applied entry is "archived"
        assert w.archived_through(0) == before_purge[-1].commit_index == first - 1
        w.on_applied(0, at(first))  # a purge
        assert w.archived_through(0) == first - 1
        for a in APPLIED:
            if a.commit_index > first:
                w.on_applied(0, a)
                assert w.archived_through(0) == first - 1  # held while the purge is buffered
        w.flush()
        assert w.archived_through(0) == APPLIED[-1].commit_index
    assert holds == [APPLIED[-1].commit_index]


# ---- restart: nothing lost, nothing twice ----------------------------------------------


def restart_and_replay(root: Path, snapshot_index: int, node: str = "n1") -> ArchiveWriter:
    """What a restarted node does: open the archive, restore the replica from its
    snapshot at `snapshot_index` and re-apply the log after it."""
    w = writer(root, node)
    sm = replay([e for e in LOG if e[0] <= snapshot_index])
    sm = BucketStateMachine.restore(sm.snapshot())
    for index, data in LOG:
        if index > snapshot_index:
            w.on_applied(0, sm.apply(index, data))
    w.flush()
    return w


def test_restart_skips_what_was_archived_and_archives_the_rest(root: Path) -> None:
    w = writer(root)
    feed(w, up_to(PURGE_INDEXES[1]))
    w.flush()
    persisted = w.archived_through(0)
    assert persisted == PURGE_INDEXES[1]
    w.close()
    w = restart_and_replay(root, snapshot_index=0)  # the whole log replayed
    assert w.stats().rows_skipped == ROWS_AT[PURGE_INDEXES[0]] + ROWS_AT[PURGE_INDEXES[1]]
    w.close()
    assert archived(root) == EXPECTED


def test_the_dedupe_boundary_is_archived_through(root: Path) -> None:
    p1, p2 = PURGE_INDEXES[:2]
    assert p2 == p1 + 1
    with writer(root) as w:
        feed(w, up_to(p1))
        w.flush()
        assert w.archived_through(0) == p1
    with writer(root) as w:
        w.on_applied(0, at(p1))  # at archived_through: already archived, skipped
        assert w.stats().rows_skipped == ROWS_AT[p1] and w.stats().rows_buffered == 0
        w.on_applied(0, at(p2))  # just after it: archived
        assert w.stats().rows_buffered == ROWS_AT[p2]
    assert archived(root) == Counter(event(*p) for p in purged(APPLIED) if p[0] in (p1, p2))


CHILD_ROWS_MAX = 6


def kill_at(point: str | None, hit: int) -> Callable[[str], None]:
    """A fault hook that SIGKILLs this process the `hit`-th time it reaches `point`."""
    count = 0

    def fault(name: str) -> None:
        nonlocal count
        if name == point:
            count += 1
            if count == hit:
                os.kill(os.getpid(), signal.SIGKILL)

    return fault


def _child(root: str, point: str | None, hit: int, holds: str) -> None:
    """A node process: applies the log, publishing by size as it goes, and SIGKILLs
    itself at the `hit`-th time it reaches fault point `point` (or after the log)."""
    fault = kill_at(point, hit)
    w = ArchiveWriter(root, "n1", background=False, segment_rows_max=CHILD_ROWS_MAX, fault=fault)
    sm = BucketStateMachine("bucket-0000")
    with open(holds, "a") as out:
        for index, data in LOG:
            w.on_applied(0, sm.apply(index, data))
            w.publish_due()
            out.write(f"{w.archived_through(0)}\n")  # the hold point the node would set
            out.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # crash with the tail still buffered


def fault_trace(tmp: Path) -> list[str]:
    """The fault points the child passes, in order, when nothing kills it."""
    points: list[str] = []
    w = ArchiveWriter(
        tmp, "n1", background=False, segment_rows_max=CHILD_ROWS_MAX, fault=points.append
    )
    sm = BucketStateMachine("bucket-0000")
    for index, data in LOG:
        w.on_applied(0, sm.apply(index, data))
        w.publish_due()
    w.close()
    return points


CRASHES = [
    ("mid-segment", None),
    ("before-rename", "segment-written"),
    ("between-two-epoch-parts", "part-published"),
    ("before-manifest", "segments-published"),
    ("after-manifest", "manifest-written"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "point"), CRASHES, ids=[c[0] for c in CRASHES])
@pytest.mark.parametrize("snapshot", ["none", "at-hold-point"])
def test_kill_9_at_each_publication_step_loses_and_duplicates_nothing(
    tmp_path: Path, name: str, point: str | None, snapshot: str
) -> None:
    root, holds = tmp_path / "archive", tmp_path / "holds"
    trace = fault_trace(tmp_path / "dry-run")
    if name == "between-two-epoch-parts":
        # the first part of a two-part batch: renamed, its sibling not yet
        parts = [i for i, p in enumerate(trace) if p == "part-published"]
        hit = next(n for n, i in enumerate(parts, 1) if trace[i + 1] == "part-published")
    else:
        hit = 2  # the second segment or manifest: something is already published
    assert point is None or trace.count(point) > hit
    proc = multiprocessing.get_context("spawn").Process(
        target=_child, args=(str(root), point, hit, str(holds))
    )
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    before = archived(root)
    assert not +(before - EXPECTED), "published rows must be a subset of the purged rows"
    assert before != EXPECTED, "the crash must leave work for the restart"
    # The replica may have compacted up to the highest hold point it was ever given.
    hold = max(int(x) for x in holds.read_text().split())
    w = restart_and_replay(root, snapshot_index=hold if snapshot == "at-hold-point" else 0)
    w.close()
    assert archived(root) == EXPECTED
    assert not list(root.rglob("*.tmp"))


def test_a_multi_epoch_batch_caught_half_renamed_is_completed_not_rewritten(root: Path) -> None:
    class Crash(BaseException):
        pass

    def fault(point: str) -> None:
        if point == "part-published":
            raise Crash

    w = writer(root, fault=fault)
    last = TWO_EPOCHS[0]
    feed(w, up_to(last))
    with pytest.raises(Crash):
        w.flush()  # one batch, purges up to `last`: its epoch-1 part is renamed, then "crash"
    w._release.close()  # the crashed process's lock goes with it
    (part,) = visible_files(root)
    assert read_segment_info(part).batch_epochs == (1, 2)
    w = writer(root)
    assert w.stats().segments_adopted == 1
    manifest = json.loads((root / "_manifests" / "n1.json").read_text())
    assert manifest["buckets"]["0"]["partial"] == {
        "first": PURGE_INDEXES[0],
        "last": last,
        "epochs": [1],
    }
    assert w.archived_through(0) == PURGE_INDEXES[0] - 1
    feed(w, up_to(last))  # the replay
    assert w.stats().rows_skipped == sum(
        1 for p, _, r in purged(APPLIED) if p <= last and r.emit_seq.epoch_counter == 1
    )
    w.close()
    assert archived(root) == Counter(event(*p) for p in purged(APPLIED) if p[0] <= last)
    assert (
        "partial" not in json.loads((root / "_manifests" / "n1.json").read_text())["buckets"]["0"]
    )


def test_every_node_archives_its_own_copy(root: Path) -> None:
    for node in ("n1", "n2", "n3"):
        with writer(root, node) as w:
            feed(w, APPLIED)
    for node in ("n1", "n2", "n3"):
        assert archived(root, node) == EXPECTED
        assert (root / "_manifests" / f"{node}.json").exists()
    assert sum(archived(root).values()) == 3 * sum(EXPECTED.values())


# ---- failures and configuration ----------------------------------------------------------


def test_a_failed_publish_keeps_the_rows_and_is_retried(root: Path) -> None:
    clock = Clock()
    root.mkdir()
    (root / "bucket_uuid=bucket-0000").write_text("in the way")  # cannot mkdir there
    with writer(root, clock=clock, segment_rows_max=1) as w:
        feed(w, APPLIED)
        assert w.publish_due() == 0
        stats = w.stats()
        assert stats.publish_failures == 1 and "bucket 0" in (stats.last_error or "")
        assert stats.rows_buffered == TOTAL and w.archived_through(0) == PURGE_INDEXES[0] - 1
        with pytest.raises(ArchiveError, match="archive publish failed"):
            w.flush()
        (root / "bucket_uuid=bucket-0000").unlink()
        clock.now += 60
        assert w.publish_due() > 0
        w.flush()
    assert archived(root) == EXPECTED


def test_a_broken_effect_freezes_the_hold_point_instead_of_raising(root: Path) -> None:
    with writer(root) as w:
        feed(w, APPLIED[:5])
        held = w.archived_through(0)
        bad = Applied(99, APPLIED[0].result, (RowsPurged((object(),), 1),))  # type: ignore[arg-type]
        w.on_applied(0, bad)  # logged, not raised
        feed(w, APPLIED[5:])
        assert w.archived_through(0) == held


def test_partition_values_are_escaped_the_way_spark_unescapes_them(root: Path) -> None:
    assert escape_partition_value("a/b=c%d") == "a%2Fb%3Dc%25d"
    assert escape_partition_value("0b0e2c1e-4a1f-4c8e-9a51-1d2f3a4b5c6d") == (
        "0b0e2c1e-4a1f-4c8e-9a51-1d2f3a4b5c6d"
    )
    d = Driver(BucketStateMachine("odd/uuid=1"))
    with writer(root) as w:
        feed(w, [d.lease(), d.subscribe("s", "prefix:k"), d.set("k1"), d.outbox()])  # type: ignore[list-item]
        w.on_applied(0, purge(d, ("s", 0)))
    assert (root / "bucket_uuid=odd%2Fuuid%3D1" / "epoch=1").is_dir()
    table = pa_ds.dataset(
        str(root), format="parquet", partitioning="hive", ignore_prefixes=[".", "_"]
    ).to_table()
    assert table.column("bucket_uuid").to_pylist() == ["odd/uuid=1"]


BAD_SETTINGS: list[tuple[dict[str, Any], str]] = [
    ({"segment_rows_max": 0}, "segment_rows_max must be a positive integer"),
    ({"segment_rows_max": 1.5}, "segment_rows_max must be a positive integer"),
    ({"segment_bytes_max": -1}, "segment_bytes_max must be a positive integer"),
    ({"segment_age_s_max": 0}, "segment_age_s_max must be a positive, finite"),
    ({"segment_age_s_max": float("inf")}, "segment_age_s_max must be a positive, finite"),
    ({"compression": "rar"}, "compression must be one of"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_SETTINGS)
def test_bad_settings_are_refused_clearly(root: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ArchiveConfigError, match=message):
        ArchiveWriter(root, "n1", background=False, **kwargs)


def test_bad_roots_node_ids_and_a_second_writer_are_refused(root: Path, tmp_path: Path) -> None:
    for node in ("", "_hidden", ".dot", "a/b", "x" * 200):
        with pytest.raises(ArchiveConfigError, match="node_id"):
            writer(root, node)
    (tmp_path / "file").write_text("")
    with pytest.raises(ArchiveConfigError, match="not a directory"):
        writer(tmp_path / "file")
    with writer(root), pytest.raises(ArchiveError, match="another archive writer"):
        writer(root)
    closed = writer(root)
    closed.close()
    closed.close()  # idempotent
    with pytest.raises(ArchiveError, match="is closed"):
        closed.flush()


def test_settings_from_the_environment() -> None:
    env = {
        "SEVENDB_ARCHIVE_SEGMENT_ROWS_MAX": "10",
        "SEVENDB_ARCHIVE_SEGMENT_AGE_S_MAX": "0.5",
        "SEVENDB_ARCHIVE_COMPRESSION": "snappy",
        "PATH": "/bin",
    }
    s = ArchiveSettings.from_env(env)
    assert (s.segment_rows_max, s.segment_age_s_max, s.compression) == (10, 0.5, "snappy")
    with pytest.raises(ArchiveConfigError, match="unknown setting SEVENDB_ARCHIVE_ROWS"):
        ArchiveSettings.from_env({"SEVENDB_ARCHIVE_ROWS": "1"})
    with pytest.raises(ArchiveConfigError, match="is not a number"):
        ArchiveSettings.from_env({"SEVENDB_ARCHIVE_SEGMENT_ROWS_MAX": "many"})


def test_a_damaged_manifest_is_reported(root: Path) -> None:
    with writer(root) as w:
        feed(w, APPLIED)
    (root / "_manifests" / "n1.json").write_text("{not json")
    with pytest.raises(ArchiveError, match=r"manifest .* is unreadable"):
        writer(root)
