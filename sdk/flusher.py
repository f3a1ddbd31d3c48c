"""When one subscription persists its processed positions, and then acknowledges
them: the I/O and timers around the pure `Progress` (docs/emission.md, "Processed").

A purge must never overtake the durable cursor, so a position is saved to the
cursor store (fsync) before the ack that covers it leaves. A flush is due after
`ack_every_events` processed events (checked as the application asks for its next
event) or `ack_interval_s` after the first unflushed one (checked by a timer on the
client's loop, armed when events are handed over, so a consumer blocked waiting
still acks what it processed and its own thread wakes only for events). The
timers of a loop's subscriptions share one `FlushClock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Final

from sevendb.outbox.emitseq import EmitSeq
from sevendb.sdk.acks import AckPipeline
from sevendb.sdk.cursor_store import CursorStore, SavedCursor
from sevendb.sdk.engine import Engine
from sevendb.sdk.errors import BrokenReason, SubscriptionBroken
from sevendb.sdk.progress import Flush, Partial, Progress

log = logging.getLogger(__name__)

FLUSH_TICK_S: Final = 0.005
"""The grid a loop's time-based flushes run on: one is due at most this late."""


class FlushClock:
    """The time-based flushes of every subscription on one loop, one loop timer per
    `FLUSH_TICK_S` slot that has any. A timer per subscription (a flush after each
    delivery, a resend check after each flush) kept thousands in the loop's heap,
    whose pushes compare them in Python: with 2,500 one-key subscriptions a process,
    10% of its samples. Flushes due in one slot also send their acks together. Loop
    only."""

    __slots__ = ("_loop", "_slots")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the registry below must not keep loops alive
        self._slots: dict[int, list[Flusher]] = {}

    def at(self, slot: int, flusher: Flusher) -> None:
        """Call `flusher._fire(slot)` at the slot's time (`slot_of`)."""
        waiting = self._slots.get(slot)
        if waiting is None:
            loop = self._loop()
            assert loop is not None  # the caller runs on it
            self._slots[slot] = [flusher]
            loop.call_at(slot * FLUSH_TICK_S, self._fire, slot)
        else:
            waiting.append(flusher)

    def _fire(self, slot: int) -> None:
        for flusher in self._slots.pop(slot):
            try:
                flusher._fire(slot)
            except Exception:  # one subscription's bug must not stop the others' acks
                log.exception("a timed flush failed")


def slot_of(when: float) -> int:
    """The first `FlushClock` slot at or after loop time `when`."""
    return math.ceil(when / FLUSH_TICK_S)


_CLOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FlushClock] = (
    weakref.WeakKeyDictionary()
)


def flush_clock(loop: asyncio.AbstractEventLoop) -> FlushClock:
    """The `FlushClock` of `loop` (one per loop, made on first use; loop only)."""
    clock = _CLOCKS.get(loop)
    if clock is None:
        clock = _CLOCKS[loop] = FlushClock(loop)
    return clock


