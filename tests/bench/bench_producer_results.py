"""Benchmark: what a bucket's kept producer results cost, per producer, by how many
are kept (`limits.PRODUCER_RESULTS_CACHED`).

    .venv/bin/python tests/bench/bench_producer_results.py [--producers 2000] [--kept 5,64,128,256]

For each count kept, producers that each wrote twice that many writes (of 1 key, and
of 8 keys): the memory their results hold (tracemalloc; the keys and data are the
bucket's anyway), their bytes in a snapshot and the time a restore spends checking
them; next to memory and snapshot bytes of the whole results kept before (a
`(sequence, WriteResult)` per write; in a snapshot with its commit and keys). Then
the apply cost of a producer's write (its result kept) and of a retry answered from
the kept results. Not a test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections import deque

import msgpack

from sevendb.outbox import limits
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import InitProducer, Op, OpKind, ProducerRef, Write, encode_entry
from sevendb.outbox.model import WriteResult
from sevendb.outbox.producer_results import ProducerResults
from sevendb.outbox.producers import Producer
from sevendb.outbox.state import BucketStateMachine

UUID = "0f6c3d52-4b8e-4bb4-9d53-1a2b3c4d5e6f"
KEPT_BUILT = limits.PRODUCER_RESULTS_CACHED
FIRST_INDEX = 5_000_000
"""Commit indexes of a bucket that has run a while (5-byte msgpack integers)."""


def results_of(pid: int, kept: int, keys: list[str]) -> list[WriteResult]:
    index = FIRST_INDEX + pid * kept
    return [
        WriteResult(EmitSeq(UUID, 3, index + i), tuple((k, 7) for k in keys)) for i in range(kept)
    ]


def measure(producers: int, kept: int, width: int) -> dict[str, float]:
    limits.PRODUCER_RESULTS_CACHED = kept  # type: ignore[misc]  # read at each add
    keys = [f"orders/customer-{i:06d}/status" for i in range(width)]  # held by the data
    writes = 2 * kept  # each producer wrote more than it keeps (evicted ones included)
    whole = [results_of(pid, writes, keys) for pid in range(producers)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    new: list[Producer] = []
    for results in whole:
        p = Producer(0, 1, writes - 1)
        for result in results:
            p.results.add(result)
        new.append(p)
    packed_bytes = tracemalloc.get_traced_memory()[0] - before
    before = tracemalloc.get_traced_memory()[0]
    old = []
    for results in whole:  # as builds before kept them: whole results, keys shared
        cache: deque[tuple[int, WriteResult]] = deque(maxlen=kept)
        cache.extend(
            (
                seq,
                WriteResult(
                    EmitSeq(UUID, r.commit.epoch_counter, r.commit.commit_index),
                    tuple((k, v) for k, v in r.versions),
                ),
            )
            for seq, r in enumerate(results)
        )
        old.append(cache)
    whole_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    snap_new = [[pid, 0, writes - 1, p.results.packed(), 1] for pid, p in enumerate(new)]
    snap_old = [
        [pid, 0, writes - 1, [[q, _whole(r)] for q, r in c], 1] for pid, c in enumerate(old)
    ]
    raw_new = msgpack.unpackb(msgpack.packb(snap_new, use_bin_type=True), raw=False)
    started = time.perf_counter()
    for _, _, last, results, _ in raw_new:
        ProducerResults.restore(results, last)
    restore_new = time.perf_counter() - started
    return {
        "mem_new": packed_bytes / producers,
        "mem_old": whole_bytes / producers,
        "snap_new": len(msgpack.packb(snap_new, use_bin_type=True)) / producers,
        "snap_old": len(msgpack.packb(snap_old, use_bin_type=True)) / producers,
        "restore_new_us": restore_new / producers * 1e6,
    }


def _whole(r: WriteResult) -> list[object]:
    return [r.commit.pack(), [list(kv) for kv in r.versions], None]


def apply_cost(writes: int = 20_000) -> tuple[float, float]:
    """µs per producer write applied (result kept) and per retry answered from them."""
    limits.PRODUCER_RESULTS_CACHED = KEPT_BUILT  # type: ignore[misc]
    sm = BucketStateMachine(UUID)
    sm.apply(1, encode_entry(InitProducer(7, 1)))
    entries = [
        encode_entry(Write((Op(OpKind.SET, f"k{i}", b"v"),), ProducerRef(7, 0, i), 2))
        for i in range(writes)
    ]
    started = time.perf_counter()
    for i, data in enumerate(entries):
        sm.apply(2 + i, data)
    applied = (time.perf_counter() - started) / writes * 1e6
    retry = Write((Op(OpKind.SET, "k", b"v"),), ProducerRef(7, 0, writes - 1), 3)
    results = sm.producers[7].results
    started = time.perf_counter()
    for i in range(writes):
        results.original(i % len(results), UUID, retry)
    return applied, (time.perf_counter() - started) / writes * 1e6


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--producers", type=int, default=2000)
    p.add_argument("--kept", default="5,64,128,256")
    args = p.parse_args()
    print(f"build: PRODUCER_RESULTS_CACHED = {KEPT_BUILT}")
    print(
        "\n| kept | keys per write | memory per producer, packed / whole | snapshot bytes "
        "per producer, packed / whole | restore µs per producer (packed, checked) | "
        f"memory at {limits.PRODUCERS_PER_BUCKET_MAX:,} producers, packed |"
        "\n|---|---|---|---|---|---|"
    )
    for kept in (int(k) for k in args.kept.split(",")):
        for width in (1, 8):
            m = measure(args.producers, kept, width)
            total = m["mem_new"] * limits.PRODUCERS_PER_BUCKET_MAX / 2**20
            print(
                f"| {kept} | {width} | {m['mem_new']:,.0f} / {m['mem_old']:,.0f} B | "
                f"{m['snap_new']:,.0f} / {m['snap_old']:,.0f} B | "
                f"{m['restore_new_us']:,.0f} | {total:,.0f} MiB |"
            )
    applied, answered = apply_cost()
    print(
        f"\napply of a one-key producer write (result packed and kept): {applied:.1f} µs; "
        f"a retry answered from the kept results: {answered:.2f} µs"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
