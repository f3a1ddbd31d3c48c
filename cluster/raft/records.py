"""The journal's file format (docs/raft.md, "Files"): a header with two alternating
slots that record what the replica acknowledged (and a copy of its term and vote),
then CRC'd records. Reading a file tells a torn tail from records damaged in the
middle, which the journal reports instead of silently cutting the log short. Pure
functions over bytes: the journal does the I/O."""

from __future__ import annotations

import re
import struct
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Final

from .sidecars import JournalError, Position, VoteId, decode_vote, encode_vote

__all__ = [
    "FORMAT_VERSION",
    "HEADER_V1",
    "HEADER_V2",
    "MAGIC",
    "SLOT_BYTES",
    "SLOT_OFFSETS",
    "Entry",
    "JournalFormatError",
    "LogImage",
    "Slot",
    "encode_record",
    "encode_slot",
    "empty_log",
    "read_log",
]

#: One pysyncobj log entry: ``(command, idx, term)``. pysyncobj 0.3.17 builds commands
#: as bytes (``struct.pack('B', type) + pickled payload``) and stores the tuple as is.
Entry = tuple[bytes, int, int]

MAGIC: Final = b"7DBJRNL\x00"
FORMAT_VERSION: Final = 2
_PREAMBLE = struct.Struct("<8sII")  # magic, format version, flags
HEADER_V1: Final = _PREAMBLE.size
SLOT_BYTES: Final = 512
SLOT_OFFSETS: Final = (512, 1024)
"""Sector-aligned, so that writing one slot never tears the other."""
HEADER_V2: Final = 1536

_LEN = struct.Struct("<I")
_IDX_TERM = struct.Struct("<QQ")
_CRC = struct.Struct("<I")
_MAX_BODY: Final = 0xFFFFFFFF
# Slot: sequence, acknowledged term and index, current term, vote tag, vote length,
# vote bytes, zero padding, then crc32 of everything before it.
_SLOT = struct.Struct("<QQQQBH")
_VOTE_MAX: Final = SLOT_BYTES - _SLOT.size - _CRC.size
# Where a record can start after a damaged one: a length prefix that is not zero, then
# an index and a term below 2**32 (their high four bytes zero).
_RECORD_START = re.compile(rb"(?=(?!\x00\x00\x00\x00)[\s\S]{8}\x00{4}[\s\S]{4}\x00{4})")


class JournalFormatError(JournalError):
    """The log file is not a journal this code can read (bad magic, unknown version).
    Raised instead of wiping the file, because the file may hold acked entries
    written by something else or by a newer release."""


@dataclass(frozen=True)
class Slot:
    """What the replica had made durable (and so may have acknowledged) when the slot
    was written, with a copy of its term and vote (`sidecars.StateFile` holds the
    other copy)."""

    seq: int
    acked: Position
    term: int
    vote: VoteId


def encode_slot(slot: Slot) -> bytes:
    tag, raw = encode_vote(slot.vote)
    if len(raw) > _VOTE_MAX:
        raise ValueError(f"a vote of {len(raw)} bytes does not fit a journal slot")
    head = _SLOT.pack(slot.seq, slot.acked[0], slot.acked[1], slot.term, tag, len(raw)) + raw
    body = head.ljust(SLOT_BYTES - _CRC.size, b"\x00")
    return body + _CRC.pack(zlib.crc32(body))


def _decode_slot(raw: bytes) -> Slot | None:
    if len(raw) != SLOT_BYTES or _CRC.unpack_from(raw, SLOT_BYTES - _CRC.size)[0] != zlib.crc32(
        raw[: -_CRC.size]
    ):
        return None
    seq, acked_term, acked_idx, term, tag, size = _SLOT.unpack_from(raw, 0)
    if seq == 0 or size > _VOTE_MAX:
        return None
    try:
        vote = decode_vote(tag, raw[_SLOT.size : _SLOT.size + size])
    except ValueError:
        return None
    return Slot(seq, (acked_term, acked_idx), term, vote)


def empty_log(slot: Slot) -> bytes:
    """A log without records whose newest slot is `slot`."""
    preamble = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0).ljust(SLOT_OFFSETS[0], b"\x00")
    slots = [b"\x00" * SLOT_BYTES, b"\x00" * SLOT_BYTES]
    slots[slot.seq % 2] = encode_slot(slot)
    return preamble + b"".join(slots)


def encode_record(command: bytes, idx: int, term: int) -> bytes:
    body_len = _IDX_TERM.size + len(command)
    if body_len > _MAX_BODY:
        raise ValueError(f"journal command of {len(command)} bytes is too large")
    idx_term = _IDX_TERM.pack(idx, term)
    crc = zlib.crc32(command, zlib.crc32(idx_term))
    return b"".join((_LEN.pack(body_len), idx_term, command, _CRC.pack(crc)))


