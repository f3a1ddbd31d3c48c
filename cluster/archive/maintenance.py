"""Archive maintenance on one node: retention (delete this node's oldest segments past
an age or beyond a byte budget) and compaction (merge runs of small segments of one
partition into larger ones, so Spark opens fewer files).

Both only touch segments every registered stream consumer has consumed (its mark in
`_consumers/` covers them), so an incremental `sevendb spark stream` never misses a
row; the writer records each change in its manifest before it deletes a file, and a
compacted segment is in place before its sources go (docs/spark.md: retention and
compaction, with the crash argument).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import pyarrow as pa
import pyarrow.parquet as pq

from sevendb.cluster.archive.format import (
    CONSUMERS_DIR,
    FILE_SCHEMA,
    ArchiveError,
    ConsumerMark,
    SegmentInfo,
    conform,
    segment_footer,
    segment_name,
)
from sevendb.cluster.archive.settings import ArchiveSettings
from sevendb.cluster.archive.store import ArchiveStore

log = logging.getLogger("sevendb.archive")

COMPACT_BATCH_ROWS: Final = 4096
"""Compaction reads its sources this many rows at a time..."""
COMPACT_BUFFER_BYTES: Final = 8 * 1024 * 1024
"""...and writes a row group each time this many bytes of them are buffered. What a
compaction holds is bounded by this, not by its sources: reading each whole made a
node's memory grow with its largest compacted segment, which is merged again at
every pass until it reaches half of `compact_target_bytes` (in the soak, pyarrow's
allocator kept ~15 MB more a node every few minutes: docs/performance.md)."""

Fault = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Consumers:
    """The registered stream consumers' marks; an unreadable mark holds everything."""

    marks: tuple[ConsumerMark, ...] = ()
    unreadable: tuple[str, ...] = ()

    def covers(self, segment: SegmentInfo) -> bool:
        """Whether every consumer has consumed `segment`."""
        if self.unreadable:
            return False
        return all(
            m.covers(segment.node_id, segment.bucket_uuid, segment.epoch, segment.last_index)
            for m in self.marks
        )


def read_consumers(store: ArchiveStore) -> Consumers:
    """Every `_consumers/<name>.json` under the root (hidden files, such as Hadoop's
    `.crc` companions, are not marks)."""
    marks: list[ConsumerMark] = []
    unreadable: list[str] = []
    for file in store.files(CONSUMERS_DIR, recursive=False):
        name = file.path.rsplit("/", 1)[-1]
        if name.startswith(".") or not name.endswith(".json"):
            continue
        where = store.describe(file.path)
        data = store.read_bytes(file.path)
        if data is None:  # deleted while we listed: the consumer left
            continue
        try:
            marks.append(ConsumerMark.from_bytes(data, where))
        except ArchiveError as exc:
            log.error("archive: %s; holding every segment until it is fixed or removed", exc)
            unreadable.append(where)
    return Consumers(tuple(marks), tuple(unreadable))


def retention_victims(
    segments: Sequence[SegmentInfo],
    settings: ArchiveSettings,
    now_ms: int,
    consumers: Consumers,
) -> tuple[list[SegmentInfo], list[SegmentInfo]]:
    """`(delete, held)`: segments older than `retention_age_s`, then the oldest while
    the node's bytes exceed `retention_bytes`, oldest first; `held` are those a
    consumer has not consumed yet (kept)."""
    age_ms = int(settings.retention_age_s * 1000)
    budget = settings.retention_bytes
    total = sum(s.bytes for s in segments)
    delete: list[SegmentInfo] = []
    held: list[SegmentInfo] = []
    for s in sorted(segments, key=lambda s: (s.ack_ms_max, s.path)):
        too_old = age_ms > 0 and s.ack_ms_max < now_ms - age_ms
        too_big = budget > 0 and total > budget
        if not (too_old or too_big):
            break
        if consumers.covers(s):
            delete.append(s)
            total -= s.bytes
        else:
            held.append(s)
    return delete, held


