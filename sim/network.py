"""The simulated network between clients and replicas, and the messages on it.

Delay, loss, duplication, reordering and partitions, all drawn from the
simulation's one `random.Random`. No sockets: a heap of (deliver_at, seq) entries.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field

from sevendb.notifier.core import Attach
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import LATEST, Start
from sevendb.outbox.model import OutboxRow, SubscribeResult
from sevendb.outbox.query import Query

from .config import NetFaults

# ---- messages ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OwnerRequest:
    """Client -> replica, on behalf of the principal that owns (or claims) `sub_id`."""

    sub_id: str
    principal: str


@dataclass(frozen=True, slots=True)
class UnsubscribeReq(OwnerRequest):
    """End the subscription (proposes UNSUBSCRIBE)."""


@dataclass(frozen=True, slots=True)
class AckReq(OwnerRequest):
    """Everything up to `up_to` is processed: the holder may purge it."""

    up_to: EmitSeq


@dataclass(frozen=True, slots=True)
class SubscribeReq(OwnerRequest):
    """Subscribe `query` (proposes SUBSCRIBE; answered by `SubAck` once applied)."""

    client: str
    query: Query
    plan_hash: int
    durable: str = ""
    start: Start = LATEST


@dataclass(frozen=True, slots=True)
class ReconnectReq(OwnerRequest):
    """Attach a new stream (`conn`) after `after`, the last emit_seq processed (None:
    after the server's acknowledged position, a durable subscription resumed by name,
    as the node's Subscribe does)."""

    client: str
    conn: int
    after: EmitSeq | None


@dataclass(frozen=True, slots=True)
class SubAck:
    """Replica -> client: the SUBSCRIBE applied (its start, or why not)."""

    sub_id: str
    result: SubscribeResult


@dataclass(frozen=True, slots=True)
class OnStream:
    """Replica -> client, about one attached stream: `conn` tells a client's streams
    apart, `replica` is the sender (the checker counts receipts per sender)."""

    conn: int
    sub_id: str
    replica: str


@dataclass(frozen=True, slots=True)
class Events(OnStream):
    """Outboxed rows of the subscription, in emit_seq order."""

    rows: tuple[OutboxRow, ...]


@dataclass(frozen=True, slots=True)
class AttachReply(OnStream):
    """How a `ReconnectReq` went (`after`: where it attached)."""

    attach: Attach
    after: EmitSeq | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat(OnStream):
    """The stream is alive and has nothing to send."""


@dataclass(frozen=True, slots=True)
class Close(OnStream):
    """The stream ended (the holder lost the lease, the subscription ended, ...)."""


Body = (
    SubscribeReq
    | SubAck
    | UnsubscribeReq
    | ReconnectReq
    | AttachReply
    | Events
    | Heartbeat
    | Close
    | AckReq
)


@dataclass(frozen=True, slots=True)
class Message:
    src: str
    dst: str
    body: Body


# ---- the network -------------------------------------------------------------------


@dataclass(slots=True)
class Network:
    rng: random.Random
    latency_ms: tuple[int, int] = (1, 4)
    faults: NetFaults = field(default_factory=NetFaults)
    side: dict[str, int] = field(default_factory=dict)
    stats: Counter[str] = field(default_factory=Counter)
    """Messages sent, delivered, dropped, duplicated, partitioned (cut off)."""
    _queue: list[tuple[int, int, Message]] = field(default_factory=list)
    _seq: int = 0

    raft_side: dict[str, int] = field(default_factory=dict)
    """A partition between replicas only: clients still reach every replica."""

    def reachable(self, a: str, b: str) -> bool:
        return self.side.get(a, 0) == self.side.get(b, 0)

    def reachable_raft(self, a: str, b: str) -> bool:
        return self.reachable(a, b) and self.raft_side.get(a, 0) == self.raft_side.get(b, 0)

    def partition(self, sides: dict[str, int], *, replicas_only: bool = False) -> None:
        if replicas_only:
            self.raft_side = dict(sides)
        else:
            self.side = dict(sides)

    def heal(self) -> None:
        self.side = {}
        self.raft_side = {}

    @property
    def partitioned(self) -> bool:
        return any(self.side.values()) or any(self.raft_side.values())

    def send(self, now_ms: int, src: str, dst: str, body: Body) -> None:
        self.stats["sent"] += 1
        if not self.reachable(src, dst):
            self.stats["partitioned"] += 1
            return
        f = self.faults
        if f.drop and self.rng.random() < f.drop:
            self.stats["dropped"] += 1
            return
        copies = 1
        if f.duplicate and self.rng.random() < f.duplicate:
            copies = 2
            self.stats["duplicated"] += 1
        for _ in range(copies):
            delay = self.rng.randint(*self.latency_ms)
            if f.jitter_ms:
                delay += self.rng.randint(0, f.jitter_ms)
            if f.spike and self.rng.random() < f.spike:
                delay += self.rng.randint(f.spike_ms // 4, f.spike_ms)
            self._seq += 1
            heapq.heappush(self._queue, (now_ms + delay, self._seq, Message(src, dst, body)))

    def due(self, now_ms: int) -> list[Message]:
        """Messages whose delivery time has come, in delivery order."""
        out = []
        while self._queue and self._queue[0][0] <= now_ms:
            message = heapq.heappop(self._queue)[2]
            if not self.reachable(message.src, message.dst):
                self.stats["partitioned"] += 1
                continue
            self.stats["delivered"] += 1
            out.append(message)
        return out

    def in_flight(self) -> int:
        return len(self._queue)
