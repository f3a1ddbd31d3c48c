"""The notifier adapter each simulated replica runs: it performs what `NotifierCore`
decides (propose entries through Raft, send events, answer reconnects), the way the
gRPC notifier will."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from sevendb.notifier.core import (
    Attach,
    AttachStatus,
    NotifierConfig,
    NotifierCore,
    needs_lease,
    rendezvous_lease_holder,
)
from sevendb.outbox.entries import Entry, Subscribe, Unsubscribe
from sevendb.outbox.model import Applied, RowsOutboxed, SubscribeResult

from .network import (
    AckReq,
    AttachReply,
    Close,
    Events,
    Heartbeat,
    Message,
    ReconnectReq,
    SubAck,
    SubscribeReq,
    UnsubscribeReq,
)
from .raft import Replica, Role
from .variants import make_core

if TYPE_CHECKING:
    from .world import Simulation

LEASE_RETRY_MS: Final = 200
OUTBOX_RETRY_MS: Final = 200
PURGE_INTERVAL_MS: Final = 40
PURGE_RETRY_MS: Final = 200
HEARTBEAT_MS: Final = 100
CONFIRM_MS: Final = 140
"""A holder emits only while Raft confirmed its view this recently (below the
smallest election timeout, 150 ms)."""
SEND_EVENTS_MAX: Final = 64
"""Events one replica sends per tick, all streams together."""


class NotifierHost:
    """One replica's notifier adapter (volatile: a crash loses all of it)."""

    def __init__(self, sim: Simulation, replica: Replica) -> None:
        self.sim = sim
        self.replica = replica
        self.config = NotifierConfig(
            window_events=sim.config.window_events,
            resend_after_ms=sim.config.resend_after_ms,
            outbox_retry_ms=OUTBOX_RETRY_MS,
        )
        self.reset()
        self.crash_after_outbox = False

    def reset(self) -> None:
        self.core: NotifierCore | None = None
        self.conns: dict[str, tuple[str, int]] = {}
        self.heartbeat_ms: dict[str, int] = {}
        self.waiters: dict[str, str] = {}
        self.lease_proposed_ms = -LEASE_RETRY_MS
        self.purge_proposed: tuple[object, int] | None = None
        self.last_purge_ms = 0
        self.sent_rows = 0

    # ---- decisions -------------------------------------------------------------

    def desired_holder(self) -> str:
        r = self.replica
        if self.sim.config.enabled("rendezvous"):
            # Over the replicas currently up (a failure detector's view; god's-eye here),
            # so the lease fails over when its holder dies.
            live = [x.name for x in self.sim.raft.replicas.values() if x.usable]
            return rendezvous_lease_holder(r.bucket_uuid, r.sm.epoch.epoch_counter, live)
        return r.name if r.role is Role.LEADER else ""

    def emitting(self, now_ms: int) -> bool:
        """Fencing: the applied state names this replica, and its Raft view is current
        (a deposed holder in a minority partition stops instead of holding its clients
        captive until the stall window drops them)."""
        r = self.replica
        if self.sim.config.bugs.lease_without_fencing:
            return r.role is Role.LEADER
        return r.sm.lease_holder == r.name and self.sim.raft.confirmed(r, now_ms, CONFIRM_MS)

    def propose(self, entry: Entry) -> int | None:
        return self.sim.propose(self.replica, entry)

    def tick(self, now_ms: int) -> None:
        r = self.replica
        sm = r.sm
        lease = needs_lease(sm, r.name, self.desired_holder(), now_ms)
        if lease is not None and now_ms - self.lease_proposed_ms >= LEASE_RETRY_MS:
            if self.propose(lease) is not None:
                self.sim.trace("lease?", r.name)
            self.lease_proposed_ms = now_ms
        if self.emitting(now_ms):
            if self.core is None:
                self.core = make_core(r.name, self.config, self.sim.config.bugs, sm)
                self.sim.trace("notifier-up", r.name, sm.lease_index)
        elif self.core is not None:
            self.sim.trace("notifier-down", r.name)
            for sub_id in sorted(self.conns):
                self._close(sub_id, now_ms)
            self.core = None
        core = self.core
        if core is None:
            return
        self._outbox(core, now_ms)
        self._purge(core, now_ms)
        for sub_id in core.closed_streams(sm):
            self._close(sub_id, now_ms)
        for sub_id, rows in core.next_batches(sm, SEND_EVENTS_MAX, now_ms):
            conn = self.conns.get(sub_id)
            if conn is None:
                core.detach(sub_id)
                continue
            client, conn_id = conn
            self.sim.net.send(now_ms, r.name, client, Events(conn_id, sub_id, rows, r.name))
            self.heartbeat_ms[sub_id] = now_ms
            self.sent_rows += len(rows)
            self.sim.trace(
                "send",
                r.name,
                sub_id,
                rows[0].emit_seq.commit_index,
                rows[-1].emit_seq.commit_index,
            )
        for sub_id in sorted(self.conns):
            if now_ms - self.heartbeat_ms.get(sub_id, 0) >= HEARTBEAT_MS:
                client, conn_id = self.conns[sub_id]
                self.sim.net.send(now_ms, r.name, client, Heartbeat(conn_id, sub_id))
                self.heartbeat_ms[sub_id] = now_ms

    def _outbox(self, core: NotifierCore, now_ms: int) -> None:
        sm = self.replica.sm
        entry = core.outbox_entry(sm, sm.lease_index, now_ms)
        if entry is None:
            return
        if self.propose(entry) is not None:
            self.sim.trace("outbox?", self.replica.name, entry.from_index, entry.through_index)
            core.outbox_proposed(entry, now_ms)

    def _purge(self, core: NotifierCore, now_ms: int) -> None:
        if now_ms - self.last_purge_ms < PURGE_INTERVAL_MS:
            return
        self.last_purge_ms = now_ms
        sm = self.replica.sm
        entry = core.purge_entry(sm, sm.lease_index, now_ms, self.sim.config.stall_window_ms)
        if entry is None:
            return
        content = (entry.acks, entry.expire)
        if self.purge_proposed is not None:
            last, at = self.purge_proposed
            if last == content and now_ms - at < PURGE_RETRY_MS:
                return
        self.propose(entry)
        self.purge_proposed = (content, now_ms)

    def _close(self, sub_id: str, now_ms: int) -> None:
        conn = self.conns.pop(sub_id, None)
        self.heartbeat_ms.pop(sub_id, None)
        if self.core is not None:
            self.core.detach(sub_id)
        if conn is not None:
            client, conn_id = conn
            self.sim.net.send(now_ms, self.replica.name, client, Close(conn_id, sub_id))

    # ---- messages --------------------------------------------------------------

    def on_message(self, message: Message, now_ms: int) -> None:
        body = message.body
        r = self.replica
        if isinstance(body, ReconnectReq):
            if self.core is None:
                hint = "" if r.sm.lease_holder == r.name else r.sm.lease_holder
                reply = Attach(AttachStatus.NOT_HOLDER, holder=hint)
            else:
                reply = self.core.attach(r.sm, body.sub_id, body.principal, body.after, now_ms)
                if reply.status is AttachStatus.ATTACHED:
                    old = self.conns.get(body.sub_id)
                    if old is not None and old != (body.client, body.conn):
                        self.sim.net.send(now_ms, r.name, old[0], Close(old[1], body.sub_id))
                    self.conns[body.sub_id] = (body.client, body.conn)
                    self.heartbeat_ms[body.sub_id] = now_ms
            self.sim.net.send(
                now_ms, r.name, body.client, AttachReply(body.conn, body.sub_id, reply, r.name)
            )
        elif isinstance(body, AckReq):
            if self.core is not None:
                self.core.on_client_ack(r.sm, body.sub_id, body.principal, body.up_to, now_ms)
        elif isinstance(body, SubscribeReq):
            entry = Subscribe(body.sub_id, body.principal, body.query, body.plan_hash, now_ms)
            if self.propose(entry) is not None:
                self.waiters[body.sub_id] = body.client
        elif isinstance(body, UnsubscribeReq):
            self.propose(Unsubscribe(body.sub_id, body.principal, now_ms))

    def on_applied(self, index: int, applied: Applied, now_ms: int) -> None:
        result = applied.result
        if isinstance(result, SubscribeResult):
            client = self.waiters.pop(result.sub_id, None)
            if client is not None:
                self.sim.net.send(now_ms, self.replica.name, client, SubAck(result.sub_id, result))
        if (
            self.crash_after_outbox
            and self.core is not None
            and any(isinstance(e, RowsOutboxed) for e in applied.effects)
        ):
            self.crash_after_outbox = False
            self.sim.trace("crash-after-outbox", self.replica.name, index)
            self.sim.crash_replica(self.replica, kind="crash_after_outbox")
