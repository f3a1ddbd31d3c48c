"""Reads: `Get`, `Sync` and `History`, served by the bucket's leader (forwarded there
from any other node), so a read sees every write acknowledged before it."""

from __future__ import annotations

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
        return pb.SyncResponse(
            items=[
                pb.KeyValue(
                    key=i.key, value=i.value, version=i.version, mod_commit_index=i.mod_index
                )
                for i in page.items
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
            page = replica.read(lambda sm: sm.history_page(plan, after, through, request.limit))
        except SevenDBError as exc:
            raise Failure.domain(exc) from None
        return pb.HistoryResponse(
            events=[
                pb.HistoryEvent(
                    emit_seq=codec.seq_to_pb(e.emit_seq),
                    delta=pb.Delta(
                        changes=[codec.change_to_pb(c) for c in e.changes],
                        commit_time_ms=e.commit_time_ms,
                    ),
                )
                for e in page.events
            ],
            more=page.more,
            next_after=codec.seq_to_pb(page.next_after),
            retained_after=codec.seq_to_pb(page.retained_after),
        )


__all__ = ["Reads"]
