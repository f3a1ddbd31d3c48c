"""Tests for sevendb.cluster.raft.journal: the durable, group-committed Raft journal.

They pin down what Raft safety needs from the journal: what was synced comes back
after a reopen; a torn tail (a crash mid-append) is cut off and said so; records lost
or damaged below what the replica acknowledged are reported as damage, never cut off
silently, and the header keeps claiming them; term and vote survive the loss of one
of their two copies; a file that is not ours is refused rather than wiped; and group
commit really turns N appends into one fsync.
"""

from __future__ import annotations

import ast
import logging
import os
import struct
import tempfile
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sevendb.cluster.raft import journal as journal_module
from sevendb.cluster.raft.journal import (
    FORMAT_VERSION,
    MAGIC,
    DurableJournal,
    Entry,
    JournalError,
    JournalFormatError,
)
from sevendb.cluster.raft.records import HEADER_V2, SLOT_BYTES, SLOT_OFFSETS
from sevendb.cluster.raft.sidecars import LOST_VOTE

HEADER_SIZE = HEADER_V2
RECORD_OVERHEAD = 4 + 16 + 4  # length prefix, idx+term, crc


def entries_of(j: DurableJournal) -> list[Entry]:
    return [j[i] for i in range(len(j))]


def make_entries(n: int, first_idx: int = 1, term: int = 1) -> list[Entry]:
    return [(b"cmd-%d" % i, first_idx + i, term) for i in range(n)]


def fill(path: Path, entries: list[Entry]) -> None:
    """Write `entries` and close cleanly: the header then claims all of them."""
    j = DurableJournal(path)
    for entry in entries:
        j.add(*entry)
    j.close()


def fill_and_crash(path: Path, entries: list[Entry]) -> None:
    """Write `entries` in one synced batch and "crash" (no clean close): the header
    claims none of them yet, as after a kill -9 right after the batch."""
    j = DurableJournal(path)
    for entry in entries:
        j.add(*entry)
    j.sync()
    os.close(j._fd)


def flip(path: Path, offset: int, mask: int = 0x40) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


def record_offsets(entries: list[Entry]) -> list[int]:
    """Offset at which each record starts in a freshly written journal."""
    offsets = []
    pos = HEADER_SIZE
    for command, _, _ in entries:
        offsets.append(pos)
        pos += RECORD_OVERHEAD + len(command)
    return offsets


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "raft.journal"


