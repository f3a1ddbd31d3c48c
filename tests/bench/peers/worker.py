"""A client process of the side-by-side harness: one writer, or a set of subscriptions,
of one system (etcd over grpc.aio with stubs generated at run time, NATS JetStream over
nats-py, sevendb over its SDK: `AsyncClient` on the worker's loop, or `Client`; the
stack's parts joined, `composed_node.py`, over bare grpc.aio streams).

    python -m peers.worker --system etcd|nats|sevendb|floor --role writer|subscriber --conf JSON

It answers each JSON command line on stdin with one JSON line on stdout (the first
line, before any command, says it is ready). Writes carry their sequence number in
the first bytes of a 100-byte value; subscribers record (sequence, receive time) per
event and summarise them per range of sequences when asked.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import functools
import json
import os
import sys
import threading
import time
import traceback
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from peers.common import (
    SEVENDB_CLIENT_ENV,
    VALUE_BYTES,
    JsonDict,
    key_of,
    pct,
    rss_kb,
    seq_of,
    value_of,
)

Done = Callable[[bool], None]
OnEvent = Callable[[int, int, int], None]
"""(subscription index, write sequence, receive time ns)."""

NATS_STREAM = "BENCH"
SUBSCRIBE_ATTEMPTS = 3


def _say(answer: JsonDict) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


# ---- writers -------------------------------------------------------------------------------


class WriterClient(Protocol):
    async def open(self) -> JsonDict: ...

    def send(self, prefix: str, seq: int, cycle: int, done: Done) -> None:
        """Start one durable write; `done(ok)` once answered (from any thread)."""
        ...

    async def close(self) -> None: ...


def _task_done(done: Done) -> Callable[[asyncio.Task[Any]], None]:
    def finished(task: asyncio.Task[Any]) -> None:
        done(not task.cancelled() and task.exception() is None)

    return finished


class EtcdWriter:
    """Puts to the leader over one grpc.aio channel (as in the peer baseline notes)."""

    def __init__(self, conf: JsonDict) -> None:
        self.endpoints: list[str] = conf["endpoints"]
        self.channel: Any = None
        self.kv: Any = None

    async def open(self) -> JsonDict:
        from etcdbench import rpc_pb2_grpc
        from grpc import aio

        leader = await etcd_leader(self.endpoints)
        self.channel = aio.insecure_channel(leader)
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        return {"connected": leader}

    def send(self, prefix: str, seq: int, cycle: int, done: Done) -> None:
        from etcdbench import rpc_pb2

        request = rpc_pb2.PutRequest(key=key_of(prefix, seq, cycle).encode(), value=value_of(seq))
        task = asyncio.get_running_loop().create_task(self._put(request))
        task.add_done_callback(_task_done(done))

    async def _put(self, request: Any) -> None:
        await self.kv.Put(request, timeout=10)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


async def etcd_statuses(endpoints: list[str]) -> list[tuple[str, bool]]:
    """(endpoint, is_leader) for each member that answers."""
    from etcdbench import rpc_pb2, rpc_pb2_grpc
    from grpc import aio

    out = []
    for endpoint in endpoints:
        async with aio.insecure_channel(endpoint) as channel:
            status = await rpc_pb2_grpc.MaintenanceStub(channel).Status(
                rpc_pb2.StatusRequest(), timeout=5
            )
            out.append((endpoint, status.leader == status.header.member_id))
    return out


async def etcd_leader(endpoints: list[str]) -> str:
    for endpoint, leader in await etcd_statuses(endpoints):
        if leader:
            return endpoint
    raise RuntimeError("etcd has no leader")


def nats_subject(prefix: str, seq: int, cycle: int) -> str:
    return f"bench.{prefix}.{seq % cycle}" if cycle else f"bench.{prefix}.x"


async def nats_stream(conf: JsonDict) -> tuple[Any, Any, str]:
    """Connect, create the R3 file stream if missing; (connection, js, leader name)."""
    import nats
    from nats.js import api
    from nats.js.errors import NotFoundError

    servers: dict[str, str] = conf["servers"]
    nc = await nats.connect(servers=list(servers.values()), connect_timeout=5)
    js = nc.jetstream()
    try:
        info = await js.stream_info(NATS_STREAM)
    except NotFoundError:
        await js.add_stream(
            api.StreamConfig(
                name=NATS_STREAM,
                subjects=["bench.>"],
                num_replicas=3,
                storage=api.StorageType.FILE,
            )
        )
        info = None
    deadline = time.monotonic() + 30
    while info is None or info.cluster is None or not info.cluster.leader:
        if time.monotonic() > deadline:
            raise RuntimeError("the NATS stream got no leader within 30 s")
        await asyncio.sleep(0.1)
        info = await js.stream_info(NATS_STREAM)
    return nc, js, str(info.cluster.leader)


class NatsWriter:
    """`js.publish` to the R3 file stream, connected to the stream leader."""

    def __init__(self, conf: JsonDict) -> None:
        self.conf = conf
        self.nc: Any = None
        self.js: Any = None

    async def open(self) -> JsonDict:
        import nats

        admin, _, leader = await nats_stream(self.conf)
        await admin.close()
        self.nc = await nats.connect(servers=[self.conf["servers"][leader]], connect_timeout=5)
        self.js = self.nc.jetstream()
        return {"connected": leader}

    def send(self, prefix: str, seq: int, cycle: int, done: Done) -> None:
        coro = self.js.publish(nats_subject(prefix, seq, cycle), value_of(seq), stream=NATS_STREAM)
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(_task_done(done))

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()


def sevendb_threaded() -> bool:
    """Whether the sevendb workers use the SDK's `Client` (its loop in a thread of its
    own: every call and every event crosses threads) rather than `AsyncClient` on
    the worker's loop, as etcd's grpc.aio and nats-py run (side_by_side.py
    `--sevendb-client`)."""
    return os.environ.get(SEVENDB_CLIENT_ENV, "async") == "thread"


class SevendbWriter:
    """Writes through the SDK (it coalesces concurrent writes): `AsyncClient.write` on
    the worker's loop, or `Client.write_async` (`sevendb_threaded`)."""

    def __init__(self, conf: JsonDict) -> None:
        self.conf = conf
        self.client: Any = None
        self.threaded = sevendb_threaded()

    async def open(self) -> JsonDict:
        from sevendb.sdk import AsyncClient, Client

        endpoints, token = self.conf["endpoints"], self.conf["token"]
        if self.threaded:
            self.client = Client(endpoints, token=token, tls=None)
            layout = await asyncio.to_thread(self.client.layout)
        else:
            self.client = AsyncClient(endpoints, token=token, tls=None)
            layout = await self.client.layout()
        return {"buckets": layout.buckets}

    def send(self, prefix: str, seq: int, cycle: int, done: Done) -> None:
        from sevendb.sdk import set_op

        ops = [set_op(key_of(prefix, seq, cycle), value_of(seq))]
        if self.threaded:
            future = self.client.write_async(ops)
            future.add_done_callback(lambda f: done(f.exception() is None))
        else:
            task = asyncio.get_running_loop().create_task(self.client.write(ops))
            task.add_done_callback(_task_done(done))

    async def close(self) -> None:
        if self.client is None:
            return
        if self.threaded:
            await asyncio.to_thread(self.client.close)
        else:
            await self.client.close()


