"""Benchmark: the floor under one durable write on this host, part by part, beside
etcd's and sevendb's one-write-at-a-time latency in the same run.

    .venv/bin/python tests/bench/bench_floor.py [--seconds 5] [--runs 3] [--dir DIR]

A write acknowledged by a 3-replica group needs at least: the client's request and
its answer (one gRPC round trip from Python), one Raft round (leader to a follower
and back), and one fdatasync on the follower (the leader's runs beside it). Each is
measured here with the stack alone, nothing of sevendb in it:

* **gRPC round trip:** a grpc.aio client and an echo server in another process, one
  message in flight: a unary call (what etcd's Python client makes) and a message
  and its answer on an open bidirectional stream (what the SDK's write stream does).
* **Raft round:** stock pysyncobj, 3 processes, one replicated increment in flight,
  called in the leader's process (`raw_pysyncobj_node.py` with sevendb's send
  settings; its journal is in memory, nothing fsynced).
* **fdatasync:** a 200-byte record appended to a preallocated file, as the journal
  does, alone and 3 at once (the round until all 3 are synced, one thread per file)
  on one disk: on this host the 3 nodes' journals share a disk (`bench_fsync.py`'s
  cases).

The floor is the sum of the three parts' p50s. Then the parts joined
(`composed_node.py`): a grpc.aio write stream into stock pysyncobj whose journal
fdatasyncs, the same hand-off between the gRPC loop's thread and the Raft thread as
sevendb's, and nothing else of sevendb's; what a write takes when the stack is used
the simplest way.

Then etcd and sevendb, each a fresh 3-node cluster, with side_by_side.py's writer
process, and for sevendb also this process writing on one WriteStream without the
SDK: one write at a time, then 500 writes/s open loop (issue 30's light load).
Prints, per run and as medians over runs, p50 / p99 in ms and the CPU used per
operation (servers, client). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from bench_fsync import many_files, one_file
from bench_writes import machine, run_raw
from composed_node import start_server
from peers.clusters import ComposedCluster, EtcdCluster, SevendbCluster
from peers.common import Worker, cpu_seconds, free_ports, pct
from peers.install import ensure_binaries, ensure_etcd_stubs

RECORD = b"r" * 200
NAN = float("nan")
OPEN_LOOP_RATE = 500

Row = tuple[float, float, float, float]
"""p50 ms, p99 ms, the servers' CPU µs per operation, the client's."""


def _row(latencies_ms: list[float], servers_us: float = NAN, client_us: float = NAN) -> Row:
    ordered = sorted(latencies_ms)
    return pct(ordered, 50), pct(ordered, 99), servers_us, client_us


# ---- gRPC ------------------------------------------------------------------------------


async def _echo_server(port: int) -> None:
    import grpc

    async def unary(request: bytes, _context: object) -> bytes:
        return request

    async def stream(requests: object, _context: object) -> object:
        async for request in requests:  # type: ignore[attr-defined]
            yield request

    server = await start_server(
        port,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        },
    )
    print("ready", flush=True)
    await server.wait_for_termination()


async def _round_trips(
    port: int, server_pid: int, seconds: float
) -> dict[str, tuple[list[float], float, float]]:
    """Per kind: the round trips' latencies (ms), and the server's and this client's
    CPU µs per round trip."""
    from grpc import aio

    out: dict[str, tuple[list[float], float, float]] = {}
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary("/floor/Unary")
        call = channel.stream_stream("/floor/Stream")()
        payload = b"x" * 100
        for kind in ("unary", "stream"):
            latencies: list[float] = []
            warm_until = time.monotonic() + 0.5
            end = warm_until + seconds
            cpu: tuple[float, float] | None = None
            while (now := time.monotonic()) < end:
                if cpu is None and now >= warm_until:
                    cpu = (cpu_seconds(server_pid), time.process_time())
                started = time.perf_counter()
                if kind == "unary":
                    await unary(payload)
                else:
                    await call.write(payload)
                    await call.read()
                if cpu is not None:
                    latencies.append(1000 * (time.perf_counter() - started))
            assert cpu is not None
            server_us = 1e6 * (cpu_seconds(server_pid) - cpu[0]) / len(latencies)
            client_us = 1e6 * (time.process_time() - cpu[1]) / len(latencies)
            out[kind] = (latencies, server_us, client_us)
        await call.done_writing()
    return out


def grpc_round_trips(seconds: float) -> dict[str, tuple[list[float], float, float]]:
    port = free_ports(1)[0]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve-echo", str(port)], stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError("the echo server did not start")
        return asyncio.run(_round_trips(port, server.pid, seconds))
    finally:
        server.kill()
        server.wait()


# ---- fdatasync -------------------------------------------------------------------------


def fdatasyncs(directory: Path, files: int, ops: int) -> list[float]:
    """ms per fdatasync of a 200-byte record in a preallocated file (`bench_fsync.py`'s
    cases): alone, or the round of `files` files synced at once, a thread each."""
    with tempfile.TemporaryDirectory(dir=directory) as where:
        if files == 1:
            us = one_file(Path(where), ops, RECORD, preallocate=True)
        else:
            us, _ = many_files(Path(where), ops, RECORD, files, parallel=True, preallocate=True)
    return [u / 1000 for u in us]


# ---- the parts joined ------------------------------------------------------------------


class Codec:
    """How one write stream's requests are made and its answers read: the composed
    node's 8-byte ids, or sevendb's WriteStream (`SevendbCodec`)."""

    method = "/floor/Write"
    metadata: tuple[tuple[str, str], ...] = ()

    def request(self, n: int) -> bytes:
        return n.to_bytes(8, "little")

    def answered(self, message: bytes) -> list[int]:
        return [int.from_bytes(message, "little")]


class SevendbCodec(Codec):
    """sevendb's WriteStream without the SDK: a WriteManyRequest of one 100-byte SET
    per write, its id the write's number."""

    method = "/sevendb.v1.SevenDB/WriteStream"

    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)

    def request(self, n: int) -> bytes:
        from sevendb.proto import sevendb_pb2 as pb

        op = pb.Op(kind=pb.Op.SET, key=f"raw/{n}", value=b"x" * 100)
        return pb.WriteManyRequest(id=n, writes=[pb.WriteRequest(ops=[op])]).SerializeToString()

    def answered(self, message: bytes) -> list[int]:
        from sevendb.proto import sevendb_pb2 as pb

        answers = pb.WriteStreamResponse.FromString(message).answers
        assert all(a.outcomes[0].HasField("ok") for a in answers), answers
        return [a.id for a in answers]


