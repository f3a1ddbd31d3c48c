"""The SDK's side of one bucket stream: a session stream's messages reach a handler
in order once pushing starts, its end reaches `read()`, and the events a message
released before a gap still reach the application. Also the session's requests
sharing messages, and a subscribe's wait for its streams."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from grpc import aio

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import OpKind
from sevendb.outbox.model import Change
from sevendb.outbox.query import Query, QueryKind
from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk.cursor import StreamCursor
from sevendb.sdk.errors import BrokenReason, SubscriptionBroken
from sevendb.sdk.flusher import FLUSH_TICK_S, flush_clock, slot_of
from sevendb.sdk.sessions import Sessions, SessionStream
from sevendb.sdk.streams import BucketStream, BucketStreams
from sevendb.sdk.subscription import Event, SubscribeOptions, offer_events


def _seq(i: int) -> pb.EmitSeq:
    return pb.EmitSeq(epoch_id=pb.EmitSeq.EpochId(bucket_uuid="b", epoch_counter=1), commit_index=i)


def _event(i: int, prev: int) -> pb.DataEvent:
    change = pb.Change(key=f"k{i}", value=b"v", version=1)
    return pb.DataEvent(
        sub_id="s", emit_seq=_seq(i), prev_emit_seq=_seq(prev), delta=pb.Delta(changes=[change])
    )


def _message(i: int) -> pb.StreamMessage:
    return pb.StreamMessage(events=pb.EventBatch(events=[_event(i, i - 1)]))


def _indexes(messages: list[Any]) -> list[int]:
    return [m.events.events[0].emit_seq.commit_index for m in messages]


def test_the_events_released_before_a_gap_are_handed_over() -> None:
    cursor: StreamCursor[Event] = StreamCursor(EmitSeq("b", 1, 1))
    # 2 and 3 chain on; 9 claims a predecessor from before what was released.
    ready, duplicates, gap = offer_events(cursor, 0, [_event(2, 1), _event(3, 2), _event(9, 0)])
    assert gap
    assert [e.emit_seq.commit_index for e in ready] == [2, 3]
    assert cursor.released == EmitSeq("b", 1, 3)  # so a resent 2 or 3 is a duplicate
    again, duplicates, gap = offer_events(cursor, 0, [_event(3, 2), _event(4, 3)])
    assert (duplicates, gap) == (1, False)
    assert [e.emit_seq.commit_index for e in again] == [4]


@pytest.mark.parametrize("count", [1, 3])
def test_an_events_changes_decode_to_named_tuples_and_an_unknown_op_is_refused(
    count: int,
) -> None:
    ev = _event(2, 1)
    for i in range(1, count):
        ev.delta.changes.append(pb.Change(key=f"d{i}", op=pb.Change.DEL, version=i))
    ready, _, _ = offer_events(StreamCursor(EmitSeq("b", 1, 1)), 0, [ev])
    (event,) = ready
    deleted = (Change(f"d{i}", OpKind.DEL, b"", i) for i in range(1, count))
    assert event.changes == (Change("k2", OpKind.SET, b"v", 1), *deleted)
    assert all(type(c) is Change and type(c.op) is OpKind for c in event.changes)
    ev.delta.changes[count - 1].op = 7  # type: ignore[assignment]  # from a newer server
    with pytest.raises(ValueError, match="7 is not a valid OpKind"):
        offer_events(StreamCursor(EmitSeq("b", 1, 1)), 0, [ev])


def test_pushing_takes_queued_messages_first_then_each_as_it_arrives() -> None:
    async def main() -> tuple[list[Any], Any]:
        stream = SessionStream(1, lambda _: None)
        stream._put(_message(1))
        stream._put(_message(2))
        pushed: list[Any] = []

        def keep(message: Any) -> bool:
            pushed.append(message)
            return True

        stream.push_to(keep)
        assert _indexes(pushed) == [1, 2]
        stream._put(_message(3))
        stream._put(aio.EOF)  # the node ended the stream
        return pushed, await asyncio.wait_for(stream.read(), 5)

    pushed, end = asyncio.run(main())
    assert _indexes(pushed) == [1, 2, 3]
    assert end is aio.EOF


def test_a_handler_that_stops_ends_reads_and_pushes_nothing_more() -> None:
    async def main() -> tuple[list[Any], Any, list[Any]]:
        stream = SessionStream(1, lambda _: None)
        pushed: list[Any] = []

        def two(message: Any) -> bool:
            pushed.append(message)
            return len(pushed) < 2

        stream.push_to(two)
        reading = asyncio.ensure_future(stream.read())
        await asyncio.sleep(0)  # the reader waits
        for i in (1, 2, 3):
            stream._put(_message(i))
        end = await asyncio.wait_for(reading, 5)
        return pushed, end, list(stream._items)

    pushed, end, left = asyncio.run(main())
    assert _indexes(pushed) == [1, 2]
    assert end is aio.EOF
    assert _indexes(left) == [3]  # queued, never handled


def test_a_failing_handler_fails_the_read_not_the_session_reader() -> None:
    async def main() -> None:
        stream = SessionStream(1, lambda _: None)

        def broken(_: Any) -> bool:
            raise ValueError("handler bug")

        stream.push_to(broken)
        stream._put(_message(1))  # what the session's reader calls: it must not raise
        with pytest.raises(ValueError, match="handler bug"):
            await asyncio.wait_for(stream.read(), 5)

    asyncio.run(main())


def test_cancelling_a_read_closes_the_stream_on_the_node() -> None:
    closed: list[int] = []

    async def main() -> None:
        stream = SessionStream(7, closed.append)
        reading = asyncio.ensure_future(stream.read())
        await asyncio.sleep(0)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading

    asyncio.run(main())
    assert closed == [7]


class _Call:
    """A stand-in Session call: records each message written; a write returns only
    once the test lets it (`release`); reads wait until the test ends."""

    def __init__(self) -> None:
        self.written: list[pb.SessionRequests] = []
        self.release = asyncio.Event()

    async def write(self, message: pb.SessionRequests) -> None:
        self.written.append(message)
        await self.release.wait()
        self.release.clear()

    async def read(self) -> Any:
        await asyncio.Event().wait()


class _Engine:
    def __init__(self, call: _Call) -> None:
        self.loop = asyncio.get_running_loop()
        self._call = call

    def stub(self, target: str) -> Any:
        call = self._call

        class _Stub:
            def Session(self, metadata: Any) -> _Call:
                return call

        return _Stub()


def test_requests_queued_while_the_session_cannot_write_share_one_message() -> None:
    """Streams opened in one loop turn go in one message, and so does whatever is
    queued while a write is under way: many subscriptions made at once cost one
    gRPC message each way instead of one per subscription."""

    async def run() -> list[list[tuple[int, str]]]:
        call = _Call()
        sessions = Sessions(_Engine(call), ())  # type: ignore[arg-type]
        request = pb.SubscribeRequest(bucket=0, query=pb.Query(kind=pb.Query.ALL))
        streams = [sessions.subscribe("n1", request) for _ in range(5)]
        while not call.written:
            await asyncio.sleep(0)
        more = [sessions.reconnect("n1", pb.ReconnectRequest(sub_id="s")) for _ in range(2)]
        streams[0].cancel()
        call.release.set()
        while len(call.written) < 2:
            await asyncio.sleep(0)
        for stream in streams[1:] + more:
            stream.cancel()
        call.release.set()
        while len(call.written) < 3:
            await asyncio.sleep(0)
        return [[(r.stream_id, r.WhichOneof("op")) for r in m.requests] for m in call.written]

    first, second, third = asyncio.run(run())
    assert first == [(i, "subscribe") for i in range(1, 6)]
    assert second == [(6, "reconnect"), (7, "reconnect"), (1, "close")]
    assert third == [(i, "close") for i in (2, 3, 4, 5, 6, 7)]


def _streams(*buckets: int) -> BucketStreams:
    """A subscription's streams with nothing behind them: only readiness and failure
    are set by hand."""
    streams = {b: BucketStream(b, None, False) for b in buckets}
    put: list[Any] = []
    unused: Any = None  # the engine, sessions and flusher: no stream runs
    return BucketStreams(
        unused, unused, unused, Query(QueryKind.ALL), SubscribeOptions(), streams, put.append
    )


def test_waiting_for_the_streams_ends_when_all_are_up_or_the_subscription_fails() -> None:
    async def up() -> None:
        bs = _streams(0, 1)
        loop = asyncio.get_running_loop()
        loop.call_soon(bs._ready, bs.streams[0])
        loop.call_soon(bs._ready, bs.streams[1])
        await bs.wait_ready(30)
        assert all(s.ready for s in bs.streams.values())

    async def failed() -> None:
        bs = _streams(0, 1)
        asyncio.get_running_loop().call_soon(bs._ready, bs.streams[0])
        error = SubscriptionBroken("refused", BrokenReason.PERMISSION_DENIED)
        asyncio.get_running_loop().call_soon(bs._broken, error)
        with pytest.raises(SubscriptionBroken) as raised:
            await bs.wait_ready(30)
        assert raised.value is error

    async def late() -> None:
        bs = _streams(0, 1)
        asyncio.get_running_loop().call_soon(bs._ready, bs.streams[0])
        bs.streams[1].history.append("refused by n2")
        with pytest.raises(SubscriptionBroken, match=r"bucket 1: no stream within 0.05 s") as e:
            await bs.wait_ready(0.05)
        assert e.value.reason is BrokenReason.UNAVAILABLE and "refused by n2" in str(e.value)

    for case in (up, failed, late):
        asyncio.run(case())


def test_flushes_due_in_one_slot_share_one_loop_timer() -> None:
    """A loop's time-based flushes run on one `FlushClock`: those due in one slot are
    one loop timer (a timer per subscription filled the loop's heap), called in the
    order they were taken."""
    timers: list[float] = []

    class CountingLoop(asyncio.SelectorEventLoop):
        def call_at(self, when: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:  # type: ignore[override]
            if getattr(args[0], "__name__", "") == "_fire":  # the clock's (not sleep's)
                timers.append(when)
            return super().call_at(when, *args, **kwargs)

    loop = CountingLoop()
    fired: list[tuple[str, int]] = []

    class Taker:
        def __init__(self, name: str) -> None:
            self.name = name

        def _fire(self, slot: int) -> None:
            fired.append((self.name, slot))

    async def run() -> None:
        clock = flush_clock(loop)
        assert flush_clock(loop) is clock
        now = loop.time()
        first, later = slot_of(now + 0.01), slot_of(now + 0.01 + 3 * FLUSH_TICK_S)
        for name in ("a", "b", "c"):
            clock.at(first, Taker(name))  # type: ignore[arg-type]
        clock.at(later, Taker("d"))  # type: ignore[arg-type]
        await asyncio.sleep(later * FLUSH_TICK_S - now + 0.01)

    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
    assert len(timers) == 2
    assert [name for name, _ in fired] == ["a", "b", "c", "d"]
    assert fired[0][1] == fired[2][1] < fired[3][1]