class FloorWriter:
    """Writes to the stack's parts joined (`composed_node.py`) on one gRPC stream to
    the leader: the writes waiting when the stream is free leave together, their
    values in one message (one Raft entry there, as the SDK's writes share a
    request and the node's batcher an entry), answered with the same bytes."""

    def __init__(self, conf: JsonDict) -> None:
        self.leader: str = conf["leader"]
        self.channel: Any = None
        self.call: Any = None
        self.outgoing: asyncio.Queue[bytes] = asyncio.Queue()
        self.waiting: dict[int, Done] = {}
        self.tasks: list[asyncio.Task[None]] = []

    async def open(self) -> JsonDict:
        from grpc import aio

        self.channel = aio.insecure_channel(self.leader)
        self.call = self.channel.stream_stream("/floor/Write")()
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._send()), loop.create_task(self._read())]
        return {"connected": self.leader}

    def send(self, prefix: str, seq: int, cycle: int, done: Done) -> None:
        self.waiting[seq] = done
        self.outgoing.put_nowait(value_of(seq))

    async def _send(self) -> None:  # one message at a time on a stream
        while True:
            values = [await self.outgoing.get()]
            while not self.outgoing.empty():
                values.append(self.outgoing.get_nowait())
            await self.call.write(b"".join(values))

    async def _read(self) -> None:
        from grpc import aio

        with contextlib.suppress(asyncio.CancelledError, aio.AioRpcError):
            while (answer := await self.call.read()) is not aio.EOF:
                # empty: the writes failed; they stay unanswered
                for at in range(0, len(answer), VALUE_BYTES):
                    done = self.waiting.pop(seq_of(answer[at : at + VALUE_BYTES]), None)
                    if done is not None:
                        done(True)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.channel is not None:
            await self.channel.close()