async def _stream_writes(address: str, codec: Codec, seconds: float, rate: float) -> list[float]:
    """ms from send to answer on one write stream: one write at a time (`rate` 0), or
    `rate` writes/s sent on schedule, whatever is in flight."""
    from grpc import aio

    async with aio.insecure_channel(address) as channel:
        call = channel.stream_stream(codec.method)(metadata=codec.metadata)
        sent: dict[int, float] = {}
        latencies: list[float] = []
        n = 0
        warm_until = time.monotonic() + 0.5
        end = warm_until + seconds
        if rate == 0:
            while (now := time.monotonic()) < end:
                started = time.perf_counter()
                await call.write(codec.request(n))
                codec.answered(await call.read())
                if now >= warm_until:
                    latencies.append(1000 * (time.perf_counter() - started))
                n += 1
        else:

            async def read() -> None:
                while (message := await call.read()) is not aio.EOF:
                    for answered in codec.answered(message):
                        started = sent.pop(answered, None)
                        if started is not None:
                            latencies.append(1000 * (time.perf_counter() - started))

            reader = asyncio.get_running_loop().create_task(read())
            start = time.monotonic()
            while (now := time.monotonic()) < end:
                due = start + n / rate
                if due > now:
                    await asyncio.sleep(due - now)
                if time.monotonic() >= warm_until:
                    sent[n] = time.perf_counter()
                await call.write(codec.request(n))
                n += 1
            await call.done_writing()
            await reader
        return latencies


