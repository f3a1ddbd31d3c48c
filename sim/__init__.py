"""sevendb.sim: a deterministic simulator for one bucket (see docs/sim.md).

from sevendb.sim import SimConfig, Simulation
report = Simulation(SimConfig.from_seed(42)).run()
assert report.ok, report.describe()

May import: `sevendb.notifier`, `sevendb.sdk`, `sevendb.outbox`, `sevendb.proto`.
"""

from .checker import Checker, Violation
from .config import Bugs, Scripted, SimConfig
from .replay import emission_trace
from .world import Report, Simulation, run_seed

__all__ = [
    "Bugs",
    "Checker",
    "Report",
    "Scripted",
    "SimConfig",
    "Simulation",
    "Violation",
    "emission_trace",
    "run_seed",
]