class Load:
    """One load run: closed loop (`inflight` writes always outstanding) or open loop
    (one write every 1/`rate` s, at most `cap` outstanding)."""

    def __init__(self, client: WriterClient, command: JsonDict) -> None:
        self.client = client
        self.prefix: str = command["prefix"]
        self.cycle: int = int(command.get("cycle", 0))
        self.seconds = float(command["seconds"])
        self.rate = float(command.get("rate", 0))
        self.inflight = int(command.get("inflight", 1))
        self.cap = int(command.get("cap", 2048))
        self.next_seq: int = int(command.get("seq0", 0))
        self.seq0 = self.next_seq
        self.trace = bool(command.get("trace", False))
        self.lock = threading.Lock()
        self.seqs = array("q")
        self.sent = array("q")
        self.acked = array("q")
        self.errors = 0
        self.outstanding = 0
        self.end = 0.0

    def issue(self) -> None:
        with self.lock:
            seq = self.next_seq
            self.next_seq += 1
            self.outstanding += 1
        sent = time.time_ns()
        try:
            self.client.send(self.prefix, seq, self.cycle, lambda ok: self.finished(seq, sent, ok))
        except Exception:
            self.finished(seq, sent, False)

    def finished(self, seq: int, sent: int, ok: bool) -> None:
        now = time.time_ns()
        again = False
        with self.lock:
            if ok:
                self.seqs.append(seq)
                self.sent.append(sent)
                self.acked.append(now)
            else:
                self.errors += 1
            if not self.rate and time.monotonic() < self.end:
                again = True
            self.outstanding -= 1
        if again:
            self.issue()

    async def run(self) -> JsonDict:
        cpu0 = time.process_time()
        t0 = time.monotonic()
        self.end = t0 + self.seconds
        if self.rate:
            i = 0
            while (now := time.monotonic()) < self.end:
                due = t0 + i / self.rate
                if due > now:
                    await asyncio.sleep(due - now)
                    continue
                if self.outstanding >= self.cap:
                    await asyncio.sleep(0.001)
                    continue
                self.issue()
                i += 1
        else:
            for _ in range(self.inflight):
                self.issue()
            await asyncio.sleep(self.seconds)
        deadline = time.monotonic() + 60
        while self.outstanding and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        elapsed = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        with self.lock:
            lat = sorted((a - s) / 1e6 for s, a in zip(self.sent, self.acked, strict=True))
            n = len(self.seqs)
            out: JsonDict = {
                "writes": n,
                "errors": self.errors,
                "unanswered": self.outstanding,
                "elapsed_s": elapsed,
                # acknowledged writes over first send .. last ack
                "writes_per_s": n / ((max(self.acked) - min(self.sent)) / 1e9) if n > 1 else 0.0,
                "p50_ms": pct(lat, 50),
                "p99_ms": pct(lat, 99),
                "seq0": self.seq0,
                "seq_end": self.next_seq,
                "first_send_ns": min(self.sent) if n else 0,
                "last_ack_ns": max(self.acked) if n else 0,
                "cpu_s": cpu,
            }
            if self.trace:
                out["trace"] = [
                    [q, s, a] for q, s, a in zip(self.seqs, self.sent, self.acked, strict=True)
                ]
        return out


async def serve_writer(client: WriterClient, commands: asyncio.Queue[JsonDict | None]) -> None:
    _say({"ready": True, **(await client.open())})
    while (command := await commands.get()) is not None:
        op = command.get("op")
        if op == "load":
            _say(await Load(client, command).run())
        elif op == "quit":
            break
        else:
            _say({"error": f"unknown op {op!r}"})
    await client.close()
    _say({"closed": True})


# ---- subscribers -------------------------------------------------------------------------


