"""`RaftNode`: pysyncobj's SyncObj with its hazards fixed, by overriding its
name-mangled methods (the table of hazards and fixes: docs/raft.md). It runs in
its `RaftLoop`'s thread and applies committed entries through its `BucketReplica`.
Line numbers in comments are pysyncobj 0.3.17's syncobj.py."""

from __future__ import annotations

import contextlib
import logging
import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import pysyncobj.pickle as _pysyncobj_pickle
from pysyncobj import FAIL_REASON, SyncObj, replicated
from pysyncobj.monotonic import monotonic as _monotonic
from pysyncobj.syncobj import SyncObjExceptionWrongVer

from sevendb.cluster.common.files import fsync_dir
from sevendb.outbox.replica import ApplyOutcome

from . import patches  # noqa: F401 - installs the patches before any SyncObj exists
from .journal import FailStopJournal
from .links import FollowerFlow, KeepAlives
from .loop import LoopPoller, LoopTransport, RaftLoop
from .recovery import ACCEPT_LOSS, KEEP_ALIVE
from .sidecars import NOTHING, Position
from .transfer import LeadershipTransfer
from .tuning import SnapshotTurn, compaction_due

if TYPE_CHECKING:
    from .replica import BucketReplica

__all__ = [
    "FAIL_NAMES",
    "LateTickWatch",
    "RaftCounters",
    "RaftNode",
    "leader_view",
]

logger = logging.getLogger(__name__)


# pysyncobj internals we mirror (syncobj.py:51-60).
_FOLLOWER: Final = 0
_LEADER: Final = 2
_CMD_MEMBERSHIP: Final = 2

FAIL_NAMES: Final = {
    getattr(FAIL_REASON, name): name
    for name in dir(FAIL_REASON)
    if name.isupper() and isinstance(getattr(FAIL_REASON, name), int)
}
"""pysyncobj's failure codes by number, for messages."""


@dataclass
class RaftCounters:
    """What a replica counts about itself (`BucketReplica.status`)."""

    entry_errors: int = 0
    plan_mismatches: int = 0
    follower_regressions: int = 0
    compactions_deferred: int = 0
    stale_term_acks: int = 0
    rewinds_prevented: int = 0
    matching_entries_kept: int = 0
    late_leader_ticks: int = 0
    leader_changes: int = 0
    """Times this replica saw a new leader (itself elected, or another's first
    AppendEntries), like etcd's leader_changes_seen."""
    proposals_failed: int = 0
    """Proposals made here that pysyncobj failed (no leader, leader changed, ...)."""
    compactions: int = 0
    """Times the log was cut after a snapshot."""


def leader_view(node: RaftNode) -> tuple[bool, int]:
    """(whether `node` leads or heard from a leader within the longest election
    timeout, the commit index its leader last told it - its own on a leader).
    pysyncobj keeps a follower's last leader for as long as it reaches no one to
    campaign with, so `_getLeader()` alone can name a dead one. Any thread."""
    if node._isLeader():
        return True, int(node._SyncObj__raftCommitIndex)
    heard = _monotonic() - node._leader_contact_s < node._election_max_s
    known = node._getLeader() is not None and heard
    return known, int(node._SyncObj__leaderCommitIndex or 0)


def _last(journal: FailStopJournal) -> Position:
    """(term, idx) of the last entry of a log (pysyncobj keeps it non-empty)."""
    _, idx, term = journal[-1]
    return (term, idx)


def _command_response(request_id: Any, error: int) -> dict[str, object]:
    return {"type": "apply_command_response", "request_id": request_id, "error": error}


class LateTickWatch:
    """A leader sends heartbeats from its tick thread only, and pysyncobj says
    nothing when that thread is held up (a snapshot, the GIL, no free core): its
    followers just start an election. Like etcd's "leader failed to send out
    heartbeat on time", warn when a leader's ticks are further apart than half the
    shortest election timeout (at most every 10 s), and count them in status()."""

    def __init__(self, bucket: int, late_s: float, counters: RaftCounters) -> None:
        self._bucket = bucket
        self._late_s = late_s
        self._counters = counters
        self._last_s = 0.0
        self._next_warning_s = 0.0

    def tick(self, me: str, leader: bool) -> None:
        now = _monotonic()
        last, self._last_s = self._last_s, now
        if not last or now - last < self._late_s or not leader:
            return
        self._counters.late_leader_ticks += 1
        if now >= self._next_warning_s:
            self._next_warning_s = now + 10.0
            logger.warning(
                "bucket %d: leader %s sent no heartbeat for %.0f ms (followers campaign "
                "after %.1f s): this process is overloaded (%d late ticks so far)",
                self._bucket,
                me,
                1000 * (now - last),
                2 * self._late_s,
                self._counters.late_leader_ticks,
            )


