"""Summaries of the runs: the table (median, min, max over runs, and the ratios
sevendb/etcd, sevendb/NATS and, with --netns, sevendb on namespace hosts over
sevendb on loopback, computed within each run), the targets, the markdown page and
the chart."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from peers.common import JsonDict

SYSTEMS: Final = ("etcd", "nats", "sevendb", "sevendb-netns", "floor")
LABELS: Final = {
    "etcd": "etcd",
    "nats": "NATS",
    "sevendb": "sevendb",
    "sevendb-netns": "sevendb, 3 netns hosts",
    "floor": "the stack's parts joined",
}
RATIOS: Final = (
    ("sevendb", "etcd"),
    ("sevendb", "nats"),
    ("sevendb-netns", "sevendb"),
    ("floor", "etcd"),
)
"""The ratio columns of the table (system / base), when both ran."""


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    kind: str = "value"
    """value; flag (kept up: runs counted); info or near0 (values near or below zero,
    where a ratio says nothing): no ratio."""


def rows(many_subs: int) -> list[Row]:
    out: list[Row] = []
    for n in (1, 32, 64):
        out += [
            Row(f"w1.{n}.writes_per_s", f"1. durable writes/s, {n} in flight"),
            Row(f"w1.{n}.p50_ms", f"1. write latency p50 ms, {n} in flight"),
            Row(f"w1.{n}.p99_ms", f"1. write latency p99 ms, {n} in flight"),
        ]
    out += [
        Row("w1.64.server_cores", "1. server CPU cores, 64 in flight", "info"),
        Row("w1.64.client_cores", "1. writer CPU cores, 64 in flight", "info"),
        Row("w2.commit_to_app.p50_ms", "2. commit→application p50 ms @500 writes/s", "near0"),
        Row("w2.commit_to_app.p99_ms", "2. commit→application p99 ms @500 writes/s"),
        Row("w2.send_to_app.p50_ms", "2. send→application p50 ms @500 writes/s"),
        Row("w2.send_to_app.p99_ms", "2. send→application p99 ms @500 writes/s"),
        Row("w2.write.p50_ms", "2. write ack p50 ms @500 writes/s"),
        Row("w2.kept_up", "2. kept up @500 writes/s", "flag"),
        Row("w3.events_per_s", "3. events delivered/s, 100 subscribers (best kept-up step)"),
        Row("w3.writes_per_s", "3. writes/s at that step"),
        Row("w3.kept_up", "3. kept up at some step", "flag"),
        Row("w4.1.events_per_s", "4. events delivered/s, 1 subscription"),
        Row(f"w4.{many_subs}.events_per_s", f"4. events delivered/s, {many_subs:,} subscriptions"),
        Row("w4.1.events_per_cpu_s", "4. events per CPU-second, 1 subscription"),
        Row(
            f"w4.{many_subs}.events_per_cpu_s",
            f"4. events per CPU-second, {many_subs:,} subscriptions",
        ),
        Row("w4.per_core_ratio", f"4. per-core figure, {many_subs:,} ÷ 1 subscription"),
        Row(f"w4.{many_subs}.kept_up", f"4. kept up, {many_subs:,} subscriptions", "flag"),
        Row("w4.server_kib_per_sub", "4. server memory KiB per subscription (3 servers)"),
        Row("w4.client_kib_per_sub", "4. client memory KiB per subscription"),
        Row("w4.setup_subs_per_s", f"4. subscriptions set up per second ({many_subs:,})"),
        Row("w4.setup_retries", "4. subscribe calls retried after the SDK's 30 s timeout", "info"),
        Row(
            f"w4.{many_subs}.idle_server_cores",
            f"4. server CPU cores while {many_subs:,} subscriptions idle",
            "info",
        ),
        Row(
            f"w4.{many_subs}.idle_client_cores",
            f"4. client CPU cores while {many_subs:,} subscriptions idle",
            "info",
        ),
    ]
    return out


def _finite(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None and not math.isnan(v)]


def fmt(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    a = abs(value)
    if a >= 100:
        return f"{value:,.0f}"
    if a >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def spread(values: Sequence[float | None], flag: bool = False) -> str:
    got = _finite(values)
    if flag:
        return f"{sum(1 for v in got if v >= 1)}/{len(values)}" if values else "-"
    if not got:
        return "-"
    if len(got) == 1:
        return fmt(got[0])
    return f"{fmt(statistics.median(got))} ({fmt(min(got))}-{fmt(max(got))})"


def series(results: JsonDict, system: str, key: str) -> list[float | None]:
    runs: list[JsonDict] = results["runs"].get(system, [])
    return [r["figures"].get(key) for r in runs]


def ratios(results: JsonDict, system: str, key: str, base: str) -> list[float | None]:
    """system/base within each run (same run index: same cluster order, same hour)."""
    mine, theirs = series(results, system, key), series(results, base, key)
    out: list[float | None] = []
    for a, b in zip(mine, theirs, strict=False):
        out.append(a / b if a is not None and b and not math.isnan(a) else None)
    return out


def median(values: Sequence[float | None]) -> float:
    got = _finite(values)
    return statistics.median(got) if got else float("nan")


def table(results: JsonDict) -> str:
    present = [s for s in SYSTEMS if results["runs"].get(s)]
    head = ["figure", *(LABELS[s] for s in present)]
    pairs = [(s, b) for s, b in RATIOS if s in present and b in present]
    head += [f"{LABELS[s]} / {LABELS[b]}" for s, b in pairs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows(int(results["options"]["many_subs"])):
        cells = [row.label]
        if all(not _finite(series(results, s, row.key)) for s in present):
            continue
        cells += [spread(series(results, s, row.key), row.kind == "flag") for s in present]
        for s, b in pairs:
            cells.append("" if row.kind != "value" else spread(ratios(results, s, row.key, b)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """One target: sevendb's figure `key` against a peer's from the same run (a ratio
    per run, `bound` on its median, or on every run with `every_run`), or against a
    fixed `bound` when `base` is empty."""

    label: str
    key: str
    bound: float
    base: str = "etcd"
    higher_is_better: bool = True
    every_run: bool = False


def target_list(many: int) -> list[Target]:
    """Issue 30's table, in its order, then the earlier targets still in force."""
    return [
        Target(
            "send→application p50 ms @500 writes/s ≤ 1.0x etcd's",
            "w2.send_to_app.p50_ms",
            1.0,
            higher_is_better=False,
        ),
        Target(
            "send→application p99 ms @500 writes/s ≤ 1.0x etcd's",
            "w2.send_to_app.p99_ms",
            1.0,
            higher_is_better=False,
        ),
        Target("durable writes/s, 1 in flight ≥ 1.0x etcd", "w1.1.writes_per_s", 1.0),
        Target(
            "write latency p50 ms, 1 in flight ≤ etcd's", "w1.1.p50_ms", 1.0, higher_is_better=False
        ),
        Target(
            "durable writes/s, 64 in flight ≥ 2.5x etcd in every run",
            "w1.64.writes_per_s",
            2.5,
            every_run=True,
        ),
        Target(
            "durable writes/s, 64 in flight ≥ NATS JetStream's",
            "w1.64.writes_per_s",
            1.0,
            base="nats",
        ),
        Target(
            f"subscriptions set up per second ({many:,}) ≥ 1.0x etcd", "w4.setup_subs_per_s", 1.0
        ),
        Target(
            f"events per CPU-second, {many:,} ÷ 1 subscription ≥ 0.8",
            "w4.per_core_ratio",
            0.8,
            base="",
        ),
        Target(
            "events delivered/s, 100 subscribers ≥ 2.5x etcd (keep), every run kept up",
            "w3.events_per_s",
            2.5,
        ),
        Target(
            "write ack p50 ms @500 writes/s ≤ etcd's (issue 30, item 3)",
            "w2.write.p50_ms",
            1.0,
            higher_is_better=False,
        ),
        Target(
            "commit→application p99 ms @500 writes/s ≤ etcd's",
            "w2.commit_to_app.p99_ms",
            1.0,
            higher_is_better=False,
        ),
    ]


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**not met**")


