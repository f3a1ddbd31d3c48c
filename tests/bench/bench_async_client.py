"""Benchmark: `Client` and `AsyncClient` side by side on one local cluster.

    .venv/bin/python tests/bench/bench_async_client.py [--data DIR] [--seq 400] [--many 5000]

Prints, for each face: sequential `get` and `put` latency (p50, mean) with the
client process's CPU per get, and many writes in flight at once (`write_async`
futures for `Client`, `asyncio.gather` of `put` coroutines for `AsyncClient`) in
writes/s and client CPU per write. The CPU figures are the steadier ones on a busy
machine (wall times there move with the other processes' load).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster_harness import LocalCluster

from sevendb.sdk import AsyncClient, Client, set_op


def latency(samples: list[float]) -> str:
    p50, mean = statistics.median(samples) * 1e3, statistics.mean(samples) * 1e3
    return f"p50 {p50:.2f} ms, mean {mean:.2f} ms"


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def sync_face(client: Client, seq: int, many: int) -> None:
    client.put("warm", b"x")
    cpu = time.process_time()
    gets = [timed(lambda: client.get("warm")) for _ in range(seq)]
    cpu_get = (time.process_time() - cpu) / seq
    print(f"Client       get: {latency(gets)}, client CPU {cpu_get * 1e6:.0f} us/get")
    puts = [timed(functools.partial(client.put, f"s/{i}", b"v")) for i in range(seq)]
    print(f"Client       put: {latency(puts)}")
    started, cpu = time.perf_counter(), time.process_time()
    futures = [client.write_async([set_op(f"m/{i}", b"v")]) for i in range(many)]
    for future in futures:
        future.result()
    wall, used = time.perf_counter() - started, time.process_time() - cpu
    print(
        f"Client       write_async x{many}: {many / wall:.0f} writes/s, "
        f"client CPU {used / many * 1e6:.0f} us/write"
    )


async def async_face(client: AsyncClient, seq: int, many: int) -> None:
    await client.put("warm", b"x")
    gets = []
    cpu = time.process_time()
    for _ in range(seq):
        started = time.perf_counter()
        await client.get("warm")
        gets.append(time.perf_counter() - started)
    cpu_get = (time.process_time() - cpu) / seq
    print(f"AsyncClient  get: {latency(gets)}, client CPU {cpu_get * 1e6:.0f} us/get")
    puts = []
    for i in range(seq):
        started = time.perf_counter()
        await client.put(f"a/{i}", b"v")
        puts.append(time.perf_counter() - started)
    print(f"AsyncClient  put: {latency(puts)}")
    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client.put(f"am/{i}", b"v") for i in range(many)))
    wall, used = time.perf_counter() - started, time.process_time() - cpu
    print(
        f"AsyncClient  gather(put) x{many}: {many / wall:.0f} writes/s, "
        f"client CPU {used / many * 1e6:.0f} us/write"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="the cluster's data dir (default: a temp dir)")
    parser.add_argument("--seq", type=int, default=400, help="sequential gets and puts")
    parser.add_argument("--many", type=int, default=5000, help="writes in flight at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster.start(args.data or Path(tmp) / "data", buckets=2)
        try:
            cluster.wait_settled()
            endpoints = [n.grpc_address for n in cluster.spec.nodes]
            token, tls = cluster.token(), cluster.tls
            with Client(endpoints, token=token, tls=tls) as client:
                sync_face(client, args.seq, args.many)

            async def run() -> None:
                async with AsyncClient(endpoints, token=token, tls=tls) as client:
                    await async_face(client, args.seq, args.many)

            asyncio.run(run())
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