def _both_loads(address: str, codec: Codec, pids: list[int], seconds: float) -> tuple[Row, Row]:
    """One write at a time, then 500 writes/s open loop, on one stream to `address`."""
    rows: list[Row] = []
    for rate in (0.0, float(OPEN_LOOP_RATE)):
        cpu0, own0 = sum(cpu_seconds(pid) for pid in pids), time.process_time()
        latencies = asyncio.run(_stream_writes(address, codec, seconds, rate))
        servers_s = sum(cpu_seconds(pid) for pid in pids) - cpu0
        n = len(latencies)
        rows.append(_row(latencies, 1e6 * servers_s / n, 1e6 * (time.process_time() - own0) / n))
    return rows[0], rows[1]


def composed(seconds: float, *, one_thread: bool = False) -> tuple[Row, Row]:
    """The parts joined (`composed_node.py`): a write stream into stock pysyncobj with
    an fdatasyncing journal, 3 processes. One write at a time, then 500 writes/s open
    loop, as `writes` loads etcd and sevendb."""
    root = Path(tempfile.mkdtemp(prefix="bench-floor-composed-"))
    cluster = ComposedCluster(root, one_thread=one_thread)
    try:
        cluster.start()
        return _both_loads(cluster.conf()["leader"], Codec(), cluster.pids(), seconds)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


# ---- the systems -----------------------------------------------------------------------


def writes(system: str, seconds: float) -> list[Row]:
    """side_by_side.py's writer on a fresh 3-node cluster of `system`: one write at a
    time, then 500 writes/s open loop. Per load: p50 / p99 ms from send to
    acknowledgement, the servers' and the writer's CPU µs per write. For sevendb, then
    the same two loads from this process on one WriteStream to the leader, without
    the SDK (`SevendbCodec`)."""
    root = Path(tempfile.mkdtemp(prefix=f"bench-floor-{system}-"))
    cluster = EtcdCluster(root) if system == "etcd" else SevendbCluster(root, buckets=1)
    try:
        cluster.start()
        writer = Worker(system, "writer", cluster.conf(), root / "writer.log")
        time.sleep(3)  # a fresh sevendb cluster hands leadership over in its first seconds
        writer.call({"op": "load", "prefix": "warm", "inflight": 1, "seconds": 1}, 60)
        rows: list[Row] = []
        for load in ({"inflight": 1}, {"rate": OPEN_LOOP_RATE}):
            cpu0 = sum(cpu_seconds(pid) for pid in cluster.pids())
            command = {"op": "load", "prefix": f"f{len(rows)}", "seconds": seconds, **load}
            answer = writer.call(command, seconds + 120)
            servers_s = sum(cpu_seconds(pid) for pid in cluster.pids()) - cpu0
            n = int(answer["writes"])
            rows.append(
                (
                    float(answer["p50_ms"]),
                    float(answer["p99_ms"]),
                    1e6 * servers_s / n,
                    1e6 * float(answer["cpu_s"]) / n,
                )
            )
        writer.close({"op": "quit"}, 30)
        if isinstance(cluster, SevendbCluster):
            rows += _both_loads(
                _leader(cluster), SevendbCodec(cluster.conf()["token"]), cluster.pids(), seconds
            )
        return rows
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _leader(cluster: SevendbCluster) -> str:
    from sevendb.cluster.ops.local import node_status

    for address in cluster.conf()["endpoints"]:
        status = node_status(address, None)
        if status is not None and any(r.is_leader for r in status.replicas):
            return str(address)
    raise RuntimeError("no node leads the bucket")


# ---- main ------------------------------------------------------------------------------