class RaftNode(SyncObj):  # type: ignore[misc]
    """pysyncobj SyncObj with the hazards fixed. Runs entirely in its `RaftLoop`'s
    thread (the "tick thread" below), except ``apply_entry(...)`` proposals and the
    read-only accessors."""

    # Set by SyncObj.__init__; annotated for mypy.
    _SyncObj__raftCommitIndex: int
    _SyncObj__raftCurrentTerm: int
    _SyncObj__newAppendEntriesTime: float
    _SyncObj__recvTransmission: bytes | str
    _SyncObj__leaderCommitIndex: int | None
    _SyncObj__forceLogCompaction: bool

    def __init__(
        self,
        owner: BucketReplica,
        self_addr: str,
        partners: list[str],
        conf: Any,
        loop: RaftLoop,
    ) -> None:
        # Set before SyncObj.__init__, which subscribes sockets and may call back.
        self._loop_poller = LoopPoller(loop, self)
        self._owner = owner
        self._journal: FailStopJournal = owner._journal
        self._counters: RaftCounters = owner._counters
        self._next_transfer_s = 0.0
        self._transfer_tried = False
        self.transfer = LeadershipTransfer()
        self._recovery = owner._recovery
        self._keep_alives = KeepAlives(conf.connectionTimeout / 4)
        tuning = owner._tuning
        self.flow = FollowerFlow(
            tuning.follower_entries_in_flight_max,
            tuning.follower_bytes_buffered_max,
            owner.bucket,
            tuning.follower_stalled_warn_s,
            probe_resend_s=float(conf.raftMinTimeout),
        )
        self._next_judge_s = 0.0
        self._leader_contact_s = 0.0
        """When an AppendEntries last came from a leader (`Recovery.judge`)."""
        self._election_max_s = float(conf.raftMaxTimeout)
        self._gate_closed_until_s = 0.0
        self._poll_until = 0.0
        """When the current tick's final poll times out (see `_onTick`)."""
        self._late_ticks = LateTickWatch(owner.bucket, conf.raftMinTimeout / 2, self._counters)
        self._tick_s = float(conf.autoTickPeriod)
        self._snapshot_turn = SnapshotTurn()
        super().__init__(self_addr, partners, conf, transportClass=LoopTransport)

    @property
    def _poller(self) -> LoopPoller:
        """pysyncobj's poller of this SyncObj: the loop's, seen through a view."""
        return self._loop_poller

    @_poller.setter
    def _poller(self, _own: object) -> None:
        """SyncObj.__init__ makes a poller of its own (syncobj.py:205); unused."""

    def tick(self) -> None:
        """One tick, from the `RaftLoop` (pysyncobj's ``_autoTickThread`` body: an
        exception is logged and the replica waits a tick period before the next). A
        tick the loop runs after the replica closed its journal does nothing."""
        if self._journal.closed:
            return
        try:
            if self._journal.failure is None:
                self._loop_poller.activate()  # after a failed socket callback
            self._onTick(self._tick_s)
        except Exception:
            logger.exception("bucket %d: a Raft tick failed", self._owner.bucket)
            self._poll_until = _monotonic() + self._tick_s

    # -- what this replica knows (any thread) ---------------------------------------

    def quorum(self) -> bool:
        """Whether this replica reaches a majority of its group (pysyncobj's view)."""
        for _ in range(3):
            with contextlib.suppress(RuntimeError):  # a set changed size under us
                return bool(self.hasQuorum)
        return False

    def member_addresses(self) -> list[str]:
        """The group's members as this replica sees them (sorted addresses)."""
        me = str(self.selfNode.id)
        for _ in range(3):
            with contextlib.suppress(RuntimeError):
                return sorted([me, *(str(n.id) for n in self.otherNodes)])
        return [me]

    def ready_for_clients(self) -> bool:
        """A leader is known and this replica applied what the leader had committed
        when it first heard from it (a leader: its own term's NO_OP)."""
        leader = self._getLeader()
        if leader is None or not self.isReady():
            return False
        if self._isLeader():
            noop = self._SyncObj__noopIDx
            return noop is not None and int(self.raftLastApplied) >= int(noop)
        return True

    # -- the replicated method -------------------------------------------------------

    @replicated  # type: ignore[untyped-decorator]
    def apply_entry(self, entry: bytes) -> ApplyOutcome | None:
        # raftLastApplied is incremented after the method returns (syncobj.py:725),
        # so the entry being applied has index raftLastApplied + 1.
        return self._owner._apply(int(self.raftLastApplied) + 1, entry)

    def _SyncObj__doApplyCommand(self, command: bytes) -> object:
        """Wraps syncobj.py:870 so that nothing raised while decoding or applying a
        committed command can wedge the tick (the same entry would be re-applied
        every tick forever: 714-729). A failure quarantines this replica."""
        try:
            return SyncObj._SyncObj__doApplyCommand(self, command)
        except SyncObjExceptionWrongVer:
            raise
        except Exception as exc:
            self._owner._enter_quarantine(
                int(self.raftLastApplied) + 1,
                f"applying a committed command failed: {type(exc).__name__}: {exc}",
                exc_info=True,
            )
            return None

    # -- durability ------------------------------------------------------------------

    def _onTick(self, timeToWait: float = 0.0) -> None:
        if self._journal.failure is not None:
            # Fail-stop: behave like a crashed replica (no acks, votes or applies,
            # nothing read); the rest of the group goes on without it.
            self._loop_poller.suspend()
            self._owner._enter_quarantine(
                int(self.raftLastApplied) + 1,
                f"journal fsync failed ({self._journal.failure}); replica stopped",
            )
            self._poll_until = _monotonic() + timeToWait
            return
        self._late_ticks.tick(self.selfNode.id, self._SyncObj__raftState == _LEADER)
        # Everything appended so far is durable before this tick's commit computation
        # counts the leader itself (`count = 1`, syncobj.py:660). A no-op if nothing is
        # pending (group commit happens in _checkCommandsToApply).
        self._journal.sync()
        owner = self._owner
        if owner._quarantine is not None or self._recovery.need is not None or owner.retiring:
            self._hold_back_tick()
        self._recovery_tick()
        self.transfer.step(self)
        self._keep_alives.due(
            self._SyncObj__transport,
            self._SyncObj__otherNodes,
            self._recovery,
            _last(self._journal),
        )
        now = _monotonic()
        if self._SyncObj__raftState == _LEADER:
            # Wake for a commit notification due sooner than the idle poll timeout.
            timeToWait = max(0.0, min(timeToWait, self._SyncObj__newAppendEntriesTime - now))
        # The loop ticks this replica again at the latest then (or on an event of its
        # sockets); an apply that brings the next AppendEntries forward lowers it.
        self._poll_until = now + timeToWait
        SyncObj._onTick(self, timeToWait)

    def _SyncObj__sendAppendEntries(self) -> None:
        """pysyncobj's send to every follower (syncobj.py:1251-1336), with flow
        control: a follower too far behind gets only a heartbeat (`FollowerFlow`)."""
        self.flow.send_all(self, SyncObj._SyncObj__sendAppendEntries)

    def _hold_back_tick(self) -> None:
        """A quarantined replica, one repairing lost entries, or a retired one (its node
        drained and exiting) keeps storing and acking the log (the group needs its
        acks) but never campaigns, and hands leadership away if it holds it: first by
        a leadership transfer (no election timeout), and if it still leads half a
        second later (the transfer went to another held-back replica, or no follower
        was caught up) by stepping down, so that a healthy replica times out and
        wins."""
        now = _monotonic()
        self._SyncObj__raftElectionDeadline = now + 3600.0
        if not self._isLeader() or now < self._next_transfer_s:
            return
        self._next_transfer_s = now + 0.5
        if not self._transfer_tried:
            self._transfer_tried = True
            self.transferLeadership()
            return
        logger.warning("held-back leader %s steps down", self.selfNode.id)
        self._SyncObj__setState(_FOLLOWER)
        self._SyncObj__raftLeader = None

    def _recovery_tick(self) -> None:
        """A repairing replica notices when its log holds what it lost again; every
        half second the bucket's DATA_LOSS verdict is revised and an operator's
        decision looked for (docs/raft.md, "Disk faults")."""
        recovery = self._recovery
        if recovery.need is not None:
            durable = (
                self._journal[self._journal.durable_len - 1] if self._journal.durable_len else None
            )
            leader = self._getLeader()
            position = NOTHING if durable is None else (durable[2], durable[1])
            if recovery.repaired(position, None if leader is None else str(leader.id)):
                self._serve_again()
        now = _monotonic()
        if now < self._next_judge_s:
            return
        self._next_judge_s = now + 0.5
        leader_known = self._isLeader() or now - self._leader_contact_s < self._election_max_s
        recovery.judge(_last(self._journal), leader_known, self.member_addresses())
        if recovery.decision_due() and recovery.take_decision() == ACCEPT_LOSS:
            recovery.accept_loss()
            self._serve_again()

    def _serve_again(self) -> None:
        """The need is met or given up: the header claims what the log holds, and the
        election timeout `_hold_back_tick` kept pushing back runs again."""
        self._journal.release_need()
        if self._owner._quarantine is None:
            self._SyncObj__raftElectionDeadline = (
                _monotonic() + self._SyncObj__generateRaftTimeout()
            )

    def _checkCommandsToApply(self) -> None:
        """Re-implements syncobj.py:503-574 for the leader's batch: drain every queued
        proposal into the log, send one AppendEntries per follower, then fsync once
        (group commit). The original sends after every single command when
        appendEntriesUseBatch is off, which costs a message and a follower fsync per
        entry. Followers' proposals are still forwarded one message each, as before."""
        conf = self._SyncObj__conf
        commands = self._SyncObj__commandsQueue
        if self.transfer.holding(self._isLeader()):
            self._journal.sync()
            return  # commands wait while leadership moves (see LeadershipTransfer)
        start = _monotonic()
        appended = False
        while _monotonic() - start < conf.appendEntriesPeriod:
            if self._SyncObj__raftLeader is None and conf.commandsWaitLeader:
                break
            try:
                command, callback = commands.get_nowait()
            except queue.Empty:
                break
            local, request_node, request_id = callback, None, None
            if isinstance(callback, tuple):
                local, (request_node, request_id) = None, callback
            if self._SyncObj__raftState == _LEADER:
                appended |= self._append_command(command, local, request_node, request_id)
            elif self._SyncObj__raftLeader is not None:
                self._forward_command(command, local, request_node, request_id)
            else:
                self._SyncObj__callErrCallback(FAIL_REASON.MISSING_LEADER, callback)
        if appended and self._SyncObj__raftState == _LEADER:
            # Send first, then fsync: the followers' appends and fsyncs overlap with
            # ours (Raft §10.2.1). Safe because the leader only counts itself for
            # entries already synced: this sync runs before the next commit loop.
            self._SyncObj__sendAppendEntries()
            if not self._SyncObj__otherNodes:
                # A one-replica group commits on its own at the next tick; no ack will
                # wake the loop for it, so tick it again at once.
                self._poll_until = 0.0
        self._journal.sync()

    def _append_command(
        self, command: bytes, callback: Any, request_node: Any, request_id: Any
    ) -> bool:
        """The leader appends one proposal (its own: `callback`; a follower's:
        `request_node`, `request_id`), or refuses a membership change while an
        earlier one is uncommitted. Returns whether it appended."""
        conf = self._SyncObj__conf
        transport = self._SyncObj__transport
        idx, term = self._journal[-1][1] + 1, self._SyncObj__raftCurrentTerm
        change = (
            self._SyncObj__parseChangeClusterRequest(command)
            if conf.dynamicMembershipChange
            else None
        )
        if change is not None and not self._SyncObj__changeCluster(change):
            if request_node is not None:
                denied = _command_response(request_id, FAIL_REASON.REQUEST_DENIED)
                transport.send(request_node, denied)
            elif callback is not None:
                callback(None, FAIL_REASON.REQUEST_DENIED)
            return False
        self._journal.add(command, idx, term)
        if request_node is not None:
            response = {"type": "apply_command_response", "request_id": request_id}
            transport.send(request_node, {**response, "log_idx": idx, "log_term": term})
        elif callback is not None:
            self._SyncObj__commandsWaitingCommit[idx].append((term, callback))
        return True

    def _forward_command(
        self, command: bytes, callback: Any, request_node: Any, request_id: Any
    ) -> None:
        """A follower sends its own proposal to the leader, and refuses one forwarded
        to it by another follower (it is not the leader)."""
        transport = self._SyncObj__transport
        if request_node is not None:
            transport.send(request_node, _command_response(request_id, FAIL_REASON.NOT_LEADER))
            return
        message: dict[str, object] = {"type": "apply_command", "command": command}
        if callback is not None:
            self._SyncObj__commandsLocalCounter += 1
            counter = self._SyncObj__commandsLocalCounter
            self._SyncObj__commandsWaitingReply[counter] = callback
            message["request_id"] = counter
        transport.send(self._SyncObj__raftLeader, message)

    def _SyncObj__applyLogEntries(self) -> bool:
        """syncobj.py:711-738, minus one message per follower per commit. With
        batching off, the original asks for an AppendEntries right after every apply,
        only to tell followers the new commit index - a message (and an ack back) per
        follower per committed entry. Followers only need it to apply (clients are
        answered and events emitted by the leader): the next AppendEntries carries
        it, and the heartbeat is brought forward to at most `commit_notify_s` away."""
        applied = SyncObj._SyncObj__applyLogEntries(self)
        if applied:
            self._owner._after_applies()
            due = _monotonic() + self._owner._tuning.commit_notify_s
            if due < self._SyncObj__newAppendEntriesTime:
                self._SyncObj__newAppendEntriesTime = due
                # Otherwise the loop's poll could sleep up to tick_s before this
                # replica's next tick (measured: a write forwarded by a follower
                # waited p50 15 ms, p90 105 ms, for the follower to learn the
                # commit; 10 ms is the design).
                self._poll_until = min(self._poll_until, due)
        return False

    def _SyncObj__onBecomeLeader(self) -> None:
        # The new term's NO_OP (syncobj.py:1227) is durable before anyone counts it.
        self._recovery.leader_seen()
        self._counters.leader_changes += 1
        SyncObj._SyncObj__onBecomeLeader(self)
        self._journal.sync()

    def _SyncObj__sendNextNodeIdx(
        self,
        node: Any,
        reset: bool = False,
        nextNodeIdx: int | None = None,
        success: bool = False,
        refused: int | None = None,
    ) -> None:
        """syncobj.py:1098 plus: fsync before any positive ack (the follower acks only
        entries it made durable), the follower's term, so the leader can drop acks
        from another term (the original message carries none: 1101-1106), and on a
        refusal the previous entry of the AppendEntries refused, so the leader can
        tell a stale refusal (`FollowerFlow.refusal_is_current`)."""
        if success:
            self._journal.sync()
        if nextNodeIdx is None:
            nextNodeIdx = self._journal[-1][1] + 1
        message = {
            "type": "next_node_idx",
            "next_node_idx": nextNodeIdx,
            "reset": reset,
            "success": success,
            "term": self._SyncObj__raftCurrentTerm,
        }
        if refused is not None:
            message["refused"] = refused
        self._SyncObj__transport.send(node, message)

    # -- message handling ------------------------------------------------------------

    def _SyncObj__onMessageReceived(self, node: Any, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == KEEP_ALIVE:
            self._recovery.heard(str(node.id), message)
            return
        if self._recovery.need is not None and kind in ("request_vote", "timeout_now"):
            if kind == "request_vote":  # TimeoutNow: a repairing replica never campaigns
                self._on_request_vote(node, message)
            return
        if kind == "append_entries" and "prevLogIdx" in message:
            self._on_append_entries(node, message)
        elif kind == "next_node_idx":
            self._on_next_node_idx(node, message)
        else:
            SyncObj._SyncObj__onMessageReceived(self, node, message)

    def _on_request_vote(self, node: Any, message: dict[str, Any]) -> None:
        """syncobj.py:905-931 for a replica that lost acknowledged entries: it votes
        only for a candidate whose log reaches what it had acknowledged
        (`Recovery.may_vote_for`), not merely what it holds now."""
        term = message["term"]
        if term > self._SyncObj__raftCurrentTerm:
            self._SyncObj__setCurrentTerm(term, None)
            self._SyncObj__setState(_FOLLOWER)
            self._SyncObj__raftLeader = None
        if (
            self._SyncObj__raftState == _LEADER
            or term < self._SyncObj__raftCurrentTerm
            or self._SyncObj__votedForNodeId is not None
        ):
            return
        candidate = (message["last_log_term"], message["last_log_index"])
        if candidate < _last(self._journal) or not self._recovery.may_vote_for(candidate):
            self._recovery.votes_refused += 1
            return
        self._SyncObj__setCurrentTerm(self._SyncObj__raftCurrentTerm, node.id)
        self._SyncObj__raftElectionDeadline = _monotonic() + self._SyncObj__generateRaftTimeout()
        self._SyncObj__transport.send(node, {"type": "response_vote", "term": term})

    def _on_next_node_idx(self, node: Any, message: dict[str, Any]) -> None:
        """Leader side of syncobj.py:1070-1083, fixed: nextIndex/matchIndex only move
        forward on success (a late ack used to rewind a pipelined nextIndex, making
        the follower truncate matching entries), responses from another term are
        ignored (Raft §5.1), and so is a stale refusal (one that answers an earlier
        probe: `FollowerFlow`). A current refusal in this term says where the
        follower's log can agree: trusted, even below matchIndex (the follower lost
        entries it had acked)."""
        if self._SyncObj__raftState != _LEADER:
            return
        term = message.get("term")
        if term is not None and term != self._SyncObj__raftCurrentTerm:
            self._counters.stale_term_acks += 1
            return
        match_index = self._SyncObj__raftMatchIndex
        next_index = self._SyncObj__raftNextIndex
        if node not in match_index or node not in next_index:
            return  # not (or no longer) a member
        next_idx = int(message["next_node_idx"])
        self._SyncObj__lastResponseTime[node] = _monotonic()
        if message["success"]:
            if next_idx - 1 > match_index[node]:
                match_index[node] = next_idx - 1
                if next_idx < next_index[node]:
                    self._counters.rewinds_prevented += 1
            if next_idx > next_index[node]:
                next_index[node] = next_idx
            self.flow.matched(self, node)
        elif message["reset"]:
            if not self.flow.refusal_is_current(self, node, message.get("refused")):
                return
            if next_idx <= match_index[node]:
                # In this term the follower acked through matchIndex, so a reset below it
                # means its log really is shorter now: it lost acknowledged entries (a
                # corrupt or truncated journal). Repair it from where its log ends;
                # holding nextIndex above would leave it stuck forever.
                self._counters.follower_regressions += 1
                logger.warning(
                    "follower %s lost acknowledged entries (its log ends at %d, it had "
                    "acked %d); resending from there",
                    node,
                    next_idx - 1,
                    match_index[node],
                )
                match_index[node] = next_idx - 1
            next_index[node] = next_idx
            # Probe from there at the next tick, not after the idle heartbeat.
            self._SyncObj__newAppendEntriesTime = self._poll_until = _monotonic()

    def _on_append_entries(self, node: Any, message: dict[str, Any]) -> None:
        """Follower side of AppendEntries, re-implementing syncobj.py:945-1035 (the
        ``prevLogIdx`` branch; snapshot installs still go to the original).

        Differences: only entries that *conflict* (same index, other term) are
        deleted, with everything after them (Raft §5.3); entries that match are kept,
        so a stale or re-sent AppendEntries can no longer shorten a log below what was
        acked or applied (the original deleted everything after prevLogIdx: 991-1004).
        The commit index advances at most to the last entry this message verified,
        since entries past it may be stale ones from an older term."""
        term = message["term"]
        if term < self._SyncObj__raftCurrentTerm:
            return
        if term > self._SyncObj__raftCurrentTerm:
            self._SyncObj__transferInProgress = False
        if not self._SyncObj__transferInProgress:
            self._SyncObj__raftElectionDeadline = (
                _monotonic() + self._SyncObj__generateRaftTimeout()
            )
        if self._SyncObj__raftLeader != node:
            self._SyncObj__onLeaderChanged()
            self._counters.leader_changes += 1
        self._SyncObj__raftLeader = node
        self._leader_contact_s = _monotonic()
        if self._recovery.data_loss is not None:
            self._recovery.leader_seen()
        if term > self._SyncObj__raftCurrentTerm:
            self._SyncObj__setCurrentTerm(term, None)
        self._SyncObj__setState(_FOLLOWER)
        self._SyncObj__leaderCommitIndex = leader_commit = message["commit_index"]
        new_entries = _entries_of(self, node, message)
        if new_entries is None:
            return

        log = self._journal
        prev_idx, prev_term = message["prevLogIdx"], message["prevLogTerm"]
        first_idx, last_idx = log[0][1], log[-1][1]
        if prev_idx is None or not first_idx <= prev_idx <= last_idx:
            self._SyncObj__sendNextNodeIdx(node, success=False, reset=True, refused=prev_idx)
            return
        if log[prev_idx - first_idx][2] != prev_term:
            hint = _conflict_start(log, prev_idx, int(self._SyncObj__raftCommitIndex))
            self._SyncObj__sendNextNodeIdx(
                node, nextNodeIdx=hint, success=False, reset=True, refused=prev_idx
            )
            return

        self._append_entries(new_entries, last_idx, first_idx)
        verified = new_entries[-1][1] if new_entries else prev_idx
        self._SyncObj__sendNextNodeIdx(node, nextNodeIdx=verified + 1, success=True)

        commit = int(self._SyncObj__raftCommitIndex)
        current = log[-1][1]
        if commit > current:
            commit = current
        if leader_commit > commit:
            commit = max(commit, min(leader_commit, verified))
        self._SyncObj__raftCommitIndex = commit
        log.setRaftCommitIndex(commit)

    def _append_entries(self, new_entries: list[Any], last_idx: int, first_idx: int) -> None:
        """Append what the log lacks of `new_entries` (which follow an entry this log
        holds): entries it already has with the same term are kept, the first one in
        conflict is truncated with everything after it."""
        log = self._journal
        append_from = 0
        for position, entry in enumerate(new_entries):
            idx = entry[1]
            if idx > last_idx:
                break
            if log[idx - first_idx][2] == entry[2]:
                append_from = position + 1
                continue
            self._truncate_conflict(idx)
            break
        kept = append_from
        if kept:
            self._counters.matching_entries_kept += kept
        appended = new_entries[append_from:]
        for entry in appended:
            log.add(*entry)
        if self._SyncObj__conf.dynamicMembershipChange:
            for entry in appended:
                change = self._SyncObj__parseChangeClusterRequest(entry[0])
                if change is not None:
                    self._SyncObj__doChangeCluster(change)

    def _truncate_conflict(self, idx: int) -> None:
        """Delete the log from ``idx`` (the first conflicting entry) on, rolling back
        membership changes it carried (as syncobj.py:991-997 does)."""
        log = self._journal
        first_idx = log[0][1]
        last_applied = int(self.raftLastApplied)
        if idx <= last_applied:
            # Committed entries never conflict in Raft; if they do, this replica's
            # applied state cannot be trusted any more.
            logger.critical(
                "truncating already-applied log entries from index %d (last applied: %d)"
                " - state machine may have diverged from other cluster members",
                idx,
                last_applied,
            )
            self._owner._enter_quarantine(idx, "the leader replaced an already-applied entry")
        if self._SyncObj__conf.dynamicMembershipChange:
            for entry in reversed(log[idx - first_idx :]):
                change = self._SyncObj__parseChangeClusterRequest(entry[0])
                if change is not None:
                    self._SyncObj__doChangeCluster(change, reverse=True)
        log.deleteEntriesFrom(idx - first_idx)

    # -- membership ----------------------------------------------------------------

    def _SyncObj__changeCluster(self, request: Any) -> bool:
        """syncobj.py:1356 with a working guard: refuse while an earlier membership
        entry is still uncommitted (`__changeClusterIDx` is never set upstream)."""
        log = self._journal
        commit = int(self._SyncObj__raftCommitIndex)
        first_idx = log[0][1]
        for command, _idx, _term in log[max(0, commit + 1 - first_idx) :]:
            if command[:1] == bytes([_CMD_MEMBERSHIP]):
                return False
        return bool(SyncObj._SyncObj__changeCluster(self, request))

    # -- snapshots and compaction ----------------------------------------------------

    def _SyncObj__tryLogCompaction(self) -> None:
        """syncobj.py:1421, gated: a new snapshot starts when it is due
        (`compaction_due`) and the replica may take one (not quarantined, repairing,
        or waiting for its archive). Finishing a snapshot already taken is never held
        back; how far the log is then cut is `_SyncObj__deleteEntriesTo`'s affair."""
        serializer = self._SyncObj__serializer
        if serializer._Serializer__pid == 0:  # none being made: whether to start one
            # The trigger of syncobj.py:1436-1439, counting the entries (and their
            # bytes) since the last snapshot, weighed against the snapshot's size. Due
            # by entries or time, it implies the original's, which then starts the
            # snapshot; due by bytes alone, the original is told to (`force`).
            snapshots = self._owner._snapshots
            entries = self._journal[-1][1] - snapshots.index
            due = compaction_due(
                self._owner._tuning,
                entries=entries,
                log_bytes=self._journal.size_bytes(snapshots.index),
                snapshot_bytes=snapshots.size,
                since_last_s=_monotonic() - self._SyncObj__lastSerializedTime,
            )
            if not (due or self._SyncObj__forceLogCompaction):
                self._snapshot_turn.reset()
                return
            if not self._owner._compaction_allowed():
                return
            turn = self._snapshot_turn.come(
                self._owner._tuning, self.member_addresses(), str(self.selfNode.id), _monotonic()
            )
            if not (self._SyncObj__forceLogCompaction or turn):
                return
            if due and entries <= self._owner._tuning.compaction_min_entries:
                self._SyncObj__forceLogCompaction = True  # due by its bytes
        SyncObj._SyncObj__tryLogCompaction(self)
        if serializer._Serializer__pid != 0:  # one started (or finished): the next is due anew
            self._snapshot_turn.reset()

    def _SyncObj__deleteEntriesTo(self, toIDx: int) -> None:
        """Compaction (syncobj.py:1427), once a snapshot is written. The snapshot was
        renamed into place without a directory fsync; make that durable before
        dropping the entries it replaces. The log is cut no further than the core's
        safety point when the snapshot was taken (a subscriber's acknowledgements, a
        cold replica checkpoint, a migration hold point: docs/core.md), and never
        past its last entry (an empty log makes every tick raise IndexError at
        `self.__raftLog[0]`, 1146)."""
        fsync_dir(self._owner._data_dir)
        last_idx = self._journal[-1][1]
        if toIDx > last_idx:
            logger.error("compaction to %d past the log end %d; clamped", toIDx, last_idx)
            toIDx = last_idx
        point = self._owner._cut_point
        if point < toIDx:
            self._counters.compactions_deferred += 1
            toIDx = point
        self._counters.compactions += 1
        SyncObj._SyncObj__deleteEntriesTo(self, toIDx)

    def _SyncObj__loadDumpFile(self, clearJournal: bool) -> None:
        """syncobj.py:1472. At startup (clearJournal=False) pysyncobj keeps the journal
        only if its first two entries are the snapshot's last two, and otherwise
        CLEARS it (1489-1495): a crash after the snapshot rename but before the
        compaction lost every acked entry after the snapshot, and the entries kept
        before the snapshot for the safety point would go too. The journal is kept
        whenever it holds the snapshot's point."""
        if clearJournal or not self._owner._snapshots.holds_point(self._journal):
            SyncObj._SyncObj__loadDumpFile(self, clearJournal)
            return
        try:
            _, last, _prev, cluster = self._SyncObj__serializer.deserialize()
            self._SyncObj__raftLastApplied = last[1]
            self._SyncObj__raftCommitIndex = min(
                self._SyncObj__raftCommitIndex, self._journal[-1][1]
            )
            if self._SyncObj__conf.dynamicMembershipChange:
                me = self._SyncObj__selfNode
                self._SyncObj__updateClusterConfiguration([n for n in cluster if n != me])
            self._SyncObj__onSetCodeVersion(0)
        except Exception:
            logger.exception("bucket %d: failed to load the snapshot", self._owner.bucket)


def _conflict_start(log: FailStopJournal, idx: int, commit: int) -> int:
    """Where a follower whose entry `idx` is of another term than its leader's asks
    to be probed from: the first entry of that term's run in its log, above its
    commit index and its log's first entry (those never conflict) - so a tail left
    by an old leader costs one probe, not one per entry. Entries it skips that do
    match are kept when they arrive again (`_append_entries`)."""
    first_idx = log[0][1]
    term = log[idx - first_idx][2]
    low = max(commit, first_idx) + 1
    while idx > low and log[idx - 1 - first_idx][2] == term:
        idx -= 1
    return idx


def _entries_of(self: RaftNode, node: Any, message: dict[str, Any]) -> list[Any] | None:
    """The entries an AppendEntries carries; None once answered (a chunk of one
    entry larger than the batch size: never with our default batch size, see
    RaftTuning.append_batch_bytes)."""
    transmission = message.get("transmission")
    if transmission is None:
        entries: list[Any] = message.get("entries", [])
        return entries
    received = self._SyncObj__recvTransmission
    if transmission == "start":
        self._SyncObj__recvTransmission = message["data"]
        self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
        return None
    if transmission not in ("process", "finish") or not isinstance(received, bytes):
        self._SyncObj__recvTransmission = ""
        self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
        return None
    if transmission == "process":
        self._SyncObj__recvTransmission = received + message["data"]
        self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
        return None
    self._SyncObj__recvTransmission = ""
    try:
        return [_pysyncobj_pickle.loads(received + message["data"])]
    except Exception:
        logger.exception("bucket %d: unreadable chunked entry", self._owner.bucket)
        self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
        return None
