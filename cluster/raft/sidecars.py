"""The journal's two small companion files: the term/vote record (`StateFile`,
replaced atomically and fsynced before a vote or a new term is acted on, as Raft
requires) and the commit-index hint (`CommitHint`, overwritten in place once a
second and never fsynced: a lost hint only delays a restarted replica's applies; it
also mirrors what the replica acknowledged, in case the journal itself is lost).
Formats: docs/raft.md, "Files"."""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Final

from sevendb.cluster.common.files import pwrite_all

__all__ = [
    "COMMIT_MAGIC",
    "LOST_VOTE",
    "NOTHING",
    "STATE_FORMAT_VERSION",
    "STATE_MAGIC",
    "CommitHint",
    "JournalError",
    "JournalMeta",
    "JournalStateError",
    "Position",
    "StateFile",
    "VoteId",
    "check_vote",
    "decode_vote",
    "encode_vote",
]

logger = logging.getLogger(__name__)

#: What pysyncobj passes as ``votedForNodeId``: ``Node.id`` (a ``"host:port"`` string for
#: TCP nodes, but any hashable in principle) or None. We persist the common, safely
#: encodable types and refuse the rest rather than pickle arbitrary objects.
VoteId = str | bytes | int | None

LOST_VOTE: Final = "<vote lost>"
"""The vote of a replica whose term and vote were both lost (both copies damaged): it
may have voted in the term it restarts in, so it votes for no one in that term (any
non-None vote stops pysyncobj from voting again)."""

#: A log position in Raft order: (term, index); later positions compare greater.
Position = tuple[int, int]
NOTHING: Final[Position] = (0, 0)

STATE_MAGIC: Final = b"7DBSTAT\x00"
STATE_FORMAT_VERSION: Final = 1
COMMIT_MAGIC: Final = b"7DBCMT2\x00"
_COMMIT_MAGIC_V1: Final = b"7DBCMIT\x00"

_CRC = struct.Struct("<I")
# State: magic, version, term, commit index, vote tag, vote length, vote bytes, then
# crc32 of everything before it.
_STATE_FIXED = struct.Struct("<8sIQQBI")
_VOTE_NONE, _VOTE_STR, _VOTE_BYTES, _VOTE_INT = 0, 1, 2, 3
# Commit-index hint: magic, commit index, acknowledged term and index, then crc32 of
# them (version 1: magic, commit index, crc32).
_COMMIT_HINT = struct.Struct("<8sQQQ")
_COMMIT_HINT_V1 = struct.Struct("<8sQ")


class JournalError(Exception):
    """Base class for errors raised by the journal and its sidecars."""


class JournalStateError(JournalError):
    """The term/vote sidecar is unreadable. Raised instead of defaulting to term 0 and
    no vote, because forgetting a vote lets a node vote twice in one term."""


def encode_vote(vote: VoteId) -> tuple[int, bytes]:
    """(tag, bytes) of a vote, as the state file and the journal's slots store it."""
    if vote is None:
        return _VOTE_NONE, b""
    if isinstance(vote, str):
        return _VOTE_STR, vote.encode("utf-8")
    if isinstance(vote, bytes):
        return _VOTE_BYTES, vote
    if type(vote) is int:  # not bool: True would come back as 1
        return _VOTE_INT, str(vote).encode("ascii")
    raise TypeError(f"votedForNodeId must be str, bytes, int or None, got {type(vote).__name__}")


def check_vote(vote: VoteId) -> None:
    """Raise TypeError if `vote` cannot be stored."""
    encode_vote(vote)


def decode_vote(tag: int, raw: bytes) -> VoteId:
    """The vote `encode_vote` gave (tag, raw) for; ValueError for an unknown tag."""
    if tag == _VOTE_NONE:
        return None
    if tag == _VOTE_STR:
        return raw.decode("utf-8")
    if tag == _VOTE_BYTES:
        return raw
    if tag == _VOTE_INT:
        return int(raw.decode("ascii"))
    raise ValueError(f"unknown vote tag {tag}")


