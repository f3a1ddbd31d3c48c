"""DET-01: replay one committed log under a scheduling seed and record what it emits.

`emission_trace(log, scheduling_seed)` applies the log on several fresh replicas,
interleaved at random, with random snapshot/restore cycles and crashes that
rebuild a replica from its last snapshot and re-apply the log after it. Every
effect a replica derives at a raft index (rows computed, outboxed, purged,
subscriptions closed, lease and epoch changes) must be identical on every
replica and every re-derivation; the trace is those effects in index order,
plus the final digest. Two scheduling seeds must give byte-identical traces.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgpack
import xxhash

from sevendb.outbox.model import (
    Applied,
    EpochChanged,
    LeaseChanged,
    RowsOutboxed,
    RowsPending,
    RowsPurged,
    SubscriptionClosed,
)
from sevendb.outbox.query import Planner, plan_query
from sevendb.outbox.state import BucketStateMachine

from .checker import Violation, row_key


def effects_bytes(applied: Applied) -> bytes:
    """A canonical encoding of one entry's effects (the checker's own row form)."""
    out: list[object] = []
    for effect in applied.effects:
        if isinstance(effect, RowsPending | RowsOutboxed):
            kind = "pending" if isinstance(effect, RowsPending) else "outboxed"
            out.append([kind, [list(row_key(r)) for r in effect.rows]])
        elif isinstance(effect, RowsPurged):
            out.append(["purged", [list(row_key(r)) for r in effect.rows], effect.ack_time_ms])
        elif isinstance(effect, SubscriptionClosed):
            out.append(["closed", effect.sub_id, str(effect.reason)])
        elif isinstance(effect, LeaseChanged):
            out.append(["lease", effect.holder, effect.lease_index])
        elif isinstance(effect, EpochChanged):
            out.append(["epoch", effect.epoch.epoch_counter])
    packed = msgpack.packb(out, use_bin_type=True)
    assert isinstance(packed, bytes)
    return packed


@dataclass(slots=True)
class _Replay:
    sm: BucketStateMachine
    next: int = 0
    """Position in the log of the next entry to apply."""
    snapshot: bytes | None = None
    snapshot_next: int = 0


@dataclass(slots=True)
class EmissionTrace:
    data: bytes
    digest: str
    state_digest: str
    steps: int = 0
    restores: int = 0
    crashes: int = 0
    per_index: dict[int, bytes] = field(default_factory=dict)


def emission_trace(
    log: list[tuple[int, bytes]],
    scheduling_seed: int,
    *,
    replicas: int = 3,
    bucket_uuid: str,
    planner: Planner = plan_query,
) -> EmissionTrace:
    """Replay `log` ((index, entry) pairs, increasing) under one scheduling seed."""
    rng = random.Random(scheduling_seed)
    nodes = [_Replay(BucketStateMachine(bucket_uuid, planner=planner)) for _ in range(replicas)]
    per_index: dict[int, bytes] = {}
    trace = EmissionTrace(b"", "", "")
    while any(n.next < len(log) for n in nodes):
        node = rng.choice([n for n in nodes if n.next < len(log)])
        roll = rng.random()
        trace.steps += 1
        if roll < 0.1:
            # Snapshot, then continue from the restored copy.
            node.snapshot, node.snapshot_next = node.sm.snapshot(), node.next
            node.sm = BucketStateMachine.restore(node.snapshot, planner=planner)
            trace.restores += 1
        elif roll < 0.15:
            # Crash: back to the last snapshot (or nothing), then replay.
            if node.snapshot is None:
                node.sm, node.next = BucketStateMachine(bucket_uuid, planner=planner), 0
            else:
                node.sm = BucketStateMachine.restore(node.snapshot, planner=planner)
                node.next = node.snapshot_next
            trace.crashes += 1
        else:
            for _ in range(rng.randint(1, 6)):
                if node.next >= len(log):
                    break
                index, data = log[node.next]
                node.next += 1
                encoded = effects_bytes(node.sm.apply(index, data))
                seen = per_index.setdefault(index, encoded)
                if seen != encoded:
                    raise Violation(
                        "determinism", f"replay seed {scheduling_seed}: effects differ at {index}"
                    )
    digests = {n.sm.digest() for n in nodes}
    if len(digests) != 1:
        raise Violation("determinism", f"replay seed {scheduling_seed}: replicas end differently")
    body = msgpack.packb(
        [[index, per_index[index]] for index in sorted(per_index)], use_bin_type=True
    )
    assert isinstance(body, bytes)
    trace.data = body
    trace.digest = xxhash.xxh64_hexdigest(body)
    trace.state_digest = digests.pop()
    trace.per_index = per_index
    return trace