class SubscriberClient(Protocol):
    async def open(self, spec: JsonDict, on_event: OnEvent) -> JsonDict:
        """Make every subscription of `spec` and start receiving; returns when all are
        established (a write made afterwards is delivered)."""
        ...

    async def close(self, unsubscribe: bool) -> None: ...


SETUP_CONCURRENCY = 64
"""Subscriptions a subscriber process sets up at once, the same for every system (etcd
Watch creations, NATS consumer creations, sevendb `Client.subscribe` calls, each
blocking, on as many threads)."""


def subscriptions(spec: JsonDict) -> list[int | None]:
    """None per prefix subscription, or the key index of each key subscription."""
    if spec["kind"] == "prefix":
        return [None] * int(spec["count"])
    return list(range(int(spec["key0"]), int(spec["key1"])))


def _prefix_range_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


class _Watches:
    """Subscriptions as streams on one grpc.aio channel, each read by a task."""

    def __init__(self) -> None:
        self.channel: Any = None
        self.calls: list[Any] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def close(self, unsubscribe: bool) -> None:
        for call in self.calls:
            call.cancel()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.channel is not None:
            await self.channel.close()


class EtcdSubscriber(_Watches):
    """Watch streams over one grpc.aio channel; `per_stream` watchers share a stream
    (1: one Watch stream per subscription, as sevendb has one stream per subscription
    and bucket)."""

    def __init__(self, conf: JsonDict) -> None:
        super().__init__()
        self.conf = conf

    async def open(self, spec: JsonDict, on_event: OnEvent) -> JsonDict:
        from etcdbench import rpc_pb2, rpc_pb2_grpc
        from grpc import aio

        endpoints: list[str] = self.conf["endpoints"]
        place = spec.get("placement", "follower")
        if place == "follower":
            endpoint = next(e for e, leader in await etcd_statuses(endpoints) if not leader)
        else:
            endpoint = endpoints[int(place) % len(endpoints)]
        self.channel = aio.insecure_channel(endpoint)
        stub = rpc_pb2_grpc.WatchStub(self.channel)
        prefix: str = spec["prefix"]
        subs = subscriptions(spec)
        per_stream = max(1, int(spec.get("per_stream", 1)))

        def create(key_index: int | None) -> Any:
            if key_index is None:
                key = f"{prefix}/".encode()
                return rpc_pb2.WatchCreateRequest(key=key, range_end=_prefix_range_end(key))
            return rpc_pb2.WatchCreateRequest(key=f"{prefix}/{key_index}".encode())

        async def stream(first: int) -> None:
            call = stub.Watch()
            self.calls.append(call)
            owner: dict[int, int] = {}
            for i in range(first, min(first + per_stream, len(subs))):
                await call.write(rpc_pb2.WatchRequest(create_request=create(subs[i])))
                response = await call.read()
                if response is aio.EOF or not response.created:
                    raise RuntimeError(f"watch {i} not created: {response}")
                owner[response.watch_id] = i
            self.tasks.append(
                asyncio.get_running_loop().create_task(self._read(call, owner, on_event))
            )

        starts = list(range(0, len(subs), per_stream))
        gate = asyncio.Semaphore(SETUP_CONCURRENCY)

        async def gated(first: int) -> None:
            async with gate:
                await stream(first)

        await asyncio.gather(*(gated(s) for s in starts))
        return {"endpoint": endpoint, "streams": len(starts)}

    async def _read(self, call: Any, owner: dict[int, int], on_event: OnEvent) -> None:
        from grpc import aio

        with contextlib.suppress(asyncio.CancelledError, aio.AioRpcError):
            while (response := await call.read()) is not aio.EOF:
                now = time.time_ns()
                index = owner.get(response.watch_id)
                if index is None:
                    continue
                for event in response.events:
                    on_event(index, seq_of(event.kv.value), now)