@pytest.fixture
def fsync_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every real fsync/fdatasync syscall, so fsync_count cannot lie."""
    calls: list[str] = []
    real_fsync = os.fsync
    real_fdatasync = getattr(os, "fdatasync", os.fsync)

    def fsync(fd: int) -> None:
        calls.append("fsync")
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        calls.append("fdatasync")
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync, raising=False)
    return calls


# ---------------------------------------------------------------- round trips


def test_append_and_reopen_returns_same_entries(path: Path) -> None:
    entries = [(b"", 1, 0), (b"\x00\x01binary\xff", 2, 3), (b"x" * 100_000, 3, 3)]
    fill(path, entries)
    j = DurableJournal(path)
    assert len(j) == 3
    assert entries_of(j) == entries
    assert all(type(e) is tuple and type(e[0]) is bytes for e in entries_of(j))
    assert j.durable_len == 3
    j.close()


def test_indexing_matches_list_semantics(path: Path) -> None:
    entries = make_entries(6, first_idx=10)
    j = DurableJournal(path)
    for entry in entries:
        j.add(*entry)
    assert j[0] == entries[0]
    assert j[-1] == entries[-1]
    assert j[2:] == entries[2:]
    assert j[1:3] == entries[1:3]
    assert j[4:100] == entries[4:]
    assert isinstance(j[1:2], list)
    assert list(j) == entries
    with pytest.raises(IndexError):
        j[6]
    j.close()


def test_str_command_is_stored_as_utf8_bytes(path: Path) -> None:
    j = DurableJournal(path)
    j.add("héllo", 1, 0)  # type: ignore[arg-type]  # pysyncobj's to_bytes accepts str
    assert j[0] == ("héllo".encode(), 1, 0)
    with pytest.raises(TypeError):
        j.add(object(), 2, 0)  # type: ignore[arg-type]
    j.close()
    assert entries_of(DurableJournal(path)) == [("héllo".encode(), 1, 0)]


def test_non_contiguous_append_is_refused(path: Path) -> None:
    j = DurableJournal(path)
    j.add(b"a", 5, 2)
    with pytest.raises(ValueError, match="non-contiguous"):
        j.add(b"b", 7, 2)
    with pytest.raises(ValueError, match="non-contiguous"):
        j.add(b"b", 6, 1)
    j.add(b"b", 6, 2)
    assert len(j) == 2
    j.close()


def test_term_and_vote_survive_reopen(path: Path) -> None:
    j = DurableJournal(path)
    assert (j.getCurrentTerm(), j.getVotedForNodeId()) == (0, None)
    j.setCurrentTerm(7, "10.0.0.1:4321")
    # setCurrentTerm must be durable on return: reopen without closing.
    k = DurableJournal(path)
    assert (k.getCurrentTerm(), k.getVotedForNodeId()) == (7, "10.0.0.1:4321")
    k.close()
    for vote in (None, 42, b"node-b", "n\u00f8de"):
        j.setCurrentTerm(8, vote)
        k = DurableJournal(path)
        assert k.getCurrentTerm() == 8
        assert k.getVotedForNodeId() == vote
        k.close()
    with pytest.raises(TypeError):
        j.setCurrentTerm(9, ("not", "encodable"))  # type: ignore[arg-type]
    assert j.getCurrentTerm() == 8
    j.close()


def test_commit_index_is_lazy_hint_clamped_to_log(path: Path) -> None:
    j = DurableJournal(path)
    assert j.getRaftCommitIndex() == 1  # FileJournal's default
    for entry in make_entries(5):
        j.add(*entry)
    j.setRaftCommitIndex(4)
    assert j.getRaftCommitIndex() == 4
    assert DurableJournal(path).getRaftCommitIndex() == 1  # not persisted yet: lazy
    j.onOneSecondTimer()
    assert DurableJournal(path).getRaftCommitIndex() == 4
    j.setRaftCommitIndex(5)
    j.deleteEntriesFrom(2)  # log now ends at idx 2
    j.close()
    assert DurableJournal(path).getRaftCommitIndex() == 2


def test_the_commit_hint_costs_no_fsync_and_a_bad_one_is_ignored(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    j = DurableJournal(path)
    for entry in make_entries(5):
        j.add(*entry)
    j.sync()
    j.setCurrentTerm(3, "n1")  # term and vote: durable at once
    j.onOneSecondTimer()  # the header catches up with the synced entries: one fdatasync
    fsyncs = j.fsync_count
    for commit in (2, 3, 4):
        j.setRaftCommitIndex(commit)
        j.onOneSecondTimer()  # once a second on the tick thread: must not block on disk
    assert j.fsync_count == fsyncs
    j.close()
    reopened = DurableJournal(path)
    assert reopened.getRaftCommitIndex() == 4
    assert (reopened.getCurrentTerm(), reopened.getVotedForNodeId()) == (3, "n1")
    reopened.close()
    hint = Path(str(path) + ".commit")
    raw = bytearray(hint.read_bytes())
    raw[9] ^= 0xFF  # a torn or flipped hint: only a hint, so it is ignored and reported
    hint.write_bytes(bytes(raw))
    reopened = DurableJournal(path)
    assert reopened.getRaftCommitIndex() == 1  # back to the default; the leader resends it
    assert (reopened.getCurrentTerm(), reopened.getVotedForNodeId()) == (3, "n1")
    assert any("unreadable commit-index hint" in p for p in reopened.problems)
    assert reopened.need is None  # nothing acknowledged was lost
    reopened.close()


# ------------------------------------------------------------- torn / corrupt


def test_torn_tail_is_truncated_logged_and_appends_continue(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    entries = make_entries(5)
    fill_and_crash(path, entries)
    last_offset = record_offsets(entries)[-1]
    full_size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(full_size - 3)  # crash in the middle of the last record

    with caplog.at_level(logging.WARNING, logger="sevendb.cluster.raft.journal"):
        j = DurableJournal(path)
    assert entries_of(j) == entries[:4]
    assert path.stat().st_size == last_offset
    assert (j.problems, j.need) == ([], None)  # a torn write, not damage
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "torn tail" in message
    assert str(path) in message
    assert f"offset {last_offset}" in message
    assert f"dropping {full_size - 3 - last_offset} bytes" in message

    j.add(b"again", 5, 1)
    j.add(b"more", 6, 2)
    j.sync()
    j.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sevendb.cluster.raft.journal"):
        k = DurableJournal(path)
    assert entries_of(k) == [*entries[:4], (b"again", 5, 1), (b"more", 6, 2)]
    assert not caplog.records
    k.close()


def test_torn_length_prefix_is_truncated(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    entries = make_entries(3)
    fill_and_crash(path, entries)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x07\x00")  # two bytes of the next length prefix
    with caplog.at_level(logging.WARNING, logger="sevendb.cluster.raft.journal"):
        j = DurableJournal(path)
    assert entries_of(j) == entries
    assert path.stat().st_size == size
    assert "dropping 2 bytes" in caplog.text
    j.close()


@pytest.mark.parametrize("victim", [1, 2, 4])
def test_a_flipped_byte_below_what_was_acknowledged_is_damage_not_a_torn_tail(
    path: Path, caplog: pytest.LogCaptureFixture, victim: int
) -> None:
    """BEFORE: a record damaged in the middle of the log was taken for a torn tail:
    it and every record after it were dropped with one WARNING, and the replica went
    on as if it had never acknowledged them. AFTER: the good prefix is kept, the loss
    is reported (`problems`, `need`: what was acknowledged), and every header written
    from then on keeps claiming it, across reopens, until the replica is repaired."""
    entries = make_entries(5)
    fill(path, entries)  # closed cleanly: all five acknowledged
    offset = record_offsets(entries)[victim]
    flip(path, offset + 4 + 16 + 2)  # inside the command bytes of record `victim`
    with caplog.at_level(logging.WARNING, logger="sevendb.cluster.raft.journal"):
        j = DurableJournal(path)
    assert entries_of(j) == entries[:victim]
    assert path.stat().st_size == offset
    assert j.need == (1, 5)
    assert len(j.problems) == 1 and "lost acknowledged entries" in j.problems[0]
    assert "crc mismatch" in j.problems[0] and f"offset {offset}" in j.problems[0]
    assert "torn tail" not in caplog.text
    j.add(b"again", victim + 1, 1)  # what a leader sends while repairing it
    j.close()
    k = DurableJournal(path)
    if victim < 4:
        assert k.need == (1, 5)  # the header still claims the lost entries
    else:
        assert k.need is None  # the one lost entry is back: repaired
    k.release_need()
    k.close()
    assert DurableJournal(path).need is None


def test_a_damaged_record_with_good_records_after_it_is_damage_even_past_the_claim(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Past what the header claims (a crash right after a batch), a bad record with
    good records after it is still not a torn tail: it is reported (the replica logs
    it as damage), though nothing acknowledged is lost, so no repair is needed."""
    entries = make_entries(5)
    fill_and_crash(path, entries)
    flip(path, record_offsets(entries)[2] + 4 + 16)
    with caplog.at_level(logging.WARNING, logger="sevendb.cluster.raft.journal"):
        j = DurableJournal(path)
    assert entries_of(j) == entries[:2]
    assert j.need is None
    assert len(j.problems) == 1 and "good records after it" in j.problems[0]
    assert "torn tail" not in caplog.text
    j.close()


