"""The SDK's write pipeline against endpoints that misbehave (no cluster needed)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from cluster_harness import wait_for

from sevendb.proto import sevendb_pb2 as pb
from sevendb.sdk import ClientClosed, InvalidArgument, Unavailable
from sevendb.sdk.engine import Engine
from sevendb.sdk.writer import BATCH_BYTES_MAX, WritePipeline


@pytest.fixture
def mute_node() -> Iterator[str]:
    """An address that accepts TCP connections and never says a word (a hung node)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


@pytest.fixture
def dead_node() -> str:
    """An address nothing listens on (connections are refused: UNAVAILABLE)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def pipeline(
    engine: Engine,
    *,
    deadline_s: float = 2.0,
    call_timeout_s: float = 0.3,
    backoff_s: float = 0.05,
) -> WritePipeline[pb.WriteResponse]:
    return WritePipeline(
        engine,
        (),
        lambda response: response,
        deadline_s=deadline_s,
        call_timeout_s=call_timeout_s,
        backoff_initial_s=backoff_s,
        backoff_max_s=max(0.2, backoff_s),
    )


def write(key: str, value: bytes = b"v") -> pb.WriteRequest:
    return pb.WriteRequest(ops=[pb.Op(key=key, value=value)])


def test_writes_to_a_node_that_never_answers_fail_by_their_deadline(mute_node: str) -> None:
    """Each attempt is bounded by call_timeout_s even when the stream never opens,
    and the node's request slots are given back: later writes are sent, and fail
    the same way, instead of waiting forever."""
    engine = Engine([mute_node], None)
    try:
        writes = pipeline(engine)
        started = time.monotonic()
        futures = [writes.submit(write(f"k{i}"), 0) for i in range(8)]
        for future in futures:
            with pytest.raises(Unavailable, match="not committed after"):
                future.result(timeout=10)
        assert time.monotonic() - started < 6
        later = writes.submit(write("later"), 0)
        with pytest.raises(Unavailable, match="not committed after"):
            later.result(timeout=10)
        assert writes._calls.get(mute_node, 0) == 0
    finally:
        engine.close()


def test_a_write_too_large_for_a_request_is_refused_before_it_is_queued(mute_node: str) -> None:
    engine = Engine([mute_node], None)
    try:
        writes = pipeline(engine)
        with pytest.raises(InvalidArgument, match="the limit is"):
            writes.submit(write("big", b"x" * (BATCH_BYTES_MAX + 1)), 0)
        assert not writes._inbox and writes.calls == 0
    finally:
        engine.close()


@pytest.mark.parametrize("where", ["in flight", "in a retry backoff"])
def test_closing_fails_every_write_not_answered_yet(
    where: str, mute_node: str, dead_node: str
) -> None:
    """In flight to a node that never answers, or waiting out a backoff after a
    refused connection: with minutes of deadline left, `close` fails them at once
    (the loop they wait on stops next), and a write submitted afterwards is refused."""
    endpoint = mute_node if where == "in flight" else dead_node
    engine = Engine([endpoint], None)
    try:
        writes = pipeline(engine, deadline_s=300, call_timeout_s=300, backoff_s=60)
        futures = [writes.submit(write(f"k{i}"), 0) for i in range(100)]  # 2+ requests
        if where == "in flight":
            wait_for(lambda: writes.calls >= 1, 10, "a request in flight")
        else:
            wait_for(lambda: len(writes._parked.get(0, ())) == 100, 10, "every write in a backoff")
        started = time.monotonic()
        engine.submit(writes.close()).result(10)
        for future in futures:
            with pytest.raises(ClientClosed, match="the client is closing"):
                future.result(timeout=0)
        assert time.monotonic() - started < 5
        with pytest.raises(ClientClosed, match="the client is closing"):
            writes.submit(write("late"), 0)
    finally:
        engine.close()


def test_closing_fails_writes_whose_request_had_not_started(mute_node: str) -> None:
    """A request task created in the loop turn before `close` is cancelled before
    its first line runs, so it settles nothing itself: `close` fails its writes."""
    engine = Engine([mute_node], None)
    try:
        writes = pipeline(engine, deadline_s=300, call_timeout_s=300)

        async def submit_and_close() -> list[Future[pb.WriteResponse]]:
            futures = [writes.submit(write(f"k{i}"), 0) for i in range(10)]
            writes._drain()  # what the loop would run next: the request task is created
            assert writes._sending and writes.calls == 0  # ... and has not started
            await writes.close()
            return futures

        for future in engine.submit(submit_and_close()).result(10):
            with pytest.raises(ClientClosed, match="the client is closing"):
                future.result(timeout=0)
    finally:
        engine.close()
