"""Reads: `Get`, `Sync` and `History`, served by the bucket's leader (forwarded there
from any other node), so a read sees every write acknowledged before it; and `Range`,
keys in key order across every bucket, read from each bucket's replica here (or on a
node holding one) after a read barrier (linearizable), or without one on request
(serializable). Keys the caller may not read are left out of every answer."""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Final

from sevendb.cluster.common.acl import Permission
from sevendb.cluster.raft.replica import ReplicaUnavailable
from sevendb.cluster.server.edge import Call, Edge
from sevendb.cluster.server.errors import Failure
from sevendb.outbox import limits
from sevendb.outbox.entries import check_key
from sevendb.outbox.errors import SevenDBError
from sevendb.outbox.keys import bucket_of
from sevendb.outbox.query import plan_query
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb


class Reads:
    """The read handlers of one node."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge

    async def get(self, request: pb.GetRequest, call: Call) -> pb.GetResponse:
        try:
            key = check_key(request.key)
        except SevenDBError as exc:
            raise Failure.invalid(str(exc)) from None
        self._edge.allow(call.principal, Permission.READ, key)
        bucket = bucket_of(key, len(self._edge.spec.buckets))
        replica = self._edge.leader_replica(bucket)
        if replica is None:
            return await self._edge.forward(call, bucket, request, pb.GetResponse, to_leader=True)
        record = replica.read(lambda sm: sm.get(key))
        if record is None:
            return pb.GetResponse(found=False)
        return pb.GetResponse(
            found=True,
            value=record.value,
            version=record.version,
            mod_commit_index=record.mod_index,
        )

    async def sync(self, request: pb.SyncRequest, call: Call) -> pb.SyncResponse:
        bucket = request.bucket
        self._edge.check_bucket(bucket)
        replica = self._edge.leader_replica(bucket)
        if replica is None:
            return await self._edge.forward(call, bucket, request, pb.SyncResponse, to_leader=True)
        limit = min(request.limit or limits.SYNC_LIMIT_DEFAULT, limits.SYNC_LIMIT_MAX)
        page = replica.read(
            lambda sm: sm.sync_page(request.since_commit_index, request.since_key, limit)
        )
        readable = self._edge.readable(call.principal)  # the cursor still covers the rest
        return pb.SyncResponse(
            items=[
                pb.KeyValue(
                    key=i.key, value=i.value, version=i.version, mod_commit_index=i.mod_index
                )
                for i in page.items
                if readable(i.key)
            ],
            has_more=page.has_more,
            next_since_commit_index=page.next_since_index,
            next_since_key=page.next_since_key,
            applied_index=page.applied_index,
        )

    async def history(self, request: pb.HistoryRequest, call: Call) -> pb.HistoryResponse:
        """A page of the bucket's retained history matching a query (docs/wire.md)."""
        bucket = request.bucket
        self._edge.check_bucket(bucket)
        try:
            plan = plan_query(codec.query_from_pb(request.query))
            after = codec.seq_from_pb(request.after) if request.HasField("after") else None
        except SevenDBError as exc:
            raise Failure.domain(exc) from None
        except ValueError as exc:
            raise Failure.invalid(f"bad query: {exc}") from None
        replica = self._edge.leader_replica(bucket)
        if replica is None:
            return await self._edge.forward(
                call, bucket, request, pb.HistoryResponse, to_leader=True
            )
        through = request.through_commit_index or None
        try:
            page = replica.read(lambda sm: sm.history.page(plan, after, through, request.limit))
        except SevenDBError as exc:
            raise Failure.domain(exc) from None
        readable = self._edge.readable(call.principal)
        shown = [
            (e, [codec.change_to_pb(c) for c in e.changes if readable(c.key)]) for e in page.events
        ]
        return pb.HistoryResponse(
            events=[  # (a change set with no key the caller may read is left out)
                pb.HistoryEvent(
                    emit_seq=codec.seq_to_pb(e.emit_seq),
                    delta=pb.Delta(changes=changes, commit_time_ms=e.commit_time_ms),
                )
                for e, changes in shown
                if changes
            ],
            more=page.more,
            next_after=codec.seq_to_pb(page.next_after),
            retained_after=codec.seq_to_pb(page.retained_after),
        )

    async def range(self, request: pb.RangeRequest, call: Call) -> pb.RangeResponse:
        if request.prefix and (request.start or request.end):
            raise Failure.invalid("a range is a prefix or start..end, not both")
        if request.end and request.start >= request.end:
            raise Failure.invalid(f"start {request.start!r} is not before end {request.end!r}")
        after = _after(request.page_token)
        limit = min(request.limit or limits.SYNC_LIMIT_DEFAULT, limits.SYNC_LIMIT_MAX)
        if request.HasField("bucket"):
            self._edge.check_bucket(request.bucket)
            items, cut = await self._bucket_range(request, call, request.bucket, after, limit)
            return _page(items, cut)
        parts = await asyncio.gather(
            *(
                self._bucket_range(request, call, b, after, limit)
                for b in range(len(self._edge.spec.buckets))
            )
        )
        # A bucket with more keys than it gave cuts the page at its last key scanned:
        # the keys after it are unknown, and another bucket's may not go past them.
        cuts = [cut for _, cut in parts if cut is not None]
        cut = min(cuts) if cuts else None
        items = sorted(
            (i for got, _ in parts for i in got if cut is None or i.key <= cut),
            key=lambda i: i.key,
        )
        if len(items) > limit:
            items, cut = items[:limit], items[limit - 1].key
        return _page(items, cut)

    async def _bucket_range(
        self, request: pb.RangeRequest, call: Call, bucket: int, after: str, limit: int
    ) -> tuple[list[pb.KeyValue], str | None]:
        """One bucket's keys of the range (those the caller may read), and its last key
        scanned if it has more (None if not)."""
        edge = self._edge
        replica = edge.replicas.get(bucket)
        if replica is None:
            one = pb.RangeRequest()
            one.CopyFrom(request)
            one.bucket, one.limit = bucket, limit
            got = await edge.forward(call, bucket, one, pb.RangeResponse, to_leader=False)
            cut = _after(got.next_page_token) if got.next_page_token else None
            return list(got.items), cut
        if not request.serializable:
            await edge.read_barrier(bucket)
        prefix, start, end = request.prefix, request.start, request.end
        try:
            make = replica.read(lambda sm: sm.store.range_later(start, end, prefix, after, limit))
        except ReplicaUnavailable as exc:
            raise edge.unavailable(bucket, exc) from None
        page, more = await asyncio.to_thread(make)  # the scan holds neither lock nor loop
        readable = edge.readable(call.principal)
        items = [
            pb.KeyValue(key=i.key, value=i.value, version=i.version, mod_commit_index=i.mod_index)
            for i in page
            if readable(i.key)
        ]
        return items, page[-1].key if more else None


PAGE_TOKEN_PREFIX: Final = "k1."


def _after(token: str) -> str:
    """The key a page token says the next page starts after ("" for none)."""
    if not token:
        return ""
    try:
        if not token.startswith(PAGE_TOKEN_PREFIX):
            raise ValueError("no version")
        return base64.urlsafe_b64decode(token.removeprefix(PAGE_TOKEN_PREFIX)).decode()
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise Failure.invalid(
            f"page_token {token[:40]!r} is not one a Range answered; start without one"
        ) from None


def _page(items: list[pb.KeyValue], cut: str | None) -> pb.RangeResponse:
    token = (
        "" if cut is None else PAGE_TOKEN_PREFIX + base64.urlsafe_b64encode(cut.encode()).decode()
    )
    return pb.RangeResponse(items=items, next_page_token=token)


__all__ = ["Reads"]
