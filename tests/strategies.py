"""Random but meaningful entry sequences for property tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from helpers import Driver
from hypothesis import strategies as st

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import (
    NOT_EXISTS,
    Ack,
    Expected,
    Op,
    OpKind,
    OutboxPurge,
    ProducerRef,
    Write,
    WriteBatch,
)
from sevendb.outbox.model import Applied

KEYS = ["a/1", "a/2", "b/1", "b/2", "c"]
QUERIES = ["all", "prefix:a/", "prefix:b", "key:c", "key:a/1"]
PRINCIPALS = ["alice", "bob"]

action = st.one_of(
    st.tuples(
        st.just("set"),
        st.sampled_from(KEYS),
        st.binary(max_size=8),
        st.sampled_from(["any", "not", "exact1", "exact2"]),
    ),
    st.tuples(st.just("del"), st.sampled_from(KEYS)),
    st.tuples(
        st.just("sub"), st.integers(0, 3), st.sampled_from(QUERIES), st.sampled_from(PRINCIPALS)
    ),
    st.tuples(st.just("unsub"), st.integers(0, 3), st.sampled_from(PRINCIPALS)),
    st.tuples(st.just("outbox")),
    st.tuples(st.just("ack"), st.integers(0, 3), st.integers(0, 5), st.sampled_from(PRINCIPALS)),
    st.tuples(st.just("lease"), st.sampled_from(["n1", "n2"])),
    st.tuples(st.just("epoch")),
    st.tuples(st.just("init"), st.integers(1, 2)),
    st.tuples(st.just("pwrite"), st.integers(1, 2), st.integers(-2, 2), st.sampled_from(KEYS)),
    st.tuples(st.just("expire"), st.integers(0, 3), st.integers(0, 3_000)),
    st.tuples(st.just("garbage"), st.binary(max_size=12)),
    st.tuples(
        st.just("batch"),
        st.lists(
            st.tuples(
                st.sampled_from(KEYS),
                st.binary(max_size=4),
                st.sampled_from(["any", "not", "exact1"]),
            ),
            min_size=1,
            max_size=4,
        ),
    ),
)
actions = st.lists(action, max_size=60)

EXPECT = {
    "any": Expected(),
    "not": NOT_EXISTS,
    "exact1": Expected.exact(1),
    "exact2": Expected.exact(2),
}


def run_actions(
    d: Driver, acts: list[tuple[Any, ...]], after: Callable[[Applied], None] | None = None
) -> list[Applied]:
    """Turn actions into entries on `d`'s log; returns what each valid entry applied
    to. `after` sees each as it is applied (with `d` in the state it left)."""
    from sevendb.outbox.errors import EntryError

    applied: list[Applied] = []

    def add(one: Applied) -> None:
        applied.append(one)
        if after is not None:
            after(one)

    producer_seq: dict[int, int] = {}
    producer_epoch: dict[int, int] = {}
    for act in acts:
        kind = act[0]
        if kind == "set":
            _, key, value, exp = act
            add(d.set(key, value, EXPECT[exp]))
        elif kind == "del":
            add(d.delete(act[1]))
        elif kind == "sub":
            add(d.subscribe(f"s{act[1]}", act[2], act[3]))
        elif kind == "unsub":
            add(d.unsubscribe(f"s{act[1]}", act[2]))
        elif kind == "outbox":
            out = d.outbox()
            if out is not None:
                add(out)
        elif kind == "ack":
            _, sub, pick, who = act
            rows = d.rows(f"s{sub}")
            up_to = rows[min(pick, len(rows) - 1)].emit_seq if rows else EmitSeq("x", 1, 1)
            add(
                d.apply(
                    OutboxPurge(
                        d.sm.lease_index,
                        (Ack(f"s{sub}", who, up_to),),
                        now_ms=d.tick(),
                    )
                )
            )
        elif kind == "lease":
            add(d.lease(act[1]))
        elif kind == "epoch":
            add(d.epoch())
        elif kind == "init":
            pid = act[1]
            add(d.init_producer(pid))
            producer_epoch[pid] = producer_epoch.get(pid, -1) + 1
            producer_seq[pid] = 0
        elif kind == "pwrite":
            _, pid, delta, key = act
            seq = max(0, producer_seq.get(pid, 0) + delta)
            ref = ProducerRef(pid, producer_epoch.get(pid, 0), seq)
            add(d.set(key, b"p", producer=ref))
            if delta == 0:
                producer_seq[pid] = seq + 1
        elif kind == "batch":
            writes = tuple(
                Write((Op(OpKind.SET, key, value, EXPECT[exp]),), None, d.tick())
                for key, value, exp in act[1]
            )
            add(d.apply(WriteBatch(writes)))
        elif kind == "expire":
            _, sub, jump = act
            now = d.tick(jump)
            add(d.apply(OutboxPurge(d.sm.lease_index, (), (f"s{sub}",), 1_000, now)))
        else:
            with contextlib.suppress(EntryError):
                add(d.apply(act[1]))
    return applied