class NatsSubscriber:
    """Push consumers with explicit acks (each message acked), delivering new messages
    only; durable (replicated like the stream) or ephemeral."""

    def __init__(self, conf: JsonDict) -> None:
        self.conf = conf
        self.nc: Any = None
        self.js: Any = None
        self.subs: list[Any] = []
        self.durables: list[str] = []

    async def open(self, spec: JsonDict, on_event: OnEvent) -> JsonDict:
        import nats
        from nats.js import api

        admin, _, leader = await nats_stream(self.conf)
        await admin.close()
        servers: dict[str, str] = self.conf["servers"]
        names = sorted(servers)
        place = spec.get("placement", "follower")
        if place == "follower":
            server = next(n for n in names if n != leader)
        else:
            server = names[int(place) % len(names)]
        self.nc = await nats.connect(servers=[servers[server]], connect_timeout=5)
        self.js = self.nc.jetstream()
        prefix: str = spec["prefix"]
        durable = bool(spec.get("durable", False))
        tag: str = spec.get("tag", "s")
        gate = asyncio.Semaphore(SETUP_CONCURRENCY)

        async def make(i: int, key_index: int | None) -> None:
            subject = f"bench.{prefix}.>" if key_index is None else f"bench.{prefix}.{key_index}"

            async def handle(msg: Any) -> None:
                on_event(i, seq_of(msg.data), time.time_ns())
                await msg.ack()

            config = api.ConsumerConfig(
                ack_policy=api.AckPolicy.EXPLICIT,
                max_ack_pending=20000,
                deliver_policy=api.DeliverPolicy.NEW,
                filter_subject=subject,
            )
            name = f"{tag}-{i}" if durable else None
            async with gate:
                sub = await self.js.subscribe(
                    subject,
                    cb=handle,
                    durable=name,
                    stream=NATS_STREAM,
                    manual_ack=True,
                    config=config,
                )
            self.subs.append(sub)
            if name:
                self.durables.append(name)

        await asyncio.gather(*(make(i, k) for i, k in enumerate(subscriptions(spec))))
        return {"server": server, "stream_leader": leader}

    async def close(self, unsubscribe: bool) -> None:
        if self.nc is None:
            return
        if unsubscribe:
            for sub in self.subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            for name in self.durables:
                with contextlib.suppress(Exception):
                    await self.js.delete_consumer(NATS_STREAM, name)
        with contextlib.suppress(Exception):
            await self.nc.close()


class FloorSubscriber(_Watches):
    """Watches of the stack's parts joined (`composed_node.py`): every write a replica
    applies; on the leader unless `placement` says otherwise (where sevendb emits,
    and one hop sooner than a follower). Prefix specs only (a watch has no filter:
    the workloads write one prefix at a time)."""

    def __init__(self, conf: JsonDict) -> None:
        super().__init__()
        self.conf = conf

    async def open(self, spec: JsonDict, on_event: OnEvent) -> JsonDict:
        from grpc import aio

        if spec["kind"] != "prefix":
            raise ValueError("the floor's watches take prefix specs only")
        endpoints: list[str] = self.conf["endpoints"]
        place = spec.get("placement", "leader")
        if place == "leader":
            endpoint = self.conf["leader"]
        elif place == "follower":
            endpoint = next(e for e in endpoints if e != self.conf["leader"])
        else:
            endpoint = endpoints[int(place) % len(endpoints)]
        self.channel = aio.insecure_channel(endpoint)
        watch = self.channel.unary_stream("/floor/Watch")
        loop = asyncio.get_running_loop()
        for i in range(int(spec["count"])):
            call = watch(b"")
            if await call.read() != b"":  # the watch is in place
                raise RuntimeError(f"watch {i} not created")
            self.calls.append(call)
            self.tasks.append(loop.create_task(self._read(i, call, on_event)))
        return {"endpoint": endpoint}

    @staticmethod
    async def _read(index: int, call: Any, on_event: OnEvent) -> None:
        from grpc import aio

        with contextlib.suppress(asyncio.CancelledError, aio.AioRpcError):
            while (values := await call.read()) is not aio.EOF:
                now = time.time_ns()
                for at in range(0, len(values), VALUE_BYTES):  # one entry's writes
                    on_event(index, seq_of(values[at : at + VALUE_BYTES]), now)