def test_the_header_claims_synced_entries_one_batch_late_and_all_at_close(path: Path) -> None:
    """A header never claims entries a crash could still take away: a sync writes the
    slot for what was durable before it (in the same fdatasync), the one-second timer
    and a clean close bring it up to date."""
    j = DurableJournal(path)
    for entry in make_entries(3):
        j.add(*entry)
    j.sync()
    assert j._slot.acked == (0, 0)
    j.add(b"4", 4, 1)
    j.sync()
    assert j._slot.acked == (1, 3)
    j.onOneSecondTimer()
    assert j._slot.acked == (1, 4)
    j.add(b"5", 5, 1)
    j.close()
    raw = path.read_bytes()
    slots = [raw[o : o + SLOT_BYTES] for o in SLOT_OFFSETS]
    assert any(struct.pack("<QQ", 1, 5) in slot[8:24] for slot in slots)


def test_lost_records_past_the_last_good_one_are_damage_after_a_clean_close(path: Path) -> None:
    entries = make_entries(6)
    fill(path, entries)
    with open(path, "r+b") as f:
        f.truncate(record_offsets(entries)[4])  # records 5 and 6 gone, at a boundary
    j = DurableJournal(path)
    assert entries_of(j) == entries[:4]
    assert j.need == (1, 6)
    assert "lost acknowledged entries" in j.problems[0]
    j.close()


