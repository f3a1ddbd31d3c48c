"""Archive throughput on this machine (figures in docs/spark.md):

1. the archive writer: rows/s from `on_applied` (generated OUTBOX_PURGE effects) to
   published, fsynced Parquet segments and manifest;
2. compaction: small segments merged by one maintenance pass (files/s, rows/s), and
   with `--compaction-spark` the Spark audit over the files before and after;
3. the Spark audit: rows/s over a 10-million-row archive (generated with pyarrow
   directly: 4 buckets, 2 node copies of every event, 1 change per event).

    python tests/bench/bench_archive.py [--rows 10000000] [--writer-rows 500000]
                                        [--master local[*]] [--dir DIR] [--keep] [--stats]
                                        [--compaction-segments 2000] [--compaction-spark]
                                        [--skip-spark]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sevendb.cluster.archive.format import CHANGE_TYPE, FILE_SCHEMA, partition_dir, segment_name
from sevendb.cluster.archive.spark_jobs import audit, spark_session, stats
from sevendb.cluster.archive.writer import ArchiveWriter
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import OpKind
from sevendb.outbox.model import (
    Applied,
    Change,
    Delta,
    OutboxRow,
    PurgeResult,
    RowsPurged,
)

BUCKETS = 4
NODES = ("n1", "n2")
SEGMENT_ROWS = 250_000
ACK_EVERY = 16  # events per subscription acknowledged by one purge


def say(line: str) -> None:
    print(line, flush=True)


# ---- 1. the writer --------------------------------------------------------------------


def purge_effects(rows: int, per_entry: int, subs: int) -> list[Applied]:
    """`rows` purged rows in entries of `per_entry`, chained per subscription."""
    bucket_uuid = "6f1c2d3e-0000-4000-8000-00000000be00"
    value = b"v" * 64
    last: dict[str, EmitSeq] = {}
    applied: list[Applied] = []
    index = 0
    made = 0
    while made < rows:
        batch = []
        for _ in range(min(per_entry, rows - made)):
            index += 1
            sub = f"sub-{made % subs:05d}"
            seq = EmitSeq(bucket_uuid, 1, index)
            prev = last.get(sub, EmitSeq(bucket_uuid, 1, 0))
            change = Change(f"orders/{made:010d}", OpKind.SET, value, 1)
            batch.append(OutboxRow(sub, seq, prev, Delta((change,), 1_700_000_000_000 + index)))
            last[sub] = seq
            made += 1
        index += 1  # the OUTBOX_PURGE entry itself
        effect = RowsPurged(tuple(batch), 1_700_000_000_000 + index + 40)
        applied.append(Applied(index, PurgeResult(purged_rows=len(batch)), (effect,)))
    return applied


def bench_writer(root: Path, rows: int, repeat: int) -> None:
    say(f"writer: generating {rows:,} purged rows ...")
    applied = purge_effects(rows, per_entry=500, subs=1000)
    rates = []
    for run in range(repeat):
        with ArchiveWriter(root / str(run), "n1", segment_rows_max=100_000) as writer:
            start = time.perf_counter()
            for a in applied:
                writer.on_applied(0, a)
            fed = time.perf_counter() - start
            writer.flush()
            total = time.perf_counter() - start
            segments = writer.segments()
        size = sum(s.bytes for s in segments)
        rates.append(rows / total)
        say(
            f"writer: run {run + 1}: {rows:,} rows in {len(applied):,} purge entries -> "
            f"{len(segments)} segments ({size / 1e6:.1f} MB zstd); on_applied (tick thread) "
            f"{fed / len(applied) * 1e3:.3f} ms per entry = {fed / rows * 1e6:.2f} us per row; "
            f"published + manifest in {total:.2f}s = {rows / total:,.0f} rows/s"
        )
    say(f"writer: best {max(rates):,.0f} rows/s, median {sorted(rates)[len(rates) // 2]:,.0f}")


# ---- 2. compaction ----------------------------------------------------------------------


def bench_compaction(root: Path, segments: int, per_segment: int, master: str | None) -> None:
    """`segments` small segments (one per purge entry) merged by one maintenance
    pass; with `master`, the Spark audit before and after, to show what fewer files buy."""
    rows = segments * per_segment
    say(f"compaction: {segments:,} segments of {per_segment} rows ...")
    applied = purge_effects(rows, per_entry=per_segment, subs=1000)
    with ArchiveWriter(
        root, "n1", background=False, segment_rows_max=per_segment, retention_age_s=0
    ) as writer:
        for a in applied:
            writer.on_applied(0, a)
            writer.publish_due()
        writer.flush()
        before = writer.segments()
        spark = None
        if master:
            spark = spark_session(master, app_name="sevendb-bench")
            took = _timed_audit(spark, root)
            say(f"compaction: Spark audit over {len(before):,} files: {took:.1f}s")
        start = time.perf_counter()
        report = writer.maintain()
        took = time.perf_counter() - start
        after = writer.segments()
    size = sum(s.bytes for s in before) / 1e6
    say(
        f"compaction: {report.compacted:,} segments ({size:.1f} MB) -> {len(after)} in "
        f"{took:.2f}s = {rows / took:,.0f} rows/s, {report.compacted / took:,.0f} files/s"
    )
    if spark is not None:
        try:
            took = _timed_audit(spark, root)
            say(f"compaction: Spark audit over {len(after)} files: {took:.1f}s")
        finally:
            spark.stop()


def _timed_audit(spark: Any, root: Path) -> float:
    start = time.perf_counter()
    report = audit(spark, root, progress_s=60.0, echo=lambda _: None)
    assert report.ok, report
    return time.perf_counter() - start


# ---- 3. the Spark audit ---------------------------------------------------------------


def generate(root: Path, rows: int) -> int:
    """Write `rows` archived rows (every event in each of NODES) straight with pyarrow;
    returns the number of distinct events (needs numpy)."""
    import numpy as np

    events = rows // len(NODES)
    per_bucket = events // BUCKETS
    subs = 2_500  # per bucket
    rng = np.random.default_rng(7)
    value = pa.array([b"x" * 32], pa.binary())
    for b in range(BUCKETS):
        bucket_uuid = f"0a0b0c0d-0000-4000-8000-{b:012d}"
        n = per_bucket
        pos = np.arange(n, dtype=np.int64)
        sub = pos % subs  # events interleave across subscriptions
        nth = pos // subs  # the event's place in its subscription's stream
        commit = 10 + pos  # one source entry per event
        prev = np.where(nth == 0, 5, commit - subs)  # 5: the subscriptions' start
        # each subscription is acked every ACK_EVERY events: one purge per window
        window_end = np.minimum((nth // ACK_EVERY + 1) * ACK_EVERY - 1, (n - 1 - sub) // subs)
        purge = 10 + n + window_end * subs + sub
        commit_ms = 1_700_000_000_000 + commit * 2
        ack_ms = commit_ms + 5 + rng.exponential(30.0, n).astype(np.int64)
        sub_names = pa.array([f"sub-{s:05d}" for s in range(subs)], pa.string())
        keys = pa.array([f"orders/{s:05d}" for s in range(subs)], pa.string())
        changes = pa.ListArray.from_arrays(
            pa.array(np.arange(n + 1, dtype=np.int32)),
            pa.StructArray.from_arrays(
                [
                    keys.take(pa.array(sub)),
                    pa.array(np.full(n, "SET", dtype=object), pa.string()),
                    value.take(pa.array(np.zeros(n, dtype=np.int64))),
                    pa.array(nth + 1),
                ],
                fields=list(CHANGE_TYPE),
            ),
        ).cast(FILE_SCHEMA.field("changes").type)
        base = [
            pa.array(commit),
            sub_names.take(pa.array(sub)),
            pa.array(np.full(n, bucket_uuid, dtype=object), pa.string()),
            pa.array(np.ones(n, dtype=np.int64)),
            pa.array(prev),
            changes,
            pa.array(commit_ms),
            pa.array(ack_ms),
            pa.array(purge),
        ]
        directory = partition_dir(root, bucket_uuid, 1)
        directory.mkdir(parents=True, exist_ok=True)
        for node in NODES:
            node_col = pa.array(np.full(n, node, dtype=object), pa.string())
            table = pa.Table.from_arrays([*base, node_col], schema=FILE_SCHEMA)
            for start in range(0, n, SEGMENT_ROWS):
                part = table.slice(start, SEGMENT_ROWS)
                first = int(part.column("purge_index")[0].as_py())
                name = segment_name(node, first, first + start)
                pq.write_table(part, directory / name, compression="zstd")
    return per_bucket * BUCKETS


def bench_spark(root: Path, rows: int, master: str, with_stats: bool) -> None:
    say(f"spark: generating a {rows:,}-row archive with pyarrow in {root} ...")
    start = time.perf_counter()
    events = generate(root, rows)
    size = sum(p.stat().st_size for p in root.rglob("*.parquet"))
    say(
        f"spark: generated {events * len(NODES):,} rows ({events:,} events x {len(NODES)} "
        f"nodes, {size / 1e6:.0f} MB) in {time.perf_counter() - start:.1f}s"
    )
    start = time.perf_counter()
    spark = spark_session(master, app_name="sevendb-bench", conf={"spark.driver.memory": "3g"})
    say(f"spark: session ({master}) in {time.perf_counter() - start:.1f}s")
    try:
        start = time.perf_counter()
        report = audit(spark, root, progress_s=15.0, echo=say)
        took = time.perf_counter() - start
        assert report.ok, report
        assert report.rows == events * len(NODES) and report.events == events, report
        say(
            f"spark: audit of {report.rows:,} rows ({report.events:,} events, "
            f"{report.subscriptions:,} subscriptions) in {took:.1f}s = "
            f"{report.rows / took:,.0f} rows/s - OK"
        )
        if not with_stats:
            return
        start = time.perf_counter()
        result = stats(spark, root, progress_s=15.0, echo=say)
        took = time.perf_counter() - start
        assert result.total is not None and result.total.deliveries == events
        say(
            f"spark: stats in {took:.1f}s = {report.rows / took:,.0f} rows/s "
            f"(latency p50 {result.total.latency.p50} ms, p99 {result.total.latency.p99} ms)"
        )
    finally:
        spark.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="archived rows for Spark")
    parser.add_argument("--writer-rows", type=int, default=500_000)
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--dir", type=Path, help="work directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the generated archives")
    parser.add_argument("--stats", action="store_true", help="also time the stats job")
    parser.add_argument("--repeat", type=int, default=3, help="writer runs (default 3)")
    parser.add_argument(
        "--compaction-segments", type=int, default=2_000, help="small segments to compact"
    )
    parser.add_argument("--compaction-spark", action="store_true", help="audit before/after")
    parser.add_argument("--skip-spark", action="store_true", help="no 10M-row Spark audit")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-archive-", dir=args.dir))
    say(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (a shared machine)")
    try:
        bench_writer(work / "writer", args.writer_rows, args.repeat)
        bench_compaction(
            work / "compaction",
            args.compaction_segments,
            250,
            args.master if args.compaction_spark else None,
        )
        if not args.skip_spark:
            bench_spark(work / "spark", args.rows, args.master, args.stats)
        say(f"load average {os.getloadavg()[0]:.1f} at the end")
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