class Flusher:
    """Persist-then-ack for the bucket streams of one subscription (any thread,
    unless a method says otherwise)."""

    def __init__(
        self,
        engine: Engine,
        acks: AckPipeline,
        store: CursorStore | None,
        name: str,
        progress: Progress,
        *,
        interval_s: float,
        target_of: Callable[[int], str],
        failed: Callable[[BaseException], None],
    ) -> None:
        self._engine = engine
        self._acks = acks
        self.store = store
        self._name = name
        self._progress = progress
        self._interval_s = interval_s
        self._target_of = target_of
        """The node a bucket's acks go to (its stream's)."""
        self._failed = failed
        """Where a timed flush that failed is reported (the application's next read)."""
        self._lock = threading.Lock()
        """Guards `_progress` and the counters below."""
        self._flush_lock = threading.Lock()
        """One flush at a time, from whichever thread: the cursor store never gets an
        older position after a newer one, nor a cursor after `close` or a forget."""
        self._closed = False
        self._flushing = False
        """A timed flush is in the executor (loop only): no second one queued behind it."""
        self._handed = 0
        """Events handed to the application (loop only) ..."""
        self._marked = 0
        """... and those it has processed (under `_lock`)."""
        self._arm_on_mark = False
        """The ack timer found the application behind: its next processed event arms it
        again (under `_lock`)."""
        self._due: int | None = None
        """The `FlushClock` slot at which the loop next looks for time-based flushes
        (loop only; an earlier registration of a later slot is ignored when it fires)."""
        self._clock: FlushClock | None = None

    # ---- positions -------------------------------------------------------------------

    def start(
        self, bucket: int, sub_id: str, position: EmitSeq, partial: Partial | None = None
    ) -> None:
        """A bucket's stream (re)starts at `position` (`partial`: a saved cursor's)."""
        with self._lock:
            self._progress.start(bucket, sub_id, position, partial)

    def flushed(self, bucket: int) -> EmitSeq | None:
        """Where a reconnect of this bucket's stream resumes."""
        with self._lock:
            return self._progress.flushed(bucket)

    def forget(self, bucket: int) -> None:
        """The bucket's stream was dropped: nothing of it is persisted or acked again."""
        with self._lock:
            self._progress.forget(bucket)

    def save(self, bucket: int, sub_id: str, position: EmitSeq | None) -> None:
        """Persist one stream's cursor now (blocking; a no-op without a store)."""
        if self.store is not None:
            self.store.save([SavedCursor(sub_id, bucket, self._name, position)])

    def forget_cursor(self, sub_id: str) -> None:
        """Remove a stream's cursor (blocking), after any flush already running,
        which could save it again."""
        if self.store is not None:
            with self._flush_lock:
                self.store.forget([sub_id])

    def handed(self, count: int) -> None:
        """On the loop: `count` events went to the application."""
        self._handed += count
        self._arm(self._interval_s)

    def processed(self, bucket: int, sub_id: str, position: EmitSeq, count: int = 1) -> None:
        """The application finished with the events of the stream up to `position`
        (`count` of them since the last call; its thread)."""
        self.processed_change(bucket, sub_id, position, 0, 1, count)

    def processed_change(
        self, bucket: int, sub_id: str, emit_seq: EmitSeq, index: int, size: int, count: int = 1
    ) -> None:
        """The application finished with the stream's changes up to change `index` of
        the `size` of the entry at `emit_seq` (per-change delivery; `Progress`)."""
        with self._lock:
            self._progress.processed_change(
                bucket, sub_id, emit_seq, index, size, time.monotonic(), count
            )
            self._marked += count
            arm, self._arm_on_mark = self._arm_on_mark, False
        if arm:
            with contextlib.suppress(RuntimeError):  # the client's loop is gone
                self._engine.mailbox.post(self._arm, self._interval_s)

    def confirmed(self, bucket: int, sub_id: str, position: EmitSeq) -> None:
        """On the loop: the node accepted (or had covered) the ack for `position`."""
        with self._lock:
            self._progress.confirmed(bucket, sub_id, position)
            idle = self._marked == self._handed and self._progress.next_due_s(0.0) is None
        if idle:  # no resend check due: nothing left to look at (its slot finds so)
            self._due = None

    # ---- flushing --------------------------------------------------------------------

    def due(self) -> bool:
        with self._lock:
            return self._progress.due(time.monotonic())

    def flush_soon(self) -> None:
        """Any thread, never blocking: the loop looks for due flushes now (and does
        the fsync, if any, off the loop)."""
        with contextlib.suppress(RuntimeError):  # the client's loop is gone
            self._engine.mailbox.post(self._now)

    def _now(self) -> None:
        """On the loop: look for due flushes at once, not at the next clock slot."""
        if not self._closed:
            self._on_due()

    def flush(self, early_s: float = 0.0) -> None:
        """Persist, then acknowledge, whatever is due `early_s` from now (any thread;
        with a cursor store it blocks on the fsync)."""
        with self._flush_lock:
            if self._closed:
                return  # `close` flushed last
            with self._lock:
                now = time.monotonic() + early_s
                if not self._progress.due(now):
                    return
                flush = self._progress.take_flush(now)
            self._persist(flush)
            if flush.positions:
                if self._engine.on_loop_thread():
                    self._send_acks(flush)
                else:
                    self._engine.mailbox.post(self._send_acks, flush)

    def close(self, *, final: bool) -> Flush:
        """Stop flushing; with `final`, persist every position processed and return
        them, to be acknowledged with `wait_applied` (an empty `Flush` if persisting
        failed: nothing unpersisted may be acked)."""
        with self._flush_lock:  # after a flush already running; later ones see _closed
            self._closed = True
            if not final:
                return Flush(())
            with self._lock:
                flush = self._progress.take_flush(time.monotonic(), final=True)
            try:
                self._persist(flush)
            except Exception:
                log.exception("final cursor persist failed; the final acks are not sent")
                return Flush(())
            return flush

    def stop(self) -> None:
        """On the loop: no more timed flushes."""
        self._due = None

    def _persist(self, flush: Flush) -> None:
        if flush.saves and self.store is not None:
            self.store.save(
                [
                    SavedCursor(sub_id, bucket, self._name, pos, partial)
                    for bucket, sub_id, pos, partial in flush.saves
                ]
            )

    def _send_acks(self, flush: Flush) -> None:
        """On the loop: hand the acks to the client's per-node coalescing pipeline."""
        for bucket, sub_id, pos in flush.positions:
            confirmed = functools.partial(self.confirmed, bucket, sub_id)
            self._acks.ack(self._target_of(bucket), sub_id, pos, confirmed)

    # ---- the timer (loop only) -------------------------------------------------------
    # Time-based flushes (every `ack_interval_s`, resends after `ack_resend_s`) are the
    # loop's: a slot of its `FlushClock`, taken when events are handed over, flushes
    # while the application waits for its next event. The application's own task
    # then wakes once per delivery, not also for each ack due.

    def _arm(self, after_s: float) -> None:
        """Look for due flushes `after_s` from now, unless the timer is set sooner."""
        if self._closed:
            return
        loop = self._engine.loop
        slot = slot_of(loop.time() + after_s)
        if self._due is not None and self._due <= slot:
            return
        if self._clock is None:
            self._clock = flush_clock(loop)
        self._due = slot
        self._clock.at(slot, self)

    def _fire(self, slot: int) -> None:
        """Its `FlushClock` slot came (ignored unless it is the one taken last)."""
        if slot == self._due:
            self._on_due()

    def _on_due(self) -> None:
        self._due = None
        if self._closed:
            return
        # A quarter interval early: the first unflushed event was processed just
        # after the delivery that armed the timer, and one visit should take it.
        early = self._interval_s / 4
        if self.store is None:
            self._timed_flush(early)
            self._rearm()
        elif not self._flushing:  # the fsync off the loop; its end sets the timer again
            self._flushing = True
            done = self._engine.loop.run_in_executor(None, self._timed_flush, early)
            done.add_done_callback(self._flushed)

    def _flushed(self, _: object) -> None:
        self._flushing = False
        self._rearm()

    def _timed_flush(self, early_s: float) -> None:
        try:
            self.flush(early_s)
        except Exception as exc:  # the application's next read raises it
            log.exception("flushing cursors and acks of %s failed", self._name)
            self._failed(SubscriptionBroken(f"flush failed: {exc!r}", BrokenReason.FLUSH))

    def _rearm(self) -> None:
        with self._lock:
            wait = self._progress.next_due_s(time.monotonic())
            if self._marked < self._handed:
                self._arm_on_mark = True
        if wait is not None:
            self._arm(wait)


__all__ = ["Flusher"]
