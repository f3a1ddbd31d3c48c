"""One process of the composed floor (`bench_floor.py`): the least a durable write
through this stack takes when its parts are joined, with nothing of sevendb's in it.

Stock pysyncobj (sevendb's send settings), one counter group over 3 processes, with
a journal that appends each entry to a preallocated file and fdatasyncs it, as
sevendb's does, once per batch: a follower before it answers, the leader right
after it has sent the entries to the followers (so that its fsync runs beside
theirs). In front, a grpc.aio write stream served from the process's main thread:
each request (the bytes of one or more writes, which name them: a client sends
together the writes waiting, as sevendb's SDK does) is one entry, submitted to
pysyncobj as it arrives (pysyncobj's tick thread appends, sends and commits it), and
answered with the same bytes once applied. That is the same hand-off sevendb has
between its gRPC loop's thread and its Raft thread, and nothing more: no parsing,
batching across requests, state machine, outbox, encryption or flow control. With
`--one-thread`, pysyncobj is ticked on the gRPC loop's thread instead
(`LoopPoller`): no hand-off between threads at all.

Each replica also serves a watch: every entry it applies, pushed to each watcher as
it applies it (the least a subscription is).

Prints one JSON line, ``{"port": P, "leader": true|false}``, once the group has a
leader, then serves until it is killed. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import struct
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pysyncobj.syncobj
from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.journal import MemoryJournal
from pysyncobj.transport import TCPTransport
from raw_pysyncobj_node import Counter

JOURNAL_BYTES = 64 << 20
"""Preallocated; the offset wraps around (only the fsync's cost matters here)."""


class SyncedJournal(MemoryJournal):  # type: ignore[misc]
    """pysyncobj's in-memory log, each entry also written to a preallocated file, and
    fdatasynced by `sync` once per batch: on a follower before it answers the message
    that brought the entries, on the leader right after it sent them."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(self._fd, 0, JOURNAL_BYTES)
        os.fsync(self._fd)
        self._offset = 0
        self._dirty = False

    def add(self, command: bytes, idx: int, term: int) -> None:
        super().add(command, idx, term)
        record = struct.pack("<QQI", idx, term, len(command)) + command
        if self._offset + len(record) > JOURNAL_BYTES:
            self._offset = 0
        os.pwrite(self._fd, record, self._offset)
        self._offset += len(record)
        self._dirty = True

    def sync(self) -> None:
        if self._dirty:
            self._dirty = False
            os.fdatasync(self._fd)


def _patch(journal: SyncedJournal) -> None:
    pysyncobj.syncobj.createJournal = lambda _path: journal
    send_entries = SyncObj._SyncObj__sendAppendEntries
    send = TCPTransport.send

    def send_entries_then_sync(self: SyncObj) -> None:
        send_entries(self)
        journal.sync()  # the leader's own fsync, once the followers have the entries

    def sync_then_answer(self: TCPTransport, node: object, message: dict[str, object]) -> object:
        if message.get("type") == "next_node_idx":  # a follower's answer to AppendEntries
            journal.sync()
        return send(self, node, message)

    SyncObj._SyncObj__sendAppendEntries = send_entries_then_sync
    TCPTransport.send = sync_then_answer


class LoopPoller:
    """pysyncobj's poller on the asyncio loop (`--one-thread`): its sockets' and
    pipe's events call it back from the loop, and each pass of events is followed
    by one tick (`tick_soon`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._callbacks: dict[int, Callable[[int, int], None]] = {}
        self._ticking = False
        self.syncobj: SyncObj | None = None

    def subscribe(self, fd: int, callback: Callable[[int, int], None], mask: int) -> None:
        self.unsubscribe(fd)
        self._callbacks[fd] = callback
        if mask & 5:  # read, error
            self._loop.add_reader(fd, self._fire, fd, 1)
        if mask & 2:
            self._loop.add_writer(fd, self._fire, fd, 2)

    def unsubscribe(self, fd: int) -> None:
        if self._callbacks.pop(fd, None) is not None:
            self._loop.remove_reader(fd)
            self._loop.remove_writer(fd)

    def poll(self, timeout: float) -> None:
        """The end of a tick: the loop polls."""

    def _fire(self, fd: int, kind: int) -> None:
        callback = self._callbacks.get(fd)
        if callback is not None:
            callback(fd, kind)
            self.tick_soon()

    def tick_soon(self) -> None:
        if not self._ticking:
            self._ticking = True
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._ticking = False
        if self.syncobj is not None:
            self.syncobj._onTick(0.0)

    async def tick_forever(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.tick_soon()


async def start_server(port: int, methods: dict[str, Any]) -> Any:
    """A started grpc.aio server of the service "floor" on 127.0.0.1:`port`
    (plaintext), with `methods` (name -> grpc method handler)."""
    import grpc
    from grpc import aio

    server = aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor", methods),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def serve(make_counter: Callable[[], Counter], port: int, one_thread: bool) -> None:
    import grpc

    loop = asyncio.get_running_loop()
    poller = LoopPoller(loop)
    if one_thread:
        pysyncobj.syncobj.createPoller = lambda _kind: poller
    counter = make_counter()
    if one_thread:
        poller.syncobj = counter
        ticks = loop.create_task(poller.tick_forever(counter.conf.autoTickPeriod))

    watchers: set[asyncio.Queue[bytes]] = set()

    def fan_out(payload: bytes) -> None:
        for queue in watchers:
            queue.put_nowait(payload)

    def applied(payload: bytes) -> None:  # by a tick, on every replica
        if watchers:
            if one_thread:
                fan_out(payload)
            else:
                loop.call_soon_threadsafe(fan_out, payload)

    counter.applied = applied

    async def watch(_request: bytes, _context: object) -> AsyncIterator[bytes]:
        """Every entry this replica applies from now on, one message each, after an
        empty first message (the watch is in place)."""
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        watchers.add(queue)
        try:
            yield b""
            while True:
                yield await queue.get()
        finally:
            watchers.discard(queue)

    async def stream(requests: AsyncIterator[bytes], _context: object) -> AsyncIterator[bytes]:
        answers: asyncio.Queue[asyncio.Future[bytes] | None] = asyncio.Queue()

        async def submit() -> None:
            async for request in requests:
                answer: asyncio.Future[bytes] = loop.create_future()

                def committed(
                    _value: int,
                    error: int,
                    answer: asyncio.Future[bytes] = answer,
                    request: bytes = request,
                ) -> None:
                    result = request if error == 0 else b""  # the write, or an empty failure
                    if one_thread:  # called in this thread, by a tick
                        answer.set_result(result)
                    else:
                        loop.call_soon_threadsafe(answer.set_result, result)

                counter.incr(request, callback=committed)
                if one_thread:
                    poller.tick_soon()
                answers.put_nowait(answer)
            answers.put_nowait(None)

        reader = loop.create_task(submit())
        while (answer := await answers.get()) is not None:
            yield await answer
        await reader

    server = await start_server(
        port,
        {
            "Write": grpc.stream_stream_rpc_method_handler(stream),
            "Watch": grpc.unary_stream_rpc_method_handler(watch),
        },
    )
    while counter._getLeader() is None or not counter.isReady():
        await asyncio.sleep(0.05)
    print(json.dumps({"port": port, "leader": counter._isLeader()}), flush=True)
    await server.wait_for_termination()  # until killed
    if one_thread:
        ticks.cancel()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--me", required=True)
    p.add_argument("--partners", required=True, help="the other two addresses, comma-separated")
    p.add_argument("--port", type=int, required=True, help="the gRPC port")
    p.add_argument("--journal", type=Path, required=True, help="the journal file")
    p.add_argument("--conf", default="{}", help="SyncObjConf settings as a JSON object")
    p.add_argument(
        "--one-thread",
        action="store_true",
        help="tick pysyncobj on the gRPC loop's thread instead of a thread of its own",
    )
    args = p.parse_args()
    journal = SyncedJournal(args.journal)
    _patch(journal)
    conf = SyncObjConf(**json.loads(args.conf), autoTick=not args.one_thread)
    make_counter = functools.partial(Counter, args.me, args.partners.split(","), conf)
    asyncio.run(serve(make_counter, args.port, args.one_thread))
    return 0


if __name__ == "__main__":
    sys.exit(main())
