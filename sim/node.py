"""One simulated node process: a member's replica contract (`SimReplica`), the
production notifier host on it (`BucketNotifier`, its passes run from the
simulation's steps by a `SteppedRunner` on the simulated clock), and what the gRPC
service does for clients, over the simulated network: subscribe, unsubscribe,
reconnect (attach a `Stream`), ack, and heartbeats on idle streams.

A crash discards the node with everything volatile in it; a restart builds a new
one, as a node process starts afresh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Final

from sevendb.notifier.core import AttachStatus, EmissionMode
from sevendb.notifier.host import BucketNotifier, NotifierSettings
from sevendb.outbox.entries import Subscribe, SubscribeBatch, Unsubscribe, encode_entry
from sevendb.outbox.model import OutboxRow, SubscribeBatchResult, SubscribeResult
from sevendb.outbox.replica import ApplyOutcome, ReplicaUnavailable

from . import network as wire
from .config import SimConfig
from .raft import Member
from .replica import SimReplica, SpeculativeReplica
from .variants import core_factory

if TYPE_CHECKING:
    from .world import Simulation

RETRY_MS: Final = 200
"""An uncommitted LEASE / OUTBOX_WRITE / OUTBOX_PURGE is proposed again after this."""
PURGE_INTERVAL_MS: Final = 40
IDLE_MS: Final = 100
"""A notifier pass runs at least this often (the production `idle_wait_s`)."""
HEARTBEAT_MS: Final = 100
"""An attached stream with nothing to send gets a heartbeat this often."""


def notifier_settings(config: SimConfig) -> NotifierSettings:
    """The production settings, scaled to a simulated run."""
    return NotifierSettings(
        lease_mode="rendezvous" if config.enabled("rendezvous") else "leader",
        window_events=config.window_events,
        resend_after_ms=config.resend_after_ms,
        purge_interval_ms=PURGE_INTERVAL_MS,
        retry_ms=RETRY_MS,
        stall_window_ms=config.stall_window_ms,
        idle_wait_s=IDLE_MS / 1000,
        emission_mode=EmissionMode(config.emission),
        history_entries=config.history_entries,
    )


class SteppedRunner:
    """The notifier host's `Runner` in the simulator: a pass runs from a simulation
    step when woken, after `idle_ms` of simulated time, and at the next step again
    while a pass says more is ready (as `NotifierThread` does, without a thread)."""

    def __init__(self, idle_ms: int) -> None:
        self.idle_ms = idle_ms
        self.woken = False
        self.busy = False
        self.last_ms = -idle_ms
        self._step: Callable[[], bool] | None = None

    def start(self, step: Callable[[], bool]) -> None:
        self._step = step
        self.woken = True

    def wake(self) -> None:
        self.woken = True

    def stop(self) -> None:
        self._step = None

    def run_due(self, now_ms: int) -> bool:
        """Run a pass if one is due; True if it ran."""
        if self._step is None:
            return False
        if not (self.woken or self.busy or now_ms - self.last_ms >= self.idle_ms):
            return False
        self.woken = False
        self.last_ms = now_ms
        self.busy = self._step()
        return True


@dataclasses.dataclass(eq=False, slots=True)
class Stream:
    """One client stream attached on a node (a gRPC stream's place): the `EventSink`
    the host hands rows to, sent over the simulated network."""

    node: SimNode
    client: str
    conn: int
    sub_id: str
    last_sent_ms: int
    open: bool = True

    def deliver(self, rows: tuple[OutboxRow, ...]) -> None:
        self.node.send_events(self, rows)

    def close(self, reason: str) -> None:
        self.node.end_stream(self)


class SimNode:
    """One node process of the simulation (see the module docstring)."""

    def __init__(self, sim: Simulation, member: Member) -> None:
        self.sim = sim
        self.name = member.name
        config = sim.config
        replica_class = SpeculativeReplica if config.bugs.send_before_commit else SimReplica
        self.replica = replica_class(
            member,
            sim.raft,
            sim.clock_ms,
            sim.reachable,
            fenced=not config.bugs.lease_without_fencing,
            on_propose=sim.on_propose,
        )
        settings = notifier_settings(config)
        self.runner = SteppedRunner(IDLE_MS)
        self.host = BucketNotifier(
            self.replica,
            settings,
            clock_ms=sim.clock_ms,
            runner=self.runner,
            new_core=core_factory(config.bugs),
        )
        self.host.start()
        self.streams: dict[str, Stream] = {}
        self.emitting = False
        self.crash_after_outbox = False
        self._subscribes: list[tuple[str, Subscribe]] = []
        """(client, SUBSCRIBE) received in this step, proposed together at its end."""

    # ---- the process -----------------------------------------------------------

    def tick(self, now_ms: int) -> None:
        """A simulation step: a notifier pass if one is due, then heartbeats."""
        if self.runner.run_due(now_ms) and self.host.emitting != self.emitting:
            self.emitting = self.host.emitting
            if self.emitting:
                self.sim.trace("notifier-up", self.name, self.replica.member.sm.lease_index)
            else:
                self.sim.trace("notifier-down", self.name)
        for sub_id in sorted(self.streams):
            stream = self.streams[sub_id]
            if now_ms - stream.last_sent_ms >= HEARTBEAT_MS:
                self._send(stream.client, wire.Heartbeat(stream.conn, sub_id, self.name))
                stream.last_sent_ms = now_ms

    def crash(self) -> None:
        """kill -9: nothing runs any more, connections just break."""
        self.runner.stop()
        self.streams.clear()

    def on_apply(self, index: int, outcome: ApplyOutcome | None) -> None:
        """The replica applied `index` (the replica's on_applied hook, then the
        proposal's callback, in cluster/raft's order)."""
        if outcome is not None and outcome.applied is not None:
            self.host.on_applied(outcome.applied)
        self.replica.on_apply(index, outcome)

    # ---- streams ---------------------------------------------------------------

    def _send(self, dst: str, body: wire.Body) -> None:
        self.sim.net.send(self.sim.now_ms, self.name, dst, body)

    def send_events(self, stream: Stream, rows: tuple[OutboxRow, ...]) -> None:
        if not stream.open:
            return
        self._send(stream.client, wire.Events(stream.conn, stream.sub_id, self.name, rows))
        stream.last_sent_ms = self.sim.now_ms
        first, last = rows[0].emit_seq.commit_index, rows[-1].emit_seq.commit_index
        self.sim.trace("send", self.name, stream.sub_id, first, last)

    def end_stream(self, stream: Stream) -> None:
        if not stream.open:
            return
        stream.open = False
        if self.streams.get(stream.sub_id) is stream:
            del self.streams[stream.sub_id]
        self._send(stream.client, wire.Close(stream.conn, stream.sub_id, self.name))

    # ---- requests --------------------------------------------------------------

    def on_message(self, message: wire.Message) -> None:
        body = message.body
        if isinstance(body, wire.ReconnectReq):
            self._reconnect(body)
        elif isinstance(body, wire.AckReq):
            self.host.ack(body.principal, [(body.sub_id, body.up_to)])
        elif isinstance(body, wire.SubscribeReq):
            now = self.sim.now_ms
            entry = Subscribe(
                body.sub_id,
                body.principal,
                body.query,
                body.plan_hash,
                now,
                body.durable,
                body.start,
            )
            self._subscribes.append((body.client, entry))
        elif isinstance(body, wire.UnsubscribeReq):
            entry_u = Unsubscribe(body.sub_id, body.principal, self.sim.now_ms)
            self._propose(encode_entry(entry_u), None)

    def _reconnect(self, body: wire.ReconnectReq) -> None:
        stream = Stream(self, body.client, body.conn, body.sub_id, self.sim.now_ms)
        if body.after is None:
            attach, _, after = self.host.resume(body.sub_id, body.principal, stream)
        else:
            after = body.after
            attach, _ = self.host.attach(body.sub_id, body.principal, after, stream)
        if attach.status is AttachStatus.ATTACHED:
            self.streams[body.sub_id] = stream
        elif attach.holder == self.name:
            attach = dataclasses.replace(attach, holder="")  # no hint: retry elsewhere
        reply = wire.AttachReply(body.conn, body.sub_id, self.name, attach, after)
        self._send(body.client, reply)

    def _propose(self, entry: bytes, done: Callable[[Future[ApplyOutcome]], None] | None) -> None:
        try:
            future = self.replica.submit(entry)
        except ReplicaUnavailable:
            return  # the client retries
        if done is not None:
            future.add_done_callback(done)

    def flush_subscribes(self) -> None:
        """Propose the SUBSCRIBEs that arrived in this step: one entry for all of them
        (a SUBSCRIBE_BATCH when there are several), as a service batching concurrent
        Subscribe calls would."""
        waiting, self._subscribes = self._subscribes, []
        if len(waiting) == 1:
            self._propose(encode_entry(waiting[0][1]), lambda f: self._subscribed(waiting, f))
        elif waiting:
            batch = SubscribeBatch(tuple(entry for _, entry in waiting))
            self._propose(encode_entry(batch), lambda f: self._subscribed(waiting, f))

    def _subscribed(
        self, waiting: list[tuple[str, Subscribe]], future: Future[ApplyOutcome]
    ) -> None:
        if future.exception() is not None:
            return
        applied = future.result().applied
        if applied is None:
            return
        result = applied.result
        results = result.results if isinstance(result, SubscribeBatchResult) else (result,)
        for (client, entry), one in zip(waiting, results, strict=True):
            if isinstance(one, SubscribeResult):  # (a durable name: `one` has its sub_id)
                self._send(client, wire.SubAck(entry.sub_id, one))
