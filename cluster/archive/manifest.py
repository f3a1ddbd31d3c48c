"""A node's archive manifest (`_manifests/<node>.json`) and the per-bucket state it
persists: each bucket's `archived_through`, a batch caught half-published by a crash,
the segments the node has published, and the segments it has retired (compacted
into another, or past retention) but may not have deleted yet. The file is only
ever replaced atomically (docs/spark.md has the crash argument).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sevendb.cluster.archive.format import MANIFEST_DIR, MANIFEST_FORMAT, ArchiveError, SegmentInfo
from sevendb.cluster.archive.store import ArchiveStore
from sevendb.outbox.model import OutboxRow


@dataclass(slots=True)
class Purge:
    """The rows one OUTBOX_PURGE entry removed (restricted to epochs still to write),
    as `(ack_time_ms, rows)` per RowsPurged effect. An entry is never split between
    segments: `archived_through` moves by whole entries."""

    index: int
    effects: tuple[tuple[int, tuple[OutboxRow, ...]], ...]
    rows: int
    nbytes: int
    added: float  # clock() when buffered
    read_uncommitted: frozenset[str] = frozenset()
    """The entry's sub_ids whose subscriptions read uncommitted (`RowsPurged`)."""


@dataclass(slots=True)
class Partial:
    """A batch caught half-renamed by a crash: its parts for `epochs` are published;
    replayed entries in [first, last] write only the other epochs."""

    first: int
    last: int
    epochs: frozenset[int]

    def to_json(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "epochs": sorted(self.epochs)}


@dataclass(slots=True)
class BucketState:
    bucket: int
    bucket_uuid: str | None = None
    durable: int = 0  # archived_through as persisted in the manifest
    seen: int = 0  # the last log index handed to on_applied (or skipped)
    pending: list[Purge] = field(default_factory=list)
    pending_rows: int = 0
    pending_bytes: int = 0
    inflight_first: int | None = None
    partial: Partial | None = None
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

    def settled(self, segment: SegmentInfo) -> bool:
        """Whether `segment` is below everything still to be written for this bucket
        (so maintenance may rewrite or delete it)."""
        if segment.last_index > self.durable:
            return False
        return self.partial is None or segment.last_index < self.partial.first


@dataclass(slots=True)
class ManifestState:
    buckets: dict[int, BucketState] = field(default_factory=dict)
    segments: list[SegmentInfo] = field(default_factory=list)
    #: Segment paths no longer part of the archive, to be deleted.
    retired: list[str] = field(default_factory=list)


class Manifest:
    """One node's manifest file in the archive."""

    def __init__(self, store: ArchiveStore, node_id: str) -> None:
        self.store = store
        self.node_id = node_id
        self.rel = f"{MANIFEST_DIR}/{node_id}.json"

    def describe(self) -> str:
        return self.store.describe(self.rel)

    def content(
        self,
        buckets: dict[int, BucketState],
        segments: Iterable[SegmentInfo],
        retired: Iterable[str],
    ) -> dict[str, Any]:
        """The manifest for this state (callers hold the writer's lock)."""
        content: dict[str, Any] = {
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
                for b, st in sorted(buckets.items())
            },
            "segments": [s.to_json() for s in segments],
        }
        retired = list(retired)
        if retired:
            content["retired"] = retired
        return content

    def save(self, content: dict[str, Any]) -> None:
        self.store.write_atomic(self.rel, json.dumps(content, indent=1, sort_keys=True).encode())

    def load(self) -> ManifestState | None:
        """The persisted state, or None if there is no manifest yet."""
        data = self.store.read_bytes(self.rel)
        if data is None:
            return None
        try:
            manifest = json.loads(data)
            if manifest.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"unsupported manifest format {manifest.get('format')!r}")
            if manifest.get("node_id") != self.node_id:
                raise ValueError(f"it belongs to node {manifest.get('node_id')!r}")
            state = ManifestState()
            for b, entry in manifest["buckets"].items():
                through = int(entry["archived_through"])
                partial = entry.get("partial")
                state.buckets[int(b)] = BucketState(
                    int(b),
                    entry.get("bucket_uuid"),
                    durable=through,
                    seen=through,
                    partial=None
                    if partial is None
                    else Partial(
                        int(partial["first"]),
                        int(partial["last"]),
                        frozenset(int(e) for e in partial["epochs"]),
                    ),
                )
            state.segments = [SegmentInfo.from_json(s) for s in manifest["segments"]]
            state.retired = [str(p) for p in manifest.get("retired", ())]
            return state
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            raise ArchiveError(
                f"archive manifest {self.describe()} is unreadable: {exc}. It is only "
                "ever replaced atomically, so something else changed it; restore it or "
                "move it aside (segments not in a manifest are adopted from their footers)"
            ) from exc


__all__ = ["BucketState", "Manifest", "ManifestState", "Partial", "Purge"]
