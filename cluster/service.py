"""The gRPC servicer of one node: routes each request to its bucket's replica.

Thin by design: validation comes from the core's entry constructors, decisions
from the core, replication from `BucketReplica`; this module only translates.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc

from sevendb.cluster.batcher import WriteBatcher
from sevendb.cluster.grpc_errors import ERROR_CODE_KEY, LEADER_HINT_KEY, STATUS_OF
from sevendb.cluster.replica import ApplyOutcome, BucketReplica, ReplicaUnavailable
from sevendb.cluster.topology import ClusterSpec, bucket_of
from sevendb.outbox import limits
from sevendb.outbox.entries import (
    Expected,
    ExpectKind,
    InitProducer,
    Op,
    OpKind,
    ProducerRef,
    Write,
    check_key,
    encode_entry,
)
from sevendb.outbox.errors import Rejection, SevenDBError
from sevendb.outbox.model import InitProducerResult
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

FORWARD_KEY = "sevendb-forwarded"
PROPOSE_TIMEOUT_S = 5.0
FORWARD_TIMEOUT_S = 10.0


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _abort(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    *,
    leader: str | None = None,
    error: str | None = None,
) -> NoReturn:
    trailers = []
    if leader:
        trailers.append((LEADER_HINT_KEY, leader))
    if error:
        trailers.append((ERROR_CODE_KEY, error))
    if trailers:
        context.set_trailing_metadata(tuple(trailers))
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


def _reject(context: grpc.ServicerContext, rejection: Rejection) -> NoReturn:
    _abort(
        context,
        STATUS_OF[rejection.code],
        f"{rejection.code}: {rejection.message}",
        error=str(rejection.code),
    )


def _op_from_pb(op: pb.Op) -> Op:
    which = op.expected.WhichOneof("kind")
    if which == "not_exists":
        expected = Expected(ExpectKind.NOT_EXISTS)
    elif which == "exact":
        expected = Expected.exact(op.expected.exact)
    else:
        expected = Expected()
    return Op(OpKind(op.kind), op.key, op.value, expected)


def _emit_seq_pb(seq: object) -> pb.EmitSeq:
    from sevendb.outbox.emitseq import EmitSeq

    assert isinstance(seq, EmitSeq)
    return pb.EmitSeq(
        epoch_id=pb.EmitSeq.EpochId(bucket_uuid=seq.bucket_uuid, epoch_counter=seq.epoch_counter),
        commit_index=seq.commit_index,
    )


class NodeService(pb_grpc.SevenDBServicer):
    """Client-facing API of one node; any node accepts any request."""

    def __init__(self, spec: ClusterSpec, node_id: str, replicas: dict[int, BucketReplica]) -> None:
        self._spec = spec
        self._node_id = node_id
        self._replicas = replicas
        self._batchers = {
            b: WriteBatcher(r, timeout_s=PROPOSE_TIMEOUT_S) for b, r in replicas.items()
        }
        self._channels: dict[str, pb_grpc.SevenDBStub] = {}
        self._lock = threading.Lock()

    # ---- routing -------------------------------------------------------------------

    def _stub(self, address: str) -> pb_grpc.SevenDBStub:
        with self._lock:
            stub = self._channels.get(address)
            if stub is None:
                stub = pb_grpc.SevenDBStub(grpc.insecure_channel(address))
                self._channels[address] = stub
            return stub

    def _leader_client_address(self, bucket: int, replica: BucketReplica | None) -> str | None:
        if replica is None or replica.leader is None:
            return None
        node = self._spec.node_of_raft_address(bucket, replica.leader)
        return None if node is None else node.grpc_address

    def _forward(
        self,
        context: grpc.ServicerContext,
        bucket: int,
        call: Callable[[pb_grpc.SevenDBStub, tuple[tuple[str, str], ...]], T],
        *,
        to_leader: bool,
    ) -> T:
        """Send the request to a node that can serve it (one hop at most)."""
        if any(k == FORWARD_KEY for k, _ in context.invocation_metadata()):
            _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket}: no leader here yet; retry",
                leader=self._leader_client_address(bucket, self._replicas.get(bucket)),
            )
        replica = self._replicas.get(bucket)
        if to_leader:
            target = self._leader_client_address(bucket, replica)
        else:
            target = self._spec.node(self._spec.buckets[bucket].nodes[0]).grpc_address
        if target is None and replica is None:
            target = self._spec.node(self._spec.buckets[bucket].nodes[0]).grpc_address
        if target is None or target == self._spec.node(self._node_id).grpc_address:
            _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"bucket {bucket} has no known leader; retry shortly",
            )
        try:
            return call(self._stub(target), ((FORWARD_KEY, self._node_id),))
        except grpc.RpcError as exc:
            _abort(
                context,
                exc.code(),
                exc.details() or "forwarded call failed",
                leader=target,
            )

    def _unavailable(
        self, context: grpc.ServicerContext, bucket: int, exc: ReplicaUnavailable
    ) -> NoReturn:
        hint = None
        if exc.leader_hint:
            node = self._spec.node_of_raft_address(bucket, exc.leader_hint)
            hint = None if node is None else node.grpc_address
        _abort(context, grpc.StatusCode.UNAVAILABLE, f"bucket {bucket}: {exc}", leader=hint)

    def _propose(self, context: grpc.ServicerContext, bucket: int, data: bytes) -> ApplyOutcome:
        replica = self._replicas[bucket]
        try:
            outcome = replica.propose(data, PROPOSE_TIMEOUT_S)
        except ReplicaUnavailable as exc:
            self._unavailable(context, bucket, exc)
        if outcome.error is not None:
            _abort(context, grpc.StatusCode.INTERNAL, f"bucket {bucket}: {outcome.error}")
        return outcome

    # ---- writes --------------------------------------------------------------------

    def Write(self, request: pb.WriteRequest, context: grpc.ServicerContext) -> pb.WriteResponse:
        try:
            ops = tuple(_op_from_pb(op) for op in request.ops)
            producer = None
            if request.HasField("producer"):
                p = request.producer
                producer = ProducerRef(p.producer_id, p.producer_epoch, p.sequence)
            entry = Write(ops, producer, now_ms())
        except SevenDBError as exc:
            _abort(context, STATUS_OF[exc.code], str(exc), error=str(exc.code))
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"bad op: {exc}")
        buckets = sorted({bucket_of(op.key, len(self._spec.buckets)) for op in ops})
        if len(buckets) > 1:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ops route to buckets {buckets}; a write is atomic within one bucket",
            )
        bucket = buckets[0]
        if bucket not in self._replicas:
            return self._forward(
                context,
                bucket,
                lambda s, md: s.Write(request, timeout=FORWARD_TIMEOUT_S, metadata=md),
                to_leader=False,
            )
        try:
            result = self._batchers[bucket].submit(entry)
        except ReplicaUnavailable as exc:
            self._unavailable(context, bucket, exc)
        if result.error is not None:
            _reject(context, result.error)
        return pb.WriteResponse(
            bucket=bucket,
            committed=_emit_seq_pb(result.commit),
            duplicate=result.duplicate,
            versions=[pb.KeyVersion(key=k, version=v) for k, v in result.versions],
        )

    def InitProducer(
        self, request: pb.InitProducerRequest, context: grpc.ServicerContext
    ) -> pb.InitProducerResponse:
        bucket = request.bucket
        if bucket >= len(self._spec.buckets):
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bucket {bucket} does not exist (0..{len(self._spec.buckets) - 1})",
            )
        if bucket not in self._replicas:
            return self._forward(
                context,
                bucket,
                lambda s, md: s.InitProducer(request, timeout=FORWARD_TIMEOUT_S, metadata=md),
                to_leader=False,
            )
        # Ids are minted at the edge (randomness stays out of the core).
        pid = request.producer_id or (secrets.randbits(62) | 1)
        outcome = self._propose(context, bucket, encode_entry(InitProducer(pid, now_ms())))
        assert outcome.applied is not None
        result = outcome.applied.result
        assert isinstance(result, InitProducerResult)
        if result.error is not None:
            _reject(context, result.error)
        return pb.InitProducerResponse(producer_id=pid, producer_epoch=result.epoch, bucket=bucket)

    # ---- reads (served by the leader) ------------------------------------------------

    def _leader_replica(self, context: grpc.ServicerContext, bucket: int) -> BucketReplica | None:
        replica = self._replicas.get(bucket)
        if replica is not None and replica.is_leader and not replica.quarantined:
            return replica
        return None

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetResponse:
        try:
            key = check_key(request.key)
        except SevenDBError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        bucket = bucket_of(key, len(self._spec.buckets))
        replica = self._leader_replica(context, bucket)
        if replica is None:
            return self._forward(
                context,
                bucket,
                lambda s, md: s.Get(request, timeout=FORWARD_TIMEOUT_S, metadata=md),
                to_leader=True,
            )
        record = replica.read(lambda sm: sm.get(key))
        if record is None:
            return pb.GetResponse(found=False)
        return pb.GetResponse(
            found=True,
            value=record.value,
            version=record.version,
            mod_commit_index=record.mod_index,
        )

    def Sync(self, request: pb.SyncRequest, context: grpc.ServicerContext) -> pb.SyncResponse:
        bucket = request.bucket
        if bucket >= len(self._spec.buckets):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"bucket {bucket} does not exist")
        replica = self._leader_replica(context, bucket)
        if replica is None:
            return self._forward(
                context,
                bucket,
                lambda s, md: s.Sync(request, timeout=FORWARD_TIMEOUT_S, metadata=md),
                to_leader=True,
            )
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

    def close(self) -> None:
        for batcher in self._batchers.values():
            batcher.close()

    # ---- operations --------------------------------------------------------------------

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        replicas = []
        for bucket, replica in sorted(self._replicas.items()):
            st = replica.status()
            digest = "" if replica.quarantined else replica.read(lambda sm: sm.digest())
            epoch = replica.read(lambda sm: sm.epoch.epoch_counter)
            replicas.append(
                pb.ReplicaStatus(
                    bucket=bucket,
                    bucket_uuid=self._spec.buckets[bucket].bucket_uuid,
                    address=self._spec.node(self._node_id).raft_address(bucket),
                    leader=str(st.get("leader") or ""),
                    is_leader=replica.is_leader,
                    term=_int(st.get("term")),
                    commit_index=_int(st.get("commit_index")),
                    applied_index=_int(st.get("applied_index")),
                    log_len=_int(st.get("log_len")),
                    epoch_counter=epoch,
                    digest=digest,
                    quarantined=replica.quarantined or "",
                    members=self._spec.replica_addresses(bucket),
                    fsyncs=_int(st.get("fsyncs")),
                )
            )
        return pb.StatusResponse(node_id=self._node_id, replicas=replicas)
