"""How a request fails at the node's edge: `Failure`, a gRPC status plus the domain
error, the leader's address and (RESOURCE_EXHAUSTED) how long to wait as trailers
(the table of domain errors to statuses is the wire codec's,
`sevendb.proto.codec.STATUS_OF`)."""

from __future__ import annotations

from typing import Any, NoReturn, TypeAlias

import grpc
from grpc import aio

from sevendb.outbox.errors import Rejection, SevenDBError
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb

Ctx: TypeAlias = "aio.ServicerContext[Any, Any]"


def status_of_unavailable(reason: str) -> grpc.StatusCode:
    """The status of a replica's refusal (`ReplicaUnavailable.reason`): DATA_LOSS when
    no reachable replica of the bucket holds every acknowledged entry (docs/raft.md,
    "Disk faults": retrying does not help until a replica comes back or an operator
    decides), UNAVAILABLE otherwise (retry, here or at the leader)."""
    return grpc.StatusCode.DATA_LOSS if reason == "data_loss" else grpc.StatusCode.UNAVAILABLE


class Failure(Exception):
    """How a request fails: a gRPC status, plus the domain error code and the leader's
    client address as trailing metadata. Raised anywhere below a handler; the
    handler's guard (`rpc.py`) turns it into the call's status, a Session into one
    stream's `StreamEnd`, and WriteMany into one write's outcome."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        leader: str | None = None,
        error: str | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.leader = leader
        self.error = error
        self.retry_after_ms = retry_after_ms

    @classmethod
    def rejected(cls, rejection: Rejection) -> Failure:
        return cls(
            codec.STATUS_OF[rejection.code],
            f"{rejection.code}: {rejection.message}",
            error=str(rejection.code),
        )

    @classmethod
    def domain(cls, exc: SevenDBError) -> Failure:
        return cls(codec.STATUS_OF[exc.code], str(exc), error=str(exc.code))

    @classmethod
    def denied(cls, message: str) -> Failure:
        """PERMISSION_DENIED by access control; `message` names the missing permission."""
        return cls(grpc.StatusCode.PERMISSION_DENIED, message, error="PERMISSION_DENIED")

    @classmethod
    def invalid(cls, message: str) -> Failure:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message)

    @classmethod
    def exhausted(cls, message: str, error: str, retry_after_ms: int | None) -> Failure:
        """RESOURCE_EXHAUSTED: a limit (docs/limits.md); retry after the time given."""
        return cls(
            grpc.StatusCode.RESOURCE_EXHAUSTED, message, error=error, retry_after_ms=retry_after_ms
        )

    def fill(self, out: pb.WriteOutcome) -> None:
        """Make `out` the outcome of a write of a WriteMany that failed this way."""
        out.code = self.code.value[0]
        out.message = self.message
        out.error = self.error or ""
        out.leader = self.leader or ""
        out.retry_after_ms = self.retry_after_ms or 0

    def stream_end(self) -> pb.StreamEnd:
        """How a Session stream ends that its own call would have ended this way."""
        return pb.StreamEnd(
            code=self.code.value[0],
            message=self.message,
            leader=self.leader or "",
            error=self.error or "",
            retry_after_ms=self.retry_after_ms or 0,
        )

    async def abort(self, context: Ctx) -> NoReturn:
        await context.abort(
            self.code,
            self.message,
            trailing_metadata=codec.trailers(self.leader, self.error, self.retry_after_ms),
        )
        raise AssertionError("unreachable")  # context.abort raises


__all__ = ["Ctx", "Failure"]
