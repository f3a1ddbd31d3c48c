"""The drained-outbox archive writer: every node writes the outbox rows it purges
(acknowledged events) to immutable Parquet segments that Spark reads
(`cluster/archive/spark_jobs.py`), keeps its compaction hold point
(`archived_through`), and maintains its own segments (retention, compaction).

`on_applied` (the replica's tick thread) only buffers. A background thread cuts
batches of whole purge entries, publishes them (`segments.write_batch`) and then
rewrites the node's manifest; the node holds log compaction at `archived_through`,
so rows not yet published are still in the log and are produced again by replay
after a crash. The format is in `format.py`, the crash argument in docs/spark.md.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pa_ds
import pyarrow.fs as pafs

from sevendb.cluster.archive.format import (
    ARCHIVE_SCHEMA,
    MANIFEST_DIR,
    PARTITION_SCHEMA,
    ArchiveError,
    SegmentInfo,
    archive_root,
    info_from_footer,
)
from sevendb.cluster.archive.maintenance import (
    compact,
    compaction_groups,
    read_consumers,
    retention_victims,
)
from sevendb.cluster.archive.manifest import BucketState, Manifest, Purge
from sevendb.cluster.archive.recovery import Recovery
from sevendb.cluster.archive.segments import row_bytes, write_batch
from sevendb.cluster.archive.settings import ArchiveSettings
from sevendb.cluster.archive.store import ArchiveConfigError, ArchiveStore
from sevendb.outbox.model import Applied, RowsPurged
from sevendb.proto.threads import name_os_thread

log = logging.getLogger("sevendb.archive")

_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

Fault = Callable[[str], None]

_COUNTS = (
    "rows_published",
    "rows_skipped",
    "segments_published",
    "segments_adopted",
    "publish_failures",
    "segments_compacted",
    "segments_deleted",
    "bytes_deleted",
    "segments_held",
    "maintenance_failures",
)


def read_archive(
    root: Path | str, *, node_id: str | None = None, filesystem: pafs.FileSystem | None = None
) -> pa.Table:
    """Every published row under `root` (all nodes' copies, not deduplicated) with the
    partition columns, through pyarrow; the Spark jobs read the same files."""
    store = ArchiveStore.open(root, filesystem, create=False)
    dataset = pa_ds.dataset(
        store.path(""),
        filesystem=store.fs,
        format="parquet",
        schema=ARCHIVE_SCHEMA,
        partitioning=pa_ds.partitioning(PARTITION_SCHEMA, flavor="hive"),
        ignore_prefixes=[".", "_"],
    )
    expr = None if node_id is None else pa_ds.field("node_id") == node_id
    return dataset.to_table(filter=expr)


def read_segment_info(path: Path | str, filesystem: pafs.FileSystem | None = None) -> SegmentInfo:
    """The description a segment carries in its Parquet footer."""
    import pyarrow.parquet as pq

    return info_from_footer(pq.read_schema(str(path), filesystem=filesystem).metadata, str(path))


@dataclass(frozen=True, slots=True)
class WriterStats:
    rows_buffered: int
    rows_published: int
    rows_skipped: int
    segments_published: int
    segments_adopted: int
    publish_failures: int
    last_error: str | None
    segments_live: int = 0  # this node's segments in the archive now
    bytes_live: int = 0
    segments_compacted: int = 0  # segments merged into compacted ones
    segments_deleted: int = 0  # by retention
    bytes_deleted: int = 0
    segments_held: int = 0  # past retention but not consumed by a stream (last pass)
    maintenance_failures: int = 0


@dataclass(frozen=True, slots=True)
class MaintenanceReport:
    compacted: int  # segments merged
    written: int  # compacted segments written
    deleted: int  # segments deleted by retention
    held: int  # segments past retention a consumer has not consumed


class ArchiveWriter:
    """One node's archive writer: `on_applied(bucket, applied)` from every local
    replica's tick thread; `archived_through(bucket)` for the compaction hold point.

    `root` is a path or a URI pyarrow knows (`file:///...`, `s3://...`), or a path in
    `filesystem`. Settings come from `settings` and keyword overrides
    (`segment_rows_max=...`; see `ArchiveSettings`).

    Fault points (for crash tests; `fault(name)` is called there): ``segment-written``,
    ``part-published``, ``segments-published`` (see `segments.write_batch`),
    ``manifest-written``; maintenance adds ``compacted-written``,
    ``compacted-published``, ``retire-recorded`` (the manifest no longer lists the
    retired segments) and ``retired-deleted`` (after each deletion).
    """

    def __init__(
        self,
        root: Path | str,
        node_id: str,
        settings: ArchiveSettings | None = None,
        *,
        filesystem: pafs.FileSystem | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        background: bool = True,
        on_archived: Callable[[int, int], None] | None = None,
        fault: Fault | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = (settings or ArchiveSettings()).replace(**overrides)
        if not isinstance(node_id, str) or not _NODE_ID.fullmatch(node_id):
            raise ArchiveConfigError(
                f"node_id {node_id!r} must be 1-128 characters of letters, digits, '_', "
                "'.' or '-', starting with a letter or digit (it names files)"
            )
        self.node_id = node_id
        self.store = ArchiveStore.open(root, filesystem)
        self.store.make_dirs(MANIFEST_DIR)
        self._manifest = Manifest(self.store, node_id)
        self._clock = clock
        self._wall_clock = wall_clock
        self._on_archived = on_archived
        self._fault = fault
        self._release = contextlib.ExitStack()
        self._release.enter_context(
            self.store.held(
                f"{MANIFEST_DIR}/{node_id}.lock", f"archive writer for node {node_id!r}"
            )
        )
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._publish_lock = threading.Lock()  # one publisher / manifest writer at a time
        self._maintain_lock = threading.Lock()
        self._known_dirs: set[str] = set()
        self._closing = self._closed = self._manifest_dirty = False
        self._retry_at: float | None = None
        self._retry_s = 0.1
        self._maintain_at = clock() + self.settings.maintenance_s
        self._counts: dict[str, int] = dict.fromkeys(_COUNTS, 0)
        self._last_error: str | None = None
        try:
            recovery = Recovery(self.store, self._manifest)
            state = recovery.run()
            self._buckets, self._segments = state.buckets, state.segments
            self._retired: list[str] = []
            self._counts["segments_adopted"] = recovery.adopted
            if recovery.changed:
                self._write_manifest()
        except BaseException:
            self._release.close()
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
        """A writer with `SEVENDB_ARCHIVE_*` settings; `SEVENDB_ARCHIVE_ROOT`, when
        set, replaces `root`."""
        settings = ArchiveSettings.from_env(environ)
        return cls(settings.root or root, node_id, settings, **kwargs)

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
                st = self._buckets.setdefault(bucket, BucketState(bucket))
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
                st = self._buckets[bucket] = BucketState(bucket)
            if st.broken is not None:
                return
            if index <= st.seen:
                # At or below archived_through after a restart: already published.
                self._counts["rows_skipped"] += sum(len(rows) for _, rows in effects)
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
        purge: Purge | None = None
        if effects:
            purge = Purge(
                index,
                effects,
                sum(len(rows) for _, rows in effects),
                sum(row_bytes(r) for _, rows in effects for r in rows),
                self._clock(),
                frozenset().union(
                    *(e.read_uncommitted for e in applied.effects if isinstance(e, RowsPurged))
                ),
            )
        with self._lock:
            if self._closing:
                return
            self._counts["rows_skipped"] += skipped
            if purge is not None:
                if st.bucket_uuid is None:
                    st.bucket_uuid = effects[0][1][0].emit_seq.bucket_uuid
                was_empty, before = not st.pending, st.pending_rows
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
        """This node's segments now in the archive."""
        with self._lock:
            return list(self._segments)

    def stats(self) -> WriterStats:
        with self._lock:
            return WriterStats(
                rows_buffered=sum(st.pending_rows for st in self._buckets.values()),
                last_error=self._last_error,
                segments_live=len(self._segments),
                bytes_live=sum(s.bytes for s in self._segments),
                **self._counts,
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
            self._release.close()

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _due(self, st: BucketState, now: float) -> bool:
        if not st.pending or st.broken is not None or st.inflight_first is not None:
            return False
        s = self.settings
        return (
            st.pending_rows >= s.segment_rows_max
            or st.pending_bytes >= s.segment_bytes_max
            or now - st.pending[0].added >= s.segment_age_s_max
        )

    def _next_wakeup(self, now: float) -> float:
        """Seconds until the next age deadline, retry or maintenance pass."""
        if self._retry_at is not None:
            return max(0.0, self._retry_at - now)
        deadlines = [
            st.pending[0].added + self.settings.segment_age_s_max
            for st in self._buckets.values()
            if st.pending and st.broken is None
        ]
        return max(0.0, min([self._maintain_at, *deadlines]) - now)

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
            if self._clock() >= self._maintain_at:
                self._maintain_at = self._clock() + self.settings.maintenance_s
                try:
                    self.maintain()
                except Exception as exc:
                    with self._lock:
                        self._counts["maintenance_failures"] += 1
                        self._last_error = f"maintenance: {type(exc).__name__}: {exc}"
                    log.exception("archive: maintenance failed (retried next pass)")

    def _take(self, st: BucketState, bound: int | None, now: float) -> list[Purge]:
        """Cut the next batch of whole purge entries off the bucket's buffer (forced up
        to log index `bound`, else only when due)."""
        if not st.pending or st.broken is not None or st.inflight_first is not None:
            return []
        if bound is None:
            if not self._due(st, now):
                return []
            bound = st.seen
        s = self.settings
        batch: list[Purge] = []
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
                    published += self._publish_batch(st, batch, errors)
                if errors or not force:
                    break
            with self._lock:
                stale = any(st.through() != st.durable for st in self._buckets.values())
            if published or self._manifest_dirty or (force and stale):
                try:
                    self._write_manifest()
                except Exception as exc:
                    errors.append(self._record_failure(f"manifest: {type(exc).__name__}: {exc}"))
            if not errors:
                with self._lock:
                    self._retry_s = 0.1
                    self._retry_at = None
        if errors and raise_errors:
            raise ArchiveError("archive publish failed: " + "; ".join(errors))
        return published

    def _publish_batch(self, st: BucketState, batch: list[Purge], errors: list[str]) -> int:
        assert st.bucket_uuid is not None
        try:
            codec = self.settings.compression
            infos = write_batch(
                self.store,
                self.node_id,
                st.bucket,
                st.bucket_uuid,
                batch,
                None if codec == "none" else codec,
                self._ensure_dir,
                self._fire,
            )
        except Exception as exc:
            with self._lock:
                st.pending[0:0] = batch  # nothing lost: retried in order
                st.pending_rows += sum(p.rows for p in batch)
                st.pending_bytes += sum(p.nbytes for p in batch)
                st.inflight_first = None
            where = f"bucket {st.bucket} entries {batch[0].index}..{batch[-1].index}"
            errors.append(self._record_failure(f"{where}: {type(exc).__name__}: {exc}"))
            return 0
        with self._lock:
            st.inflight_first = None
            self._segments.extend(infos)
            self._counts["segments_published"] += len(infos)
            self._counts["rows_published"] += sum(i.rows for i in infos)
            self._manifest_dirty = True
        return len(infos)

    def _record_failure(self, message: str) -> str:
        """Count a failed publish and schedule the retry (0.1 s doubling)."""
        with self._lock:
            self._counts["publish_failures"] += 1
            self._last_error = message
            self._retry_at = self._clock() + self._retry_s
            self._retry_s = min(self._retry_s * 2, self.settings.retry_s_max)
        log.error("archive: cannot publish %s (will retry)", message)
        return message

    def _ensure_dir(self, directory: str) -> None:
        if directory not in self._known_dirs:
            self.store.make_dirs(directory)
            self._known_dirs.add(directory)

    def _fire(self, point: str) -> None:
        if self._fault is not None:
            self._fault(point)

    # -- the manifest ------------------------------------------------------------------

    def _write_manifest(self) -> None:
        """Persist the state (callers hold `_publish_lock`, or are the constructor);
        then advance the durable hold points and tell `on_archived`."""
        with self._lock:
            content = self._manifest.content(self._buckets, self._segments, self._retired)
        self._manifest.save(content)
        self._fire("manifest-written")
        advanced: list[tuple[int, int]] = []
        with self._cond:
            self._manifest_dirty = False
            for b, entry in content["buckets"].items():
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

    # -- maintenance -------------------------------------------------------------------

    def maintain(self) -> MaintenanceReport:
        """One maintenance pass (the background thread runs one every `maintenance_s`):
        compaction, then retention, both limited to segments every registered stream
        consumer has consumed. Raises what a step raised (nothing is lost: a failed
        compaction leaves its sources in place)."""
        with self._maintain_lock:
            consumers = read_consumers(self.store)
            with self._lock:
                settled = {
                    s.path
                    for s in self._segments
                    if (st := self._buckets.get(s.bucket)) is not None and st.settled(s)
                }
                segments = list(self._segments)
            groups = compaction_groups(
                segments, self.settings, lambda s: s.path in settled and consumers.covers(s)
            )
            codec = self.settings.compression
            for group in groups:
                merged = compact(self.store, group, None if codec == "none" else codec, self._fire)
                self._replace(group, [merged])
                with self._lock:
                    self._counts["segments_compacted"] += len(group)
            if groups:
                # pyarrow's allocator (mimalloc) keeps what a pass freed; handed back
                # here, a node's memory does not climb pass after pass (under 1 ms;
                # docs/performance.md, the soak).
                pa.default_memory_pool().release_unused()
            victims, held = retention_victims(
                self.segments(), self.settings, int(self._wall_clock() * 1000), consumers
            )
            self._replace(victims, [])
            with self._lock:
                self._counts["segments_deleted"] += len(victims)
                self._counts["bytes_deleted"] += sum(s.bytes for s in victims)
                self._counts["segments_held"] = len(held)
            if held:
                log.warning(
                    "archive: %d segment(s) past retention are kept: a stream consumer has "
                    "not consumed them (%s; remove a consumer's mark under %s to release it)",
                    len(held),
                    ", ".join(m.name for m in consumers.marks) or "unreadable marks",
                    self.store.describe("_consumers"),
                )
            return MaintenanceReport(
                sum(len(g) for g in groups), len(groups), len(victims), len(held)
            )

    def _replace(self, old: Sequence[SegmentInfo], new: Sequence[SegmentInfo]) -> None:
        """Swap segments in the manifest, then delete the old files. The manifest
        lists them as retired until they are gone, so a crash in between finishes
        the deletion at restart instead of adopting them again."""
        if not old:
            return
        gone = {s.path for s in old}
        with self._publish_lock:
            with self._lock:
                self._segments = [s for s in self._segments if s.path not in gone]
                self._segments.extend(new)
                self._retired.extend(sorted(gone))
            self._write_manifest()
            self._fire("retire-recorded")
            for path in sorted(gone):
                self.store.delete(path)
                self._fire("retired-deleted")
            with self._lock:
                self._retired = [p for p in self._retired if p not in gone]
            self._write_manifest()


__all__ = [
    "ArchiveConfigError",
    "ArchiveError",
    "ArchiveSettings",
    "ArchiveWriter",
    "MaintenanceReport",
    "SegmentInfo",
    "WriterStats",
    "archive_root",
    "read_archive",
    "read_segment_info",
]
