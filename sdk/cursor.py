"""The client side of effective-once, pure: dedupe, a bounded reorder buffer and
gap detection through `prev_emit_seq` (docs/core.md, "The client side").

The server delivers at least once; this logic makes the application see each
event exactly once and in emit_seq order. It reads no clock and does no I/O: the
SDK's stream adapter feeds it events and acts on what it returns.
"""

from __future__ import annotations

from typing import Final, Generic, NamedTuple, Protocol, TypeVar

from sevendb.outbox.emitseq import EmitSeq

REORDER_BUFFER_MAX: Final = 1024
"""Events held while waiting for a missing predecessor before declaring a gap."""


class Chained(Protocol):
    @property
    def emit_seq(self) -> EmitSeq: ...

    @property
    def prev_emit_seq(self) -> EmitSeq: ...


E = TypeVar("E", bound=Chained)


class Offered(NamedTuple, Generic[E]):
    """What to do after offering one event.

    `ready`: deliver these to the application, in order. `duplicate`: the event was
    already released (dropped). `gap`: a predecessor is missing and the buffer is
    full: reconnect from `StreamCursor.released`.
    """

    ready: tuple[E, ...] = ()
    duplicate: bool = False
    gap: bool = False


class StreamCursor(Generic[E]):
    """Position of one subscription's stream in the client.

    `released` is the emit_seq of the last event handed to the application (or the
    stream start / the resumed position); the next event must chain from it.
    """

    def __init__(self, position: EmitSeq, *, reorder_buffer_max: int = REORDER_BUFFER_MAX) -> None:
        if reorder_buffer_max < 1:
            raise ValueError("reorder_buffer_max must be >= 1")
        self._released = position
        self._buffer: dict[EmitSeq, E] = {}
        self._buffer_max = reorder_buffer_max

    @property
    def released(self) -> EmitSeq:
        return self._released

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def waiting(self) -> bool:
        """True while events are held behind a missing predecessor."""
        return bool(self._buffer)

    def offer(self, event: E) -> Offered[E]:
        released = self._released
        if not self._buffer and event.prev_emit_seq == released and event.emit_seq > released:
            # The common case, in order with nothing held: the checks below would agree.
            self._released = event.emit_seq
            return Offered((event,))
        if event.emit_seq <= self._released:
            return Offered(duplicate=True)
        if event.prev_emit_seq < self._released:
            # Chains from before our position: this stream disagrees with what we
            # released. Never guess; resynchronise.
            return Offered(gap=True)
        if event.prev_emit_seq != self._released:
            # Out of order (or a gap): keep it, keyed by its predecessor.
            if event.prev_emit_seq not in self._buffer:
                self._buffer[event.prev_emit_seq] = event
            return Offered(gap=len(self._buffer) >= self._buffer_max)
        ready = [event]
        self._released = event.emit_seq
        while (nxt := self._buffer.pop(self._released, None)) is not None:
            ready.append(nxt)
            self._released = nxt.emit_seq
        # Anything left that chains from before the new position is a stale duplicate.
        for prev in [p for p in self._buffer if p < self._released]:
            del self._buffer[prev]
        return Offered(ready=tuple(ready))

    def resumed(self, position: EmitSeq) -> None:
        """The stream was re-established after `position`: drop what was buffered."""
        self._released = position
        self._buffer.clear()
