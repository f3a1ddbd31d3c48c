"""The SDK's durable cursor store."""

from __future__ import annotations

from pathlib import Path

import pytest

from sevendb.outbox.emitseq import EmitSeq
from sevendb.sdk import CursorStore, CursorStoreError, SavedCursor, SevenDBError


def cursor(sub: str, index: int) -> SavedCursor:
    return SavedCursor(sub, 0, "prefix:a", EmitSeq("u", 1, index))


def test_positions_survive_reopen(tmp_path: Path) -> None:
    store = CursorStore(tmp_path / "c.json")
    store.save([cursor("s1", 5), cursor("s2", 7)])
    store.save([cursor("s1", 9)])
    again = CursorStore(tmp_path / "c.json")
    assert again.get("s1") == cursor("s1", 9) and again.get("s2") == cursor("s2", 7)
    again.forget(["s2"])
    assert CursorStore(tmp_path / "c.json").all() == [cursor("s1", 9)]


def test_one_fsynced_write_per_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    calls: list[int] = []
    real = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    store = CursorStore(tmp_path / "c.json")
    store.save([cursor(f"s{i}", i) for i in range(50)])
    assert len(calls) == 2  # the file, then its directory
    assert not (tmp_path / "c.json.tmp").exists()


def test_a_corrupt_file_is_refused_not_reset(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"format": 1, "cursors": [{"sub_id": "s"')
    with pytest.raises(CursorStoreError, match="unreadable"):
        CursorStore(path)
    assert path.read_text().startswith('{"format"')


def test_a_cursor_store_error_is_a_sevendb_error(tmp_path: Path) -> None:
    """One ``except SevenDBError`` around a subscription covers its cursor file too."""
    path = tmp_path / "c.json"
    path.write_text('{"format": 999, "cursors": []}')
    with pytest.raises(SevenDBError, match="unknown format"):
        CursorStore(str(path))


def test_a_partial_entry_survives_reopen_and_older_files_have_none(tmp_path: Path) -> None:
    """Per-change delivery persists the changes processed of the next entry."""
    path = tmp_path / "c.json"
    partial = (EmitSeq("u", 1, 6), 2)
    store = CursorStore(path)
    store.save([SavedCursor("s1", 0, "all", EmitSeq("u", 1, 5), partial), cursor("s2", 7)])
    again = CursorStore(path)
    assert again.get("s1") == SavedCursor("s1", 0, "all", EmitSeq("u", 1, 5), partial)
    assert again.get("s2") == cursor("s2", 7) and '"partial"' in path.read_text().split("s2")[0]
    older = (
        '{"format": 2, "cursors": [{"sub_id": "s", "bucket": 0, "name": "n", "position": null}]}'
    )
    path.write_text(older)
    assert CursorStore(path).all() == [SavedCursor("s", 0, "n", None)]


@pytest.mark.parametrize("bad", ['[["u", 1, 6], 0]', '[["u", 1], 2]', '"x"'])
def test_a_malformed_partial_is_refused(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "c.json"
    body = (
        '{"format": 2, "cursors": [{"sub_id": "s", "bucket": 0, "name": "n", '
        f'"position": ["u", 1, 5], "partial": {bad}}}]}}'
    )
    path.write_text(body)
    with pytest.raises(CursorStoreError, match="corrupt"):
        CursorStore(path)
    assert path.read_text() == body  # refused, not reset