def in_sequence(entries: list[Entry], idx: int, term: int) -> bool:
    """Raft logs are contiguous in idx and non-decreasing in term; pysyncobj
    addresses entries by ``idx - first_idx``, so it relies on the former too."""
    if not entries:
        return True
    _, last_idx, last_term = entries[-1]
    return idx == last_idx + 1 and term >= last_term


@dataclass
class LogImage:
    """What a log file holds, as `read_log` found it."""

    version: int
    slot: Slot | None
    """The newest slot whose checksum holds (None: a version 1 file, or both damaged)."""
    entries: list[Entry] = field(default_factory=list)
    offsets: array[int] = field(default_factory=lambda: array("Q"))
    """File offset at which each entry's record starts."""
    end: int = HEADER_V2
    """Where the last good record ends: the file is cut here."""
    stop: str | None = None
    """Why reading stopped before the end of the file (None: it did not)."""
    valid_after: Position | None = None
    """The last record with a good checksum found past `end` (damage, not a torn write)."""

    @property
    def last(self) -> Position:
        """(term, idx) of the last good entry, (0, 0) if none."""
        if not self.entries:
            return (0, 0)
        _, idx, term = self.entries[-1]
        return (term, idx)


def read_log(data: bytes, path: object) -> LogImage:
    """Read a whole log file. Raises JournalFormatError for a file that is not a
    journal of a version this build reads; a file shorter than its header is
    reported by the caller (it reads as having no records)."""
    magic, version, _flags = _PREAMBLE.unpack_from(data, 0)
    if magic != MAGIC:
        raise JournalFormatError(
            f"{path}: bad magic {magic!r} (expected {MAGIC!r}); not a sevendb "
            "journal (a pysyncobj FileJournal?), refusing to overwrite it"
        )
    if version not in (1, FORMAT_VERSION):
        raise JournalFormatError(
            f"{path}: unknown journal format version {version} (this build "
            f"reads versions 1 and {FORMAT_VERSION}); refusing to overwrite it"
        )
    if version == 1:
        image = LogImage(1, None, end=HEADER_V1)
    else:
        slots = [_decode_slot(data[o : o + SLOT_BYTES]) for o in SLOT_OFFSETS]
        valid = [s for s in slots if s is not None]
        image = LogImage(2, max(valid, key=lambda s: s.seq) if valid else None)
    image.end, image.stop = _scan(data, image.end, image.entries, image.offsets)
    if image.stop is not None and data.count(0, image.end) == len(data) - image.end:
        image.stop = None  # zeros past the last record: space preallocated, not damage
    if image.stop is not None:
        image.valid_after = _last_valid_after(data, image.end, image.last)
    return image


def _scan(
    data: bytes, pos: int, entries: list[Entry], offsets: array[int]
) -> tuple[int, str | None]:
    """Read the records of `data` from offset `pos` into `entries` and `offsets`, up to
    the first short read, CRC mismatch or out-of-sequence record. Returns where
    reading stopped and why (None: at the end of `data`)."""
    while pos < len(data):
        record = _record_at(data, pos)
        if isinstance(record, str):
            return pos, record
        command, idx, term, end = record
        if not in_sequence(entries, idx, term):
            # A CRC-valid record that breaks the log's shape cannot be trusted
            # either; keep the longest well-formed prefix.
            return pos, f"out-of-sequence record idx={idx} term={term}"
        entries.append((command, idx, term))
        offsets.append(pos)
        pos = end
    return pos, None


def _record_at(data: bytes, pos: int) -> tuple[bytes, int, int, int] | str:
    """The record at `pos` as (command, idx, term, end), or why there is none."""
    if len(data) - pos < _LEN.size:
        return "short length prefix"
    (body_len,) = _LEN.unpack_from(data, pos)
    if body_len < _IDX_TERM.size:
        return f"impossible record length {body_len}"
    end = pos + _LEN.size + body_len + _CRC.size
    if end > len(data):
        return "short record"
    body = memoryview(data)[pos + _LEN.size : pos + _LEN.size + body_len]
    if zlib.crc32(body) != _CRC.unpack_from(data, end - _CRC.size)[0]:
        return "crc mismatch"
    idx, term = _IDX_TERM.unpack_from(body, 0)
    return bytes(body[_IDX_TERM.size :]), idx, term, end


def _last_valid_after(data: bytes, pos: int, last: Position) -> Position | None:
    """The last record past a damaged one at `pos` that has a good checksum and comes
    after `last` in the log: proof that the damage is not a torn tail. Candidates are
    found with a regular expression, so a long damaged stretch costs little."""
    found: Position | None = None
    for match in _RECORD_START.finditer(data, pos + 1):
        record = _record_at(data, match.start())
        if isinstance(record, str):
            continue
        _, idx, term, _end = record
        if (term, idx) > last and (found is None or (term, idx) > found):
            found = (term, idx)
    return found
