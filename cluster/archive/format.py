"""The archive's on-disk format, defined once: the Arrow schema of a segment, the
hive partition layout, segment names and their footer description. The writer
(pyarrow) and the Spark jobs (a DDL string derived here by `spark_ddl`) both derive
from these definitions, so the two sides cannot drift apart (docs/spark.md).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pyarrow as pa

#: The archive folder inside a local cluster's data dir (`sevendb cluster up --data`).
ARCHIVE_DIR: Final = "archive"
MANIFEST_DIR: Final = "_manifests"
#: Where stream consumers record what they have consumed (see `ConsumerMark`).
CONSUMERS_DIR: Final = "_consumers"
ORPHANS_DIR: Final = "_orphans"
#: Names starting with these are invisible to Spark and pyarrow datasets.
HIDDEN_PREFIXES: Final = (".", "_")
MANIFEST_FORMAT: Final = 1
#: 2: the transaction columns (`TXN_COLUMNS`). Format-1 segments (without them) are
#: still read: their rows read the columns as null (`conform`).
SEGMENT_FORMAT: Final = 2
SEGMENT_FORMATS_READ: Final = frozenset({1, 2})
CONSUMER_FORMAT: Final = 1
#: Footer key-value metadata key holding the segment's JSON description.
SEGMENT_METADATA_KEY: Final = b"sevendb.segment"
SEGMENT_SUFFIX: Final = ".parquet"
#: A compacted segment (several segments merged) ends in `.c.parquet`.
COMPACTED_SUFFIX: Final = ".c" + SEGMENT_SUFFIX

PARTITION_COLUMNS: Final = ("bucket_uuid", "epoch")
#: The dedupe key: one archived event. Every node's copy of it has the same content.
EVENT_KEY: Final = ("bucket_uuid", "sub_id", "epoch", "commit_index")

CHANGE_TYPE: Final = pa.struct(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("op", pa.string(), nullable=False),  # "SET" or "DEL"
        pa.field("value", pa.binary(), nullable=False),
        pa.field("version", pa.int64(), nullable=False),
    ]
)

#: The columns stored in each segment file (partition columns come from the path).
FILE_SCHEMA: Final = pa.schema(
    [
        pa.field("commit_index", pa.int64(), nullable=False),  # emit_seq.commit_index
        pa.field("sub_id", pa.string(), nullable=False),
        pa.field("prev_bucket_uuid", pa.string(), nullable=False),
        pa.field("prev_epoch", pa.int64(), nullable=False),
        pa.field("prev_commit_index", pa.int64(), nullable=False),
        pa.field("changes", pa.list_(pa.field("item", CHANGE_TYPE, nullable=False))),
        pa.field("commit_time_ms", pa.int64(), nullable=False),
        pa.field("ack_time_ms", pa.int64(), nullable=False),
        pa.field("purge_index", pa.int64(), nullable=False),  # the OUTBOX_PURGE entry
        pa.field("node_id", pa.string(), nullable=False),
        # Format 2: the transaction whose changes the event carries (docs/spark.md). All
        # null for a plain write's event and in format-1 segments.
        pa.field("txn_id", pa.string()),
        pa.field("txn_epoch", pa.int64()),
        pa.field("txn_number", pa.int64()),
        # true: made at the transaction's COMMIT marker; false: as one of its writes
        # applied, for a read_uncommitted subscription (the transaction undecided then)
        pa.field("txn_committed", pa.bool_()),
        # committed: how many of the transaction's changes in this bucket the
        # subscription's query selected, all of which the event must carry
        pa.field("txn_changes", pa.int64()),
        # the subscription reads uncommitted (null in format-1 segments: read_committed)
        pa.field("read_uncommitted", pa.bool_()),
    ]
)
#: The columns format 2 added, all nullable.
TXN_COLUMNS: Final = (
    "txn_id",
    "txn_epoch",
    "txn_number",
    "txn_committed",
    "txn_changes",
    "read_uncommitted",
)

#: The hive partition columns, as the directory names hold them.
PARTITION_SCHEMA: Final = pa.schema(
    [pa.field("bucket_uuid", pa.string()), pa.field("epoch", pa.int64())]
)

#: What a reader sees: the file columns plus the partition columns.
ARCHIVE_SCHEMA: Final = pa.unify_schemas([FILE_SCHEMA, PARTITION_SCHEMA])

_UTC_TIMESTAMP: Final = pa.timestamp("us", tz="UTC")
#: The exported (and streamed) warehouse table, one row per event: the archive's
#: columns minus `node_id`, plus the two times as timestamps.
EXPORT_SCHEMA: Final = pa.schema(
    [f for f in FILE_SCHEMA if f.name != "node_id"]
    + [pa.field("commit_time", _UTC_TIMESTAMP), pa.field("ack_time", _UTC_TIMESTAMP)]
    + list(PARTITION_SCHEMA)
)
#: Export columns computed from a millisecond column: `name -> source`.
EXPORT_TIMES: Final = {"commit_time": "commit_time_ms", "ack_time": "ack_time_ms"}

_ESCAPE: Final = frozenset("\"#%'*/:=?\\{[]^") | frozenset(chr(c) for c in range(0x20)) | {"\x7f"}
"""Spark's ExternalCatalogUtils.escapePathName: these become %XX in partition values."""


