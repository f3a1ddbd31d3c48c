"""The simulator's command line.

    python -m sevendb.sim --seed 42                 # one seed; replays exactly
    python -m sevendb.sim --seeds 500 --time-budget 60
    python -m sevendb.sim --seed 7 --bug sdk_skips_dedupe

This is the only module of `sevendb.sim` that reads a clock: a monotonic one, to
honour `--time-budget` and report seeds per second. Nothing it reads reaches a
simulation, which sees only its seed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import BUG_NAMES, CLI_FIELDS, FAULT_KINDS, SCRIPTED_ACTIONS, Bugs, Scripted, SimConfig
from .planners import PLANNERS
from .world import Report, Simulation


@dataclass(slots=True)
class SwarmResult:
    seeds: int = 0
    failures: list[Report] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    checks: int = 0
    processed: int = 0
    refused: int = 0
    """Seeds whose bucket refused with DATA_LOSS (a correct end: storage faults
    damaged a majority)."""
    elapsed_s: float = 0.0
    modes: dict[str, Counter[str]] = field(default_factory=dict)
    """Emission mode -> faults injected in the seeds that ran with it ("seeds": how many)."""

    @property
    def seeds_per_s(self) -> float:
        return self.seeds / self.elapsed_s if self.elapsed_s else 0.0


def swarm(
    start: int,
    count: int,
    *,
    overrides: dict[str, Any] | None = None,
    time_budget_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    stop_on_failure: bool = False,
) -> SwarmResult:
    """Run seeds start, start+1, ... until `count` ran or the budget is spent."""
    result = SwarmResult()
    began = clock()
    for seed in range(start, start + count):
        if time_budget_s is not None and clock() - began >= time_budget_s:
            break
        config = SimConfig.from_seed(seed, **(overrides or {}))
        report = Simulation(config).run()
        result.seeds += 1
        result.faults.update(report.faults)
        per_mode = result.modes.setdefault(config.emission, Counter())
        per_mode.update(report.faults)
        per_mode["seeds"] += 1
        result.checks += report.stats.get("checks", 0)
        result.processed += report.stats.get("processed", 0)
        result.refused += bool(report.refused)
        if not report.ok:
            result.failures.append(report)
            if stop_on_failure:
                break
    result.elapsed_s = clock() - began
    return result


def shrink(config: SimConfig, invariant: str) -> tuple[SimConfig, Report]:
    """Drop fault-plan events one by one while the run still violates `invariant`."""
    events = list(config.scripted)
    best = Simulation(config).run()
    for i in range(len(events) - 1, -1, -1):
        trial = dataclasses.replace(config, scripted=tuple(events[:i] + events[i + 1 :]))
        report = Simulation(trial).run()
        if not report.ok and report.invariant == invariant:
            events, best = list(trial.scripted), report
    return dataclasses.replace(config, scripted=tuple(events)), best


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sevendb.sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seed", type=int, help="run this one seed")
    parser.add_argument("--seeds", type=int, help="run this many seeds (swarm)")
    parser.add_argument("--start", type=int, default=0, help="first seed of the swarm")
    parser.add_argument("--time-budget", type=float, help="stop the swarm after S seconds")
    parser.add_argument(
        "--bug", action="append", default=[], choices=BUG_NAMES, help="inject a broken variant"
    )
    repeated = {
        "--set": (
            "NAME=VALUE",
            f"pin a configuration field (a Python literal); one of {', '.join(CLI_FIELDS)}",
        ),
        "--script": (
            "MS:ACTION[:ARG[:PICK]]",
            "replace the fault plan with these events ('none': no events); ACTION is one "
            f"of {', '.join(SCRIPTED_ACTIONS)}",
        ),
        "--planner": (
            "REPLICA=NAME",
            f"give a replica a broken planner ({', '.join(PLANNERS)})",
        ),
    }
    for flag, (metavar, text) in repeated.items():
        parser.add_argument(flag, action="append", default=[], metavar=metavar, help=text)
    parser.add_argument("-v", "--verbose", action="store_true", help="print run statistics")
    parser.add_argument("--trace", action="store_true", help="print the whole trace of --seed")
    parser.add_argument(
        "--shrink", action="store_true", help="if --seed fails, drop fault events while it fails"
    )
    return parser


def _overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The SimConfig fields the command line pins."""
    bugs = Bugs(**{name: True for name in args.bug})
    overrides: dict[str, Any] = {"bugs": bugs}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in CLI_FIELDS:
            parser.error(f"--set {name}: not one of {', '.join(CLI_FIELDS)}")
        if name == "faults":
            overrides[name] = tuple(kind for kind in value.split(",") if kind)
            unknown = [kind for kind in overrides[name] if kind not in FAULT_KINDS]
            if unknown:
                parser.error(f"unknown fault kinds {unknown}; known: {', '.join(FAULT_KINDS)}")
        else:
            overrides[name] = ast.literal_eval(value)
    if args.script:
        overrides["scripted"] = tuple(
            Scripted.parse(item) for item in args.script if item != "none"
        )
    if args.planner:
        overrides["planners"] = {
            replica: PLANNERS[name]
            for replica, _, name in (item.partition("=") for item in args.planner)
        }
    return overrides


def config_from_argv(argv: Sequence[str]) -> SimConfig:
    """The configuration a `--seed N ...` command line runs (replay commands parse back)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.seed is None:
        parser.error("--seed is required")
    return SimConfig.from_seed(args.seed, **_overrides(parser, args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    overrides = _overrides(parser, args)

    if args.seed is not None:
        config = SimConfig.from_seed(args.seed, **overrides)
        if args.trace:
            sim = Simulation(config, keep_trace=True)
            report = sim.run()
            print("\n".join(sim.format_trace()))
            print(report.describe())
            return 0 if report.ok else 1
        report = Simulation(config).run()
        print(report.describe())
        if not report.ok and args.shrink:
            small, smaller = shrink(config, report.invariant)
            print(
                f"\nshrunk the fault plan from {len(config.scripted)} to "
                f"{len(small.scripted)} events:\n{smaller.describe()}"
            )
        if args.verbose or report.ok:
            print(f"faults enabled: {', '.join(config.faults) or '(none)'}")
            print(f"fault plan: {' '.join(str(e) for e in config.scripted) or '(empty)'}")
            print(f"faults injected: {dict(report.faults)}")
            print(f"stats: {report.stats}")
            print(f"trace digest: {report.trace_digest}")
        return 0 if report.ok else 1

    count = args.seeds if args.seeds is not None else 100
    result = swarm(args.start, count, overrides=overrides, time_budget_s=args.time_budget)
    print(
        f"{result.seeds} seeds in {result.elapsed_s:.1f} s ({result.seeds_per_s:.1f} seeds/s); "
        f"{sum(result.faults.values())} faults injected; {result.checks} events checked; "
        f"{result.processed} events processed by applications; "
        f"{result.refused} refused with DATA_LOSS; seeds per emission mode: "
        + ", ".join(f"{mode} {c['seeds']}" for mode, c in sorted(result.modes.items()))
    )
    if args.verbose:
        print(f"faults: {dict(sorted(result.faults.items()))}")
    for report in result.failures[:5]:
        print(report.describe())
    if result.failures:
        seeds = " ".join(str(r.seed) for r in result.failures[:20])
        print(f"{len(result.failures)} failing seeds: {seeds}")
        return 1
    return 0
