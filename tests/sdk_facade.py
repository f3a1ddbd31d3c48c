"""The same client tests against `Client` and `AsyncClient`: `AsyncFacade` drives an
`AsyncClient` from a synchronous test.

The `AsyncClient` lives on an asyncio loop the facade runs in a thread of its own,
as an application's loop: every call is the client's coroutine awaited on that loop
(so the SDK's machinery runs there, not on a loop of the SDK's), and a facade
subscription is read with ``anext`` there. The facade only carries calls over; what
is tested is what the coroutines do.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Coroutine, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar, cast

from sevendb.outbox.entries import Op
from sevendb.sdk import (
    AsyncClient,
    Client,
    ClusterLayout,
    Event,
    NodeStatus,
    Record,
    RetryPolicy,
    Subscription,
    WriteResult,
)
from sevendb.sdk.subscription import aclose_subscriptions

T = TypeVar("T")
CALL_WAIT_S = 120.0


class AsyncFacade:
    """`Client`'s calls, each one an `AsyncClient` coroutine run on the facade's loop."""

    def __init__(self, endpoints: Sequence[str], **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def make() -> AsyncClient:
            return AsyncClient(endpoints, **kwargs)

        self.client = self.run(make())
        self.metadata = self.client.metadata

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_WAIT_S)

    def close(self) -> None:
        failed = sys.exc_info()[1] is not None
        try:
            self.run(self.client._close(failed=failed))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def __enter__(self) -> AsyncFacade:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    def layout(self, *, refresh: bool = False) -> ClusterLayout:
        return self.run(self.client.layout(refresh=refresh))

    def status(self, endpoint: str, *, digests: bool = False) -> NodeStatus:
        return self.run(self.client.status(endpoint, digests=digests))

    def write(self, ops: Sequence[Op]) -> WriteResult:
        return self.run(self.client.write(ops))

    def write_async(self, ops: Sequence[Op]) -> Future[WriteResult]:
        return asyncio.run_coroutine_threadsafe(self.client.write(ops), self.loop)

    def put(self, key: str, value: bytes, **conditions: Any) -> WriteResult:
        return self.run(self.client.put(key, value, **conditions))

    def delete(self, key: str, **conditions: Any) -> WriteResult:
        return self.run(self.client.delete(key, **conditions))

    def get(self, key: str) -> Record | None:
        return self.run(self.client.get(key))

    def sync_bucket(self, bucket: int, *, page_size: int = 0) -> Iterator[Record]:
        async def collect() -> list[Record]:
            return [r async for r in self.client.sync_bucket(bucket, page_size=page_size)]

        return iter(self.run(collect()))

    def producer(self) -> AsyncProducerFacade:
        return AsyncProducerFacade(self)

    def subscribe(self, query: str, **kwargs: Any) -> SubscriptionFacade:
        return SubscriptionFacade(self, self.run(self.client.subscribe(query, **kwargs)))


class AsyncProducerFacade:
    def __init__(self, facade: AsyncFacade) -> None:
        self._facade = facade
        self._producer = facade.client.producer()
        self.producer_id = self._producer.producer_id

    def put(self, key: str, value: bytes, **conditions: Any) -> WriteResult:
        return self._facade.run(self._producer.put(key, value, **conditions))


class SubscriptionFacade:
    """An `AsyncClient`'s subscription, read with ``anext`` on the facade's loop."""

    def __init__(self, facade: AsyncFacade, sub: Subscription) -> None:
        self._facade = facade
        self.sub = sub

    @property
    def sub_ids(self) -> dict[int, str]:
        return self.sub.sub_ids

    def __iter__(self) -> SubscriptionFacade:
        return self

    def __next__(self) -> Event:
        try:
            return self._facade.run(anext(self.sub))
        except StopAsyncIteration:
            raise StopIteration from None

    def poll(self, timeout_s: float = 0.0) -> Event | None:
        async def poll() -> Event | None:
            try:
                return await asyncio.wait_for(anext(self.sub), timeout_s)
            except (TimeoutError, StopAsyncIteration):
                return None

        return self._facade.run(poll())

    def ack(self, event: Event) -> None:
        self.sub.ack(event)

    def nak(self, event: Event, delay_s: float = 0.0) -> None:
        self.sub.nak(event, delay_s)

    def wait_closed(self, timeout_s: float | None = None) -> bool:
        async def wait() -> bool:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.sub.await_closed()
            except TimeoutError:
                return False
            return True

        return self._facade.run(wait())

    def close(self) -> None:
        failed = sys.exc_info()[1] is not None  # the test's exception, not the loop's
        self._facade.run(aclose_subscriptions([self.sub], failed=failed))

    def detach(self) -> None:
        self._facade.run(self.sub.adetach())

    def unsubscribe(self) -> None:
        self._facade.run(self.sub.aunsubscribe())

    def __enter__(self) -> SubscriptionFacade:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._facade.run(self.sub.__aexit__(exc_type, exc, tb))


def make_client(kind: str, endpoints: Sequence[str], **kwargs: Any) -> Client:
    """A `Client`, or (`kind` "async") an `AsyncFacade` standing in for one."""
    if kind == "sync":
        return Client(endpoints, **kwargs)
    return cast(Client, AsyncFacade(endpoints, **kwargs))


KINDS = ("sync", "async")
"""The `kind`s of `make_client`: parametrise a test's client fixture with these."""

__all__ = ["KINDS", "AsyncFacade", "RetryPolicy", "make_client"]
