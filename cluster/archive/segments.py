"""Turning purged outbox rows into segment files: Arrow columns in the archive's
schema (`format.FILE_SCHEMA`), and the publication of one batch of whole purge
entries as one file per epoch, each written under a hidden name, synced, and only
then moved into place, so a reader sees a whole file or nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc

from sevendb.cluster.archive.format import (
    CHANGE_TYPE,
    FILE_SCHEMA,
    ArchiveError,
    SegmentInfo,
    partition_path,
    segment_footer,
    segment_name,
)
from sevendb.cluster.archive.manifest import Purge
from sevendb.cluster.archive.store import ArchiveStore
from sevendb.outbox.entries import OpKind
from sevendb.outbox.model import Delta, OutboxRow, delta_bytes

log = logging.getLogger("sevendb.archive")

_OP_NAMES = {op: op.name for op in OpKind}


def row_bytes(row: OutboxRow) -> int:
    """A cheap estimate of a row's uncompressed size (for `segment_bytes_max`): its
    keys' and values' bytes as the state machine counted them (`Delta.size_bytes`),
    which the rows of one source entry share, plus fixed overheads."""
    delta = row.delta
    size = delta.size_bytes
    if size < 0:
        size = delta_bytes(delta.changes)
    return 64 + len(row.sub_id) + 24 * len(delta.changes) + size


def _changes(triples: list[tuple[int, int, OutboxRow]]) -> pa.Array:
    """The `changes` column. The rows of one source entry usually share a Delta: each
    distinct Delta's changes become one list, and Arrow repeats it for its rows."""
    deltas: list[Delta] = []
    place: dict[int, int] = {}  # id(delta) -> its place in `deltas` (which keeps it alive)
    which: list[int] = []
    for _, _, row in triples:
        at = place.get(id(row.delta))
        if at is None:
            at = place[id(row.delta)] = len(deltas)
            deltas.append(row.delta)
        which.append(at)
    offsets = [0]
    keys: list[str] = []
    ops: list[str] = []
    values: list[bytes] = []
    versions: list[int] = []
    for delta in deltas:
        for c in delta.changes:
            keys.append(c.key)
            ops.append(_OP_NAMES[c.op])
            values.append(c.value)
            versions.append(c.version)
        offsets.append(len(keys))
    return (
        pa.ListArray.from_arrays(
            pa.array(offsets, pa.int32()),
            pa.StructArray.from_arrays(
                [
                    pa.array(keys, pa.string()),
                    pa.array(ops, pa.string()),
                    pa.array(values, pa.binary()),
                    pa.array(versions, pa.int64()),
                ],
                fields=list(CHANGE_TYPE),
            ),
        )
        .take(pa.array(which, pa.int32()))
        .cast(FILE_SCHEMA.field("changes").type)
    )


def rows_table(
    rows: Iterable[tuple[int, int, OutboxRow]],
    node_id: str,
    read_uncommitted: Collection[str] = frozenset(),
) -> pa.Table:
    """Arrow columns (FILE_SCHEMA) for `(purge_index, ack_time_ms, row)` triples;
    `read_uncommitted`: the sub_ids among them whose subscriptions read uncommitted."""
    triples = list(rows)
    seqs = [row.emit_seq for _, _, row in triples]
    prevs = [row.prev_emit_seq for _, _, row in triples]
    tags = [row.delta.txn for _, _, row in triples]
    columns = {
        "commit_index": [s.commit_index for s in seqs],
        "sub_id": [row.sub_id for _, _, row in triples],
        "prev_bucket_uuid": [s.bucket_uuid for s in prevs],
        "prev_epoch": [s.epoch_counter for s in prevs],
        "prev_commit_index": [s.commit_index for s in prevs],
        "changes": _changes(triples),
        "commit_time_ms": [row.delta.commit_time_ms for _, _, row in triples],
        "ack_time_ms": [ack_ms for _, ack_ms, _ in triples],
        "purge_index": [purge for purge, _, _ in triples],
        "node_id": pa.repeat(pa.scalar(node_id, pa.string()), len(triples)),
        "txn_id": [None if t is None else t.txn_id for t in tags],
        "txn_epoch": [None if t is None else t.epoch for t in tags],
        "txn_number": [None if t is None else t.number for t in tags],
        "txn_committed": [None if t is None else t.committed for t in tags],
        "txn_changes": [
            len(row.delta.changes) if t is not None and t.committed else None
            for t, (_, _, row) in zip(tags, triples, strict=True)
        ],
        "read_uncommitted": [row.sub_id in read_uncommitted for _, _, row in triples],
    }
    return pa.Table.from_pydict(columns, schema=FILE_SCHEMA)


