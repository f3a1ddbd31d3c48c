"""Drive a bucket state machine the way the replica and notifier adapters will."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    ANY,
    Ack,
    Entry,
    EpochCreate,
    Expected,
    InitProducer,
    Lease,
    Op,
    OpKind,
    OutboxPurge,
    ProducerRef,
    Subscribe,
    Unsubscribe,
    Write,
    encode_entry,
)
from sevendb.outbox.errors import EntryError
from sevendb.outbox.model import Applied, OutboxRow, PurgeResult
from sevendb.outbox.query import Query, plan_query
from sevendb.outbox.state import BucketStateMachine

BUCKET = "bucket-0000"


class Driver:
    """A bucket plus a log: every call encodes an entry and applies it at the next index."""

    def __init__(self, sm: BucketStateMachine | None = None, *, holder: str = "node-a") -> None:
        self.sm = sm if sm is not None else BucketStateMachine(BUCKET)
        self.index = self.sm.applied_index
        self.log: list[tuple[int, bytes]] = []
        self.now_ms = 1_000
        self.holder = holder

    def apply(self, entry: Entry | bytes, *, gap: int = 1) -> Applied:
        self.index += gap
        data = entry if isinstance(entry, bytes) else encode_entry(entry)
        self.log.append((self.index, data))
        return self.sm.apply(self.index, data)

    def tick(self, ms: int = 10) -> int:
        self.now_ms += ms
        return self.now_ms

    # ---- conveniences ------------------------------------------------------------

    def lease(self, holder: str | None = None) -> Applied:
        return self.apply(Lease(holder or self.holder, self.tick()))

    def set(
        self,
        key: str,
        value: bytes = b"v",
        expected: Expected = ANY,
        producer: ProducerRef | None = None,
    ) -> Applied:
        return self.apply(Write((Op(OpKind.SET, key, value, expected),), producer, self.tick()))

    def delete(self, key: str, expected: Expected = ANY) -> Applied:
        return self.apply(Write((Op(OpKind.DEL, key, b"", expected),), None, self.tick()))

    def init_producer(self, pid: int) -> Applied:
        return self.apply(InitProducer(pid, self.tick()))

    def subscribe(
        self, sub_id: str, query: str, principal: str = "alice", *, durable: str = ""
    ) -> Applied:
        q = Query.parse(query)
        return self.apply(
            Subscribe(sub_id, principal, q, plan_query(q).plan_hash, self.tick(), durable)
        )

    def unsubscribe(self, sub_id: str, principal: str = "alice") -> Applied:
        return self.apply(Unsubscribe(sub_id, principal, self.tick()))

    def outbox(self) -> Applied | None:
        """Propose and apply the OUTBOX_WRITE the lease holder would propose now."""
        proposal = self.sm.propose_outbox_write(self.sm.lease_index, self.tick())
        return None if proposal is None else self.apply(proposal)

    def ack(self, sub_id: str, up_to: EmitSeq, principal: str = "alice") -> PurgeResult:
        applied = self.apply(
            OutboxPurge(self.sm.lease_index, (Ack(sub_id, principal, up_to),), now_ms=self.tick())
        )
        assert isinstance(applied.result, PurgeResult)
        return applied.result

    def epoch(self) -> Applied:
        return self.apply(EpochCreate(self.sm.epoch.epoch_counter + 1, self.tick()))

    def rows(self, sub_id: str) -> tuple[OutboxRow, ...]:
        return self.sm.subs.outbox_rows(sub_id)


def replay(
    log: list[tuple[int, bytes]], sm: BucketStateMachine | None = None
) -> BucketStateMachine:
    """Apply a recorded log to a fresh (or given) state machine, ignoring rejected entries."""
    sm = sm if sm is not None else BucketStateMachine(BUCKET)
    for index, data in log:
        if index <= sm.applied_index:
            continue
        with contextlib.suppress(EntryError):
            sm.apply(index, data)
    return sm


def version_2_snapshot(sm: BucketStateMachine) -> bytes:
    """`sm`'s snapshot as a build before durable names and the retained history wrote
    it (format 2): each subscription without its name, no history. `sm` must hold no
    durable subscription."""
    raw = msgpack.unpackb(sm.snapshot(), raw=False)
    assert raw[0] == 3 and len(raw) == 14
    assert all(s[10] == "" and s[11] == s[5][2] for s in raw[9]), "format 2 has no names"
    subs = [s[:10] for s in raw[9]]
    return bytes(msgpack.packb([2, *raw[1:9], subs, *raw[10:12]], use_bin_type=True))


def version_1_snapshot(sm: BucketStateMachine, stale: tuple[list[Any], ...] = ()) -> bytes:
    """`sm`'s snapshot as a build before lifecycles and the derived emission mode wrote
    it (format 1): producers without a time, each subscription with a stale flag and
    only its checkpointed rows (the others were kept only in the pending batches), no
    expired subscriptions remembered. `stale` adds subscriptions marked stale, each in
    format 2's shape (`[sub_id, principal, kind, arg, plan_hash, start, head, acked,
    last_active_ms, rows]`)."""
    raw = msgpack.unpackb(version_2_snapshot(sm), raw=False)
    assert raw[0] == 2 and len(raw) == 12
    outboxed = raw[4]
    producers = [p[:4] for p in raw[8]]
    subs = [[*s[:9], False, [r for r in s[9] if r[1][2] <= outboxed]] for s in raw[9]] + [
        [*s[:9], True, s[9]] for s in stale
    ]
    return bytes(msgpack.packb([1, *raw[1:8], producers, subs, raw[10]], use_bin_type=True))