def compaction_groups(
    segments: Sequence[SegmentInfo],
    settings: ArchiveSettings,
    eligible: Callable[[SegmentInfo], bool],
) -> list[list[SegmentInfo]]:
    """Runs of consecutive small segments (under half the target) of one partition,
    in log order, each at most `compact_target_bytes` and at least
    `compact_min_files` long. A large or ineligible segment ends a run."""
    target = settings.compact_target_bytes
    if target <= 0:
        return []
    by_partition: dict[tuple[str, int], list[SegmentInfo]] = {}
    for s in segments:
        by_partition.setdefault((s.bucket_uuid, s.epoch), []).append(s)
    groups: list[list[SegmentInfo]] = []
    for _, parts in sorted(by_partition.items()):
        run: list[SegmentInfo] = []
        size = 0
        for s in sorted(parts, key=lambda s: s.first_index):
            small = s.bytes < target // 2 and eligible(s)
            if run and (not small or size + s.bytes > target):
                groups.append(run)
                run, size = [], 0
            if small:
                run.append(s)
                size += s.bytes
        groups.append(run)
    return [g for g in groups if len(g) >= settings.compact_min_files]


def compact(
    store: ArchiveStore,
    group: Sequence[SegmentInfo],
    compression: str | None,
    fault: Fault,
    buffer_bytes: int = COMPACT_BUFFER_BYTES,
) -> SegmentInfo:
    """Write one segment holding every row of `group` (in log order) and move it into
    place; the sources are left for the caller to retire. Rows are streamed through,
    a row group per `buffer_bytes`. Fault points: ``compacted-written`` (synced under
    a hidden name), ``compacted-published``."""
    first = group[0]
    directory = first.path.rsplit("/", 1)[0]
    name = segment_name(first.node_id, first.first_index, group[-1].last_index, compacted=True)
    final, tmp = f"{directory}/{name}", f"{directory}/.{name}.tmp"
    if store.exists(final):
        raise ArchiveError(f"{store.describe(final)} already exists; refusing to overwrite it")
    info = SegmentInfo(
        path=final,
        node_id=first.node_id,
        bucket=first.bucket,
        bucket_uuid=first.bucket_uuid,
        epoch=first.epoch,
        first_index=first.first_index,
        last_index=group[-1].last_index,
        rows=sum(s.rows for s in group),
        bytes=0,
        batch_epochs=(first.epoch,),
        ack_ms_max=max(s.ack_ms_max for s in group),
        compacted_from=tuple(s.path.rsplit("/", 1)[-1] for s in group),
    )
    schema = FILE_SCHEMA.with_metadata(segment_footer(info))
    rows = 0
    try:
        with store.parquet_writer(tmp, schema, compression) as out:
            rows = _stream_rows(store, group, out, buffer_bytes)
        if rows != info.rows:
            raise ArchiveError(
                f"compacting into {name}: read {rows} rows, the manifest says {info.rows}"
            )
        store.sync(tmp)
        size = int(store.info(tmp).size or 0)
        fault("compacted-written")
    except BaseException:
        store.delete(tmp)
        raise
    store.move(tmp, final)
    fault("compacted-published")
    log.info(
        "archive: compacted %d segments (%d rows) of %s into %s",
        len(group),
        rows,
        directory,
        name,
    )
    return dataclasses.replace(info, bytes=size)


def _stream_rows(
    store: ArchiveStore, group: Sequence[SegmentInfo], out: pq.ParquetWriter, buffer_bytes: int
) -> int:
    """Copy every row of `group` into `out` (a ParquetWriter); returns how many."""
    rows = 0
    buffered: list[pa.RecordBatch] = []
    size = 0
    for s in group:
        for batch in store.batches(s.path, COMPACT_BATCH_ROWS):
            rows += batch.num_rows
            buffered.append(conform(batch))  # a format-1 segment's rows: new columns null
            size += batch.nbytes
            if size >= buffer_bytes:
                out.write_table(pa.Table.from_batches(buffered).cast(FILE_SCHEMA))
                buffered, size = [], 0
    if buffered:
        out.write_table(pa.Table.from_batches(buffered).cast(FILE_SCHEMA))
    return rows


__all__ = [
    "Consumers",
    "compact",
    "compaction_groups",
    "read_consumers",
    "retention_victims",
]