@dataclass(frozen=True, slots=True)
class _Part:
    directory: str
    final: str
    info: SegmentInfo
    table: pa.Table


def _plan(node_id: str, bucket: int, bucket_uuid: str, batch: list[Purge]) -> list[_Part]:
    by_epoch: dict[int, list[tuple[int, int, OutboxRow]]] = {}
    for purge in batch:
        for ack_ms, rows in purge.effects:
            for row in rows:
                by_epoch.setdefault(row.emit_seq.epoch_counter, []).append(
                    (purge.index, ack_ms, row)
                )
    readers = frozenset().union(*(purge.read_uncommitted for purge in batch))
    epochs = tuple(sorted(by_epoch))
    first, last = batch[0].index, batch[-1].index
    name = segment_name(node_id, first, last)
    parts = []
    for epoch in epochs:
        directory = partition_path(bucket_uuid, epoch)
        table = rows_table(by_epoch[epoch], node_id, readers)
        info = SegmentInfo(
            path=f"{directory}/{name}",
            node_id=node_id,
            bucket=bucket,
            bucket_uuid=bucket_uuid,
            epoch=epoch,
            first_index=first,
            last_index=last,
            rows=table.num_rows,
            bytes=0,
            batch_epochs=epochs,
            ack_ms_max=int(pc.max(table.column("ack_time_ms")).as_py() or 0),
        )
        parts.append(_Part(directory, info.path, info, table))
    return parts


def write_batch(
    store: ArchiveStore,
    node_id: str,
    bucket: int,
    bucket_uuid: str,
    batch: list[Purge],
    compression: str | None,
    ensure_dir: Callable[[str], None],
    fault: Callable[[str], None],
) -> list[SegmentInfo]:
    """Publish one batch: one file per epoch; returns their descriptions. Fault points:
    ``segment-written`` (a part is synced under its hidden name), ``part-published``
    (a part was moved into place; more may follow), ``segments-published``."""
    parts = _plan(node_id, bucket, bucket_uuid, batch)
    # Write and sync every part before moving any, so a crash leaves either hidden tmp
    # files (removed at restart) or parts that are complete files.
    written: list[tuple[str, _Part, SegmentInfo]] = []
    try:
        for part in parts:
            ensure_dir(part.directory)
            if store.exists(part.final):
                raise ArchiveError(
                    f"{store.describe(part.final)} already exists; refusing to overwrite it"
                )
            tmp = f"{part.directory}/.{part.final.rsplit('/', 1)[-1]}.tmp"
            table = part.table.replace_schema_metadata(segment_footer(part.info))
            size = store.write_table(tmp, table, compression)
            written.append((tmp, part, replace(part.info, bytes=size)))
            fault("segment-written")
    except BaseException:
        for part in parts:
            with contextlib.suppress(OSError):
                store.delete(f"{part.directory}/.{part.final.rsplit('/', 1)[-1]}.tmp")
        raise
    infos: list[SegmentInfo] = []
    for tmp, part, info in written:
        store.move(tmp, part.final)
        infos.append(info)
        log.info(
            "archive: published %s (%d rows, %d bytes, entries %d..%d)",
            info.path,
            info.rows,
            info.bytes,
            info.first_index,
            info.last_index,
        )
        fault("part-published")
    fault("segments-published")
    return infos


__all__ = ["row_bytes", "rows_table", "write_batch"]