class SevendbSubscriber:
    """SDK subscriptions of one `AsyncClient` on the worker's loop, or of one `Client`
    (`sevendb_threaded`: its streams on the SDK's loop thread), each handing its
    events to a function (`on_event`, as a NATS subscription's callback; processed
    events are acknowledged by the SDK)."""

    def __init__(self, conf: JsonDict) -> None:
        self.conf = conf
        self.client: Any = None
        self.subs: list[Any] = []
        self.retries = 0
        self.threaded = sevendb_threaded()

    async def open(self, spec: JsonDict, on_event: OnEvent) -> JsonDict:
        from sevendb.sdk import AsyncClient, Client

        endpoints, token = self.conf["endpoints"], self.conf["token"]
        prefix: str = spec["prefix"]
        tag: str = spec.get("tag", "s")
        queries = [
            f"prefix:{prefix}/" if k is None else f"key:{prefix}/{k}" for k in subscriptions(spec)
        ]
        loop = asyncio.get_running_loop()
        # A subscribe returns once its streams are up: make many at once.
        concurrency = int(spec.get("setup_threads", SETUP_CONCURRENCY))
        handlers = [functools.partial(_handle, i, on_event) for i in range(len(queries))]
        if self.threaded:
            self.client = Client(endpoints, token=token, tls=None)
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                self.subs = list(
                    await asyncio.gather(
                        *(
                            loop.run_in_executor(
                                pool, self._subscribe, q, f"{tag}-{i}", handlers[i]
                            )
                            for i, q in enumerate(queries)
                        )
                    )
                )
            layout = self.client.layout()
        else:
            self.client = AsyncClient(endpoints, token=token, tls=None)
            gate = asyncio.Semaphore(concurrency)

            async def make(query: str, name: str, handler: Callable[[Any], None]) -> Any:
                async with gate:
                    return await self._asubscribe(query, name, handler)

            self.subs = list(
                await asyncio.gather(
                    *(make(q, f"{tag}-{i}", handlers[i]) for i, q in enumerate(queries))
                )
            )
            layout = await self.client.layout()
        return {"buckets": layout.buckets, "retries": self.retries}

    async def _asubscribe(self, query: str, name: str, handler: Callable[[Any], None]) -> Any:
        """`AsyncClient.subscribe`, retried as `_subscribe` is."""
        from sevendb.sdk import SubscriptionBroken

        for attempt in range(SUBSCRIBE_ATTEMPTS):
            try:
                return await self.client.subscribe(query, name=name, on_event=handler)
            except SubscriptionBroken:
                if attempt + 1 == SUBSCRIBE_ATTEMPTS:
                    raise
                self.retries += 1
        raise AssertionError("unreachable")

    def _subscribe(self, query: str, name: str, handler: Callable[[Any], None]) -> Any:
        """`Client.subscribe`, retried (and counted) when a stream is not up within the
        SDK's 30 s: seen with thousands of subscriptions on a starved host."""
        from sevendb.sdk import SubscriptionBroken

        for attempt in range(SUBSCRIBE_ATTEMPTS):
            try:
                return self.client.subscribe(query, name=name, on_event=handler)
            except SubscriptionBroken:
                if attempt + 1 == SUBSCRIBE_ATTEMPTS:
                    raise
                self.retries += 1
        raise AssertionError("unreachable")

    async def close(self, unsubscribe: bool) -> None:
        if self.client is None:
            return
        if not self.threaded:

            async def end(sub: Any) -> None:
                with contextlib.suppress(Exception):
                    await (sub.aunsubscribe() if unsubscribe else sub.aclose())

            await asyncio.gather(*(end(s) for s in self.subs))
            await self.client.close()
            return

        def finish(sub: Any) -> None:
            with contextlib.suppress(Exception):
                sub.unsubscribe() if unsubscribe else sub.close()

        with ThreadPoolExecutor(max_workers=16) as pool:
            await asyncio.gather(
                *(asyncio.get_running_loop().run_in_executor(pool, finish, s) for s in self.subs)
            )
        await asyncio.to_thread(self.client.close)


def _handle(index: int, on_event: OnEvent, event: Any) -> None:
    """A sevendb subscription's `on_event`: each change's sequence, at its arrival."""
    now = time.time_ns()
    for change in event.changes:
        on_event(index, seq_of(change.value), now)