class StateFile:
    """``<log>.state``: current term, vote and commit index, CRC'd."""

    def __init__(self, path: Path, atomic_write: Callable[[Path, bytes], None]) -> None:
        self.path = path
        self._atomic_write = atomic_write

    def load(self) -> tuple[int, int, VoteId] | None:
        """(term, commit index, vote), or None if there is no file (a fresh node, or
        one that crashed before its first term change: term 0)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        fixed = _STATE_FIXED.size
        if len(raw) < fixed + _CRC.size:
            raise JournalStateError(f"{self.path}: truncated ({len(raw)} bytes)")
        magic, version, term, commit, tag, vote_len = _STATE_FIXED.unpack_from(raw, 0)
        if magic != STATE_MAGIC:
            raise JournalStateError(f"{self.path}: bad magic {magic!r}")
        if version != STATE_FORMAT_VERSION:
            raise JournalStateError(f"{self.path}: unknown state format version {version}")
        if len(raw) != fixed + vote_len + _CRC.size:
            raise JournalStateError(f"{self.path}: length mismatch")
        (crc,) = _CRC.unpack_from(raw, fixed + vote_len)
        if zlib.crc32(raw[: fixed + vote_len]) != crc:
            raise JournalStateError(f"{self.path}: crc mismatch")
        try:
            vote = decode_vote(tag, raw[fixed : fixed + vote_len])
        except ValueError as exc:
            raise JournalStateError(f"{self.path}: {exc}") from exc
        return term, commit, vote

    def store(self, term: int, commit: int, vote: VoteId) -> None:
        """Replace the file atomically and durably."""
        tag, raw_vote = encode_vote(vote)
        head = _STATE_FIXED.pack(
            STATE_MAGIC, STATE_FORMAT_VERSION, term, commit, tag, len(raw_vote)
        )
        payload = head + raw_vote
        self._atomic_write(self.path, payload + _CRC.pack(zlib.crc32(payload)))


class CommitHint:
    """``<log>.commit``: the commit index and what the replica acknowledged, overwritten
    in place, never fsynced."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def load(self) -> tuple[int, Position | None] | str | None:
        """(commit index, acknowledged position or None for a version 1 hint); None if
        there is no file; why it is unreadable otherwise."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        for layout, magic in ((_COMMIT_HINT, COMMIT_MAGIC), (_COMMIT_HINT_V1, _COMMIT_MAGIC_V1)):
            size = layout.size
            if (
                len(raw) == size + _CRC.size
                and _CRC.unpack_from(raw, size)[0] == zlib.crc32(raw[:size])
                and raw[:8] == magic
            ):
                fields = layout.unpack_from(raw, 0)
                acked = (int(fields[2]), int(fields[3])) if len(fields) == 4 else None
                return int(fields[1]), acked
        return f"{self.path}: unreadable commit-index hint ({len(raw)} bytes)"

    def store(self, commit: int, acked: Position) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        payload = _COMMIT_HINT.pack(COMMIT_MAGIC, commit, *acked)
        pwrite_all(self._fd, payload + _CRC.pack(zlib.crc32(payload)), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class JournalMeta:
    """A journal's current term, vote and commit index, and the two files that keep
    them (``<log>.state``, ``<log>.commit``). `load` notes what it found damaged in
    `problems` instead of raising: the journal decides what the damage means."""

    def __init__(self, log_path: Path, atomic_write: Callable[[Path, bytes], None]) -> None:
        self.state = StateFile(Path(str(log_path) + ".state"), atomic_write)
        self.hint = CommitHint(Path(str(log_path) + ".commit"))
        self.term = 0
        self.vote: VoteId = None
        self.commit = 1  # pysyncobj's FileJournal default
        self.state_found = False
        """A state file was there (readable or not): this replica has lived before."""
        self.state_lost = False
        """The state file was missing or unreadable (the journal may hold a copy)."""
        self.hint_found = False
        self.hint_acked: Position | None = None
        """What the hint says was acknowledged (None: no readable version 2 hint)."""
        self.problems: list[str] = []
        self._stored: tuple[int, Position] | None = None

    def load(self) -> None:
        self.hint_found = self.hint.path.exists()
        self.state_found = self.state.path.exists()
        try:
            state = self.state.load()
        except JournalStateError as exc:
            self.problems.append(f"term and vote record unreadable ({exc})")
            state = None
        if state is None:
            self.state_lost = True
        else:
            self.term, self.commit, self.vote = state
        hint = self.hint.load()
        if isinstance(hint, str):
            self.problems.append(hint)
        elif hint is not None:
            self.commit = max(self.commit, hint[0])
            self.hint_acked = hint[1]

    def set_term(self, term: int, vote: VoteId) -> None:
        """Persist term and vote (and the commit index with them) durably."""
        check_vote(vote)  # validate before changing anything
        self.term, self.vote = term, vote
        self.state.store(self.term, self.commit, self.vote)

    def set_commit(self, commit: int) -> None:
        """Remember the commit index; written by `store_hint`, lazily."""
        self.commit = commit

    def store_hint(self, acked: Position) -> None:
        """Overwrite a changed hint in place, without fsync (a lost hint only delays a
        restarted replica's applies)."""
        if self._stored != (self.commit, acked):
            self.hint.store(self.commit, acked)
            self._stored = (self.commit, acked)

    def close(self) -> None:
        self.hint.close()
