"""The guard in front of every handler: the token is checked from the metadata
before the request's bytes are parsed, bytes that are not the method's message get
INVALID_ARGUMENT (and one rate-limited WARNING line, never a traceback), and a
`Failure` raised by the handler becomes the call's status and trailers.

gRPC would parse each request before any handler runs, and answer a bad one
UNKNOWN with an ERROR traceback per request, from anyone: so the methods are
registered with raw bytes (`register`), and parsed here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, TypeAlias

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError, Message
from grpc import aio

from sevendb.cluster.server.edge import Call, Edge
from sevendb.cluster.server.errors import Ctx, Failure
from sevendb.cluster.server.logs import REQUEST_LOGGER
from sevendb.cluster.server.metrics import MethodMetrics
from sevendb.proto import sevendb_pb2 as pb

log = logging.getLogger(__name__)
request_log = logging.getLogger(REQUEST_LOGGER)
"""One DEBUG line per finished call: method, principal, status code, duration, peer
(docs/operations.md, "Logs")."""

SERVICE: Final = "sevendb.v1.SevenDB"
MALFORMED_LOG_EVERY_S: Final = 10.0
"""At most one WARNING line about malformed requests per this many seconds."""
_LOG_DETAIL_CHARS: Final = 160
REFUSED_WHILE_DRAINING: Final = frozenset(
    {"Write", "WriteMany", "WriteStream", "InitProducer", "Subscribe", "Reconnect", "Session"}
)
"""What a draining node (SIGTERM) no longer takes: new writes and new streams. The
caller is told UNAVAILABLE with another node's address, and retries there."""

Handler: TypeAlias = Callable[[Any, Call], Any]
"""`(request, call)` -> a response (awaitable), or the messages of a stream (an
async iterator); a stream of requests arrives as an async iterator of messages."""


class Auth(Enum):
    TOKEN = "token"
    """A valid token is needed: UNAUTHENTICATED before anything is parsed."""
    NONE = "none"
    """No token (Status, ClusterInfo): `Call.principal` is empty."""
    HANDLER = "handler"
    """The handler checks the token itself (WriteStream answers each request
    UNAUTHENTICATED rather than ending the stream: see its docstring)."""


@dataclass(frozen=True, slots=True)
class Route:
    handler: Handler
    auth: Auth = Auth.TOKEN
    replica_of: Callable[[Any], int] | None = None
    """For a unary request any replica of its bucket serves: its bucket. From a node
    without a replica of it, the request is forwarded (`Edge.unless_local`)."""