class ArchiveError(Exception):
    """The archive cannot be opened, read or written as asked."""


def conform(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A segment's rows in `FILE_SCHEMA`: a format-1 segment's rows get the columns
    format 2 added, as nulls (the other columns must be there)."""
    if batch.schema.equals(FILE_SCHEMA):
        return batch
    missing = [name for name in FILE_SCHEMA.names if name not in batch.schema.names]
    if any(name not in TXN_COLUMNS for name in missing):
        raise ArchiveError(f"a segment lacks the columns {missing}")
    columns = [
        batch.column(name) if name in batch.schema.names else pa.nulls(batch.num_rows, f.type)
        for name, f in zip(FILE_SCHEMA.names, FILE_SCHEMA, strict=True)
    ]
    return pa.RecordBatch.from_arrays(columns, schema=FILE_SCHEMA)


# ------------------------------------------------------------------------ Spark's view


_SPARK_SCALARS: Final = (
    (pa.types.is_string, "STRING"),
    (pa.types.is_large_string, "STRING"),
    (pa.types.is_int64, "BIGINT"),
    (pa.types.is_int32, "INT"),
    (pa.types.is_binary, "BINARY"),
    (pa.types.is_large_binary, "BINARY"),
    (pa.types.is_boolean, "BOOLEAN"),
    (pa.types.is_float64, "DOUBLE"),
)


def spark_type(t: pa.DataType) -> str:
    """The Spark SQL type of an Arrow type used in the archive."""
    for test, name in _SPARK_SCALARS:
        if test(t):
            return name
    if pa.types.is_timestamp(t):
        return "TIMESTAMP" if t.tz is not None else "TIMESTAMP_NTZ"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"ARRAY<{spark_type(t.value_type)}>"
    if pa.types.is_struct(t):
        return "STRUCT<" + ", ".join(f"{f.name}: {spark_type(f.type)}" for f in t) + ">"
    raise ArchiveError(f"no Spark type for Arrow type {t}")


def spark_ddl(schema: pa.Schema) -> str:
    """The schema as a Spark DDL string (`DataFrameReader.schema(...)` takes it)."""
    return ", ".join(f"{f.name} {spark_type(f.type)}" for f in schema)


# ------------------------------------------------------------------------------ layout


def archive_root(data_dir: Path) -> Path:
    """Where the nodes of a local cluster in `data_dir` write their archive (unless
    `SEVENDB_ARCHIVE_ROOT` names another root)."""
    return Path(data_dir) / ARCHIVE_DIR


def escape_partition_value(value: str) -> str:
    """Escape a partition value for a `name=value` directory the way Spark (and
    pyarrow's `segment_encoding="uri"`) unescape it."""
    if value == "":
        raise ArchiveError("an empty partition value cannot be archived")
    return "".join(f"%{ord(c):02X}" if c in _ESCAPE else c for c in value)


def partition_path(bucket_uuid: str, epoch: int) -> str:
    """The partition's directory relative to the archive root, '/'-separated."""
    return f"bucket_uuid={escape_partition_value(bucket_uuid)}/epoch={epoch}"


def partition_dir(root: Path, bucket_uuid: str, epoch: int) -> Path:
    return Path(root) / partition_path(bucket_uuid, epoch)


def is_hidden(relative: str) -> bool:
    """Whether readers skip this path (some part of it starts with `.` or `_`)."""
    return any(part.startswith(HIDDEN_PREFIXES) for part in relative.split("/"))


@dataclass(frozen=True, slots=True)
class SegmentName:
    """What a segment's file name says: `<node>-<first>-<last>[.c].parquet`."""

    node_id: str
    first_index: int
    last_index: int
    compacted: bool


_SEGMENT_NAME: Final = re.compile(
    r"(?P<node>.+)-(?P<first>\d{12})-(?P<last>\d{12})(?P<c>\.c)?\.parquet"
)
#: The same pattern for Spark's `regexp_extract` over a file name (groups 1, 2, 3).
SEGMENT_NAME_REGEX: Final = r"-(\d{12})-(\d{12})(\.c)?\.parquet$"


def segment_name(
    node_id: str, first_index: int, last_index: int, *, compacted: bool = False
) -> str:
    """A segment's file name: its node and the Raft indexes of the first and last
    OUTBOX_PURGE entry whose rows it holds (zero-padded, so names sort by index)."""
    suffix = COMPACTED_SUFFIX if compacted else SEGMENT_SUFFIX
    return f"{node_id}-{first_index:012d}-{last_index:012d}{suffix}"


def parse_segment_name(name: str) -> SegmentName | None:
    """The parts of a segment file name (a path's last part is used), or None."""
    m = _SEGMENT_NAME.fullmatch(name.rsplit("/", 1)[-1])
    if m is None:
        return None
    return SegmentName(m["node"], int(m["first"]), int(m["last"]), m["c"] is not None)


# ------------------------------------------------------------------------ descriptions


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One published segment file, as recorded in the manifest and in its footer."""

    path: str  # relative to the archive root, '/'-separated
    node_id: str
    bucket: int
    bucket_uuid: str
    epoch: int
    first_index: int  # first OUTBOX_PURGE entry in the batch
    last_index: int  # last OUTBOX_PURGE entry in the batch
    rows: int
    bytes: int
    #: Every epoch the batch wrote a part for; the batch is whole when all are present.
    batch_epochs: tuple[int, ...]
    #: The newest `ack_time_ms` in the segment (retention by age reads it).
    ack_ms_max: int = 0
    #: A compacted segment: the names of the segments whose rows it holds.
    compacted_from: tuple[str, ...] = ()

    @property
    def compacted(self) -> bool:
        return bool(self.compacted_from)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["batch_epochs"] = list(self.batch_epochs)
        d["compacted_from"] = list(self.compacted_from)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SegmentInfo:
        return cls(
            path=str(d["path"]),
            node_id=str(d["node_id"]),
            bucket=int(d["bucket"]),
            bucket_uuid=str(d["bucket_uuid"]),
            epoch=int(d["epoch"]),
            first_index=int(d["first_index"]),
            last_index=int(d["last_index"]),
            rows=int(d["rows"]),
            bytes=int(d["bytes"]),
            batch_epochs=tuple(int(e) for e in d["batch_epochs"]),
            ack_ms_max=int(d.get("ack_ms_max", 0)),
            compacted_from=tuple(str(n) for n in d.get("compacted_from", ())),
        )


def segment_footer(info: SegmentInfo) -> dict[bytes, bytes]:
    """The key-value metadata a segment file carries in its Parquet footer."""
    return {SEGMENT_METADATA_KEY: json.dumps({"format": SEGMENT_FORMAT, **info.to_json()}).encode()}


def info_from_footer(metadata: Mapping[bytes, bytes] | None, where: str) -> SegmentInfo:
    """The description in a segment's footer metadata (`where` names the file)."""
    raw = (metadata or {}).get(SEGMENT_METADATA_KEY)
    if raw is None:
        raise ArchiveError(f"{where} has no {SEGMENT_METADATA_KEY.decode()} footer metadata")
    d = json.loads(raw)
    if d.get("format") not in SEGMENT_FORMATS_READ:
        raise ArchiveError(f"{where}: unsupported segment format {d.get('format')!r}")
    return SegmentInfo.from_json(d)


# ------------------------------------------------------------------------- consumers


@dataclass(frozen=True, slots=True)
class ConsumerMark:
    """What one incremental reader (a `sevendb spark stream`) has consumed, written by
    it to `<root>/_consumers/<name>.json` after each batch's events are in its table:
    for each node, bucket and epoch, the `last_index` of the newest segment consumed.
    A node reads every mark and neither compacts nor deletes a segment of its own
    that a mark does not cover (docs/spark.md, retention)."""

    name: str
    updated_ms: int
    consumed: Mapping[str, Mapping[str, Mapping[int, int]]]

    def covers(self, node_id: str, bucket_uuid: str, epoch: int, last_index: int) -> bool:
        return self.consumed.get(node_id, {}).get(bucket_uuid, {}).get(epoch, 0) >= last_index

    def advanced(self, node_id: str, bucket_uuid: str, epoch: int, last_index: int) -> ConsumerMark:
        consumed = {n: {b: dict(e) for b, e in by.items()} for n, by in self.consumed.items()}
        epochs = consumed.setdefault(node_id, {}).setdefault(bucket_uuid, {})
        epochs[epoch] = max(epochs.get(epoch, 0), last_index)
        return dataclasses.replace(self, consumed=consumed)

    def to_bytes(self) -> bytes:
        consumed = {
            n: {b: {str(e): i for e, i in sorted(by_e.items())} for b, by_e in sorted(by.items())}
            for n, by in sorted(self.consumed.items())
        }
        d = {
            "format": CONSUMER_FORMAT,
            "name": self.name,
            "updated_ms": self.updated_ms,
            "consumed": consumed,
        }
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> ConsumerMark:
        try:
            d = json.loads(data)
            if d.get("format") != CONSUMER_FORMAT:
                raise ValueError(f"unsupported format {d.get('format')!r}")
            consumed = {
                str(n): {
                    str(b): {int(e): int(i) for e, i in by_e.items()} for b, by_e in by.items()
                }
                for n, by in d["consumed"].items()
            }
            return cls(str(d["name"]), int(d["updated_ms"]), consumed)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ArchiveError(f"consumer mark {where} is unreadable: {exc}") from None


def consumer_path(name: str) -> str:
    """A consumer mark's path relative to the archive root."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", name):
        raise ArchiveError(
            f"consumer name {name!r} must be 1-128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return f"{CONSUMERS_DIR}/{name}.json"


__all__ = [
    "ARCHIVE_DIR",
    "ARCHIVE_SCHEMA",
    "CHANGE_TYPE",
    "COMPACTED_SUFFIX",
    "CONSUMERS_DIR",
    "EVENT_KEY",
    "EXPORT_SCHEMA",
    "EXPORT_TIMES",
    "FILE_SCHEMA",
    "MANIFEST_DIR",
    "PARTITION_COLUMNS",
    "PARTITION_SCHEMA",
    "SEGMENT_FORMAT",
    "SEGMENT_FORMATS_READ",
    "SEGMENT_NAME_REGEX",
    "TXN_COLUMNS",
    "ArchiveError",
    "ConsumerMark",
    "SegmentInfo",
    "SegmentName",
    "archive_root",
    "conform",
    "consumer_path",
    "escape_partition_value",
    "info_from_footer",
    "is_hidden",
    "parse_segment_name",
    "partition_dir",
    "partition_path",
    "segment_footer",
    "segment_name",
    "spark_ddl",
    "spark_type",
]
