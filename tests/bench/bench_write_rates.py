"""Benchmark: how long a durable write takes to be acknowledged at a given rate, with
and without a subscriber receiving every write.

    .venv/bin/python tests/bench/bench_write_rates.py [--rates 1,50,200,500]
        [--seconds 6] [--runs 3]

For each run, a fresh 3-node, 1-bucket cluster (`sevendb cluster up`, plaintext, as
side_by_side.py's). Each rate writes open loop (one write every 1/rate s) through
`AsyncClient.write` for `--seconds`, first with no subscriber, then with one
`AsyncClient` subscription of every write in a process of its own (acknowledging as
the SDK does). Prints the acknowledgement's p50 / p90 / p99 in ms and the CPU the
three nodes used per second of load. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_writes import machine
from peers.common import cpu_seconds

SUBSCRIBER = "--serve-subscriber"


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


async def _writes(
    endpoints: list[str], token: str, prefix: str, rate: float, seconds: float
) -> list[float]:
    from sevendb.sdk import AsyncClient, set_op

    client = AsyncClient(endpoints, token=token, tls=None)
    await client.layout()
    latencies: list[float] = []

    async def one(i: int) -> None:
        started = time.perf_counter()
        await client.write([set_op(f"{prefix}/{i}", b"x" * 100)])
        latencies.append(1000 * (time.perf_counter() - started))

    tasks = []
    t0 = time.monotonic()
    i = 0
    while (now := time.monotonic()) - t0 < seconds:
        due = t0 + i / rate
        if due > now:
            await asyncio.sleep(due - now)
            continue
        tasks.append(asyncio.ensure_future(one(i)))
        i += 1
    await asyncio.gather(*tasks)
    await client.close()
    return latencies


async def _serve_subscriber(conf: dict[str, object]) -> None:
    from sevendb.sdk import AsyncClient

    client = AsyncClient(conf["endpoints"], token=str(conf["token"]), tls=None)  # type: ignore[arg-type]
    sub = await client.subscribe(f"prefix:{conf['prefix']}/", name="bench")
    print("ready", flush=True)
    async for _event in sub:
        pass


def _run(
    rates: list[float], seconds: float, run: int
) -> list[tuple[str, float, list[float], float]]:
    from sevendb.cluster.ops.local import (
        cluster_down,
        cluster_up,
        local_nodes,
        local_token,
        running_pid,
    )

    root = Path(tempfile.mkdtemp(prefix="bench-rates-"))
    out = []
    try:
        spec = cluster_up(root, nodes=3, buckets=1, replicas=3, insecure=True).spec
        endpoints = [n.grpc_address for n in spec.nodes]
        token = local_token(root)
        pids = [p for n in local_nodes(root) if (p := running_pid(root, n)) is not None]
        time.sleep(3)  # the fresh cluster's leadership hand-over
        for subscribed in (False, True):
            for rate in rates:
                prefix = f"r{run}-{int(rate)}-{int(subscribed)}"
                sub = None
                if subscribed:
                    conf = {"endpoints": endpoints, "token": token, "prefix": prefix}
                    sub = subprocess.Popen(
                        [sys.executable, __file__, SUBSCRIBER, json.dumps(conf)],
                        stdout=subprocess.PIPE,
                    )
                    assert sub.stdout is not None and sub.stdout.readline().strip() == b"ready"
                cpu0 = sum(cpu_seconds(p) for p in pids)
                latencies = asyncio.run(_writes(endpoints, token, prefix, rate, seconds))
                cpu = (sum(cpu_seconds(p) for p in pids) - cpu0) / seconds
                if sub is not None:
                    sub.kill()
                    sub.wait()
                out.append(("1 subscriber" if subscribed else "none", rate, latencies, cpu))
    finally:
        cluster_down(root)
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1,50,200,500", help="writes per second, comma-separated")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    print(f"# {machine()}; {args.seconds:g} s per rate, {args.runs} run(s), fresh cluster each")
    print("| subscriber | writes/s | ack p50 ms | p90 ms | p99 ms | node CPU cores |")
    print("|---|---|---|---|---|---|")
    results: dict[tuple[str, float], list[tuple[float, float, float, float]]] = {}
    for run in range(args.runs):
        for who, rate, latencies, cpu in _run(rates, args.seconds, run):
            row = (_pct(latencies, 50), _pct(latencies, 90), _pct(latencies, 99), cpu)
            results.setdefault((who, rate), []).append(row)
            print(
                f"| {who} | {rate:g} | "
                + " | ".join(f"{v:.2f}" for v in row)
                + f" | (run {run + 1})",
                flush=True,
            )
    print("\nMedians over the runs (range):")
    for (who, rate), rows in results.items():
        cells = []
        for column in zip(*rows, strict=True):
            cells.append(f"{statistics.median(column):.2f} ({min(column):.2f}-{max(column):.2f})")
        print(f"| {who} | {rate:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == SUBSCRIBER:
        asyncio.run(_serve_subscriber(json.loads(sys.argv[2])))
    else:
        sys.exit(main())