class Received:
    """Per subscription: sequences and receive times of its events."""

    def __init__(self, subs: int) -> None:
        self.seqs = [array("q") for _ in range(subs)]
        self.times = [array("q") for _ in range(subs)]
        self.marks = [0] * subs
        """Where the previous `report(since_last=True)` stopped, per subscription."""
        self.total = 0

    def on_event(self, index: int, seq: int, now: int) -> None:
        self.seqs[index].append(seq)
        self.times[index].append(now)
        self.total += 1

    def report(self, ranges: list[list[int]], trace: bool, since_last: bool) -> JsonDict:
        """Per range of sequences [a, b): events received (raw and distinct per
        subscription), the fewest any subscription got, first and last receive time.
        `since_last` looks only at events received after the previous such report."""
        starts = [a for a, _ in ranges]
        n = len(ranges)
        raw = [0] * n
        distinct = [0] * n
        min_sub = [-1] * n
        first = [0] * n
        last = [0] * n
        for i, (seqs, times) in enumerate(zip(self.seqs, self.times, strict=True)):
            seen: list[set[int]] = [set() for _ in range(n)]
            begin, end = (self.marks[i], len(seqs)) if since_last else (0, len(seqs))
            if since_last:
                self.marks[i] = end
            for seq, t in zip(seqs[begin:end], times[begin:end], strict=True):
                r = bisect.bisect_right(starts, seq) - 1
                if r < 0 or seq >= ranges[r][1]:
                    continue
                raw[r] += 1
                seen[r].add(seq)
                first[r] = t if not first[r] else min(first[r], t)
                last[r] = max(last[r], t)
            for r in range(n):
                distinct[r] += len(seen[r])
                min_sub[r] = len(seen[r]) if min_sub[r] < 0 else min(min_sub[r], len(seen[r]))
        out: JsonDict = {
            "ranges": [
                {
                    "received": raw[r],
                    "distinct": distinct[r],
                    "min_per_sub": max(0, min_sub[r]),
                    "first_ns": first[r],
                    "last_ns": last[r],
                }
                for r in range(n)
            ]
        }
        if trace and self.seqs:
            out["trace"] = [[s, t] for s, t in zip(self.seqs[0], self.times[0], strict=True)]
        return out


async def serve_subscriber(
    client: SubscriberClient, spec: JsonDict, commands: asyncio.Queue[JsonDict | None]
) -> None:
    received = Received(len(subscriptions(spec)))
    rss0 = rss_kb_self()
    t0 = time.monotonic()
    info = await client.open(spec, received.on_event)
    _say(
        {
            "ready": True,
            "subs": len(received.seqs),
            "setup_s": time.monotonic() - t0,
            "rss_kb_before": rss0,
            "rss_kb_after": rss_kb_self(),
            **info,
        }
    )
    unsubscribe = True
    while (command := await commands.get()) is not None:
        op = command.get("op")
        if op == "count":
            _say({"received": received.total, "cpu_s": time.process_time()})
        elif op == "report":
            _say(
                received.report(
                    command["ranges"],
                    bool(command.get("trace", False)),
                    bool(command.get("since_last", False)),
                )
            )
        elif op == "quit":
            unsubscribe = bool(command.get("unsubscribe", True))
            if command.get("abandon"):
                _say({"closed": True, "abandoned": True})
                os._exit(0)  # leave the subscriptions to the cluster's teardown
            break
        else:
            _say({"error": f"unknown op {op!r}"})
    await client.close(unsubscribe)
    _say({"closed": True})


def rss_kb_self() -> int:
    return rss_kb(os.getpid())


# ---- main ----------------------------------------------------------------------------------


def make_writer(system: str, conf: JsonDict) -> WriterClient:
    classes: dict[str, Callable[[JsonDict], WriterClient]] = {
        "etcd": EtcdWriter,
        "nats": NatsWriter,
        "sevendb": SevendbWriter,
        "floor": FloorWriter,
    }
    return classes[system](conf)


def make_subscriber(system: str, conf: JsonDict) -> SubscriberClient:
    classes: dict[str, Callable[[JsonDict], SubscriberClient]] = {
        "etcd": EtcdSubscriber,
        "nats": NatsSubscriber,
        "sevendb": SevendbSubscriber,
        "floor": FloorSubscriber,
    }
    return classes[system](conf)


async def amain(args: argparse.Namespace) -> None:
    conf: JsonDict = json.loads(args.conf)
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[JsonDict | None] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(commands.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_stdin, daemon=True).start()
    if args.role == "writer":
        await serve_writer(make_writer(args.system, conf), commands)
    else:
        await serve_subscriber(make_subscriber(args.system, conf), conf["spec"], commands)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["etcd", "nats", "sevendb", "floor"], required=True)
    p.add_argument("--role", choices=["writer", "subscriber"], required=True)
    p.add_argument("--conf", required=True)
    args = p.parse_args()
    try:
        asyncio.run(amain(args))
    except Exception as exc:
        traceback.print_exc()
        _say({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