@pytest.mark.parametrize("removal", ["conflict", "snapshot install"])
def test_entries_removed_by_raft_then_a_crash_are_not_damage(path: Path, removal: str) -> None:
    """A follower drops a conflicting suffix (or its whole log for a snapshot) and
    crashes before the lazy hint catches up: the header, lowered durably before the
    cut, is what counts, not the hint that still claims the dropped entries."""
    fill(path, make_entries(6))  # header and hint both claim (1, 6)
    j = DurableJournal(path)
    if removal == "conflict":
        j.deleteEntriesFrom(3)
    else:
        j.clear()
    os.close(j._fd)  # crash: no clean close, the hint is not rewritten
    k = DurableJournal(path)
    assert (k.problems, k.need) == ([], None)
    k.close()


@pytest.mark.parametrize("damage", ["deleted", "emptied", "cut in its header"])
def test_a_journal_gone_while_the_replica_has_lived_is_damage_claiming_the_hint(
    path: Path, damage: str
) -> None:
    entries = make_entries(4, term=2)
    j = DurableJournal(path)
    j.setCurrentTerm(2, "a:1")
    for entry in entries:
        j.add(*entry)
    j.close()
    if damage == "deleted":
        path.unlink()
    elif damage == "emptied":
        path.write_bytes(b"")
    else:
        path.write_bytes(path.read_bytes()[:700])
    k = DurableJournal(path)
    assert len(k) == 0
    assert k.need == (2, 4)  # the commit hint mirrors what was acknowledged
    assert k.problems
    assert (k.getCurrentTerm(), k.getVotedForNodeId()) == (2, "a:1")
    k.close()
    Path(str(path) + ".commit").unlink()
    path.unlink()
    unknown = DurableJournal(path)  # nothing says how much: more than anything known
    assert unknown.need is not None and unknown.need[0] == 2 and unknown.need[1] > 2**32
    unknown.close()


def test_a_fresh_journal_is_not_damage(path: Path) -> None:
    j = DurableJournal(path)
    j.add(b"noop", 1, 0)
    j.close()
    for _ in range(2):
        k = DurableJournal(path)
        assert (k.problems, k.need) == ([], None)
        k.close()


def test_both_header_slots_damaged_fall_back_to_the_hint(path: Path) -> None:
    fill(path, make_entries(3))
    raw = bytearray(path.read_bytes())
    for offset in SLOT_OFFSETS:
        raw[offset + 40] ^= 0xFF
    path.write_bytes(bytes(raw))
    j = DurableJournal(path)
    assert entries_of(j) == make_entries(3)
    assert any("header slots" in p for p in j.problems)
    assert j.need is None
    j.close()
    assert DurableJournal(path).problems == []  # written again


