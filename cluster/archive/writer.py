"""The drained-outbox archive: acknowledged (purged) outbox rows, written by every node
to immutable Parquet segments that Spark reads (`sevendb.cluster.archive.spark_jobs`,
docs/spark.md).

Layout under the archive root (hive-style, so Spark and pyarrow prune partitions)::

    root/bucket_uuid=<uuid>/epoch=<n>/<node>-<first>-<last>.parquet   published segments
    root/bucket_uuid=<uuid>/epoch=<n>/.<node>-<first>-<last>.parquet.tmp   being written
    root/_manifests/<node>.json                                          per-node manifest
    root/_manifests/<node>.lock                                          one writer per node

`<first>`/`<last>` are the Raft indexes of the first and last OUTBOX_PURGE entry whose
rows the segment holds. Files and directories starting with `.` or `_` are invisible
to Spark and pyarrow datasets.

One row per archived event (an `OutboxRow`), its changes as a list; see `FILE_SCHEMA`.
The partition columns `bucket_uuid` and `epoch` (the row's emit_seq epoch) live in the
directory names, not in the files.

Crash safety (docs/spark.md has the argument in full):

* `on_applied` (the replica's tick thread) only buffers. A background thread (or
  `flush()`/`close()`) cuts a batch of whole purge entries, writes one file per epoch
  to a hidden tmp name, fsyncs it, renames it into place and fsyncs the directory, and
  then rewrites the manifest the same way. No reader ever sees a partial file.
* `archived_through(bucket)` is the highest log index at or below which every purge
  this writer was handed is durably published. It only grows, so a stale read is a
  lower, safer value. The node holds log compaction at it: rows not yet published are
  still in the log and are produced again by replay after a crash.
* After a restart, effects of entries at or below the persisted `archived_through` are
  skipped (they were published), so nothing is archived twice. Segments renamed into
  place just before a crash but not yet in the manifest are adopted from their footer
  metadata; a multi-epoch batch caught half-renamed keeps its published parts and only
  the missing epochs are written again.
* Every replica of a bucket archives the same rows (one copy per node), and a replica
  that installed a snapshot from its leader never sees the purges inside it (the
  leader archived them before compacting). Readers therefore take the union of all
  nodes' copies and deduplicate by `(bucket_uuid, sub_id, epoch, commit_index)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.dataset as pa_ds
import pyarrow.parquet as pq

from sevendb.cluster.common.files import fsync_dir, write_synced
from sevendb.outbox.entries import OpKind
from sevendb.outbox.model import Applied, Delta, OutboxRow, RowsPurged
from sevendb.proto.threads import name_os_thread

log = logging.getLogger("sevendb.archive")

#: The archive folder inside a local cluster's data dir (`sevendb cluster up --data`).
ARCHIVE_DIR: Final = "archive"
MANIFEST_DIR: Final = "_manifests"
MANIFEST_FORMAT: Final = 1
SEGMENT_FORMAT: Final = 1
#: Footer key-value metadata key holding the segment's JSON description.
SEGMENT_METADATA_KEY: Final = b"sevendb.segment"
SEGMENT_SUFFIX: Final = ".parquet"

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
    ]
)

#: What a reader sees: file columns plus the hive partition columns.
PARTITION_SCHEMA: Final = pa.schema(
    [pa.field("bucket_uuid", pa.string()), pa.field("epoch", pa.int64())]
)

_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_COMPRESSIONS: Final = ("zstd", "snappy", "gzip", "lz4", "none")
# Spark's ExternalCatalogUtils.escapePathName: these become %XX in partition values.
_ESCAPE: Final = frozenset("\"#%'*/:=?\\{[]^") | frozenset(chr(c) for c in range(0x20)) | {"\x7f"}

ENV_PREFIX: Final = "SEVENDB_ARCHIVE_"
SEGMENT_ROWS_MAX: Final = 100_000
SEGMENT_BYTES_MAX: Final = 64 * 1024 * 1024
SEGMENT_AGE_S_MAX: Final = 30.0
COMPRESSION: Final = "zstd"
RETRY_S_MAX: Final = 30.0


class ArchiveError(Exception):
    """The archive cannot be opened or written as asked."""


class ArchiveConfigError(ArchiveError, ValueError):
    """A bad writer setting; the message names it and says what is allowed."""


def archive_root(data_dir: Path) -> Path:
    """Where the nodes of a local cluster in `data_dir` write their archive."""
    return Path(data_dir) / ARCHIVE_DIR


def escape_partition_value(value: str) -> str:
    """Escape a partition value for a `name=value` directory the way Spark (and
    pyarrow's `segment_encoding="uri"`) unescape it."""
    if value == "":
        raise ArchiveError("an empty partition value cannot be archived")
    return "".join(f"%{ord(c):02X}" if c in _ESCAPE else c for c in value)


def partition_dir(root: Path, bucket_uuid: str, epoch: int) -> Path:
    return root / f"bucket_uuid={escape_partition_value(bucket_uuid)}" / f"epoch={epoch}"


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class ArchiveSettings:
    """Segment rotation: a segment is cut at the first purge-entry boundary at or past
    `segment_rows_max` rows or `segment_bytes_max` bytes (uncompressed estimate), or
    when its oldest row has waited `segment_age_s_max` seconds."""

    segment_rows_max: int = SEGMENT_ROWS_MAX
    segment_bytes_max: int = SEGMENT_BYTES_MAX
    segment_age_s_max: float = SEGMENT_AGE_S_MAX
    compression: str = COMPRESSION
    #: The longest wait between retries of a failed publish (doubling from 0.1 s).
    retry_s_max: float = RETRY_S_MAX

    def __post_init__(self) -> None:
        for name in ("segment_rows_max", "segment_bytes_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArchiveConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("segment_age_s_max", "retry_s_max"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ArchiveConfigError(
                    f"{name} must be a positive, finite number of seconds, got {value!r}"
                )
        if self.compression not in _COMPRESSIONS:
            raise ArchiveConfigError(
                f"compression must be one of {', '.join(_COMPRESSIONS)}, got {self.compression!r}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ArchiveSettings:
        """`SEVENDB_ARCHIVE_SEGMENT_ROWS_MAX`, `..._SEGMENT_BYTES_MAX`,
        `..._SEGMENT_AGE_S_MAX`, `..._COMPRESSION`, `..._RETRY_S_MAX` override the
        defaults; anything else starting with `SEVENDB_ARCHIVE_` is refused."""
        kwargs: dict[str, Any] = {}
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        for key, raw in environ.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name not in known:
                raise ArchiveConfigError(
                    f"unknown setting {key}; known: "
                    + ", ".join(ENV_PREFIX + n.upper() for n in known)
                )
            try:
                if name == "compression":
                    kwargs[name] = raw.strip()
                elif name in ("segment_rows_max", "segment_bytes_max"):
                    kwargs[name] = int(raw)
                else:
                    kwargs[name] = float(raw)
            except ValueError:
                raise ArchiveConfigError(f"{key}={raw!r} is not a number") from None
        return cls(**kwargs)


# ------------------------------------------------------------------------------ segments


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

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["batch_epochs"] = list(self.batch_epochs)
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
        )


def segment_name(node_id: str, first_index: int, last_index: int) -> str:
    return f"{node_id}-{first_index:012d}-{last_index:012d}{SEGMENT_SUFFIX}"


def read_segment_info(path: Path) -> SegmentInfo:
    """The description a segment carries in its Parquet footer."""
    metadata = pq.read_schema(path).metadata or {}
    raw = metadata.get(SEGMENT_METADATA_KEY)
    if raw is None:
        raise ArchiveError(f"{path} has no {SEGMENT_METADATA_KEY.decode()} footer metadata")
    d = json.loads(raw)
    if d.get("format") != SEGMENT_FORMAT:
        raise ArchiveError(f"{path}: unsupported segment format {d.get('format')!r}")
    return SegmentInfo.from_json(d)


def read_archive(root: Path, *, node_id: str | None = None) -> pa.Table:
    """Every published row under `root` (all nodes' copies, not deduplicated) with the
    partition columns, through pyarrow; the Spark jobs read the same files."""
    root = Path(root)
    if not root.is_dir():
        raise ArchiveError(f"archive root {root} is not a directory")
    dataset = pa_ds.dataset(
        str(root),
        format="parquet",
        schema=pa.unify_schemas([FILE_SCHEMA, PARTITION_SCHEMA]),
        partitioning=pa_ds.partitioning(PARTITION_SCHEMA, flavor="hive"),
        ignore_prefixes=[".", "_"],
    )
    expr = None if node_id is None else pa_ds.field("node_id") == node_id
    return dataset.to_table(filter=expr)


_OP_NAMES: Final = {op: op.name for op in OpKind}


def rows_table(rows: Iterable[tuple[int, int, OutboxRow]], node_id: str) -> pa.Table:
    """Arrow columns (FILE_SCHEMA) for `(purge_index, ack_time_ms, row)` triples."""
    triples = list(rows)
    n = len(triples)
    # The rows of one source entry usually share a Delta: each distinct Delta's
    # changes become one list, and Arrow repeats it for the rows that share it.
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
    changes = (
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
    seqs = [row.emit_seq for _, _, row in triples]
    prevs = [row.prev_emit_seq for _, _, row in triples]
    commit_index = [s.commit_index for s in seqs]
    sub_id = [row.sub_id for _, _, row in triples]
    prev_uuid = [s.bucket_uuid for s in prevs]
    prev_epoch = [s.epoch_counter for s in prevs]
    prev_index = [s.commit_index for s in prevs]
    commit_time = [row.delta.commit_time_ms for _, _, row in triples]
    ack_time = [ack_ms for _, ack_ms, _ in triples]
    purge_index = [purge for purge, _, _ in triples]
    return pa.Table.from_arrays(
        [
            pa.array(commit_index, pa.int64()),
            pa.array(sub_id, pa.string()),
            pa.array(prev_uuid, pa.string()),
            pa.array(prev_epoch, pa.int64()),
            pa.array(prev_index, pa.int64()),
            changes,
            pa.array(commit_time, pa.int64()),
            pa.array(ack_time, pa.int64()),
            pa.array(purge_index, pa.int64()),
            pa.repeat(pa.scalar(node_id, pa.string()), n) if n else pa.array([], pa.string()),
        ],
        schema=FILE_SCHEMA,
    )


# --------------------------------------------------------------------------- the writer


@dataclass(slots=True)
class _Purge:
    """The rows one OUTBOX_PURGE entry removed (restricted to epochs still to write),
    as `(ack_time_ms, rows)` per RowsPurged effect. An entry is never split between
    segments: `archived_through` moves by whole entries."""

    index: int
    effects: tuple[tuple[int, tuple[OutboxRow, ...]], ...]
    rows: int
    nbytes: int
    added: float  # clock() when buffered


@dataclass(slots=True)
class _Partial:
    """A batch caught half-renamed by a crash: its parts for `epochs` are published;
    replayed entries in [first, last] write only the other epochs."""

    first: int
    last: int
    epochs: frozenset[int]

    def to_json(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "epochs": sorted(self.epochs)}


@dataclass(slots=True)
class _Bucket:
    bucket: int
    bucket_uuid: str | None = None
    durable: int = 0  # archived_through as persisted in the manifest
    seen: int = 0  # the last log index handed to on_applied (or skipped)
    pending: list[_Purge] = field(default_factory=list)
    pending_rows: int = 0
    pending_bytes: int = 0
    inflight_first: int | None = None
    partial: _Partial | None = None
    broken: str | None = None  # why on_applied failed: the value is frozen
    frozen: int = 0

    def through(self) -> int:
        """Every purge at or below this index is durably published."""
        if self.broken is not None:
            return self.frozen
        firsts = [p.index for p in self.pending[:1]]
        if self.inflight_first is not None:
            firsts.append(self.inflight_first)
        value = min(firsts) - 1 if firsts else self.seen
        return max(self.durable, value)


@dataclass(frozen=True, slots=True)
class WriterStats:
    rows_buffered: int
    rows_published: int
    rows_skipped: int
    segments_published: int
    segments_adopted: int
    publish_failures: int
    last_error: str | None


def _row_bytes(row: OutboxRow) -> int:
    """A cheap estimate of a row's uncompressed size (for `segment_bytes_max`)."""
    n = 64 + len(row.sub_id)
    for c in row.delta.changes:
        n += 24 + len(c.key) + len(c.value)
    return n


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Fault = Callable[[str], None]


class ArchiveWriter:
    """One node's archive writer: `on_applied(bucket, applied)` from every local
    replica's tick thread; `archived_through(bucket)` for the compaction hold point.

    Fault points (for crash tests; `fault(name)` is called there): ``segment-written``
    (a part is fsynced under its tmp name), ``part-published`` (a part was renamed into
    place; more parts of the batch may follow), ``segments-published`` (the whole batch
    is in place, the manifest not yet rewritten), ``manifest-written``.
    """

    def __init__(
        self,
        root: Path | str,
        node_id: str,
        *,
        segment_rows_max: int = SEGMENT_ROWS_MAX,
        segment_bytes_max: int = SEGMENT_BYTES_MAX,
        segment_age_s_max: float = SEGMENT_AGE_S_MAX,
        compression: str = COMPRESSION,
        retry_s_max: float = RETRY_S_MAX,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
        on_archived: Callable[[int, int], None] | None = None,
        fault: Fault | None = None,
    ) -> None:
        self.settings = ArchiveSettings(
            segment_rows_max=segment_rows_max,
            segment_bytes_max=segment_bytes_max,
            segment_age_s_max=segment_age_s_max,
            compression=compression,
            retry_s_max=retry_s_max,
        )
        if not isinstance(node_id, str) or not _NODE_ID.fullmatch(node_id):
            raise ArchiveConfigError(
                f"node_id {node_id!r} must be 1-128 characters of letters, digits, '_', "
                "'.' or '-', starting with a letter or digit (it names files)"
            )
        self.root = Path(root).resolve()
        self.node_id = node_id
        self._clock = clock
        self._on_archived = on_archived
        self._fault = fault
        if self.root.exists() and not self.root.is_dir():
            raise ArchiveConfigError(f"archive root {self.root} exists and is not a directory")
        self._manifest_dir = self.root / MANIFEST_DIR
        try:
            self._manifest_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ArchiveConfigError(f"cannot create archive root {self.root}: {exc}") from exc
        self.manifest_path = self._manifest_dir / f"{node_id}.json"
        self._lock_fd = self._acquire_lock()

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._publish_lock = threading.Lock()
        self._buckets: dict[int, _Bucket] = {}
        self._segments: list[SegmentInfo] = []
        self._known_dirs: set[Path] = set()
        self._closing = False
        self._closed = False
        self._manifest_dirty = False
        self._retry_at: float | None = None
        self._retry_s = 0.1
        self._rows_published = 0
        self._rows_skipped = 0
        self._segments_published = 0
        self._segments_adopted = 0
        self._publish_failures = 0
        self._last_error: str | None = None
        try:
            self._recover()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, name=f"archive-{node_id}", daemon=True
            )
            self._thread.start()

    @classmethod
    def from_env(
        cls, root: Path | str, node_id: str, environ: Mapping[str, str], **kwargs: Any
    ) -> ArchiveWriter:
        s = ArchiveSettings.from_env(environ)
        return cls(
            root,
            node_id,
            segment_rows_max=s.segment_rows_max,
            segment_bytes_max=s.segment_bytes_max,
            segment_age_s_max=s.segment_age_s_max,
            compression=s.compression,
            retry_s_max=s.retry_s_max,
            **kwargs,
        )

    # -- the tick thread -------------------------------------------------------------

    def on_applied(self, bucket: int, applied: Applied) -> None:
        """Buffer the rows of any `RowsPurged` effect of this applied entry. Calls for
        one bucket come from one thread (its replica's tick thread), in log order.
        Cheap and never raises: a failure here freezes the bucket's `archived_through`
        below this entry (so the log keeps its rows) and is logged."""
        try:
            self._on_applied(bucket, applied)
        except Exception as exc:
            with self._lock:
                st = self._buckets.setdefault(bucket, _Bucket(bucket))
                if st.broken is None:
                    st.frozen = st.through()
                    st.broken = f"{type(exc).__name__}: {exc}"
            log.critical(
                "archive: bucket %d: cannot buffer entry %d (%s); archived_through stays "
                "at %d until restart so the log keeps its rows",
                bucket,
                applied.commit_index,
                exc,
                self.archived_through(bucket),
                exc_info=True,
            )

    def _on_applied(self, bucket: int, applied: Applied) -> None:
        index = applied.commit_index
        effects = tuple(
            (e.ack_time_ms, e.rows) for e in applied.effects if isinstance(e, RowsPurged) and e.rows
        )
        with self._lock:
            if self._closing:
                return  # not archived: archived_through stays put, replay brings it back
            st = self._buckets.get(bucket)
            if st is None:
                st = self._buckets[bucket] = _Bucket(bucket)
            if st.broken is not None:
                return
            if index <= st.seen:
                # At or below archived_through after a restart: already published.
                self._rows_skipped += sum(len(rows) for _, rows in effects)
                return
            partial = st.partial
        # Outside the lock (one thread feeds a bucket); nothing is changed until the end,
        # so a failure here leaves the bucket as it was.
        skipped = 0
        if effects and partial is not None and partial.first <= index <= partial.last:
            kept = tuple(
                (ack, tuple(r for r in rows if r.emit_seq.epoch_counter not in partial.epochs))
                for ack, rows in effects
            )
            skipped = sum(len(r) for _, r in effects) - sum(len(r) for _, r in kept)
            effects = tuple((ack, rows) for ack, rows in kept if rows)
        purge: _Purge | None = None
        bucket_uuid: str | None = None
        if effects:
            bucket_uuid = effects[0][1][0].emit_seq.bucket_uuid
            purge = _Purge(
                index,
                effects,
                sum(len(rows) for _, rows in effects),
                sum(_row_bytes(r) for _, rows in effects for r in rows),
                self._clock(),
            )
        with self._lock:
            if self._closing:
                return
            self._rows_skipped += skipped
            if purge is not None:
                if st.bucket_uuid is None:
                    st.bucket_uuid = bucket_uuid
                was_empty = not st.pending
                before = st.pending_rows
                st.pending.append(purge)
                st.pending_rows += purge.rows
                st.pending_bytes += purge.nbytes
                s = self.settings
                if was_empty or (
                    before < s.segment_rows_max <= st.pending_rows
                    or st.pending_bytes >= s.segment_bytes_max
                ):
                    self._cond.notify_all()
            st.seen = index

    # -- queries (any thread) ----------------------------------------------------------

    def archived_through(self, bucket: int) -> int:
        """The highest log index of `bucket` at or below which every purged row handed to
        this writer is durably published (0 before anything). Never decreases; the
        node's log compaction must not pass it."""
        with self._lock:
            st = self._buckets.get(bucket)
            return 0 if st is None else st.through()

    def buckets(self) -> dict[int, int]:
        """`archived_through` of every bucket the writer knows."""
        with self._lock:
            return {b: st.through() for b, st in self._buckets.items()}

    def segments(self) -> list[SegmentInfo]:
        with self._lock:
            return list(self._segments)

    def stats(self) -> WriterStats:
        with self._lock:
            return WriterStats(
                rows_buffered=sum(st.pending_rows for st in self._buckets.values()),
                rows_published=self._rows_published,
                rows_skipped=self._rows_skipped,
                segments_published=self._segments_published,
                segments_adopted=self._segments_adopted,
                publish_failures=self._publish_failures,
                last_error=self._last_error,
            )

    def wait_archived(self, bucket: int, index: int, timeout_s: float) -> bool:
        """Block until `archived_through(bucket) >= index` is durable in the manifest."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                st = self._buckets.get(bucket)
                if st is not None and st.durable >= index:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)

    # -- publishing ------------------------------------------------------------------

    def publish_due(self) -> int:
        """Publish every bucket whose buffer is due by size or age; returns the number
        of segment files published. Errors are recorded and retried, not raised (this
        is what the background thread runs)."""
        return self._publish(force=False, raise_errors=False)

    def flush(self) -> int:
        """Publish everything buffered and persist the manifest now; raises
        `ArchiveError` if that fails (the rows stay buffered)."""
        with self._lock:
            if self._closed:
                raise ArchiveError(f"archive writer for node {self.node_id} is closed")
        return self._publish(force=True, raise_errors=True)

    def close(self) -> None:
        """Stop the background thread, publish what is buffered, release the root."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        try:
            self._publish(force=True, raise_errors=True)
        finally:
            with self._cond:
                self._closed = True
            os.close(self._lock_fd)

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _due(self, st: _Bucket, now: float) -> bool:
        if not st.pending or st.broken is not None or st.inflight_first is not None:
            return False
        s = self.settings
        return (
            st.pending_rows >= s.segment_rows_max
            or st.pending_bytes >= s.segment_bytes_max
            or now - st.pending[0].added >= s.segment_age_s_max
        )

    def _next_wakeup(self, now: float) -> float | None:
        """Seconds until the next age deadline or retry (None: wait for a notify)."""
        if self._retry_at is not None:
            return max(0.0, self._retry_at - now)
        ages = [
            st.pending[0].added + self.settings.segment_age_s_max - now
            for st in self._buckets.values()
            if st.pending and st.broken is None
        ]
        return max(0.0, min(ages)) if ages else None

    def _run(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                while not self._closing:
                    now = self._clock()
                    if self._retry_at is None and any(
                        self._due(st, now) for st in self._buckets.values()
                    ):
                        break
                    wait = self._next_wakeup(now)
                    if wait == 0.0:
                        self._retry_at = None
                        break
                    self._cond.wait(wait)
                if self._closing:
                    return
            self.publish_due()

    def _take(self, st: _Bucket, bound: int | None, now: float) -> list[_Purge]:
        """Cut the next batch of whole purge entries off the bucket's buffer (forced up
        to log index `bound`, else only when due)."""
        if not st.pending or st.broken is not None or st.inflight_first is not None:
            return []
        if bound is None:
            if not self._due(st, now):
                return []
            bound = st.seen
        s = self.settings
        batch: list[_Purge] = []
        rows = nbytes = 0
        while (
            st.pending
            and st.pending[0].index <= bound
            and rows < s.segment_rows_max
            and nbytes < s.segment_bytes_max
        ):
            purge = st.pending.pop(0)
            batch.append(purge)
            rows += purge.rows
            nbytes += purge.nbytes
        if not batch:
            return []
        st.pending_rows -= rows
        st.pending_bytes -= nbytes
        st.inflight_first = batch[0].index
        return batch

    def _publish(self, *, force: bool, raise_errors: bool) -> int:
        published = 0
        errors: list[str] = []
        with self._publish_lock:
            with self._lock:
                # A flush publishes what was handed over before it started, no more.
                bounds = {b: st.seen for b, st in self._buckets.items()} if force else {}
            while True:
                with self._lock:
                    now = self._clock()
                    work = [
                        (st, batch)
                        for b, st in self._buckets.items()
                        if (batch := self._take(st, bounds.get(b) if force else None, now))
                    ]
                if not work:
                    break
                for st, batch in work:
                    try:
                        infos = self._write_batch(st, batch)
                    except Exception as exc:
                        errors.append(self._failed(st, batch, exc))
                        continue
                    with self._lock:
                        st.inflight_first = None
                        self._segments.extend(infos)
                        self._segments_published += len(infos)
                        self._rows_published += sum(i.rows for i in infos)
                        self._manifest_dirty = True
                    published += len(infos)
                if errors or not force:
                    break
            with self._lock:
                stale = any(st.through() != st.durable for st in self._buckets.values())
            if published or self._manifest_dirty or (force and stale):
                try:
                    self._write_manifest()
                except Exception as exc:
                    message = f"manifest {self.manifest_path}: {type(exc).__name__}: {exc}"
                    with self._lock:
                        self._publish_failures += 1
                        self._last_error = message
                    log.error("archive: cannot write %s (will retry)", message)
                    errors.append(message)
                    self._schedule_retry()
            if not errors:
                with self._lock:
                    self._retry_s = 0.1
                    self._retry_at = None
        if errors and raise_errors:
            raise ArchiveError("archive publish failed: " + "; ".join(errors))
        return published

    def _failed(self, st: _Bucket, batch: list[_Purge], exc: Exception) -> str:
        with self._lock:
            st.pending[0:0] = batch  # nothing lost: retried in order
            st.pending_rows += sum(p.rows for p in batch)
            st.pending_bytes += sum(p.nbytes for p in batch)
            st.inflight_first = None
            self._publish_failures += 1
            message = (
                f"bucket {st.bucket} entries {batch[0].index}..{batch[-1].index}: "
                f"{type(exc).__name__}: {exc}"
            )
            self._last_error = message
        log.error("archive: cannot publish %s (will retry)", message)
        self._schedule_retry()
        return message

    def _schedule_retry(self) -> None:
        with self._lock:
            self._retry_at = self._clock() + self._retry_s
            self._retry_s = min(self._retry_s * 2, self.settings.retry_s_max)

    def _write_batch(self, st: _Bucket, batch: list[_Purge]) -> list[SegmentInfo]:
        """Write one file per epoch (tmp, fsync, rename, fsync dir); returns their infos."""
        assert st.bucket_uuid is not None
        by_epoch: dict[int, list[tuple[int, int, OutboxRow]]] = {}
        for purge in batch:
            for ack_ms, rows in purge.effects:
                for row in rows:
                    by_epoch.setdefault(row.emit_seq.epoch_counter, []).append(
                        (purge.index, ack_ms, row)
                    )
        epochs = tuple(sorted(by_epoch))
        first, last = batch[0].index, batch[-1].index
        name = segment_name(self.node_id, first, last)
        planned: list[tuple[Path, Path, SegmentInfo, pa.Table]] = []
        for epoch in sorted(by_epoch):
            directory = partition_dir(self.root, st.bucket_uuid, epoch)
            final = directory / name
            table = rows_table(by_epoch[epoch], self.node_id)
            info = SegmentInfo(
                path=final.relative_to(self.root).as_posix(),
                node_id=self.node_id,
                bucket=st.bucket,
                bucket_uuid=st.bucket_uuid,
                epoch=epoch,
                first_index=first,
                last_index=last,
                rows=table.num_rows,
                bytes=0,
                batch_epochs=epochs,
            )
            planned.append((directory, final, info, table))
        # Write and fsync every part before renaming any, so a crash leaves either
        # hidden tmp files (removed at restart) or parts that are complete files.
        written: list[tuple[Path, Path, SegmentInfo]] = []
        try:
            for directory, final, info, table in planned:
                self._ensure_dir(directory)
                if final.exists():
                    raise ArchiveError(f"{final} already exists; refusing to overwrite it")
                tmp = directory / f".{name}.tmp"
                meta = json.dumps({"format": SEGMENT_FORMAT, **info.to_json()}).encode()
                table = table.replace_schema_metadata({SEGMENT_METADATA_KEY: meta})
                codec = self.settings.compression
                compression = None if codec == "none" else codec
                pq.write_table(table, str(tmp), compression=compression)
                _fsync_file(tmp)
                size = tmp.stat().st_size
                written.append((tmp, final, dataclasses.replace(info, bytes=size)))
                self._fire("segment-written")
        except BaseException:
            for tmp, _, _ in written:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            for directory, final, _, _ in planned:
                with contextlib.suppress(OSError):
                    (directory / f".{final.name}.tmp").unlink()
            raise
        infos: list[SegmentInfo] = []
        for tmp, final, info in written:
            os.rename(tmp, final)
            fsync_dir(final.parent)
            infos.append(info)
            log.info(
                "archive: published %s (%d rows, %d bytes, entries %d..%d)",
                info.path,
                info.rows,
                info.bytes,
                first,
                last,
            )
            self._fire("part-published")
        self._fire("segments-published")
        return infos

    def _ensure_dir(self, directory: Path) -> None:
        if directory in self._known_dirs:
            return
        for d in (directory.parent, directory):
            if not d.is_dir():
                d.mkdir(parents=True, exist_ok=True)
                fsync_dir(d.parent)
        self._known_dirs.add(directory)

    def _fire(self, point: str) -> None:
        if self._fault is not None:
            self._fault(point)

    # -- manifest ----------------------------------------------------------------------

    def _manifest(self) -> dict[str, Any]:
        with self._lock:
            return {
                "format": MANIFEST_FORMAT,
                "node_id": self.node_id,
                "buckets": {
                    str(b): {
                        "bucket_uuid": st.bucket_uuid,
                        "archived_through": st.through(),
                        **(
                            {"partial": st.partial.to_json()}
                            if st.partial is not None and st.through() < st.partial.last
                            else {}
                        ),
                    }
                    for b, st in sorted(self._buckets.items())
                },
                "segments": [s.to_json() for s in self._segments],
            }

    def _write_manifest(self) -> None:
        manifest = self._manifest()
        tmp = self._manifest_dir / f".{self.node_id}.json.tmp"
        write_synced(tmp, json.dumps(manifest, indent=1, sort_keys=True).encode())
        os.rename(tmp, self.manifest_path)
        fsync_dir(self._manifest_dir)
        self._fire("manifest-written")
        advanced: list[tuple[int, int]] = []
        with self._cond:
            self._manifest_dirty = False
            for b, entry in manifest["buckets"].items():
                st = self._buckets[int(b)]
                value = int(entry["archived_through"])
                if value > st.durable:
                    st.durable = value
                    advanced.append((st.bucket, value))
                if st.partial is not None and st.durable >= st.partial.last:
                    st.partial = None
            self._cond.notify_all()
        if self._on_archived is not None:
            for bucket, value in advanced:
                try:
                    self._on_archived(bucket, value)
                except Exception:
                    log.exception("archive: on_archived(%d, %d) failed", bucket, value)

    def _load_manifest(self) -> dict[str, Any] | None:
        try:
            data = self.manifest_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            manifest = json.loads(data)
            if manifest.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"unsupported manifest format {manifest.get('format')!r}")
            if manifest.get("node_id") != self.node_id:
                raise ValueError(f"it belongs to node {manifest.get('node_id')!r}")
            return dict(manifest)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ArchiveError(
                f"archive manifest {self.manifest_path} is unreadable: {exc}. It is only "
                "ever replaced atomically, so something else changed it; restore it or "
                "move it aside (segments not in a manifest are adopted from their footers)"
            ) from exc

    # -- startup -----------------------------------------------------------------------

    def _acquire_lock(self) -> int:
        path = self._manifest_dir / f"{self.node_id}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise ArchiveError(
                    f"another archive writer for node {self.node_id!r} holds {path}"
                ) from exc
            raise
        return fd

    def _own_files(self) -> Iterator[Path]:
        """This node's segment and tmp files under the root."""
        prefix, tmp_prefix = f"{self.node_id}-", f".{self.node_id}-"
        for bucket_dir in self.root.glob("bucket_uuid=*"):
            for epoch_dir in bucket_dir.glob("epoch=*"):
                for path in epoch_dir.iterdir():
                    if path.name.startswith((prefix, tmp_prefix)):
                        yield path

    def _recover(self) -> None:
        """Load the manifest, drop tmp files, adopt segments published but not yet in
        the manifest (a crash between the rename and the manifest write)."""
        manifest = self._load_manifest()
        if manifest is not None:
            for b, entry in manifest["buckets"].items():
                through = int(entry["archived_through"])
                partial = entry.get("partial")
                self._buckets[int(b)] = _Bucket(
                    int(b),
                    entry.get("bucket_uuid"),
                    durable=through,
                    seen=through,
                    partial=None
                    if partial is None
                    else _Partial(
                        int(partial["first"]),
                        int(partial["last"]),
                        frozenset(int(e) for e in partial["epochs"]),
                    ),
                )
            self._segments = [SegmentInfo.from_json(s) for s in manifest["segments"]]
        known = {s.path for s in self._segments}
        orphans: dict[tuple[int, int, int], list[SegmentInfo]] = {}
        for path in self._own_files():
            if path.name.endswith(".tmp"):
                log.info("archive: removing unpublished %s", path)
                path.unlink()
                continue
            if not path.name.endswith(SEGMENT_SUFFIX):
                continue
            rel = path.relative_to(self.root).as_posix()
            if rel in known:
                continue
            try:
                info = dataclasses.replace(
                    read_segment_info(path), path=rel, bytes=path.stat().st_size
                )
            except Exception as exc:
                raise ArchiveError(
                    f"segment {path} is not in {self.manifest_path} and its footer is "
                    f"unreadable ({exc}); segments are fsynced before they are renamed, so "
                    "this is damage from outside: inspect it and move it aside"
                ) from exc
            orphans.setdefault((info.bucket, info.first_index, info.last_index), []).append(info)
        changed = False
        for (bucket, first, last), parts in sorted(orphans.items()):
            st = self._buckets.setdefault(bucket, _Bucket(bucket, parts[0].bucket_uuid))
            st.bucket_uuid = st.bucket_uuid or parts[0].bucket_uuid
            if first <= st.durable:
                self._quarantine(parts, f"entries {first}..{last} are already archived")
                changed = True
                continue
            present = frozenset(p.epoch for p in parts)
            self._segments.extend(parts)
            self._segments_adopted += len(parts)
            changed = True
            if present >= frozenset(parts[0].batch_epochs):
                log.warning(
                    "archive: adopting %d segment(s) of bucket %d entries %d..%d published "
                    "before a crash",
                    len(parts),
                    bucket,
                    first,
                    last,
                )
                st.durable = st.seen = max(st.durable, last)
                if st.partial is not None and st.partial.last <= last:
                    st.partial = None
            else:
                epochs = present | (st.partial.epochs if st.partial else frozenset())
                log.warning(
                    "archive: bucket %d entries %d..%d: only epochs %s of %s were published "
                    "before a crash; replay writes the rest",
                    bucket,
                    first,
                    last,
                    sorted(present),
                    list(parts[0].batch_epochs),
                )
                st.partial = _Partial(first, last, epochs)
                st.durable = st.seen = max(st.durable, first - 1)
        if changed:
            self._write_manifest()

    def _quarantine(self, parts: list[SegmentInfo], why: str) -> None:
        aside = self.root / "_orphans"
        aside.mkdir(exist_ok=True)
        for part in parts:
            src = self.root / part.path
            dst = aside / part.path.replace("/", "__")
            log.error("archive: %s not in the manifest but %s; moved to %s", src, why, dst)
            os.rename(src, dst)
        fsync_dir(aside)


__all__ = [
    "ARCHIVE_DIR",
    "CHANGE_TYPE",
    "EVENT_KEY",
    "FILE_SCHEMA",
    "PARTITION_COLUMNS",
    "PARTITION_SCHEMA",
    "ArchiveConfigError",
    "ArchiveError",
    "ArchiveSettings",
    "ArchiveWriter",
    "SegmentInfo",
    "WriterStats",
    "archive_root",
    "escape_partition_value",
    "partition_dir",
    "read_archive",
    "read_segment_info",
    "rows_table",
    "segment_name",
]
