"""The gRPC API of one node (grpc.aio): every method of `sevendb.v1.SevenDB`, routed
to the handlers of its concern.

Thin by design: validation comes from the core's entry constructors, decisions from
the core and `NotifierCore`, replication from `BucketReplica`, conversions from the
wire codec (`sevendb.proto.codec`); the handlers only translate. They are grouped by
concern - `writes`, `reads`, subscription `streams` and their `session`, `acks`,
`admin` and the administration of `subscriptions` - over one `Edge` (the node as
they use it), behind the guard of `rpc` (token first, then parsing).
"""

from __future__ import annotations

import contextlib

from grpc import aio

from sevendb.cluster.server.acks import Acks
from sevendb.cluster.server.admin import Admin
from sevendb.cluster.server.backup import Backups
from sevendb.cluster.server.edge import Edge, NodeHost
from sevendb.cluster.server.faults import FaultPoints
from sevendb.cluster.server.groups import Groups
from sevendb.cluster.server.metadata import Metadata
from sevendb.cluster.server.metrics import NodeMetrics
from sevendb.cluster.server.overload import ServerLimits
from sevendb.cluster.server.reads import Reads
from sevendb.cluster.server.rpc import Auth, Route, method_handlers, register
from sevendb.cluster.server.session import Sessions
from sevendb.cluster.server.streams import Streams
from sevendb.cluster.server.subscriptions import SubscriptionAdmin
from sevendb.cluster.server.txns import Transactions
from sevendb.cluster.server.writes import Writes
from sevendb.proto import sevendb_pb2 as pb


class NodeService:
    """Client-facing API of one node; any node accepts any request."""

    def __init__(
        self,
        node: NodeHost,
        metrics: NodeMetrics | None = None,
        limits: ServerLimits | None = None,
        faults: FaultPoints | None = None,
    ) -> None:
        self.edge = Edge(node, metrics, limits)
        self.writes = Writes(self.edge)
        self.reads = Reads(self.edge)
        self.streams = Streams(self.edge)
        self.sessions = Sessions(self.streams)
        self.acks = Acks(self.edge)
        self.groups = Groups(self.edge)
        self.admin = Admin(self.edge)
        self.backups = Backups(self.edge)
        self.metadata = Metadata(self.edge)
        self.subscriptions = SubscriptionAdmin(self.edge, self.streams)
        self.txns = Transactions(self.edge, faults)
        self.writes.transactional = self.txns.write

    def routes(self) -> dict[str, Route]:
        """Each method of the service and the handler that serves it."""
        writes, reads, streams, acks, admin = (
            self.writes,
            self.reads,
            self.streams,
            self.acks,
            self.admin,
        )
        return {
            "Write": Route(writes.write),
            "WriteMany": Route(writes.write_many),
            "WriteStream": Route(writes.write_stream, Auth.HANDLER),
            "InitProducer": Route(writes.init_producer, replica_of=_bucket),
            "Get": Route(reads.get),
            "Sync": Route(reads.sync),
            "History": Route(reads.history),
            "Range": Route(reads.range),
            "Subscribe": Route(streams.subscribe_call),
            "Reconnect": Route(streams.reconnect_call),
            "Session": Route(self.sessions.session),
            "Ack": Route(acks.ack),
            "Unsubscribe": Route(acks.unsubscribe, replica_of=_bucket),
            "GroupBeat": Route(self.groups.beat, replica_of=_bucket),
            "Status": Route(admin.status, Auth.NONE),
            "ClusterInfo": Route(admin.cluster_info, Auth.NONE),
            "AddMember": Route(admin.add_member),
            "RemoveMember": Route(admin.remove_member),
            "TransferLeader": Route(admin.transfer_leader),
            "CreateEpoch": Route(admin.create_epoch),
            "RecoverBucket": Route(admin.recover_bucket),
            "BackupBucket": Route(self.backups.backup_bucket),
            "MetaRead": Route(self.metadata.meta_read),
            "MetaWrite": Route(self.metadata.meta_write),
            "JoinBundle": Route(self.metadata.join_bundle),
            "MintToken": Route(self.metadata.mint_token),
            "ListSubscriptions": Route(self.subscriptions.list_subscriptions),
            "ShowSubscription": Route(self.subscriptions.show_subscription),
            "DeleteSubscription": Route(self.subscriptions.delete_subscription),
            "Txn": Route(self.txns.txn, replica_of=self.txns.coordinator),
            "TxnMark": Route(self.txns.txn_mark, replica_of=self.txns.mark_bucket),
            "ListTransactions": Route(self.txns.list_transactions),
        }

    def serve_on(self, server: aio.Server) -> None:
        """Register every method on `server` (raw bytes in: see `rpc`)."""
        register(server, method_handlers(self.edge, self.routes()))
        with contextlib.suppress(RuntimeError):  # no running loop: no driver (tests)
            self.txns.start()

    async def close(self) -> None:
        await self.txns.stop()
        self.writes.close()
        self.streams.close()
        await self.edge.close()


def _bucket(
    request: pb.InitProducerRequest | pb.UnsubscribeRequest | pb.GroupBeatRequest,
) -> int:
    return request.bucket


__all__ = ["NodeService"]