def test_crc_valid_but_out_of_sequence_record_is_dropped(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fill(path, make_entries(2))
    body = struct.pack("<QQ", 9, 1) + b"stray"
    with open(path, "ab") as f:
        f.write(struct.pack("<I", len(body)) + body + struct.pack("<I", zlib.crc32(body)))
    with caplog.at_level(logging.WARNING, logger="sevendb.cluster.raft.journal"):
        j = DurableJournal(path)
    assert entries_of(j) == make_entries(2)
    assert "out-of-sequence" in caplog.text
    j.close()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"PYSYNCOBJ" + b"\x00" * 40, "bad magic"),
        (struct.pack("<8sII", MAGIC, FORMAT_VERSION + 1, 0) + b"\x00" * 30, "format version"),
    ],
)
def test_foreign_or_unknown_file_raises_and_is_not_wiped(
    path: Path, content: bytes, match: str
) -> None:
    path.write_bytes(content)
    with pytest.raises(JournalFormatError, match=match):
        DurableJournal(path)
    assert path.read_bytes() == content


def test_a_version_1_journal_is_read_and_rewritten_as_version_2(path: Path) -> None:
    entries = make_entries(3, term=0)
    body = b"".join(
        struct.pack("<I", 16 + len(c))
        + struct.pack("<QQ", i, t)
        + c
        + struct.pack("<I", zlib.crc32(c, zlib.crc32(struct.pack("<QQ", i, t))))
        for c, i, t in entries
    )
    path.write_bytes(struct.pack("<8sII", MAGIC, 1, 0) + body)
    j = DurableJournal(path)
    assert entries_of(j) == entries
    assert (j.problems, j.need) == ([], None)
    j.close()
    assert struct.unpack_from("<I", path.read_bytes(), 8)[0] == FORMAT_VERSION
    assert entries_of(DurableJournal(path)) == entries