class MalformedLog:
    """Malformed requests, logged as one WARNING line per `every_s` at most, with how
    many arrived since the last line: a client sending garbage cannot fill the log."""

    def __init__(
        self, every_s: float = MALFORMED_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._every_s = every_s
        self._clock = clock
        self._last: float | None = None
        self._count = 0

    def note(self, method: str, peer: str, error: Exception) -> None:
        self._count += 1
        now = self._clock()
        if self._last is not None and now - self._last < self._every_s:
            return
        detail = str(error)[:_LOG_DETAIL_CHARS]
        log.warning(
            "malformed %s request from %s (%d since the last such warning): %s",
            method,
            peer[:_LOG_DETAIL_CHARS],
            self._count,
            detail,
        )
        self._last, self._count = now, 0


class _Outcome:
    """How one call ends, around its handler (`async with`): a `Failure` raised
    inside becomes the call's status (`Failure.abort`); the call is counted in
    `/metrics` (a stream is in flight meanwhile) and logged at DEBUG with its
    principal and status (`request_log`)."""

    __slots__ = ("_context", "_method", "_started", "_stats", "_stream", "call")

    def __init__(self, stats: MethodMetrics, method: str, context: Ctx, *, stream: bool) -> None:
        self._stats, self._method, self._context, self._stream = stats, method, context, stream
        self._started = time.perf_counter()
        self.call: Call | None = None
        """The authenticated call, once the token was checked."""

    async def __aenter__(self) -> _Outcome:
        if self._stream:
            self._stats.opened()
        return self

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        code = grpc.StatusCode.OK
        try:
            if isinstance(exc, Failure):
                code = exc.code
                await exc.abort(self._context)
            elif exc is not None:
                code = _code_of(exc, self._context)
        finally:
            if self._stream:
                self._stats.closed()
            self._finished(code)

    def _finished(self, code: grpc.StatusCode) -> None:
        elapsed = time.perf_counter() - self._started
        self._stats.finished(code, elapsed)
        if request_log.isEnabledFor(logging.DEBUG):
            call, peer = self.call, self._context.peer()
            principal = call.principal if call is not None and call.principal else "-"
            request_log.debug(
                "%s by %s from %s: %s in %.1f ms",
                self._method,
                principal,
                peer,
                code.name,
                elapsed * 1000,
                extra={
                    "event": "request",
                    "method": self._method,
                    "principal": principal,
                    "code": code.name,
                    "duration_ms": round(elapsed * 1000, 3),
                    "peer": peer,
                },
            )


class _Guard:
    """One method: authenticate, parse, call the handler, turn a Failure into the
    call's status."""

    def __init__(
        self, edge: Edge, method: MethodDescriptor, route: Route, malformed: MalformedLog
    ) -> None:
        self._edge = edge
        self._name = method.name
        self._request: type[Message] = getattr(pb, method.input_type.name)
        self.reply: type[Message] = getattr(pb, method.output_type.name)
        self._route = route
        self._malformed = malformed
        streaming = method.client_streaming or method.server_streaming
        self._stats = MethodMetrics(edge.metrics, self._name, streaming)

    def _call(self, context: Ctx) -> Call:
        if self._name in REFUSED_WHILE_DRAINING and self._edge.node.draining:
            raise Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"node {self._edge.node_id} is shutting down; retry on another node",
                leader=self._edge.another_node(),
            )
        metadata = context.invocation_metadata() or ()
        principal = (
            self._edge.principal(metadata, context) if self._route.auth is Auth.TOKEN else ""
        )
        admin = bool(principal) and self._edge.acl.is_admin(principal)
        return Call(context, principal, metadata, self._name, admin)

    def _parse(self, raw: bytes, context: Ctx) -> Any:
        try:
            return self._request.FromString(raw)
        except DecodeError as exc:
            self._malformed.note(self._name, context.peer(), exc)
            raise Failure.invalid(f"malformed {self._request.__name__}: {exc}") from None

    async def unary(self, raw: bytes, context: Ctx) -> Message:
        async with _Outcome(self._stats, self._name, context, stream=False) as outcome:
            call = outcome.call = self._call(context)
            request = self._parse(raw, context)
            if self._route.replica_of is not None:
                bucket = self._route.replica_of(request)
                forwarded = await self._edge.unless_local(call, bucket, request, self.reply)
                if forwarded is not None:
                    return forwarded
            result: Awaitable[Message] = self._route.handler(request, call)
            return await result

    async def server_stream(self, raw: bytes, context: Ctx) -> AsyncIterator[Message]:
        async with _Outcome(self._stats, self._name, context, stream=True) as outcome:
            call = outcome.call = self._call(context)
            messages: AsyncIterator[Message] = self._route.handler(self._parse(raw, context), call)
            async for message in messages:
                yield message

    async def bidi_stream(
        self, requests: AsyncIterator[bytes], context: Ctx
    ) -> AsyncIterator[Message | bytes]:
        async with _Outcome(self._stats, self._name, context, stream=True) as outcome:
            call = outcome.call = self._call(context)
            parsed = self._parsed(requests, context)
            messages: AsyncIterator[Message | bytes] = self._route.handler(parsed, call)
            async for message in messages:
                yield message

    async def _parsed(self, requests: AsyncIterator[bytes], context: Ctx) -> AsyncIterator[Any]:
        """The stream's requests; a malformed one raises its Failure (the handler ends
        the call with it)."""
        async for raw in requests:
            yield self._parse(raw, context)


def _code_of(exc: BaseException, context: Ctx) -> grpc.StatusCode:
    """The status a call that raised `exc` ends with (for `/metrics` and the log)."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def method_handlers(
    edge: Edge, routes: Mapping[str, Route], malformed: MalformedLog | None = None
) -> dict[str, grpc.RpcMethodHandler]:
    """The guarded handler of every method of `sevendb.v1.SevenDB`, taking raw bytes.
    Every method needs a route, and every route a method."""
    service = pb.DESCRIPTOR.services_by_name["SevenDB"]
    names = {m.name for m in service.methods}
    if names != set(routes):
        raise ValueError(f"routes do not match the service: {sorted(names ^ set(routes))}")
    malformed = malformed or MalformedLog()
    out: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        guard = _Guard(edge, method, routes[method.name], malformed)
        serialize = _serializer(guard.reply)
        if method.client_streaming and method.server_streaming:
            handler = grpc.stream_stream_rpc_method_handler(
                guard.bidi_stream, response_serializer=serialize
            )
        elif method.server_streaming:
            handler = grpc.unary_stream_rpc_method_handler(
                guard.server_stream, response_serializer=serialize
            )
        else:
            assert not method.client_streaming, method.name  # no client-streaming RPC yet
            handler = grpc.unary_unary_rpc_method_handler(
                guard.unary, response_serializer=serialize
            )
        out[method.name] = handler
    return out


def _serializer(reply: type[Message]) -> Callable[[Message | bytes], bytes]:
    """How a method's replies are encoded: a handler may yield a reply it has
    encoded itself (bytes, as a Session's responses are), sent as it is."""
    encode = reply.SerializeToString

    def serialize(message: Message | bytes) -> bytes:
        return message if type(message) is bytes else encode(message)  # type: ignore[arg-type]

    return serialize


def register(server: aio.Server, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    """Serve `handlers` (from `method_handlers`) on `server`."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


__all__ = [
    "MALFORMED_LOG_EVERY_S",
    "REFUSED_WHILE_DRAINING",
    "Auth",
    "MalformedLog",
    "Route",
    "method_handlers",
    "register",
]
