"""When subscriptions and replicas stop holding a bucket (docs/core.md, "Lifecycles";
docs/contract.md §8): the idleness rule every replica applies, and the read-only
questions the lease holder, the replica adapter and operators ask of a bucket's
state. Pure: time is an argument.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import TYPE_CHECKING

from . import limits
from .model import SubscriptionInfo

if TYPE_CHECKING:
    from .state import BucketStateMachine
    from .subscriptions import Subscription


def idle(sub: Subscription, now_ms: int, stall_window_ms: int) -> bool:
    """No ack, subscribe or keep-alive within the window: it may be expired. With rows
    to acknowledge it is *stalled*: it no longer holds the safety point."""
    return now_ms - sub.last_active_ms > stall_window_ms


def expirable_subscriptions(
    sm: BucketStateMachine, now_ms: int, stall_window_ms: int, attached: Container[str] = ()
) -> tuple[str, ...]:
    """What an OUTBOX_PURGE may expire now (in sub_id order): every subscription idle
    past the window, except those with nothing to acknowledge whose client is
    `attached` (the holder keeps those alive instead: `touch`). A subscriber that
    acknowledges nothing is expired attached or not (docs/contract.md §8)."""
    return tuple(
        sorted(
            sub.sub_id
            for sub in sm.subs.by_id().values()
            if idle(sub, now_ms, stall_window_ms) and (sub.rows or sub.sub_id not in attached)
        )
    )


def stalled_subscriptions(
    sm: BucketStateMachine, now_ms: int, stall_window_ms: int
) -> tuple[str, ...]:
    """The idle subscriptions with rows to acknowledge (in sub_id order): they no
    longer hold the safety point (`BucketStateMachine.safety_point`)."""
    return tuple(
        sorted(
            sub.sub_id
            for sub in sm.subs.by_id().values()
            if sub.rows and idle(sub, now_ms, stall_window_ms)
        )
    )


def max_ack_lag(sm: BucketStateMachine) -> int:
    """The largest `Subscription.ack_lag` (commit indexes between a subscription's
    acknowledged point and its head) over the bucket's subscriptions; 0 with none."""
    return max((sub.ack_lag for sub in sm.subs.by_id().values()), default=0)


def cold_replica_checkpoint(
    replicas: Iterable[tuple[int, int]],
    now_ms: int,
    window_ms: int = limits.STALL_WINDOW_MS_DEFAULT,
) -> int | None:
    """The `cold_replica_checkpoint` a replica adapter passes to `safety_point`: the
    lowest log index any lagging replica still needs from the log, over the replicas
    heard from within `window_ms`. `replicas` are `(index the replica holds, log
    time it was last heard from)`; a replica silent longer no longer holds
    compaction (it is repaired from a snapshot when it returns), as a subscription
    idle past the stall window no longer does. None: no replica holds it back."""
    held = [index for index, seen_ms in replicas if now_ms - seen_ms <= window_ms]
    return min(held) if held else None


def history_trim_point(
    sm: BucketStateMachine,
    now_ms: int,
    max_entries: int,
    max_bytes: int,
    max_age_ms: int,
    stall_window_ms: int = limits.STALL_WINDOW_MS_DEFAULT,
) -> int | None:
    """The log index a HISTORY_TRIM should drop the retained history through, or None
    if it is within its bounds or the trim would drop nothing: the oldest change sets
    go while more than `max_entries` are kept, or more than `max_bytes`, or while they
    are older than `max_age_ms` (0: no bound by age). Never past the safety point: what
    acknowledged subscriptions still hold stays (docs/core.md, "Retained history")."""
    entries, size = sm.history.size()
    through = None
    for emit_seq, commit_time_ms, size_bytes in sm.history.marks():
        too_old = max_age_ms > 0 and now_ms - commit_time_ms > max_age_ms
        if entries <= max_entries and size <= max_bytes and not too_old:
            break
        through = emit_seq.commit_index
        entries, size = entries - 1, size - size_bytes
    if through is None:
        return None
    # A safety point below the oldest retained change set (between two of them, at an
    # entry that changed no key) drops nothing: proposing it anyway would append a
    # HISTORY_TRIM on every pass, for ever.
    point = min(through, sm.safety_point(now_ms, stall_window_ms))
    return point if point >= next(sm.history.marks())[0].commit_index else None


def subscription_info(sm: BucketStateMachine, sub_id: str) -> SubscriptionInfo | None:
    """What an operator sees of one subscription (None: no such live one)."""
    sub = sm.subs.get(sub_id)
    if sub is None:
        return None
    # Its rows are every one computed for it and not acknowledged; those after the
    # bucket's outboxed point are not checkpointed yet (docs/emission.md).
    through = sm.outboxed_through
    outboxed = [row for row in sub.rows if row.emit_seq.commit_index <= through]
    pending = len(sub.rows) - len(outboxed)
    size = sum(len(c.key) + len(c.value) for row in outboxed for c in row.delta.changes)
    return SubscriptionInfo(
        sub.sub_id,
        sub.principal,
        sub.query,
        sub.start,
        sub.head,
        sub.acked,
        sub.last_active_ms,
        len(outboxed),
        size,
        pending,
    )


def subscription_page(
    sm: BucketStateMachine, after: str = "", limit: int = 0, principal: str | None = None
) -> tuple[tuple[str, ...], bool]:
    """sub_ids after `after` in sub_id order (only `principal`'s, if given), at most
    `limit` (clamped as Sync pages are), and whether more follow."""
    if limit <= 0:
        limit = limits.SYNC_LIMIT_DEFAULT
    limit = min(limit, limits.SYNC_LIMIT_MAX)
    ids = sorted(
        sub_id
        for sub_id, sub in sm.subs.by_id().items()
        if sub_id > after and (principal is None or sub.principal == principal)
    )
    return tuple(ids[:limit]), len(ids) > limit


__all__ = [
    "cold_replica_checkpoint",
    "expirable_subscriptions",
    "idle",
    "max_ack_lag",
    "stalled_subscriptions",
    "subscription_info",
    "subscription_page",
]
