"""A durable store of "last processed emit_seq" per subscription.

The SDK persists here after the application has processed events and *before*
the ack that covers them, so a purge can never overtake the durable cursor: a
restarted process resumes exactly after the last event it processed. Writes are
tmp file + fsync + atomic rename + directory fsync; a crash leaves either the
old or the new content, never a torn file.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sevendb.outbox.emitseq import EmitSeq
from sevendb.sdk.errors import CursorStoreError

FORMAT_VERSION: Final = 2


@dataclass(frozen=True, slots=True)
class SavedCursor:
    """One bucket's stream of one subscription.

    `name` is the subscription's name (its query unless the application named it),
    so one file can hold several subscriptions. `position` is the last emit_seq the
    application processed, or None while the sub_id is chosen but its Subscribe has
    not been answered yet (a restart subscribes again with the same sub_id, which is
    idempotent, so a crash never leaves an orphaned subscription behind).
    """

    sub_id: str
    bucket: int
    name: str
    position: EmitSeq | None
    partial: tuple[EmitSeq, int] | None = None
    """Per-change delivery (`SubscribeOptions.per_change`): (emit_seq, n), the first
    n changes of the entry at emit_seq (the one after `position`) were processed; a
    resume skips them when the node delivers that entry again. Absent in older
    files (None)."""


def _seq(raw: Any) -> EmitSeq | None:
    if raw is None:
        return None
    return EmitSeq(str(raw[0]), int(raw[1]), int(raw[2]))


def _partial(raw: Any) -> tuple[EmitSeq, int] | None:
    if raw is None:
        return None
    seq = _seq(raw[0])
    if seq is None or int(raw[1]) < 1:
        raise ValueError(f"partial {raw!r}")
    return seq, int(raw[1])


class CursorStore:
    """A JSON file of cursors, one entry per (query, bucket) subscription. Raises
    `CursorStoreError` if the file exists but cannot be read."""

    def __init__(self, path: Path | str) -> None:
        self._path = Path(path)
        self._lock = threading.Lock()
        self._cursors: dict[str, SavedCursor] = self._load()
        self.writes = 0

    @property
    def path(self) -> Path:
        return self._path

    def _load(self) -> dict[str, SavedCursor]:
        try:
            raw = json.loads(self._path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise CursorStoreError(f"cursor file {self._path} is unreadable: {exc}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_VERSION:
            raise CursorStoreError(f"cursor file {self._path} has an unknown format")
        try:
            return {
                c["sub_id"]: SavedCursor(
                    str(c["sub_id"]),
                    int(c["bucket"]),
                    str(c["name"]),
                    _seq(c["position"]),
                    _partial(c.get("partial")),
                )
                for c in raw["cursors"]
            }
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CursorStoreError(f"cursor file {self._path} is corrupt: {exc!r}") from None

    def get(self, sub_id: str) -> SavedCursor | None:
        with self._lock:
            return self._cursors.get(sub_id)

    def all(self) -> list[SavedCursor]:
        with self._lock:
            return [self._cursors[k] for k in sorted(self._cursors)]

    def save(self, cursors: list[SavedCursor]) -> None:
        """Record these positions durably (one fsync for the whole batch)."""
        with self._lock:
            for cursor in cursors:
                self._cursors[cursor.sub_id] = cursor
            self._write()

    def named(self, name: str) -> list[SavedCursor]:
        """The cursors of one subscription, in bucket order."""
        with self._lock:
            return sorted(
                (c for c in self._cursors.values() if c.name == name), key=lambda c: c.bucket
            )

    def forget(self, sub_ids: list[str]) -> None:
        with self._lock:
            removed = [s for s in sub_ids if self._cursors.pop(s, None) is not None]
            if removed:
                self._write()

    def _write(self) -> None:
        body = json.dumps(
            {
                "format": FORMAT_VERSION,
                "cursors": [
                    {
                        "sub_id": c.sub_id,
                        "bucket": c.bucket,
                        "name": c.name,
                        "position": None if c.position is None else c.position.pack(),
                        **(
                            {}
                            if c.partial is None
                            else {"partial": [c.partial[0].pack(), c.partial[1]]}
                        ),
                    }
                    for c in (self._cursors[k] for k in sorted(self._cursors))
                ],
            },
            indent=1,
        )
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_name(self._path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)
        fd = os.open(self._path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.writes += 1