ROWS: tuple[str, ...] = (
    "gRPC unary round trip",
    "gRPC stream round trip",
    "Raft round, stock pysyncobj",
    "fdatasync, alone",
    "fdatasync, 3 at once",
    "floor: stream + Raft round + 3 fdatasyncs at once",
    "the parts joined, 1 write in flight",
    f"the parts joined, {OPEN_LOOP_RATE} writes/s open loop",
    "the parts joined in one thread, 1 write in flight",
    f"the parts joined in one thread, {OPEN_LOOP_RATE} writes/s open loop",
    "etcd, 1 write in flight",
    "sevendb, 1 write in flight",
    f"etcd, {OPEN_LOOP_RATE} writes/s open loop",
    f"sevendb, {OPEN_LOOP_RATE} writes/s open loop",
    "sevendb without the SDK, 1 write in flight",
    f"sevendb without the SDK, {OPEN_LOOP_RATE} writes/s open loop",
)


def one_run(seconds: float, directory: Path) -> dict[str, Row]:
    trips = grpc_round_trips(seconds)
    raw = run_raw(1, seconds, tuned=True)
    parts = [
        _row(*trips["unary"]),
        _row(*trips["stream"]),
        (raw["p50_ms"], raw["p99_ms"], raw["cpu_us_per_op"], NAN),
        _row(fdatasyncs(directory, 1, 1000)),
        _row(fdatasyncs(directory, 3, 1000)),
    ]
    stream, raft, synced = parts[1], parts[2], parts[4]
    floor = (stream[0] + raft[0] + synced[0], NAN, stream[2] + raft[2], stream[3])
    etcd = writes("etcd", seconds)
    seven = writes("sevendb", seconds)
    values = [
        *parts,
        floor,
        *composed(seconds),
        *composed(seconds, one_thread=True),
        etcd[0],
        seven[0],
        etcd[1],
        seven[1],
        seven[2],
        seven[3],
    ]
    return dict(zip(ROWS, values, strict=True))


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path.home(), help="where the fdatasyncs write")
    p.add_argument("--serve-echo", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_echo:
        asyncio.run(_echo_server(args.serve_echo))
        return 0
    ensure_binaries(["etcd"])
    ensure_etcd_stubs()
    print(f"# {machine()}; {args.seconds:g} s per measurement, {args.runs} run(s)", flush=True)
    runs = []
    for run in range(args.runs):
        rows = one_run(args.seconds, args.dir)
        runs.append(rows)
        print(f"\n## run {run + 1}, {time.strftime('%H:%M:%S UTC', time.gmtime())}")
        for name, (p50, p99, servers, client) in rows.items():
            print(
                f"{name:50s} p50 {p50:6.3f} ms  p99 {p99:6.3f} ms  "
                f"CPU µs: servers {servers:5.0f}, client {client:5.0f}",
                flush=True,
            )
    print(f"\n## medians over {args.runs} run(s) (range)")
    print("| part | p50 ms | p99 ms | servers' CPU µs per operation | client's |")
    print("|---|---|---|---|---|")
    for name in ROWS:
        cells = []
        for field in range(4):
            values = [r[name][field] for r in runs]
            if all(math.isnan(v) for v in values):
                cells.append("")
            elif field == 0:
                cells.append(f"{median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
            else:
                cells.append(f"{median(values):.2f}" if field == 1 else f"{median(values):.0f}")
        print(f"| {name} | {' | '.join(cells)} |")
    medians = {name: median(r[name][0] for r in runs) for name in ROWS}
    print()
    for i, load in ((0, "1 write in flight"), (1, f"{OPEN_LOOP_RATE} writes/s")):
        joined, one, bare = (medians[ROWS[k + i]] for k in (6, 8, 14))
        etcd, seven = medians[ROWS[10 + 2 * i]], medians[ROWS[11 + 2 * i]]
        print(
            f"{load}: against etcd, sevendb {seven / etcd:.2f}x, the parts joined "
            f"{joined / etcd:.2f}x (in one thread {one / etcd:.2f}x); sevendb above the parts "
            f"joined {seven - joined:.2f} ms, {bare - joined:.2f} ms of it without the SDK"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
