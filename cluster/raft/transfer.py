"""Leadership transfer (Raft thesis §3.10) as a leader runs it: let the target catch
up with writes flowing, then hold new commands briefly while it takes the last
entries, then send it TimeoutNow (docs/raft.md, hazard 8 and "leader_balance_s")."""

from __future__ import annotations

from typing import Any, Final

from pysyncobj import FAIL_REASON
from pysyncobj.monotonic import monotonic as _monotonic

__all__ = ["TRANSFER_PAUSE_LAG", "TRANSFER_PAUSE_S", "LeadershipTransfer"]

TRANSFER_PAUSE_LAG: Final = 64
"""A leadership transfer pauses new commands only once the target trails by this few."""
TRANSFER_PAUSE_S: Final = 0.5
"""The longest a transfer holds new commands back before letting them through again."""


class LeadershipTransfer:
    """One replica's leadership transfer in progress, if any. Used in the tick thread
    (`request` from any thread: it only replaces fields)."""

    def __init__(self) -> None:
        self._request: tuple[str, float] | None = None
        """(target, deadline): hand leadership over (see `step`)."""
        self._pause_until: float | None = None
        """Set once the target is close: new commands wait until then at the latest."""
        self._timeout_now_sent = False
        self._next_try = 0.0
        """After a pause that did not move leadership, writes flow until then."""
        self.pauses = 0
        """Times new commands were held for a transfer."""

    def request(self, target: str, timeout_s: float) -> None:
        """Hand leadership to member `target` within `timeout_s` (from now)."""
        self._pause_until = None
        self._next_try = 0.0
        self._request = (target, _monotonic() + timeout_s)

    def step(self, node: Any) -> None:
        """Advance the transfer, at each tick of `node` (a `RaftNode`). pysyncobj sends
        TimeoutNow only to a target holding the whole log, so while the target trails
        by more than `TRANSFER_PAUSE_LAG` entries it catches up with writes still
        flowing. Then the leader takes no new commands (they wait in the queue) for
        at most `TRANSFER_PAUSE_S`: the target takes the last entries and is sent
        TimeoutNow once (it holds the whole log; pysyncobj checks). If leadership has
        not moved when the pause ends (a lost vote, a slow target), writes flow again
        for `TRANSFER_PAUSE_S` before the next attempt, until the request's deadline.
        Once we are no longer leader, queued commands are forwarded to the new one."""
        request = self._request
        if request is None:
            return
        target, deadline = request
        now = _monotonic()
        if not node._isLeader() or now > deadline:
            self._request = self._pause_until = None
            return
        if self._pause_until is None:
            if now < self._next_try:
                return
            member = next((n for n in node._SyncObj__otherNodes if n.id == target), None)
            match = node._SyncObj__raftMatchIndex.get(member, 0) if member is not None else 0
            if node._SyncObj__getCurrentLogIndex() - match > TRANSFER_PAUSE_LAG:
                return
            self._pause_until = now + TRANSFER_PAUSE_S
            self._timeout_now_sent = False
            self.pauses += 1
        if self._timeout_now_sent:
            return  # the target is running its election
        sent: list[int] = []
        node.transferLeadership(target, callback=lambda _r, err: sent.append(err))
        self._timeout_now_sent = bool(sent) and sent[0] == FAIL_REASON.SUCCESS

    def holding(self, is_leader: bool) -> bool:
        """Whether new commands wait now (the target is taking the last entries)."""
        pause = self._pause_until
        if pause is None or not is_leader:
            return False
        now = _monotonic()
        if now > pause:
            # Leadership did not move in time: writes resume; the request retries later.
            self._pause_until = None
            self._next_try = now + TRANSFER_PAUSE_S
            return False
        return True
