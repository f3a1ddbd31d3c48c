"""What a writer does when it opens the archive after a stop or a crash: load its
manifest, delete its hidden tmp files, finish deleting segments it had retired, and
adopt segments it published but had not yet recorded (a crash between a rename and
the manifest write) from their footers. Nothing is lost and nothing is kept twice
(the crash windows are tabled in docs/spark.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pyarrow.fs as pafs

from sevendb.cluster.archive.format import (
    FILE_SCHEMA,
    ORPHANS_DIR,
    SEGMENT_SUFFIX,
    ArchiveError,
    SegmentInfo,
    info_from_footer,
    parse_segment_name,
)
from sevendb.cluster.archive.manifest import BucketState, Manifest, ManifestState, Partial
from sevendb.cluster.archive.store import ArchiveStore

log = logging.getLogger("sevendb.archive")


def own_files(store: ArchiveStore, node_id: str) -> Iterator[pafs.FileInfo]:
    """This node's segment and tmp files under the root's partition directories."""
    for info in store.files(""):
        parts = info.path.split("/")
        if len(parts) != 3 or not parts[0].startswith("bucket_uuid="):
            continue
        name = parts[2]
        if name.startswith(".") and name.endswith(".tmp"):
            name = name[1 : -len(".tmp")]
        parsed = parse_segment_name(name)
        if parsed is not None and parsed.node_id == node_id:
            yield info


class Recovery:
    """One recovery pass; `run()` returns the state to start from."""

    def __init__(self, store: ArchiveStore, manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        self.node_id = manifest.node_id
        self.state = ManifestState()
        self.adopted = 0
        self.changed = False

    def run(self) -> ManifestState:
        loaded = self.manifest.load()
        if loaded is not None:
            self.state = loaded
        known = {s.path for s in self.state.segments}
        retired = set(self.state.retired)
        plain: dict[tuple[int, int, int], list[SegmentInfo]] = {}
        compacted: list[SegmentInfo] = []
        for file in own_files(self.store, self.node_id):
            name = file.path.rsplit("/", 1)[-1]
            if name.endswith(".tmp"):
                log.info("archive: removing unpublished %s", self.store.describe(file.path))
                self.store.delete(file.path)
            elif file.path in retired:
                log.info("archive: deleting retired %s", self.store.describe(file.path))
                self.store.delete(file.path)
            elif name.endswith(SEGMENT_SUFFIX) and file.path not in known:
                info = self._footer(file)
                if info.compacted:
                    compacted.append(info)
                else:
                    plain.setdefault((info.bucket, info.first_index, info.last_index), []).append(
                        info
                    )
        if self.state.retired:
            self.state.retired = []
            self.changed = True
        self._fill_ack_times()
        for info in compacted:
            self._adopt_compacted(info)
        for (bucket, first, last), parts in sorted(plain.items()):
            self._adopt(bucket, first, last, parts)
        return self.state

    def _fill_ack_times(self) -> None:
        """Segments listed before `ack_ms_max` was recorded get it from their files'
        statistics, so retention by age never takes them for ancient."""
        for i, s in enumerate(self.state.segments):
            if s.ack_ms_max == 0 and s.rows > 0:
                newest = self.store.column_max(s.path, "ack_time_ms")
                if newest is None:  # no statistics: read the column
                    newest = max(
                        self.store.read_table(s.path, FILE_SCHEMA)["ack_time_ms"].to_pylist()
                    )
                self.state.segments[i] = dataclasses.replace(s, ack_ms_max=newest)
                self.changed = True

    def _footer(self, file: pafs.FileInfo) -> SegmentInfo:
        where = self.store.describe(file.path)
        try:
            info = info_from_footer(self.store.read_metadata(file.path), where)
        except Exception as exc:
            raise ArchiveError(
                f"segment {where} is not in {self.manifest.describe()} and its footer is "
                f"unreadable ({exc}); segments are synced before they are renamed, so "
                "this is damage from outside: inspect it and move it aside"
            ) from exc
        info = dataclasses.replace(info, path=file.path, bytes=int(file.size or 0))
        if info.ack_ms_max == 0 and info.rows > 0:
            info = dataclasses.replace(
                info, ack_ms_max=self.store.column_max(file.path, "ack_time_ms") or 0
            )
        return info

    def _adopt_compacted(self, info: SegmentInfo) -> None:
        """A compacted segment renamed into place before the manifest recorded it: it
        replaces its sources (still listed), which are deleted."""
        directory = info.path.rsplit("/", 1)[0]
        sources = {f"{directory}/{name}" for name in info.compacted_from}
        listed = {s.path for s in self.state.segments}
        self.changed = True
        if not sources <= listed:
            self._quarantine([info], f"its sources {sorted(sources - listed)} are not listed")
            return
        log.warning(
            "archive: adopting %s compacted before a crash; deleting its %d sources",
            info.path,
            len(sources),
        )
        self.state.segments = [s for s in self.state.segments if s.path not in sources]
        self.state.segments.append(info)
        self.adopted += 1
        for path in sorted(sources):
            self.store.delete(path)

    def _adopt(self, bucket: int, first: int, last: int, parts: list[SegmentInfo]) -> None:
        """Parts of a batch renamed into place before the manifest recorded them."""
        st = self.state.buckets.setdefault(bucket, BucketState(bucket, parts[0].bucket_uuid))
        st.bucket_uuid = st.bucket_uuid or parts[0].bucket_uuid
        self.changed = True
        if first <= st.durable:
            self._quarantine(parts, f"entries {first}..{last} are already archived")
            return
        present = frozenset(p.epoch for p in parts)
        self.state.segments.extend(parts)
        self.adopted += len(parts)
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
            return
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
        st.partial = Partial(first, last, epochs)
        st.durable = st.seen = max(st.durable, first - 1)

    def _quarantine(self, parts: list[SegmentInfo], why: str) -> None:
        self.store.make_dirs(ORPHANS_DIR)
        for part in parts:
            dst = f"{ORPHANS_DIR}/{part.path.replace('/', '__')}"
            log.error(
                "archive: %s not in the manifest but %s; moved to %s",
                self.store.describe(part.path),
                why,
                self.store.describe(dst),
            )
            self.store.move(part.path, dst)


__all__ = ["Recovery", "own_files"]
