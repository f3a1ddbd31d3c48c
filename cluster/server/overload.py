"""Overload protection at a node's edge: the limits a node enforces (`ServerLimits`,
settings from `SEVENDB_SERVER_<FIELD>`) and the per-principal rates (`RateLimiter`).

Everything past a limit is refused RESOURCE_EXHAUSTED with a `sevendb-error`
(`RATE_LIMITED`, `OVERLOADED`, `TOO_MANY_SUBSCRIPTIONS`) and, when waiting helps,
`sevendb-retry-after-ms`; nothing is queued beyond a bound. docs/limits.md lists
every limit with its default.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from sevendb.cluster.server.errors import Failure
from sevendb.outbox import limits
from sevendb.proto import codec

PRINCIPALS_TRACKED_MAX: Final = 65_536
"""Principals whose rates a node tracks at once; beyond, those whose allowance is
full again (idle ones: forgetting them changes nothing) are forgotten."""


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one node lets each principal do, and how far its queues may grow. A rate
    of 0 is no limit. Rates are per node: a principal writing through several nodes
    gets each node's allowance at each (a write is counted by the node whose replica
    batches it, not by a node that only forwards it)."""

    principal_writes_per_s: float = 50_000.0
    """Writes one principal may have batched here per second (a WriteMany of N counts N)."""
    principal_write_bytes_per_s: float = 64 * 1024 * 1024
    """Key and value bytes one principal may write here per second."""
    principal_burst_s: float = 1.0
    """A principal idle for a while may go this many seconds' worth over its rate at once."""
    principal_subscriptions_max: int = 32_768
    """Live subscriptions one principal may hold in one bucket (the bucket holds at
    most SUBSCRIPTIONS_PER_BUCKET_MAX = 65,536 of everyone's)."""
    batcher_writes_max: int = 65_536
    """Writes waiting in one bucket's write batcher (not yet proposed) before new ones
    are refused OVERLOADED."""
    batcher_bytes_max: int = 64 * 1024 * 1024
    """Key and value bytes waiting in one bucket's write batcher before new writes are
    refused OVERLOADED."""
    overloaded_retry_after_ms: int = 100
    """The retry-after a full batcher advises."""
    keepalive_ms: int = 60_000
    """A client connection with a call open is pinged after this long without
    traffic (gRPC keepalive): a client that vanished without closing (its host off,
    the network cut) is found, and its connection closed, its streams ended."""
    keepalive_timeout_ms: int = 20_000
    """How long a ping may go unanswered before the connection is closed."""
    connection_idle_ms: int = 600_000
    """A client connection with no call open this long is closed (GOAWAY; a client
    connects again on its next call)."""

    def __post_init__(self) -> None:
        if min(self.principal_writes_per_s, self.principal_write_bytes_per_s) < 0:
            raise ValueError("principal rates must be >= 0 (0: no limit)")
        if self.principal_burst_s <= 0:
            raise ValueError("principal_burst_s must be positive")
        if not 1 <= self.principal_subscriptions_max <= limits.SUBSCRIPTIONS_PER_BUCKET_MAX:
            raise ValueError(
                f"principal_subscriptions_max must be in [1, {limits.SUBSCRIPTIONS_PER_BUCKET_MAX}]"
            )
        if self.batcher_writes_max < 1 or self.batcher_bytes_max < 1:
            raise ValueError("batcher_writes_max and batcher_bytes_max must be >= 1")
        if self.overloaded_retry_after_ms < 1:
            raise ValueError("overloaded_retry_after_ms must be >= 1")
        if min(self.keepalive_ms, self.keepalive_timeout_ms, self.connection_idle_ms) < 1000:
            raise ValueError(
                "keepalive_ms, keepalive_timeout_ms and connection_idle_ms must be >= 1000"
            )

    def grpc_options(self) -> list[tuple[str, int]]:
        """The gRPC server's connection settings for these limits."""
        return [
            ("grpc.keepalive_time_ms", self.keepalive_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            # gRPC closes the connection on a ping's own timeout, not keepalive's.
            ("grpc.http2.ping_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.max_connection_idle_ms", self.connection_idle_ms),
            # Ping an idle stream's connection for as long as it lasts (gRPC's default
            # stops after 2 pings without data).
            ("grpc.http2.max_pings_without_data", 0),
        ]


class _Allowance:
    """One token bucket: `rate` per second, up to `rate * burst_s`, in debt allowed."""

    __slots__ = ("at", "capacity", "rate", "tokens")

    def __init__(self, rate: float, burst_s: float, now: float) -> None:
        self.rate = rate
        self.capacity = rate * burst_s
        self.tokens = self.capacity
        self.at = now

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def wait_ms(self, cost: float) -> int:
        """0 if `cost` may be taken now, else how long until it may. A cost above the
        whole burst is taken when the allowance is full (then owed)."""
        need = min(cost, self.capacity)
        if self.tokens + 1e-9 >= need:  # (refills are float sums: allow their rounding)
            return 0
        return max(1, math.ceil((need - self.tokens) / self.rate * 1000))

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.at) * self.rate >= self.capacity


class RateLimiter:
    """Per-principal write rates of one node (writes and bytes per second). Used on
    the node's event loop only."""

    def __init__(self, settings: ServerLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._writes: dict[str, _Allowance] = {}
        self._bytes: dict[str, _Allowance] = {}

    def charge_writes(self, principal: str, writes: int, size: int) -> None:
        """Take `writes` writes of `size` bytes from `principal`'s allowance, or raise
        the RESOURCE_EXHAUSTED `Failure` (RATE_LIMITED, with the wait) and take
        nothing."""
        s = self._settings
        now = self._clock()
        pairs = [
            (self._allowance(self._writes, principal, s.principal_writes_per_s, now), writes),
            (self._allowance(self._bytes, principal, s.principal_write_bytes_per_s, now), size),
        ]
        wait_ms = 0
        for allowance, cost in pairs:
            if allowance is not None:
                allowance.refill(now)
                wait_ms = max(wait_ms, allowance.wait_ms(cost))
        if wait_ms:
            rates = [
                f"{rate:g} {unit}/s"
                for rate, unit in (
                    (s.principal_writes_per_s, "writes"),
                    (s.principal_write_bytes_per_s, "bytes"),
                )
                if rate > 0
            ]
            raise Failure.exhausted(
                f"principal {principal!r} is over its write rate on this node "
                f"({', '.join(rates)}); retry in {wait_ms} ms",
                codec.RATE_LIMITED,
                wait_ms,
            )
        for allowance, cost in pairs:
            if allowance is not None:
                allowance.tokens -= cost

    def _allowance(
        self, table: dict[str, _Allowance], principal: str, rate: float, now: float
    ) -> _Allowance | None:
        if rate <= 0:
            return None
        allowance = table.get(principal)
        if allowance is None:
            if len(table) >= PRINCIPALS_TRACKED_MAX:
                for name in [n for n, a in table.items() if a.full(now)]:
                    del table[name]
            allowance = table[principal] = _Allowance(rate, self._settings.principal_burst_s, now)
        return allowance

    def tracked(self) -> int:
        """Principals tracked now (bounded by PRINCIPALS_TRACKED_MAX, unless that many
        are all over their rate at once)."""
        return len(set(self._writes) | set(self._bytes))


__all__ = ["PRINCIPALS_TRACKED_MAX", "RateLimiter", "ServerLimits"]
