"""Transactions in the simulator (docs/transactions.md, docs/sim.md): producers run
transactions under the run's faults (leaders killed between a decision and its
markers, markers proposed in any order and again, timeouts racing commits, instances
fenced by new ones) and the checker proves atomicity and read_committed isolation.
(The broken variants that each of the two invariants catches are in
tests/test_sim_broken.py.)"""

from __future__ import annotations

from collections import Counter

from sevendb.sim.config import SimConfig
from sevendb.sim.world import Simulation

SEEDS = 40


def test_transactions_under_faults_keep_every_invariant() -> None:
    stats: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    for seed in range(SEEDS):
        sim = Simulation(SimConfig.from_seed(seed, txns=8))
        report = sim.run()
        assert report.ok, report.describe()
        stats.update(sim.stats)
        faults.update(sim.faults)
    # The runs did what the test is about: commits, aborts, timeouts racing commits,
    # fencing, markers again, and leaders lost along the way.
    for what in (
        "txn_commit",
        "txn_abort",
        "txn_driver_expire",
        "txn_refused_transaction_timed_out",
        "txn_refused_producer_fenced",
        "txn_driver_again",
    ):
        assert stats[what] > 0, (what, dict(stats))
    assert faults["holder_crash"] + faults["replica_crash"] > 0


def test_a_run_without_transactions_draws_as_before() -> None:
    """Transactions take their own generator: a seed without them runs as it did."""
    plain = Simulation(SimConfig.from_seed(7)).run()
    again = Simulation(SimConfig.from_seed(7, txns=0)).run()
    assert plain.trace_digest == again.trace_digest
