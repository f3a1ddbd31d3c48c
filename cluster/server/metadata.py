"""The metadata RPCs: `MetaRead` (any principal; a voter answers from its replica of
the metadata group, any other node from its cache; the token keys only to admin and
nodes), `MetaWrite` (admin: a compare-and-set write, forwarded to a voter by a node
that is not one), `JoinBundle` (admin: what `sevendb node init` gives a new node)
and `MintToken` (admin: a token minted with the keys in force)."""

from __future__ import annotations

import asyncio
from typing import Final, TypeVar

import grpc
from google.protobuf.message import Message
from grpc import aio

from sevendb.cluster.common.acl import ACL_PREFIX, AclError, check_record
from sevendb.cluster.common.auth import (
    KEY_PREFIX,
    NODE_PRINCIPAL,
    PRIVILEGED,
    AuthError,
    Token,
)
from sevendb.cluster.server.admin import require_admin
from sevendb.cluster.server.edge import FORWARD_KEY, FORWARD_TIMEOUT_S, Call, Edge, now_ms
from sevendb.cluster.server.errors import Failure
from sevendb.cluster.server.meta import MetaMember, cas_op
from sevendb.outbox.errors import SevenDBError
from sevendb.outbox.replica import ReplicaUnavailable
from sevendb.proto import sevendb_pb2 as pb

WAIT_MS_MAX: Final = 30_000

Res = TypeVar("Res", bound=Message)


class Metadata:
    """The metadata handlers of one node."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge

    async def meta_read(self, request: pb.MetaReadRequest, call: Call) -> pb.MetaReadResponse:
        view = self._edge.node.view
        wait_s = min(request.wait_ms, WAIT_MS_MAX) / 1000
        if request.linearizable:
            member: MetaMember | None = self._edge.node.meta
            if member is None:
                return await self._forward(call, request, pb.MetaReadResponse)
            try:
                index = await asyncio.to_thread(member.barrier, now_ms())
            except ReplicaUnavailable as exc:
                raise Failure(
                    grpc.StatusCode.UNAVAILABLE, f"the metadata group cannot commit now: {exc}"
                ) from None
            state = view.state
            if state.version < index:  # applied here, the view not offered it yet
                state = await asyncio.to_thread(view.wait_newer, index - 1, WAIT_MS_MAX / 1000)
        else:
            state = view.state
        if request.after_version and state.version <= request.after_version and wait_s > 0:
            state = await asyncio.to_thread(view.wait_newer, request.after_version, wait_s)
        everything = call.principal in PRIVILEGED or call.admin
        return pb.MetaReadResponse(
            version=state.version,
            records=[
                pb.MetaRecord(key=k, value=v, version=ver)
                for k, (v, ver) in sorted(state.records.items())
                if everything or not k.startswith((KEY_PREFIX, ACL_PREFIX))
            ],
            genesis=view.genesis.to_json(),
        )

    async def meta_write(self, request: pb.MetaWriteRequest, call: Call) -> pb.MetaWriteResponse:
        require_admin(call)
        member: MetaMember | None = self._edge.node.meta
        if member is None:
            return await self._forward(call, request, pb.MetaWriteResponse)
        try:
            for op in request.ops:
                if op.key.startswith(ACL_PREFIX):
                    check_record(op.key, None if op.delete else op.value)
        except AclError as exc:
            raise Failure.invalid(f"access-control record: {exc}") from None
        try:
            ops = [
                cas_op(op.key, None if op.delete else op.value, op.expected_version)
                for op in request.ops
            ]
            result, index = await asyncio.to_thread(member.write, ops, now_ms())
        except SevenDBError as exc:
            raise Failure.domain(exc) from None
        except ReplicaUnavailable as exc:
            unknown = (
                ""
                if exc.reason == "no_quorum"
                else " (the outcome is unknown: the change "
                "may still be made; read the metadata before retrying)"
            )
            raise Failure(
                grpc.StatusCode.UNAVAILABLE, f"the metadata group cannot commit now: {exc}{unknown}"
            ) from None
        if result.error is not None:
            raise Failure.rejected(result.error)
        return pb.MetaWriteResponse(version=index)

    async def _forward(self, call: Call, request: Message, reply: type[Res]) -> Res:
        """The request (MetaWrite, or a linearizable MetaRead) on the first voter that
        can serve it."""
        method = reply.__name__.removesuffix("Response")
        edge = self._edge
        if any(k == FORWARD_KEY for k, _ in call.metadata):
            raise Failure(grpc.StatusCode.UNAVAILABLE, "forwarded to a node that is no voter")
        errors = []
        for voter in edge.spec.meta_voters:
            forwarded = ((FORWARD_KEY, edge.node_id), *edge.auth_of(call))
            try:
                answer = await getattr(edge.stub(voter.grpc_address), method)(
                    request, timeout=FORWARD_TIMEOUT_S, metadata=forwarded
                )
                assert isinstance(answer, reply)
                return answer
            except aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise Failure(exc.code(), exc.details() or "metadata write failed") from None
                errors.append(f"{voter.node_id}: {exc.details()}")
        raise Failure(
            grpc.StatusCode.UNAVAILABLE,
            f"no metadata voter could serve {method}: " + "; ".join(errors),
        )

    async def join_bundle(self, request: pb.JoinBundleRequest, call: Call) -> pb.JoinBundleResponse:
        require_admin(call)
        node = self._edge.node
        return pb.JoinBundleResponse(
            genesis=node.view.genesis.to_json(), secrets=node.secrets.to_toml()
        )

    async def mint_token(self, request: pb.MintTokenRequest, call: Call) -> pb.MintTokenResponse:
        require_admin(call)
        if request.principal == NODE_PRINCIPAL:
            raise Failure.invalid("the node principal's tokens are minted by nodes only")
        if request.ttl_s <= 0:
            raise Failure.invalid("ttl_s must be > 0")
        try:
            token = self._edge.node.keyring.mint(
                request.principal, now_ms=now_ms(), ttl_s=request.ttl_s
            )
        except AuthError as exc:
            raise Failure.invalid(str(exc)) from None
        parsed = Token.parse(token)
        return pb.MintTokenResponse(token=token, key_id=parsed.kid, expires_ms=parsed.expires_ms)
