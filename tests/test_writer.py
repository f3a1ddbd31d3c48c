"""The SDK's write pipeline against endpoints that misbehave (no cluster needed)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from sevendb.outbox.errors import SevenDBError
from sevendb.proto import sevendb_pb2 as pb
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


def pipeline(engine: Engine) -> WritePipeline[pb.WriteResponse]:
    return WritePipeline(
        engine,
        (),
        lambda response: response,
        deadline_s=2.0,
        call_timeout_s=0.3,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )


def write(key: str, value: bytes = b"v") -> pb.WriteRequest:
    return pb.WriteRequest(ops=[pb.Op(key=key, value=value)])


def test_writes_to_a_node_that_never_answers_fail_by_their_deadline(mute_node: str) -> None:
    """Each attempt is bounded by call_timeout_s even when the stream never opens,
    and the node's request slots are given back: later writes are sent, and fail
    the same way, instead of waiting forever."""
    engine = Engine([mute_node])
    try:
        writes = pipeline(engine)
        started = time.monotonic()
        futures = [writes.submit(write(f"k{i}"), 0) for i in range(8)]
        for future in futures:
            with pytest.raises(SevenDBError, match="not committed after"):
                future.result(timeout=10)
        assert time.monotonic() - started < 6
        later = writes.submit(write("later"), 0)
        with pytest.raises(SevenDBError, match="not committed after"):
            later.result(timeout=10)
        assert writes._calls.get(mute_node, 0) == 0
    finally:
        engine.close()


def test_a_write_too_large_for_a_request_is_refused_before_it_is_queued(mute_node: str) -> None:
    engine = Engine([mute_node])
    try:
        writes = pipeline(engine)
        with pytest.raises(SevenDBError, match="the limit is"):
            writes.submit(write("big", b"x" * (BATCH_BYTES_MAX + 1)), 0)
        assert not writes._inbox and writes.calls == 0
    finally:
        engine.close()
