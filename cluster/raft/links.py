"""What a replica's links to the other members carry beyond Raft's own messages:
keep-alives, and flow control of what a leader sends each follower.

* **Keep-alives.** pysyncobj drops a connection that has read nothing for
  `connectionTimeout`, and checks that only when it sends (tcp_connection.py:227-233).
  Followers never talk to each other, so the first vote request of an election after
  a leader fails (or a transfer) tore down the idle link and was lost, costing an
  election timeout (measured: migrations needed 2-6 transfer attempts, and each
  hand-over stalled writes about 1 s). Every member sends a tiny message to every
  other member a few times per timeout, so each link always has something to read;
  it also says what this replica holds and lost (`Recovery.judge`).
* **Flow control.** pysyncobj's leader sends every follower everything from its
  next index to the end of the log each time it sends (syncobj.py:1251-1336), into
  an unbounded buffer in the process when the socket cannot take it: a follower that
  is slow or catching up (a restart, a partition healed) made the leader buffer its
  whole backlog, and that follower's sends took the time the leader's loop gives
  all of them. A follower with more than `follower_entries_in_flight_max` entries
  sent and not acknowledged, or more than `follower_bytes_buffered_max` bytes waiting
  in the leader's send buffer, gets only a heartbeat until it acknowledges more; the
  others are served as usual. A follower that lacks entries and has acknowledged
  nothing for `follower_stalled_warn_s` is named in a WARNING with what the leader
  knows of it (its match and next index, the link, the snapshot being sent to it).
* **Probing.** Until a follower has acknowledged an AppendEntries in this leader's
  term, or after it refused one, the leader does not know where their logs agree. It
  then sends that follower one probe at a time from its next index, and does not
  move the next index on until an answer says where to go (Raft's probe state, as in
  etcd's `Progress`). A refusal says which entry it refused, and one that does not
  refer to the probe in flight is stale and ignored. pysyncobj moved the next index
  to the log's end with every send and trusted every refusal: when a refusal took
  longer than a round to come back, the answer to the next round's heartbeat (sent
  from the log's end) set the next index back where it had been, every time, and a
  follower whose log ended in entries of an older term never caught up (netns CI:
  a replica sat 22,000 entries behind for minutes, match 0).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from pysyncobj.monotonic import monotonic as _monotonic

from .recovery import Recovery

__all__ = ["FollowerFlow", "KeepAlives"]

logger = logging.getLogger(__name__)


class KeepAlives:
    """Sends a keep-alive to every other member every `every_s` (see the module
    docstring); `due` is called from the tick."""

    def __init__(self, every_s: float) -> None:
        self._every_s = every_s
        self._next_s = 0.0

    def due(self, transport: Any, members: Iterable[Any], recovery: Recovery, last: Any) -> None:
        now = _monotonic()
        if now < self._next_s:
            return
        self._next_s = now + self._every_s
        message = recovery.keep_alive(last)
        for node in list(members):
            transport.send(node, message)


class FollowerFlow:
    """Sends AppendEntries to every follower like pysyncobj (syncobj.py:1251-1336),
    with flow control (see the module docstring). Counts, per follower, the sends
    it held back (`held`)."""

    def __init__(
        self, entries_max: int, bytes_max: int, bucket: int, stalled_s: float, probe_resend_s: float
    ) -> None:
        self.entries_max = entries_max
        self.bytes_max = bytes_max
        self.held: dict[str, int] = {}
        self.stale_refusals = 0
        """Refusals ignored because they answered an earlier probe or heartbeat."""
        self._bucket = bucket
        self._stalled_s = stalled_s
        self._probe_resend_s = probe_resend_s
        self._term = -1
        self._matched: set[Any] = set()
        """Followers that acknowledged an AppendEntries in `_term` since their last
        refusal (replicating); the others are probed."""
        self._probe_sent: dict[Any, float] = {}
        """Probing followers with a probe carrying entries in flight: since when."""
        self._progress: dict[str, tuple[tuple[int, int], float, float]] = {}
        """Per follower: ((term, match index), since when, when it may be warned of
        next). A new term (this replica leads again) starts the count afresh."""

    def send_all(self, raft: Any, original: Callable[[Any], None]) -> None:
        """One round of sends from leader `raft` (a `RaftNode`); `original` is
        pysyncobj's own, used for what this does not handle: a follower that needs a
        snapshot, or an entry larger than a batch (its chunked path)."""
        raft._SyncObj__newAppendEntriesTime = _monotonic() + raft._SyncObj__conf.appendEntriesPeriod
        start = _monotonic()
        transport = raft._SyncObj__transport
        self._follow_term(raft)
        for node in list(raft._SyncObj__otherNodes | raft._SyncObj__readonlyNodes):
            self._watch(raft, node, start)
            if node not in raft._SyncObj__connectedNodes:
                raft._SyncObj__serializer.cancelTransmisstion(node)
                self._probe_sent.pop(node, None)
                continue
            if node in self._matched:
                sent = self._send(raft, node, transport.send, start)
            else:
                sent = self._probe(raft, node, transport.send, start)
            if not sent:
                _only(raft, node, original)

    def matched(self, raft: Any, node: Any) -> None:
        """`node` acknowledged an AppendEntries in this term: it is replicated to."""
        self._follow_term(raft)
        self._matched.add(node)
        self._probe_sent.pop(node, None)

    def refusal_is_current(self, raft: Any, node: Any, refused: int | None) -> bool:
        """Whether `node`'s refusal of the AppendEntries whose previous entry was
        `refused` says something about its log now (then it is probed from where the
        refusal says); False for a stale one (see the module docstring). A refusal that
        does not say (None) is trusted, as pysyncobj did."""
        self._follow_term(raft)
        if refused is not None:
            if node in self._matched:
                current = refused >= raft._SyncObj__raftMatchIndex.get(node, 0)
            else:
                current = refused == raft._SyncObj__raftNextIndex.get(node, 0) - 1
            if not current:
                self.stale_refusals += 1
                return False
        self._matched.discard(node)
        self._probe_sent.pop(node, None)
        return True

    def _follow_term(self, raft: Any) -> None:
        """A new term (this replica leads again): every follower is probed afresh."""
        term = raft._SyncObj__raftCurrentTerm
        if term != self._term:
            self._term = term
            self._matched.clear()
            self._probe_sent.clear()

    def _probe(self, raft: Any, node: Any, send: Callable[[Any, Any], object], now: float) -> bool:
        """One AppendEntries to a follower being probed, from its next index, which it
        does not move: with the entries that follow (a batch) when no such probe is in
        flight, as a heartbeat otherwise. False if pysyncobj's own send must do it (a
        snapshot install)."""
        log = raft._SyncObj__raftLog
        index = raft._SyncObj__raftNextIndex[node]
        if index <= log[0][1]:
            return False
        prev_index, prev_term = raft._SyncObj__getPrevLogIndexTerm(index)
        entries: list[Any] = []
        sent = self._probe_sent.get(node)
        if index <= log[-1][1] and (sent is None or now - sent > self._probe_resend_s):
            batch_bytes = raft._SyncObj__conf.appendEntriesBatchSizeBytes
            entries = raft._SyncObj__getEntries(index, None, batch_bytes)
            if len(entries) == 1 and len(entries[0][0]) >= batch_bytes:
                entries = []  # its chunked send waits until the follower is matched
            else:
                self._probe_sent[node] = now
        send(node, _append_entries(raft, prev_index, prev_term, entries))
        return True

    def _send(self, raft: Any, node: Any, send: Callable[[Any, Any], object], start: float) -> bool:
        """Entries for `node` until it has them all, or it is held back, or the round's
        time is up; always at least one message (the heartbeat). False if pysyncobj's
        own send must do it (snapshot, or one entry larger than a batch)."""
        log = raft._SyncObj__raftLog
        batch_bytes = raft._SyncObj__conf.appendEntriesBatchSizeBytes
        next_index, match_index = raft._SyncObj__raftNextIndex, raft._SyncObj__raftMatchIndex
        first = True
        while True:
            index = next_index[node]
            if index <= log[0][1]:
                return False  # behind the log's start: a snapshot install
            behind = index <= log[-1][1]
            held = behind and self._held(raft, node, index, match_index)
            if not first and (not behind or held):
                return True
            prev_index, prev_term = raft._SyncObj__getPrevLogIndexTerm(index)
            entries: list[Any] = []
            if behind and not held:  # (held: the round's one message is a heartbeat)
                entries = raft._SyncObj__getEntries(index, None, batch_bytes)
                if len(entries) == 1 and len(entries[0][0]) >= batch_bytes:
                    return False  # the chunked path of a single large entry
                next_index[node] = entries[-1][1] + 1
            send(node, _append_entries(raft, prev_index, prev_term, entries))
            first = False
            if node not in raft._SyncObj__connectedNodes:
                return True
            if _monotonic() - start > raft._SyncObj__conf.appendEntriesPeriod:
                return True

    def _watch(self, raft: Any, node: Any, now: float) -> None:
        """Warn when `node` lacks entries and its match index has not moved for
        `stalled_s` (then at most every `stalled_s`)."""
        key = str(getattr(node, "id", node))
        match = int(raft._SyncObj__raftMatchIndex.get(node, 0))
        position = (int(raft._SyncObj__raftCurrentTerm), match)
        log = raft._SyncObj__raftLog
        seen = self._progress.get(key)
        if seen is None or seen[0] != position or match >= log[-1][1]:
            self._progress[key] = (position, now, now + self._stalled_s)
            return
        if now < seen[2]:
            return
        self._progress[key] = (position, seen[1], now + self._stalled_s)
        heard = raft._SyncObj__lastResponseTime.get(node)
        sending = raft._SyncObj__serializer._Serializer__transmissions.get(node)
        logger.warning(
            "bucket %d: follower %s has acknowledged nothing for %.0f s (match %d, next %d; "
            "%s; the leader's log %d..%d; %s; last heard %s; held back %d times; %s)",
            self._bucket,
            key,
            now - seen[1],
            match,
            int(raft._SyncObj__raftNextIndex.get(node, 0)),
            "replicating" if node in self._matched else "probing",
            log[0][1],
            log[-1][1],
            "connected" if node in raft._SyncObj__connectedNodes else "not connected",
            "never" if heard is None else f"{now - heard:.1f} s ago",
            self.held.get(key, 0),
            "no snapshot being sent"
            if sending is None
            else f"snapshot sent up to byte {sending.get('transmitted', 0)}",
        )

    @staticmethod
    def positions(raft: Any, now_ms: int, leader_state: int) -> list[tuple[int, int]]:
        """On a leader: each follower's match index and when it was last heard from
        (wall-clock ms), for the cold replica checkpoint of the safety point; empty on
        a follower (it knows nothing of the others' logs)."""
        if raft._SyncObj__raftState != leader_state:
            return []
        now = _monotonic()
        heard = raft._SyncObj__lastResponseTime
        return [
            (int(index), now_ms - int((now - heard.get(node, 0.0)) * 1000))
            for node, index in list(raft._SyncObj__raftMatchIndex.items())
        ]

    def _held(self, raft: Any, node: Any, index: int, match_index: dict[Any, int]) -> bool:
        in_flight = index - match_index.get(node, 0) - 1
        conn = raft._SyncObj__transport._connections.get(node)
        buffered = conn.getSendBufferSize() if conn is not None else 0
        if in_flight < self.entries_max and buffered < self.bytes_max:
            return False
        key = str(getattr(node, "id", node))
        self.held[key] = self.held.get(key, 0) + 1
        return True


def _append_entries(raft: Any, prev_index: Any, prev_term: Any, entries: list[Any]) -> Any:
    return {
        "type": "append_entries",
        "term": raft._SyncObj__raftCurrentTerm,
        "commit_index": raft._SyncObj__raftCommitIndex,
        "entries": entries,
        "prevLogIdx": prev_index,
        "prevLogTerm": prev_term,
    }


def _only(raft: Any, node: Any, original: Callable[[Any], None]) -> None:
    """pysyncobj's send, to `node` alone."""
    others, readonly = raft._SyncObj__otherNodes, raft._SyncObj__readonlyNodes
    raft._SyncObj__otherNodes = {node} & others
    raft._SyncObj__readonlyNodes = {node} & readonly
    try:
        original(raft)
    finally:
        raft._SyncObj__otherNodes, raft._SyncObj__readonlyNodes = others, readonly
