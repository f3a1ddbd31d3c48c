"""The SDK's streams on calls of their own (nodes without `Session`): how a call's
end, failure and cancellation reach the stream's reader. A real gRPC server in this
process plays the node's `Subscribe`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from grpc import aio

from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk.engine import Engine
from sevendb.sdk.sessions import Sessions, SessionStream


def _events(i: int) -> pb.StreamMessage:
    seq = pb.EmitSeq(epoch_id=pb.EmitSeq.EpochId(bucket_uuid="b", epoch_counter=1), commit_index=i)
    return pb.StreamMessage(events=pb.EventBatch(events=[pb.DataEvent(sub_id="s", emit_seq=seq)]))


def _index(message: pb.StreamMessage) -> int:
    return int(message.events.events[0].emit_seq.commit_index)


class _Node(pb_grpc.SevenDBServicer):  # type: ignore[misc]
    """`Subscribe` sends two messages, then ends as the request's `sub_id` says."""

    def __init__(self) -> None:
        self.cancelled: asyncio.Event | None = None

    async def Subscribe(
        self, request: pb.SubscribeRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.StreamMessage]:
        yield _events(1)
        yield _events(2)
        how = request.sub_id
        if how == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node stopping")
        elif how == "hang":
            self.cancelled = asyncio.Event()
            try:
                await asyncio.Event().wait()
            finally:  # the client cancelled the call
                self.cancelled.set()


@pytest.fixture
def node() -> Iterator[tuple[Engine, str, _Node]]:
    servicer = _Node()
    engine = Engine(["127.0.0.1:1"])  # the SDK's loop; the server runs on it too
    server, port = engine.submit(_serve(servicer)).result(10)
    try:
        yield engine, f"127.0.0.1:{port}", servicer
    finally:
        engine.submit(server.stop(None)).result(10)
        engine.close()


async def _serve(servicer: _Node) -> tuple[aio.Server, int]:
    server = aio.server()
    pb_grpc.add_SevenDBServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _per_call(engine: Engine, target: str, sub_id: str) -> tuple[Sessions, SessionStream]:
    async def open_() -> tuple[Sessions, SessionStream]:
        sessions = Sessions(engine, ())
        sessions._no_session(target)  # a node without Session: a call per stream
        return sessions, sessions.subscribe(target, pb.SubscribeRequest(sub_id=sub_id))

    return engine.submit(open_()).result(10)


def _read_all(engine: Engine, stream: SessionStream) -> tuple[list[int], Any]:
    """The commit indexes read, then the stream's end (EOF or the error raised)."""

    async def run() -> tuple[list[int], Any]:
        got: list[int] = []
        while True:
            try:
                message = await asyncio.wait_for(stream.read(), 10)
            except aio.AioRpcError as exc:
                return got, exc
            if message is aio.EOF:
                return got, message
            got.append(_index(message))

    return engine.submit(run()).result(20)


def test_a_call_that_ends_ends_the_stream(node: tuple[Engine, str, _Node]) -> None:
    engine, target, _ = node
    _, stream = _per_call(engine, target, "end")
    assert _read_all(engine, stream) == ([1, 2], aio.EOF)


def test_a_failed_call_fails_the_stream_with_the_call_s_status(
    node: tuple[Engine, str, _Node],
) -> None:
    engine, target, _ = node
    _, stream = _per_call(engine, target, "fail")
    got, end = _read_all(engine, stream)
    assert got == [1, 2]
    assert isinstance(end, aio.AioRpcError)
    assert (end.code(), end.details()) == (grpc.StatusCode.UNAVAILABLE, "node stopping")


def test_closing_the_stream_cancels_the_call_and_ends_its_reader(
    node: tuple[Engine, str, _Node],
) -> None:
    engine, target, servicer = node
    sessions, stream = _per_call(engine, target, "hang")

    async def first_two_then_close() -> tuple[list[int], Any, asyncio.Task[None]]:
        (feed,) = sessions._feeds
        got = [_index(await stream.read()) for _ in range(2)]
        stream.cancel()
        with pytest.raises(aio.AioRpcError) as end:
            await asyncio.wait_for(stream.read(), 10)
        await asyncio.wait_for(feed, 10)  # ends on its own, raising nothing
        assert servicer.cancelled is not None
        await asyncio.wait_for(servicer.cancelled.wait(), 10)  # the node saw it go
        return got, end.value, feed

    got, end, feed = engine.submit(first_two_then_close()).result(30)
    assert got == [1, 2]
    assert (end.code(), end.details()) == (grpc.StatusCode.CANCELLED, "closed")
    assert not feed.cancelled() and sessions._feeds == set()


def test_a_cancelled_reader_task_ends_the_stream_and_stays_cancelled(
    node: tuple[Engine, str, _Node],
) -> None:
    engine, target, _ = node
    sessions, stream = _per_call(engine, target, "hang")

    async def cancel_the_reader() -> tuple[list[int], Any, asyncio.Task[None]]:
        (feed,) = sessions._feeds
        got = [_index(await stream.read()) for _ in range(2)]
        feed.cancel()  # the client's loop shutting down, say
        with pytest.raises(asyncio.CancelledError):
            await feed
        with pytest.raises(aio.AioRpcError) as end:
            await asyncio.wait_for(stream.read(), 10)
        return got, end.value, feed

    got, end, feed = engine.submit(cancel_the_reader()).result(30)
    assert got == [1, 2]
    assert (end.code(), end.details()) == (grpc.StatusCode.CANCELLED, "closed")
    assert feed.cancelled()  # the task re-raised its own cancellation
