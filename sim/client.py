"""Simulated client processes: the SDK logic (`StreamCursor`) plus an application
that processes events, persists its cursor with them, acks, and crashes.

What survives a crash: the subscriptions it wants and, per subscription, the
start and the last processed emit_seq (persisted atomically with processing).
Everything else (cursor buffers, connections) is lost. A durable subscription
(`SimConfig.durable`) keeps nothing but its name: a restarted process subscribes by
name again and resumes after the server's acknowledged position (docs/core.md,
"Durable names").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Final

from sevendb.notifier.core import AttachStatus
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import LATEST, Start
from sevendb.outbox.model import OutboxRow, ReconnectStatus
from sevendb.outbox.query import Query, plan_query
from sevendb.sdk.cursor import StreamCursor

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

if TYPE_CHECKING:
    from .world import Simulation

SUBSCRIBE_RETRY_MS: Final = 300
UNSUBSCRIBE_RETRY_MS: Final = 300
"""SUBSCRIBE and UNSUBSCRIBE not seen through are sent again after these (the same
sub_id: both are idempotent)."""
ATTACH_RETRY_MS: Final = 250
"""A Reconnect not answered this long goes to another replica."""
RETRY_BACKOFF_MS: Final = 30
STREAM_TIMEOUT_MS: Final = 450
"""No event or heartbeat for this long: the stream is dead, reconnect."""
ACK_INTERVAL_MS: Final = 20


class State(Enum):
    SUBSCRIBING = "subscribing"
    ATTACHING = "attaching"
    STREAMING = "streaming"
    UNSUBSCRIBING = "unsubscribing"
    ENDED = "ended"


@dataclass(slots=True)
class ClientSub:
    sub_id: str
    query: Query
    state: State = State.SUBSCRIBING
    durable: str = ""
    """Its durable name: it keeps no position across a crash, the server does."""
    resuming: bool = False
    """A durable subscription subscribing by name again after a crash."""
    begin: Start = LATEST
    """Where a new subscription starts (docs/core.md, "Start positions")."""
    # persisted
    start: EmitSeq | None = None
    persisted: EmitSeq | None = None
    # volatile
    cursor: StreamCursor[OutboxRow] | None = None
    conn: int = 0
    target: str = ""
    next_try_ms: int = 0
    last_heard_ms: int = 0
    need_ack: bool = False
    last_ack_ms: int = 0


class Client:
    def __init__(self, sim: Simulation, name: str, principal: str) -> None:
        self.sim = sim
        self.name = name
        self.principal = principal
        self.alive = True
        self.down_until_ms = 0
        self.subs: list[ClientSub] = []
        self._rr = sim.rng.randrange(len(sim.replica_names))
        self.generation = 0

    # ---- workload ----------------------------------------------------------------

    def subscribe(
        self, sub_id: str, query: Query, durable: str = "", begin: Start = LATEST
    ) -> None:
        self.subs.append(ClientSub(sub_id, query, durable=durable, begin=begin))

    def unsubscribe(self, sub: ClientSub) -> None:
        if sub.start is not None:
            self.sim.checker.end_stream(sub.sub_id, sub.start)
        sub.state = State.UNSUBSCRIBING
        sub.next_try_ms = 0

    def wants(self) -> list[ClientSub]:
        return [s for s in self.subs if s.state is not State.ENDED]

    # ---- faults ------------------------------------------------------------------

    def crash(self, until_ms: int) -> None:
        self.alive = False
        self.down_until_ms = until_ms
        for sub in self.subs:
            sub.cursor = None
            sub.conn = 0
            sub.target = ""
            sub.need_ack = False
            if sub.state is State.STREAMING:
                sub.state = State.ATTACHING
            sub.next_try_ms = 0
            if sub.durable and sub.state is State.ATTACHING:
                self._forget(sub)

    def _forget(self, sub: ClientSub) -> None:
        """A durable subscription's process kept nothing: it subscribes by name again,
        under a new sub_id (the name finds the one it had)."""
        assert sub.start is not None
        self.sim.checker.end_stream(sub.sub_id, sub.start)
        self.generation += 1
        sub.sub_id = f"{sub.sub_id.split('~')[0]}~{self.generation}"
        sub.start = sub.persisted = None
        sub.state = State.SUBSCRIBING
        sub.resuming = True

    def restart(self) -> None:
        self.alive = True
        self._rr = self.sim.rng.randrange(len(self.sim.replica_names))

    # ---- helpers -----------------------------------------------------------------

    def _next_target(self, hint: str = "") -> str:
        names = self.sim.replica_names
        if hint in names:
            return hint
        self._rr = (self._rr + 1) % len(names)
        return names[self._rr]

    def _send(self, now_ms: int, dst: str, body: object) -> None:
        self.sim.net.send(now_ms, self.name, dst, body)  # type: ignore[arg-type]

    def _find(self, sub_id: str, conn: int | None = None) -> ClientSub | None:
        for sub in self.subs:
            if sub.sub_id == sub_id and (conn is None or sub.conn == conn):
                return sub
        return None

    # ---- time --------------------------------------------------------------------

    def tick(self, now_ms: int) -> None:
        for sub in self.subs:
            if sub.state is State.ENDED:
                continue
            waiting = sub.state is not State.STREAMING and now_ms < sub.next_try_ms
            if waiting:
                continue
            if sub.state is State.SUBSCRIBING:
                sub.target = self._next_target(sub.target if sub.target else "")
                plan_hash = plan_query(sub.query).plan_hash
                req = SubscribeReq(
                    sub.sub_id,
                    self.principal,
                    self.name,
                    sub.query,
                    plan_hash,
                    sub.durable,
                    sub.begin,
                )
                self._send(now_ms, sub.target, req)
                sub.target = ""
                sub.next_try_ms = now_ms + SUBSCRIBE_RETRY_MS
            elif sub.state is State.ATTACHING:
                self._attach(sub, now_ms)
            elif sub.state is State.UNSUBSCRIBING:
                if not self.sim.checker.model_has_live(sub.sub_id):
                    sub.state = State.ENDED
                    continue
                self._send(now_ms, self._next_target(), UnsubscribeReq(sub.sub_id, self.principal))
                sub.next_try_ms = now_ms + UNSUBSCRIBE_RETRY_MS
            elif sub.state is State.STREAMING:
                if now_ms - sub.last_heard_ms > STREAM_TIMEOUT_MS:
                    self.sim.trace("client-timeout", self.name, sub.sub_id)
                    self._reconnect(sub, now_ms, "")
                elif sub.need_ack and now_ms - sub.last_ack_ms >= ACK_INTERVAL_MS:
                    assert sub.persisted is not None
                    self.sim.checker.on_confirm(self.principal, sub.sub_id, sub.persisted)
                    self._send(
                        now_ms, sub.target, AckReq(sub.sub_id, self.principal, sub.persisted)
                    )
                    sub.need_ack = False
                    sub.last_ack_ms = now_ms

    def _attach(self, sub: ClientSub, now_ms: int) -> None:
        sub.conn = self.sim.new_conn()
        sub.target = self._next_target(sub.target)
        if sub.persisted is not None:
            self.sim.checker.on_confirm(self.principal, sub.sub_id, sub.persisted)
        req = ReconnectReq(sub.sub_id, self.principal, self.name, sub.conn, sub.persisted)
        self._send(now_ms, sub.target, req)
        sub.next_try_ms = now_ms + ATTACH_RETRY_MS
        # Until answered, a retry goes elsewhere.
        sub.target = ""

    def _reconnect(self, sub: ClientSub, now_ms: int, target: str) -> None:
        sub.state = State.ATTACHING
        sub.cursor = None
        sub.conn = 0
        sub.target = target
        sub.next_try_ms = now_ms

    # ---- messages ----------------------------------------------------------------

    def on_message(self, message: Message, now_ms: int) -> None:
        body = message.body
        if isinstance(body, Events):
            self._on_events(body, now_ms)
        elif isinstance(body, Heartbeat):
            sub = self._find(body.sub_id, body.conn)
            if sub is not None and sub.state is State.STREAMING:
                sub.last_heard_ms = now_ms
        elif isinstance(body, Close):
            sub = self._find(body.sub_id, body.conn)
            if sub is not None and sub.state is State.STREAMING:
                self._reconnect(sub, now_ms + RETRY_BACKOFF_MS, "")
        elif isinstance(body, AttachReply):
            self._on_attach(body, now_ms)
        elif isinstance(body, SubAck):
            self._on_suback(body, now_ms)

    def _on_suback(self, body: SubAck, now_ms: int) -> None:
        sub = self._find(body.sub_id)
        if sub is None or sub.state is not State.SUBSCRIBING:
            return
        result = body.result
        if result.error is not None or result.start is None:
            self.sim.trace("suback-error", self.name, body.sub_id, str(result.error))
            sub.state = State.ENDED
            return
        # A durable name's sub_id: the one sent if the name was new (a retried
        # SUBSCRIBE whose answer was lost finds it existing: still a new one).
        resumed = sub.resuming and result.existing and result.sub_id != sub.sub_id
        sub.sub_id = result.sub_id
        sub.start = sub.persisted = result.start
        if resumed:
            sub.persisted = None  # it attaches after the server's acknowledged position
        else:
            self.sim.checker.on_subscribed(self.principal, sub.sub_id, result.start)
            sub.resuming = False
        sub.state = State.ATTACHING
        sub.next_try_ms = now_ms

    def _on_attach(self, body: AttachReply, now_ms: int) -> None:
        sub = self._find(body.sub_id, body.conn)
        if sub is None or sub.state is not State.ATTACHING:
            return
        assert sub.start is not None and body.after is not None
        attach = body.attach
        if sub.resuming and attach.status is AttachStatus.ATTACHED:
            sub.persisted = body.after
            again = self.sim.checker.on_durable_resume(
                self.principal, sub.sub_id, sub.start, body.after
            )
            self.sim.stats["durable_resumes"] += 1
            self.sim.stats["durable_reprocessed"] += again
            sub.resuming = False
        if sub.persisted is None:  # a resume by name not attached yet: try again
            if attach.status is AttachStatus.REFUSED:
                self._forget(sub)  # it ended meanwhile: by name again (a new one)
            else:
                sub.next_try_ms = now_ms + RETRY_BACKOFF_MS
            return
        self.sim.checker.on_attach(self.principal, sub.sub_id, sub.persisted, attach, True)
        if attach.status is AttachStatus.ATTACHED:
            sub.state = State.STREAMING
            sub.cursor = StreamCursor(
                sub.persisted, reorder_buffer_max=self.sim.config.reorder_buffer_max
            )
            sub.target = body.replica
            sub.last_heard_ms = now_ms
            self.sim.trace(
                "attached", self.name, sub.sub_id, body.replica, sub.persisted.commit_index
            )
            return
        if attach.status is AttachStatus.NOT_HOLDER:
            sub.target = attach.holder
            sub.next_try_ms = now_ms + RETRY_BACKOFF_MS
            return
        if attach.status is AttachStatus.BEHIND:
            sub.next_try_ms = now_ms + RETRY_BACKOFF_MS
            return
        assert attach.decision is not None
        self.sim.trace("refused", self.name, sub.sub_id, attach.decision.status.name)
        self.sim.checker.end_stream(sub.sub_id, sub.start)
        sub.state = State.ENDED
        if attach.decision.status is ReconnectStatus.STALE_SEQUENCE:
            self.sim.stats["stale_resubscribes"] += 1
            self.generation += 1
            base = sub.sub_id.split("~")[0]
            self.subscribe(f"{base}~{self.generation}", sub.query, sub.durable)

    def _on_events(self, body: Events, now_ms: int) -> None:
        for row in body.rows:
            self.sim.checker.on_receive(self.principal, body.sub_id, row, body.replica)
        sub = self._find(body.sub_id, body.conn)
        if sub is None or sub.state is not State.STREAMING or sub.cursor is None:
            return
        assert sub.start is not None
        sub.last_heard_ms = now_ms
        if self.sim.config.bugs.sdk_skips_dedupe:
            for row in body.rows:
                self._process(sub, row)
            return
        for row in body.rows:
            offered = sub.cursor.offer(row)
            if offered.duplicate:
                self.sim.checker.duplicates_dropped += 1
                sub.need_ack = True
            for ready in offered.ready:
                self._process(sub, ready)
            if offered.gap:
                self.sim.stats["client_gaps"] += 1
                self.sim.trace("gap", self.name, sub.sub_id, sub.cursor.released.commit_index)
                self._reconnect(sub, now_ms, sub.target)
                return

    def _process(self, sub: ClientSub, row: OutboxRow) -> None:
        """The application's effect and the cursor persist together (one transaction)."""
        assert sub.start is not None
        self.sim.checker.on_process(self.principal, sub.sub_id, sub.start, row)
        sub.persisted = row.emit_seq
        sub.need_ack = True