def judge(results: JsonDict, target: Target) -> tuple[str, str]:
    """(where sevendb stands, met?) for one target."""
    mine = median(series(results, "sevendb", target.key))
    if not target.base:
        got = _finite(series(results, "sevendb", target.key))
        if not got:
            return "n/a", _verdict(None)
        ok = mine >= target.bound if target.higher_is_better else mine <= target.bound
        return f"{fmt(mine)} ({fmt(min(got))}-{fmt(max(got))})", _verdict(ok)
    per_run = _finite(ratios(results, "sevendb", target.key, target.base))
    if not per_run:
        return "n/a", _verdict(None)
    r = statistics.median(per_run)
    checked = (min(per_run) if target.higher_is_better else max(per_run)) if target.every_run else r
    ok = checked >= target.bound if target.higher_is_better else checked <= target.bound
    if target.key == "w3.events_per_s":
        ok = ok and all(k == 1 for k in series(results, "sevendb", "w3.kept_up"))
    theirs = median(series(results, target.base, target.key))
    runs = f", runs {fmt(min(per_run))}-{fmt(max(per_run))}" if len(per_run) > 1 else ""
    where = f"{fmt(mine)} vs {fmt(theirs)}: {fmt(r)}x {LABELS[target.base]}{runs}"
    floor = _finite(ratios(results, "floor", target.key, target.base))
    if floor:  # the floor under any system on this stack, where it ran
        where += f" ({LABELS['floor']}: {fmt(statistics.median(floor))}x)"
    return where, _verdict(ok)


