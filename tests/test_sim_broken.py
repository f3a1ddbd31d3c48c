"""Proof that the checker bites: broken variants must fail within a few seeds.

Each variant is injected through the simulation's configuration (`Bugs`), never
by editing production code; the same seeds and scenario pass with the real code.
"""

from __future__ import annotations

from typing import Any

import pytest

from sevendb.sim.config import Bugs, Scripted, SimConfig
from sevendb.sim.world import Report, Simulation

SEEDS_MAX = 30
"""A broken variant must be caught within this many seeds."""

# A stale lease holder: cut off from the other replicas (not from the clients) while
# the clients reconnect, so some of them land on it after a successor served them.
STALE_HOLDER = {
    "faults": (),
    "clients": 3,
    "fault_ms": 2_500,
    "scripted": (
        Scripted(600, "isolate_holder_raft"),
        Scripted(650, "crash_clients"),
        Scripted(1_300, "crash_clients"),
        Scripted(1_700, "crash_clients"),
    ),
}

# Protocol-aware recovery: follower B stops; the leader C and follower A acknowledge
# more writes; C dies and A restarts with a corrupt record in the middle of its log;
# B comes back while C is still down. Only A's vote could make B leader, and B lacks
# entries A and C acknowledged.
DAMAGED_VOTER = {
    "faults": (),
    "replicas": 3,
    "fault_ms": 3_000,
    "scripted": (
        Scripted(900, "crash_follower", 1_400),
        Scripted(1_200, "crash_leader", 5_000),
        Scripted(1_205, "corrupt_log", 300),
    ),
}

# A new holder takes over from one that computed rows its clients never received: the
# clients are down while writes go on, then the holder dies; they come back to its
# successor behind those rows. (A stall window longer than the run: a starved stream
# must not end as a legitimately expired one.)
PREDECESSOR_LEFT_ROWS = {
    "faults": (),
    "clients": 3,
    "subs_per_client": 2,
    "writes": 80,
    "fault_ms": 2_500,
    "stall_window_ms": 100_000,
    "scripted": (Scripted(500, "crash_clients", 700), Scripted(800, "crash_holder")),
}

VARIANTS: list[tuple[str, dict[str, Any], str]] = [
    ("sdk_skips_dedupe", {}, "effective-once"),
    ("purge_before_ack", {}, "purge-safety"),
    ("lease_without_fencing", STALE_HOLDER, "reconnect"),
    ("forget_unoutboxed_tail", {}, "liveness"),
    ("damaged_replica_votes", DAMAGED_VOTER, "durability"),
    ("expiry_window_in_seconds", {}, "lifecycle"),
    # The shortcuts one-round emission must not take (docs/emission.md):
    ("send_before_commit", {}, "visibility"),
    ("skip_predecessor_rows", PREDECESSOR_LEFT_ROWS, "liveness"),
    # Transactions (docs/transactions.md): a change seen before its COMMIT marker, and
    # a committed transaction completed without its marker.
    ("deliver_before_marker", {"txns": 8}, "read-committed"),
    ("complete_without_marker", {"txns": 8}, "atomicity"),
]
MODES = ("derived", "literal")
CASES = [(*variant, mode) for variant in VARIANTS for mode in MODES]
IDS = [f"{case[0]}-{case[3]}" for case in CASES]


def first_failure(bug: str, overrides: dict[str, Any], mode: str) -> Report | None:
    for seed in range(SEEDS_MAX):
        config = SimConfig.from_seed(seed, bugs=Bugs(**{bug: True}), emission=mode, **overrides)
        report = Simulation(config).run()
        if not report.ok:
            return report
    return None


@pytest.mark.parametrize(("bug", "overrides", "invariant", "mode"), CASES, ids=IDS)
def test_the_checker_catches_a_broken_variant(
    bug: str, overrides: dict[str, Any], invariant: str, mode: str
) -> None:
    report = first_failure(bug, overrides, mode)
    assert report is not None, f"{bug} survived {SEEDS_MAX} seeds"
    assert report.invariant == invariant, report.describe()
    assert f"--bug {bug}" in report.replay
    assert report.trace_tail
    # ... and the failure replays exactly from its seed.
    config = SimConfig.from_seed(report.seed, bugs=Bugs(**{bug: True}), emission=mode, **overrides)
    again = Simulation(config).run()
    assert (again.violation, again.trace_digest) == (report.violation, report.trace_digest)


@pytest.mark.parametrize(("bug", "overrides", "invariant", "mode"), CASES, ids=IDS)
def test_the_same_seeds_pass_with_the_real_code(
    bug: str, overrides: dict[str, Any], invariant: str, mode: str
) -> None:
    broken = first_failure(bug, overrides, mode)
    assert broken is not None
    for seed in range(broken.seed + 1):
        report = Simulation(SimConfig.from_seed(seed, emission=mode, **overrides)).run()
        assert report.ok, report.describe()
