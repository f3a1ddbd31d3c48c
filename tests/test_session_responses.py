"""A Session call's responses are encoded by the node itself (each item once, as it
is taken from the call's queue): the bytes must be exactly the SessionResponse a
client parses, with the same items in order, batched as before."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sevendb.cluster.server.errors import Failure
from sevendb.cluster.server.rpc import _serializer
from sevendb.cluster.server.session import SESSION_RESPONSE_BYTES, Out, _encoded, _responses
from sevendb.proto import sevendb_pb2 as pb


def _item(stream_id: int, value_bytes: int) -> pb.SessionItem:
    change = pb.Change(key="k", value=b"x" * value_bytes)
    event = pb.DataEvent(sub_id="s", delta=pb.Delta(changes=[change]))
    return pb.SessionItem(
        stream_id=stream_id, message=pb.StreamMessage(events=pb.EventBatch(events=[event]))
    )


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300_000))
def test_an_item_encodes_as_a_response_holding_it_alone(value_bytes: int) -> None:
    item = _item(7, value_bytes)  # lengths across every varint width up to 3 bytes
    assert _encoded(item) == pb.SessionResponse(items=[item]).SerializeToString()


def _drain(items: list[pb.SessionItem], end: Failure | None) -> list[pb.SessionResponse]:
    async def main() -> list[pb.SessionResponse]:
        out: Out = asyncio.Queue()
        for item in items:
            out.put_nowait(item)
        out.put_nowait(end)
        return [pb.SessionResponse.FromString(r) async for r in _responses(out)]

    return asyncio.run(main())


def test_queued_items_leave_in_order_in_responses_of_the_size_bound() -> None:
    sizes = [10, 200, 20_000, SESSION_RESPONSE_BYTES + 10, 5, 600_000, 600_000, 3]
    items = [_item(i, size) for i, size in enumerate(sizes)]
    responses = _drain(items, None)
    assert [i for r in responses for i in r.items] == items
    # Up to the bound, or one larger item alone: [0, 1, 2] [3] [4, 5] [6, 7].
    assert [[i.stream_id for i in r.items] for r in responses] == [[0, 1, 2], [3], [4, 5], [6, 7]]


def test_the_failure_that_ends_the_call_is_raised_after_what_was_queued() -> None:
    items = [_item(1, 10), _item(2, 10)]

    async def main() -> list[pb.SessionResponse]:
        out: Out = asyncio.Queue()
        for item in items:
            out.put_nowait(item)
        out.put_nowait(Failure.invalid("bad request"))
        got = []
        with pytest.raises(Failure):
            async for r in _responses(out):
                got.append(pb.SessionResponse.FromString(r))
        return got

    assert [i for r in asyncio.run(main()) for i in r.items] == items


def test_a_reply_encoded_by_its_handler_is_sent_as_it_is() -> None:
    serialize = _serializer(pb.SessionResponse)
    response = pb.SessionResponse(items=[_item(3, 40)])
    assert serialize(response) == response.SerializeToString()
    assert serialize(b"\x0a\x00") == b"\x0a\x00"
