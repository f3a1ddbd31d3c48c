"""cluster/server/sinks.py's `StreamSink`: rows a notifier thread delivers reach a stream's
handler on the loop, in order, queued for `get` or pushed where they land (a Session's
streams), and a close ends the stream either way."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from sevendb.cluster.server.sinks import StreamSink
from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import OpKind
from sevendb.outbox.model import Change, Delta, OutboxRow


def _row(i: int) -> OutboxRow:
    delta = Delta((Change(f"k{i}", OpKind.SET, b"v", 1),), 0)
    return OutboxRow("s", EmitSeq("b", 1, i), EmitSeq("b", 1, i - 1), delta)


def _from_thread(fn: Callable[[Any], None], *items: object) -> None:
    """Call the sink as the notifier does: from another thread."""

    def run() -> None:
        for item in items:
            fn(item)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def test_rows_queued_before_pushing_starts_are_pushed_first_then_each_delivery() -> None:
    async def main() -> tuple[list[int], str]:
        sink = StreamSink(asyncio.get_running_loop())
        _from_thread(sink.deliver, (_row(1), _row(2)), (_row(3),))
        await asyncio.sleep(0)  # let the mailbox land them in the queue
        pushed: list[int] = []

        def push(rows: Sequence[OutboxRow]) -> None:
            pushed.extend(row.emit_seq.commit_index for row in rows)

        ended = sink.push_to(push)
        assert pushed == [1, 2, 3]
        _from_thread(sink.deliver, (_row(4),), (_row(5),))
        _from_thread(sink.close, "the lease moved")
        reason = await asyncio.wait_for(ended, 5)
        return pushed, reason

    pushed, reason = asyncio.run(main())
    assert pushed == [1, 2, 3, 4, 5]
    assert reason == "the lease moved"


def test_a_close_queued_before_pushing_starts_ends_the_stream_at_once() -> None:
    async def main() -> tuple[list[int], str]:
        sink = StreamSink(asyncio.get_running_loop())
        _from_thread(sink.deliver, (_row(1),))
        _from_thread(sink.close, "dropped for stalling")
        await asyncio.sleep(0)
        pushed: list[int] = []
        ended = sink.push_to(lambda rows: pushed.extend(r.emit_seq.commit_index for r in rows))
        return pushed, await asyncio.wait_for(ended, 5)

    assert asyncio.run(main()) == ([1], "dropped for stalling")


def test_a_failing_push_ends_the_stream_with_its_error_and_a_stopped_sink_pushes_nothing() -> None:
    async def main() -> None:
        sink = StreamSink(asyncio.get_running_loop())

        def push(rows: Sequence[OutboxRow]) -> None:
            raise ValueError("cannot encode")

        ended = sink.push_to(push)
        _from_thread(sink.deliver, (_row(1),))
        with pytest.raises(ValueError, match="cannot encode"):
            await asyncio.wait_for(ended, 5)

        other = StreamSink(asyncio.get_running_loop())
        pushed: list[OutboxRow] = []
        other.push_to(pushed.extend)
        other.stop()  # the stream is over: what still lands is not sent
        _from_thread(other.deliver, (_row(2),))
        rows = await asyncio.wait_for(other.get(), 5)
        assert pushed == [] and isinstance(rows, list)
        assert [r.emit_seq.commit_index for r in rows] == [2]

    asyncio.run(main())


def test_a_cancelled_stream_pushes_nothing_more() -> None:
    """A Session stream closed by its client is cancelled at once, but its task runs
    its `stop` only on a later loop turn: rows and a close landing in between must not
    reach the call."""

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        sink = StreamSink(loop)
        pushed: list[int] = []
        waiting = asyncio.Event()

        async def stream() -> None:
            ended = sink.push_to(lambda rows: pushed.extend(r.emit_seq.commit_index for r in rows))
            waiting.set()
            try:
                await ended
            finally:
                sink.stop()

        task = loop.create_task(stream())
        await waiting.wait()
        task.cancel()
        # What the mailbox runs if its turn comes before the task's:
        sink._land((_row(1),))
        sink._land("the lease moved")
        with pytest.raises(asyncio.CancelledError):
            await task
        return pushed

    assert asyncio.run(main()) == []


def test_a_fenced_sink_closes_and_says_so() -> None:
    """A newer stream of the subscription fenced this one: it closes like any other
    close (queued or pushed), and `fenced` tells its handler why."""

    async def main() -> tuple[str, bool, bool]:
        sink = StreamSink(asyncio.get_running_loop())
        plain = StreamSink(asyncio.get_running_loop())
        sink.fence()
        plain.close("lease moved")
        reason = await sink.get()
        assert isinstance(reason, str)
        assert await plain.get() == "lease moved"
        return reason, sink.fenced, plain.fenced

    reason, fenced, plain_fenced = asyncio.run(main())
    assert "newer stream" in reason
    assert fenced and not plain_fenced