def targets(results: JsonDict) -> list[tuple[str, str, str]]:
    """(target, where sevendb stands, met?) for every target (`target_list`)."""
    many = int(results["options"]["many_subs"])
    return [(t.label, *judge(results, t)) for t in target_list(many)]


def noise(results: JsonDict) -> str:
    """Per run and system: wall time, host CPU busy and steal, and the cores used by
    processes the harness did not start (other work on a shared machine)."""
    lines = [
        "| run | system | wall s | host busy % | steal % | other processes, cores | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for system in SYSTEMS:
        for i, r in enumerate(results["runs"].get(system, [])):
            failed = ", ".join(f"workload {w}" for w in r["errors"]) or ""
            lines.append(
                f"| {i + 1} | {LABELS[system]} | {r['wall_s']:.0f} | {r['host_busy_pct']:.0f} | "
                f"{r['host_steal_pct']:.1f} | {r.get('other_cores', float('nan')):.2f} | "
                f"{failed} |"
            )
    return "\n".join(lines)


def markdown(results: JsonDict, method: str) -> str:
    m = results["machine"]
    v = results["versions"]
    o = results["options"]
    lines = [
        "# Side-by-side benchmarks: sevendb, etcd and NATS JetStream",
        "",
        f"Generated by `tests/bench/side_by_side.py` on {results['finished']} "
        f"({results['mode']} mode, {o['runs']} run(s)); do not edit by hand, rerun it.",
        "",
        "## Machine",
        "",
        "| item | value |",
        "|---|---|",
        f"| host | {m['cores']} cores, {m['cpu']}, {m['mem_gib']} GiB |",
        f"| Python | {v['python']} |",
        f"| etcd | {v['etcd']} |",
        f"| NATS | {v['nats']} |",
        f"| sevendb | {v['sevendb']} |",
        f"| clients | {v['clients']} |",
        f"| host load | {results['load']} |",
        "",
        "## Commands",
        "",
        "```sh",
        "python tests/bench/side_by_side.py                  # 3 runs, 10 s loads (this page)",
        "python tests/bench/side_by_side.py --quick          # 1 short run, for development",
        "python tests/bench/side_by_side.py --only etcd,sevendb --workloads 1,2 --runs 5",
        "python tests/bench/side_by_side.py --netns          # + sevendb on 3 netns hosts (root)",
        "```",
        "",
        f"This page came from: `{results['command']}` (wall time {results['wall_min']:.1f} min).",
        "",
        "## Results",
        "",
        "Each cell: median over runs (min-max). The ratio columns are computed within each "
        "run (sevendb's figure over the peer's from the same run; with --netns also sevendb "
        "on namespace hosts over sevendb on loopback), then summarised the same way; for "
        "latencies and memory a ratio above 1 means sevendb (on namespace hosts) is worse. "
        "Kept up: runs in which it held.",
        "",
        table(results),
        "",
        "![chart](benchmarks.png)",
        "",
        "## Noise: the host during each system's run",
        "",
        noise(results),
        "",
        "## Targets",
        "",
        "Issue 30's table, then the earlier targets still in force. A ratio is sevendb's "
        "figure over the peer's within each run; a target holds on the median of those "
        "ratios over the runs, or on every run where it says so.",
        "",
        "| target | sevendb now (sevendb vs the peer, medians) | |",
        "|---|---|---|",
        *(f"| {t} | {s} | {ok} |" for t, s, ok in targets(results)),
        "",
        method,
    ]
    return "\n".join(lines) + "\n"


def chart(results: JsonDict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = int(results["options"]["many_subs"])
    present = [s for s in SYSTEMS if results["runs"].get(s)]
    colors = {
        "etcd": "#4c78a8",
        "nats": "#54a24b",
        "sevendb": "#e45756",
        "sevendb-netns": "#f58518",
        "floor": "#9d755d",
    }
    panels: list[tuple[str, list[tuple[str, str]], bool]] = [
        (
            "1. durable writes/s",
            [(f"w1.{n}.writes_per_s", f"{n} in flight") for n in (1, 32, 64)],
            False,
        ),
        (
            "2. latency @500 writes/s (ms)",
            [
                ("w2.commit_to_app.p50_ms", "commit→app p50"),
                ("w2.commit_to_app.p99_ms", "commit→app p99"),
                ("w2.send_to_app.p99_ms", "send→app p99"),
            ],
            False,
        ),
        ("3. events/s, 100 subscribers", [("w3.events_per_s", "best kept-up step")], False),
        (
            "4. events delivered/s",
            [("w4.1.events_per_s", "1 sub"), (f"w4.{many}.events_per_s", f"{many:,} subs")],
            False,
        ),
        (
            "4. events per CPU-second",
            [
                ("w4.1.events_per_cpu_s", "1 sub"),
                (f"w4.{many}.events_per_cpu_s", f"{many:,} subs"),
            ],
            False,
        ),
        (
            "4. memory per subscription (KiB)",
            [("w4.server_kib_per_sub", "servers"), ("w4.client_kib_per_sub", "client")],
            False,
        ),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (title, keys, log_scale) in zip(axes.flat, panels, strict=True):
        width = 0.8 / max(1, len(present))
        for i, system in enumerate(present):
            meds: list[float] = []
            lo: list[float] = []
            hi: list[float] = []
            for key, _ in keys:
                got = _finite(series(results, system, key))
                med = statistics.median(got) if got else 0.0
                meds.append(med)
                lo.append(med - min(got) if got else 0.0)
                hi.append(max(got) - med if got else 0.0)
            xs = [k + (i - (len(present) - 1) / 2) * width for k in range(len(keys))]
            ax.bar(
                xs,
                meds,
                width,
                yerr=[lo, hi],
                capsize=3,
                label=LABELS[system],
                color=colors[system],
            )
        ax.set_xticks(range(len(keys)), [label for _, label in keys])
        ax.set_title(title)
        if log_scale:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend()
    o = results["options"]
    fig.suptitle(
        f"sevendb vs etcd vs NATS JetStream, 3 nodes on one {results['machine']['cores']}-core "
        f"host, Python clients; median of {o['runs']} run(s), bars: min-max"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def console(results: JsonDict) -> str:
    out = [table(results), "", "Targets:"]
    out += [f"  {t}: {s} -> {ok}" for t, s, ok in targets(results)]
    return "\n".join(out)
