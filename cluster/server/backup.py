"""`BackupBucket`: one bucket's state for `sevendb backup create`, from any node
holding a replica of it, while writes go on.

The replica first passes a read barrier (`Edge.read_barrier`: it has applied every
entry committed before the call, so every write acknowledged before the backup
began is in it), then the core's snapshot is taken under the apply lock
(`BucketStateMachine.snapshot_later`: references only, a few milliseconds for a
large state) with the index it covers, made into bytes off the lock and the event
loop, and streamed in chunks. docs/operations.md, "Backup and restore".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Final

import xxhash

from sevendb.cluster.raft.replica import ReplicaUnavailable
from sevendb.cluster.server.admin import local_replica, require_admin
from sevendb.cluster.server.edge import Call, Edge
from sevendb.outbox.state import BucketStateMachine
from sevendb.proto import sevendb_pb2 as pb

CHUNK_BYTES: Final = 1024 * 1024
"""Bytes of snapshot per message (gRPC's limit is 4 MiB)."""


def _take(sm: BucketStateMachine) -> tuple[int, int, Callable[[], bytes]]:
    """Under the apply lock: the index and epoch the state is at, and the function
    that makes its snapshot bytes later."""
    return sm.applied_index, sm.epoch.epoch_counter, sm.snapshot_later()


class Backups:
    """The backup handler of one node."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge

    async def backup_bucket(
        self, request: pb.BackupRequest, call: Call
    ) -> AsyncIterator[pb.BackupChunk]:
        require_admin(call)
        edge, bucket = self._edge, request.bucket
        replica = local_replica(edge, bucket)
        await edge.read_barrier(bucket)
        try:
            index, epoch, make = await asyncio.to_thread(replica.read, _take)
        except ReplicaUnavailable as exc:
            raise edge.unavailable(bucket, exc) from None
        data = await asyncio.to_thread(make)
        yield pb.BackupChunk(
            bucket=bucket,
            bucket_uuid=replica.bucket_uuid,
            applied_index=index,
            epoch_counter=epoch,
            total_bytes=len(data),
            digest=xxhash.xxh64_hexdigest(data),
            data=data[:CHUNK_BYTES],
        )
        for start in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
            yield pb.BackupChunk(data=data[start : start + CHUNK_BYTES])


__all__ = ["CHUNK_BYTES", "Backups"]