def test_pysyncobj_file_journal_is_refused(path: Path) -> None:
    from pysyncobj.journal import FileJournal

    old = FileJournal(str(path))
    old.add(b"x", 1, 1)
    old._destroy()
    before = path.read_bytes()
    with pytest.raises(JournalFormatError, match="bad magic"):
        DurableJournal(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("damage", ["flipped", "junk", "deleted"])
def test_a_damaged_state_file_is_restored_from_the_header_copy(path: Path, damage: str) -> None:
    """BEFORE: a damaged term/vote file stopped the node from starting. AFTER: the
    journal's header holds a second copy; the file is written again from it and the
    damage reported."""
    j = DurableJournal(path)
    j.setCurrentTerm(3, "a:1")
    j.add(b"x", 1, 3)
    j.close()
    state = Path(str(path) + ".state")
    if damage == "flipped":
        flip(state, 20, 0x01)  # inside the term
    elif damage == "junk":
        state.write_bytes(b"junk")
    else:
        state.unlink()
    k = DurableJournal(path)
    assert (k.getCurrentTerm(), k.getVotedForNodeId()) == (3, "a:1")
    assert any("restored from the journal header" in p for p in k.problems)
    assert k.need is None
    k.close()
    assert DurableJournal(path).problems == []


def test_with_both_copies_of_the_vote_lost_it_votes_for_no_one_in_that_term(
    path: Path,
) -> None:
    j = DurableJournal(path)
    j.setCurrentTerm(3, "a:1")
    j.add(b"x", 1, 3)
    j.close()
    Path(str(path) + ".state").unlink()
    raw = bytearray(path.read_bytes())
    for offset in SLOT_OFFSETS:
        raw[offset + 40] ^= 0xFF
    path.write_bytes(bytes(raw))
    k = DurableJournal(path)
    assert (k.getCurrentTerm(), k.getVotedForNodeId()) == (3, LOST_VOTE)
    assert any("term and vote lost" in p for p in k.problems)
    k.close()


# ------------------------------------------------------------------- deletes


def test_delete_entries_from_then_reopen(path: Path) -> None:
    entries = make_entries(6)
    j = DurableJournal(path)
    for entry in entries:
        j.add(*entry)
    j.deleteEntriesFrom(4)
    assert entries_of(j) == entries[:4]
    j.add(b"new-5", 5, 2)  # a follower replacing a conflicting suffix
    j.sync()
    j.close()
    k = DurableJournal(path)
    assert entries_of(k) == [*entries[:4], (b"new-5", 5, 2)]
    k.deleteEntriesFrom(0)
    assert len(k) == 0
    k.close()
    assert len(DurableJournal(path)) == 0


def test_delete_entries_to_then_reopen(path: Path) -> None:
    entries = make_entries(6)
    j = DurableJournal(path)
    for entry in entries:
        j.add(*entry)
    j.setCurrentTerm(4, "b:2")
    j.deleteEntriesTo(4)
    assert entries_of(j) == entries[4:]
    assert j.durable_len == 2
    j.add(b"after", 7, 1)
    j.close()
    k = DurableJournal(path)
    assert entries_of(k) == [*entries[4:], (b"after", 7, 1)]
    assert (k.getCurrentTerm(), k.getVotedForNodeId()) == (4, "b:2")
    assert not Path(str(path) + ".tmp").exists()
    k.close()


def test_clear_then_reopen(path: Path) -> None:
    j = DurableJournal(path)
    for entry in make_entries(3):
        j.add(*entry)
    j.clear()
    j.add(b"snap-prev", 100, 5)  # what pysyncobj does when it loads a snapshot
    j.add(b"snap-last", 101, 5)
    j.close()
    assert entries_of(DurableJournal(path)) == [(b"snap-prev", 100, 5), (b"snap-last", 101, 5)]


def test_stale_tmp_files_are_ignored_and_removed(path: Path) -> None:
    fill(path, make_entries(2))
    tmp = Path(str(path) + ".tmp")
    tmp.write_bytes(b"half a compaction")
    j = DurableJournal(path)
    assert entries_of(j) == make_entries(2)
    assert not tmp.exists()
    j.close()


def test_closed_journal_refuses_writes(path: Path) -> None:
    j = DurableJournal(path)
    j.close()
    j.close()  # idempotent
    with pytest.raises(JournalError):
        j.add(b"x", 1, 0)


# -------------------------------------------------------------- group commit


def test_sync_batches_appends_into_one_fsync(path: Path, fsync_calls: list[str]) -> None:
    j = DurableJournal(path)
    fsyncs_before, calls_before = j.fsync_count, len(fsync_calls)
    for entry in make_entries(50):
        j.add(*entry)
    assert j.durable_len == 0
    assert j.pending
    assert j.fsync_count == fsyncs_before  # add() never fsyncs
    assert len(fsync_calls) == calls_before

    assert j.sync() is True
    assert j.fsync_count == fsyncs_before + 1
    assert len(fsync_calls) == calls_before + 1
    assert j.sync_count == 1
    assert j.durable_len == 50
    assert j.last_durable_index == 50
    assert not j.pending

    assert j.sync() is False  # nothing pending: no syscall
    assert len(fsync_calls) == calls_before + 1

    j.add(b"tail", 51, 1)
    assert (j.durable_len, j.last_durable_index) == (50, 50)
    j.flush()
    assert (j.durable_len, j.sync_count, j.fsync_count) == (51, 2, fsyncs_before + 2)
    assert len(fsync_calls) == calls_before + 2
    j.close()


def test_set_current_term_is_fsynced(path: Path, fsync_calls: list[str]) -> None:
    j = DurableJournal(path)
    before = len(fsync_calls)
    j.setCurrentTerm(1, "a:1")
    # tmp file + directory; the rename alone would not survive power loss
    assert len(fsync_calls) - before >= 2
    j.close()


def test_close_makes_pending_appends_durable(path: Path) -> None:
    j = DurableJournal(path)
    j.add(b"x", 1, 0)
    assert j.durable_len == 0
    j._destroy()
    assert j.sync_count == 1


# ------------------------------------------------------ interface / hygiene


def test_implements_every_pysyncobj_journal_method() -> None:
    from pysyncobj.journal import FileJournal, Journal

    wanted = {
        name
        for cls in (Journal, FileJournal)
        for name, value in vars(cls).items()
        if callable(value)
        and not name.startswith("_FileJournal__")
        and name not in {"__init__", "__module__"}
    }
    missing = {name for name in wanted if not hasattr(DurableJournal, name)}
    assert not missing


def test_module_does_not_import_pysyncobj() -> None:
    tree = ast.parse(Path(journal_module.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert not any(name.split(".")[0] == "pysyncobj" for name in imported)


# --------------------------------------------------------------- properties


Op = tuple[str, int, bytes]

ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.binary(max_size=40)),
        st.tuples(st.just("add"), st.integers(0, 2), st.binary(max_size=40)),
        st.tuples(st.just("del_from"), st.integers(0, 12), st.just(b"")),
        st.tuples(st.just("del_to"), st.integers(0, 12), st.just(b"")),
        st.tuples(st.just("sync"), st.just(0), st.just(b"")),
        st.tuples(st.just("reopen"), st.just(0), st.just(b"")),
        st.tuples(st.just("clear"), st.integers(1, 1000), st.just(b"")),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(ops=ops_strategy)
def test_random_operations_match_list_model(ops: list[Op]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "j"
        j = DurableJournal(file)
        model: list[Entry] = []
        next_idx, term = 1, 0
        try:
            for kind, arg, payload in ops:
                if kind == "add":
                    term += arg
                    entry = (payload, model[-1][1] + 1 if model else next_idx, term)
                    j.add(*entry)
                    model.append(entry)
                elif kind == "del_from":
                    j.deleteEntriesFrom(arg)
                    del model[arg:]
                elif kind == "del_to":
                    j.deleteEntriesTo(arg)
                    model = model[arg:]
                elif kind == "sync":
                    j.sync()
                    assert j.durable_len == len(model)
                elif kind == "reopen":
                    j.close()
                    j = DurableJournal(file)
                elif kind == "clear":
                    j.clear()
                    model = []
                    next_idx = arg  # pysyncobj refills from a snapshot at any index
                assert j.durable_len <= len(j)
                assert entries_of(j) == model
            j.close()
            j = DurableJournal(file)
            assert entries_of(j) == model
        finally:
            j.close()


def _written(tmp: str, n: int) -> tuple[Path, list[Entry]]:
    file = Path(tmp) / "j"
    entries = [(bytes([i]) * (i % 7), i + 1, i // 3) for i in range(n)]
    fill(file, entries)
    return file, entries


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 12), data=st.data())
def test_any_truncation_recovers_the_complete_prefix(n: int, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        file, entries = _written(tmp, n)
        size = file.stat().st_size
        cut = data.draw(st.integers(HEADER_SIZE, size), label="cut")
        with open(file, "r+b") as f:
            f.truncate(cut)
        complete = sum(1 for off in [*record_offsets(entries), size] if off <= cut) - 1
        j = DurableJournal(file)
        assert entries_of(j) == entries[:complete]
        # Closed cleanly, so every record was acknowledged: a cut is never a torn tail.
        assert j.need == (None if complete == n else (entries[-1][2], entries[-1][1]))
        j.close()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_any_flipped_record_byte_keeps_the_prefix_and_claims_the_rest(
    n: int, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        file, entries = _written(tmp, n)
        size = file.stat().st_size
        pos = data.draw(st.integers(HEADER_SIZE, size - 1), label="pos")
        bit = data.draw(st.integers(0, 7), label="bit")
        raw = bytearray(file.read_bytes())
        raw[pos] ^= 1 << bit
        file.write_bytes(bytes(raw))
        hit = sum(1 for off in record_offsets(entries) if off <= pos) - 1
        j = DurableJournal(file)
        assert entries_of(j) == entries[:hit]
        assert j.need == (entries[-1][2], entries[-1][1])
        j.close()


# ----------------------------------------------------------------- preallocation

CHUNK = 4096


def test_a_preallocating_journal_appends_over_zeros_without_growing_the_file(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The file grows a chunk of zeros at a time, not with each append (so an
    fdatasync of a batch commits no new file size); reopened, the zeros past the
    last record are unused space: no torn tail, no damage, the space is kept."""
    entries = make_entries(20)
    j = DurableJournal(path, preallocate_bytes=CHUNK)
    j.add(*entries[0])
    j.sync()
    size = path.stat().st_size
    assert size >= record_offsets(entries)[1] + CHUNK
    for entry in entries[1:]:
        j.add(*entry)
        j.sync()
        assert path.stat().st_size == size
    os.close(j._fd)  # a crash: the header claims what was durable before the last sync
    with caplog.at_level(logging.WARNING, logger="sevendb.cluster.raft.journal"):
        k = DurableJournal(path, preallocate_bytes=CHUNK)
    assert entries_of(k) == entries
    assert (k.problems, k.need, caplog.records) == ([], None, [])
    assert path.stat().st_size == size
    k.add(b"next", 21, 1)
    k.close()
    assert path.stat().st_size == size
    assert entries_of(DurableJournal(path)) == [*entries, (b"next", 21, 1)]


def test_a_preallocating_journal_grows_by_a_chunk_past_a_large_record(path: Path) -> None:
    j = DurableJournal(path, preallocate_bytes=CHUNK)
    j.add(b"x" * (3 * CHUNK), 1, 1)
    j.sync()
    assert path.stat().st_size == HEADER_SIZE + RECORD_OVERHEAD + 3 * CHUNK + CHUNK
    j.close()
    assert entries_of(DurableJournal(path)) == [(b"x" * (3 * CHUNK), 1, 1)]


def test_a_torn_record_in_preallocated_space_is_a_torn_tail(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    entries = make_entries(5)
    j = DurableJournal(path, preallocate_bytes=CHUNK)
    for entry in entries:
        j.add(*entry)
    j.sync()
    os.close(j._fd)
    last = record_offsets(entries)[-1]
    with open(path, "r+b") as f:  # the last record half on disk, zeros after it
        f.seek(last + RECORD_OVERHEAD // 2)
        f.write(bytes(RECORD_OVERHEAD))
    with caplog.at_level(logging.WARNING, logger="sevendb.cluster.raft.journal"):
        k = DurableJournal(path, preallocate_bytes=CHUNK)
    assert entries_of(k) == entries[:4]
    assert (k.problems, k.need) == ([], None)
    assert "torn tail" in caplog.text
    assert path.stat().st_size == last  # cut there; the next append preallocates again
    k.add(*entries[4])
    k.close()
    assert entries_of(DurableJournal(path)) == entries


def test_damage_before_preallocated_space_is_still_damage(path: Path) -> None:
    """Zeros after the records never hide what was acknowledged: a flipped byte
    below the claim is reported, as without preallocation."""
    entries = make_entries(5)
    j = DurableJournal(path, preallocate_bytes=CHUNK)
    for entry in entries:
        j.add(*entry)
    j.close()  # all five acknowledged
    flip(path, record_offsets(entries)[2] + RECORD_OVERHEAD)
    k = DurableJournal(path, preallocate_bytes=CHUNK)
    assert entries_of(k) == entries[:2]
    assert k.need == (1, 5)
    assert len(k.problems) == 1 and "lost acknowledged entries" in k.problems[0]


def test_zeros_over_acknowledged_records_are_a_loss_not_preallocated_space(path: Path) -> None:
    entries = make_entries(5)
    fill(path, entries)
    with open(path, "r+b") as f:  # the last two records' blocks lost as zeros
        f.seek(record_offsets(entries)[3])
        f.write(bytes(4 * CHUNK))
    k = DurableJournal(path)
    assert entries_of(k) == entries[:3]
    assert k.need == (1, 5)
    assert len(k.problems) == 1 and "lost acknowledged entries" in k.problems[0]


def test_preallocate_bytes_must_not_be_negative(path: Path) -> None:
    with pytest.raises(ValueError, match="preallocate_bytes"):
        DurableJournal(path, preallocate_bytes=-1)
