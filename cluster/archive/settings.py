"""The archive writer's settings: where the archive lives, when a segment is cut, and
how long segments are kept and merged. Each has a default (docs/spark.md lists them)
and a `SEVENDB_ARCHIVE_<NAME>` environment variable, which is how a node gets them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from sevendb.cluster.archive.store import ArchiveConfigError

ENV_PREFIX: Final = "SEVENDB_ARCHIVE_"
SEGMENT_ROWS_MAX: Final = 100_000
SEGMENT_BYTES_MAX: Final = 64 * 1024 * 1024
SEGMENT_AGE_S_MAX: Final = 30.0
COMPRESSION: Final = "zstd"
RETRY_S_MAX: Final = 30.0
RETENTION_AGE_S: Final = 7 * 24 * 3600.0
RETENTION_BYTES: Final = 0
COMPACT_TARGET_BYTES: Final = 64 * 1024 * 1024
COMPACT_MIN_FILES: Final = 8
MAINTENANCE_S: Final = 60.0

_COMPRESSIONS: Final = ("zstd", "snappy", "gzip", "lz4", "none")
_POSITIVE_INTS: Final = ("segment_rows_max", "segment_bytes_max", "compact_min_files")
_NON_NEGATIVE_INTS: Final = ("retention_bytes", "compact_target_bytes")
_POSITIVE_SECONDS: Final = ("segment_age_s_max", "retry_s_max", "maintenance_s")
_NON_NEGATIVE_SECONDS: Final = ("retention_age_s",)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class ArchiveSettings:
    """Rotation: a segment is cut at the first purge-entry boundary at or past
    `segment_rows_max` rows or `segment_bytes_max` bytes (uncompressed estimate), or
    when its oldest row has waited `segment_age_s_max` seconds.

    Maintenance (every `maintenance_s`): segments whose newest row was acknowledged
    more than `retention_age_s` ago are deleted (0: kept whatever their age), then the
    oldest while this node's segments exceed `retention_bytes` (0: no limit); runs of
    at least `compact_min_files` small segments of one partition are merged into
    segments of up to `compact_target_bytes` (0: no compaction). Neither touches a
    segment a registered stream consumer has not consumed."""

    #: The archive root, a path or a pyarrow URI; empty: `<data_dir>/archive`.
    root: str = ""
    segment_rows_max: int = SEGMENT_ROWS_MAX
    segment_bytes_max: int = SEGMENT_BYTES_MAX
    segment_age_s_max: float = SEGMENT_AGE_S_MAX
    compression: str = COMPRESSION
    #: The longest wait between retries of a failed publish (doubling from 0.1 s).
    retry_s_max: float = RETRY_S_MAX
    retention_age_s: float = RETENTION_AGE_S
    retention_bytes: int = RETENTION_BYTES
    compact_target_bytes: int = COMPACT_TARGET_BYTES
    compact_min_files: int = COMPACT_MIN_FILES
    maintenance_s: float = MAINTENANCE_S

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS + _NON_NEGATIVE_INTS:
            value, floor = getattr(self, name), 1 if name in _POSITIVE_INTS else 0
            if not _is_int(value) or value < floor:
                kind = "a positive" if floor else "a non-negative"
                raise ArchiveConfigError(f"{name} must be {kind} integer, got {value!r}")
        for name in _POSITIVE_SECONDS + _NON_NEGATIVE_SECONDS:
            value, positive = getattr(self, name), name in _POSITIVE_SECONDS
            if not _is_seconds(value) or value < 0 or (positive and value == 0):
                kind = "a positive" if positive else "a non-negative"
                raise ArchiveConfigError(
                    f"{name} must be {kind}, finite number of seconds, got {value!r}"
                )
        if self.compression not in _COMPRESSIONS:
            raise ArchiveConfigError(
                f"compression must be one of {', '.join(_COMPRESSIONS)}, got {self.compression!r}"
            )
        if not isinstance(self.root, str):
            raise ArchiveConfigError(f"root must be a path or URI string, got {self.root!r}")

    def replace(self, **overrides: Any) -> ArchiveSettings:
        """These settings with some changed; an unknown name is an `ArchiveConfigError`."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ArchiveConfigError(
                f"unknown archive setting(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ArchiveSettings:
        """`SEVENDB_ARCHIVE_<FIELD>` (e.g. `SEVENDB_ARCHIVE_RETENTION_AGE_S=86400`)
        overrides each default; anything else starting with `SEVENDB_ARCHIVE_` is
        refused, and so is a value that is not a number where one is wanted."""
        kwargs: dict[str, Any] = {}
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        for key, raw in environ.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name not in kinds:
                raise ArchiveConfigError(
                    f"unknown setting {key}; known: "
                    + ", ".join(ENV_PREFIX + n.upper() for n in kinds)
                )
            try:
                if kinds[name] == "str":
                    kwargs[name] = raw.strip()
                elif kinds[name] == "int":
                    kwargs[name] = int(raw)
                else:
                    kwargs[name] = float(raw)
            except ValueError:
                raise ArchiveConfigError(f"{key}={raw!r} is not a number") from None
        return cls(**kwargs)


__all__ = ["ENV_PREFIX", "ArchiveSettings"]
