"""The four workloads, run the same way against each system's cluster; each returns
flat figures (name -> number) for one run of one system."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from peers.clusters import Cluster
from peers.common import (
    JsonDict,
    Worker,
    WorkerError,
    cpu_seconds,
    log,
    pct,
    rss_kb,
    thread_cpu,
)

INFLIGHTS: Final = (1, 32, 64)
LATENCY_RATE: Final = 500.0
KEPT_UP_S: Final = 1.0
"""Kept up: every event arrived, the last within this long of the last write's ack."""
QUIET_CORES: Final = 0.25
"""The servers together under this over a second: quiet (`Context.wait_quiet`)."""
QUIET_WAIT_S_MAX: Final = 120.0
W4_INFLIGHT: Final = 64
W4_KEYS: Final = 10_000

Figures = dict[str, float]

CLIENT_OF: Final = {"sevendb-netns": "sevendb"}
"""The worker (client library) a system's cluster is driven with, when not its own."""


@dataclass
class Options:
    seconds: float
    quick: bool
    fanout_subs: int = 100
    fanout_procs: int = 4
    fanout_start_rate: float = 50.0
    fanout_factor: float = 2**0.5
    fanout_phase_s: float = 3.0
    fanout_budget_s: float = 60.0
    many_subs: int = 10_000
    many_procs: int = 4
    etcd_watches_per_stream: int = 1
    drain_grace_s: float = 10.0


@dataclass
class Context:
    system: str
    cluster: Cluster
    options: Options
    logs: Path
    run: int
    figures: Figures = field(default_factory=dict)
    seq: int = 0
    _writer: Worker | None = None
    _workers: int = 0

    @property
    def client(self) -> str:
        return CLIENT_OF.get(self.system, self.system)

    def writer(self) -> Worker:
        if self._writer is None or self._writer.proc.poll() is not None:
            self._writer = Worker(
                self.client, "writer", self.cluster.conf(), self.log_path("writer")
            )
        return self._writer

    def drop_writer(self) -> None:
        if self._writer is not None:
            self._writer.close({"op": "quit"}, 30)
            self._writer = None

    def log_path(self, what: str) -> Path:
        self._workers += 1
        return self.logs / f"run{self.run}-{self.system}-{self._workers:02d}-{what}.log"

    def subscriber(self, spec: JsonDict, what: str, ready_timeout_s: float = 120.0) -> Worker:
        return Worker(
            self.client,
            "subscriber",
            {**self.cluster.conf(), "spec": spec},
            self.log_path(what),
            ready_timeout_s=ready_timeout_s,
        )

    def server_cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.cluster.pids())

    def wait_quiet(self) -> float:
        """Wait until the servers use under QUIET_CORES together over a second (what an
        earlier workload left them to do is done: sevendb archives what it delivered in
        the background), for at most QUIET_WAIT_S_MAX; the seconds waited."""
        t0 = time.monotonic()
        while True:
            cpu0 = self.server_cpu()
            time.sleep(1.0)
            busy = self.server_cpu() - cpu0
            waited = time.monotonic() - t0
            if busy < QUIET_CORES or waited >= QUIET_WAIT_S_MAX:
                if waited > 1.5:
                    log(f"  {self.system}: waited {waited:.0f} s for the servers to go quiet")
                return waited

    def server_rss_kb(self) -> int:
        return sum(rss_kb(p) for p in self.cluster.pids())

    def load(self, **command: object) -> JsonDict:
        """One writer load; sequences continue across loads of this run."""
        seconds = float(command["seconds"])  # type: ignore[arg-type]
        cpu0 = self.server_cpu()
        answer = self.writer().call({"op": "load", "seq0": self.seq, **command}, seconds + 120)
        answer["server_cpu_s"] = self.server_cpu() - cpu0
        self.seq = int(answer["seq_end"])
        return answer


def close_all(workers: list[Worker], unsubscribe: bool = True, abandon: bool = False) -> None:
    for w in workers:
        try:
            w.close({"op": "quit", "unsubscribe": unsubscribe, "abandon": abandon}, 90)
        except WorkerError as exc:
            log(f"  {w.name} did not quit cleanly: {exc}")


def wait_received(
    workers: list[Worker], expected: int, last_ack_ns: int, grace_s: float
) -> tuple[int, float]:
    """Poll the subscribers until `expected` events in total arrived, or `grace_s` past
    the last ack; (events seen, subscriber CPU seconds so far)."""
    deadline_ns = last_ack_ns + int((KEPT_UP_S + grace_s) * 1e9)
    while True:
        answers = [w.call({"op": "count"}, 30) for w in workers]
        got = sum(int(a["received"]) for a in answers)
        if got >= expected or time.time_ns() > deadline_ns:
            return got, sum(float(a["cpu_s"]) for a in answers)
        time.sleep(0.02)


def subscriber_cpu(workers: list[Worker]) -> float:
    return sum(float(w.call({"op": "count"}, 30)["cpu_s"]) for w in workers)


# ---- 1. durable writes ---------------------------------------------------------------------


def durable_writes(ctx: Context) -> None:
    for n in INFLIGHTS:
        r = ctx.load(prefix=f"w{n}", inflight=n, seconds=ctx.options.seconds)
        f = ctx.figures
        f[f"w1.{n}.writes_per_s"] = r["writes_per_s"]
        f[f"w1.{n}.p50_ms"] = r["p50_ms"]
        f[f"w1.{n}.p99_ms"] = r["p99_ms"]
        f[f"w1.{n}.server_cores"] = r["server_cpu_s"] / r["elapsed_s"]
        f[f"w1.{n}.client_cores"] = r["cpu_s"] / r["elapsed_s"]
        f[f"w1.{n}.errors"] = r["errors"]
        log(
            f"  {ctx.system} {n:>2} in flight: {r['writes_per_s']:,.0f} writes/s, "
            f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
            f"server {f[f'w1.{n}.server_cores']:.2f} cores, "
            f"client {f[f'w1.{n}.client_cores']:.2f}"
        )


# ---- 2. commit -> application latency ---------------------------------------------------------


def latency(ctx: Context) -> None:
    sub = ctx.subscriber(
        {"kind": "prefix", "prefix": "lat", "count": 1, "durable": True, "tag": f"lat{ctx.run}"},
        "latency-sub",
    )
    try:
        r = ctx.load(prefix="lat", rate=LATENCY_RATE, seconds=ctx.options.seconds, trace=True)
        wait_received([sub], r["writes"], r["last_ack_ns"], ctx.options.drain_grace_s)
        report = sub.call(
            {"op": "report", "ranges": [[r["seq0"], r["seq_end"]]], "trace": True}, 120
        )
    finally:
        close_all([sub])
    received: dict[int, int] = {}
    for seq, t in report["trace"]:
        received.setdefault(seq, t)
    commit_to_app: list[float] = []
    send_to_app: list[float] = []
    write: list[float] = []
    for seq, sent, acked in r["trace"]:
        write.append((acked - sent) / 1e6)
        got = received.get(seq)
        if got is not None:
            commit_to_app.append((got - acked) / 1e6)
            send_to_app.append((got - sent) / 1e6)
    commit_to_app.sort()
    send_to_app.sort()
    write.sort()
    summary = report["ranges"][0]
    kept_up = summary["distinct"] >= r["writes"] and summary["last_ns"] <= r["last_ack_ns"] + int(
        KEPT_UP_S * 1e9
    )
    f = ctx.figures
    f["w2.writes_per_s"] = r["writes_per_s"]
    f["w2.commit_to_app.p50_ms"] = pct(commit_to_app, 50)
    f["w2.commit_to_app.p99_ms"] = pct(commit_to_app, 99)
    f["w2.send_to_app.p50_ms"] = pct(send_to_app, 50)
    f["w2.send_to_app.p99_ms"] = pct(send_to_app, 99)
    f["w2.write.p50_ms"] = pct(write, 50)
    f["w2.write.p99_ms"] = pct(write, 99)
    f["w2.missing"] = r["writes"] - summary["distinct"]
    f["w2.kept_up"] = float(kept_up)
    log(
        f"  {ctx.system} @{LATENCY_RATE:.0f}/s: commit->app p50 {f['w2.commit_to_app.p50_ms']:.1f}"
        f" p99 {f['w2.commit_to_app.p99_ms']:.1f} ms, send->app p50 "
        f"{f['w2.send_to_app.p50_ms']:.1f} p99 {f['w2.send_to_app.p99_ms']:.1f} ms, "
        f"kept up {kept_up}"
    )


# ---- 3. fan-out to 100 subscribers ---------------------------------------------------------------


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """[a, b) index ranges of `parts` near-equal shares of `total`."""
    parts = max(1, min(parts, total))
    bounds = [round(total * i / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def fanout(ctx: Context) -> None:
    o = ctx.options
    workers: list[Worker] = []
    try:
        for p, (a, b) in enumerate(split(o.fanout_subs, o.fanout_procs)):
            workers.append(
                ctx.subscriber(
                    {
                        "kind": "prefix",
                        "prefix": "fan",
                        "count": b - a,
                        "durable": True,
                        "tag": f"fan{ctx.run}-{p}",
                        "placement": p,
                        "per_stream": 1,
                    },
                    f"fanout-sub{p}",
                )
            )
        subs = [int(w.ready["subs"]) for w in workers]
        log(
            f"  {ctx.system}: {sum(subs)} subscriptions in {len(workers)} processes, set up in "
            f"{max(float(w.ready['setup_s']) for w in workers):.1f} s"
        )
        rate = o.fanout_start_rate
        t_end = time.monotonic() + o.fanout_budget_s
        best: JsonDict | None = None
        first_fail: JsonDict | None = None
        write_bound = False
        phases = 0
        expected = 0  # events so far, over every phase
        while time.monotonic() < t_end:
            phases += 1
            r = ctx.load(prefix="fan", rate=rate, seconds=o.fanout_phase_s)
            expected += r["writes"] * sum(subs)
            wait_received(workers, expected, r["last_ack_ns"], 0.0)
            # events of this phase only (events of earlier phases all arrived: kept up)
            wait_ns = r["last_ack_ns"] + int(KEPT_UP_S * 1e9)
            reports = [
                w.call(
                    {"op": "report", "ranges": [[r["seq0"], r["seq_end"]]], "since_last": True},
                    120,
                )["ranges"][0]
                for w in workers
            ]
            distinct = sum(int(x["distinct"]) for x in reports)
            min_per_sub = min(int(x["min_per_sub"]) for x in reports)
            last_ns = max(int(x["last_ns"]) for x in reports)
            kept_up = min_per_sub >= r["writes"] and last_ns <= wait_ns
            span_s = max(1e-9, (last_ns - r["first_send_ns"]) / 1e9)
            phase = {
                "rate": rate,
                "writes_per_s": r["writes_per_s"],
                "events_per_s": distinct / span_s,
                "kept_up": kept_up,
                "lag_s": (last_ns - r["last_ack_ns"]) / 1e9,
            }
            log(
                f"  {ctx.system} fan-out @{rate:,.0f} writes/s: {r['writes_per_s']:,.0f} "
                f"writes/s, {phase['events_per_s']:,.0f} events/s, kept up {kept_up} "
                f"(last event {phase['lag_s'] * 1000:.0f} ms after the last ack)"
            )
            if kept_up and (best is None or phase["events_per_s"] > best["events_per_s"]):
                best = phase
            if not kept_up:
                first_fail = phase
                # let the backlog drain before the subscribers are stopped
                wait_received(workers, 0, r["last_ack_ns"], o.drain_grace_s)
                break
            if r["writes_per_s"] < 0.5 * rate:
                write_bound = True  # the writes themselves are far behind: stop here
                break
            rate *= o.fanout_factor
        f = ctx.figures
        chosen = best or first_fail
        if chosen is not None:
            f["w3.events_per_s"] = chosen["events_per_s"]
            f["w3.writes_per_s"] = chosen["writes_per_s"]
            f["w3.kept_up"] = float(best is not None)
        if first_fail is not None:
            f["w3.failed_at_writes_per_s"] = first_fail["rate"]
        f["w3.phases"] = phases
        f["w3.write_bound"] = float(write_bound)
        f["w3.setup_s"] = max(float(w.ready["setup_s"]) for w in workers)
    finally:
        close_all(workers)


# ---- 4. from 1 to 10,000 subscriptions ---------------------------------------------------------


def _per_event(before: dict[str, float], after: dict[str, float], events: int) -> str:
    """µs of CPU per event by thread name, largest first."""
    by_thread = sorted(((t - before.get(n, 0.0)) * 1e6 / events, n) for n, t in after.items())
    return ", ".join(f"{name} {us:.1f} µs" for us, name in reversed(by_thread) if us >= 0.05)


def many(ctx: Context) -> None:
    """The same write stream (64 in flight, keys cycling over 10,000) delivered to 1
    subscription on their prefix, then to 10,000 subscriptions of one key each."""
    o = ctx.options
    n_keys = max(o.many_subs, 1)
    for subs in (1, o.many_subs):
        prefix = f"many{subs}"
        procs = 1 if subs == 1 else o.many_procs
        ctx.figures[f"w4.{subs}.quiet_wait_s"] = ctx.wait_quiet()
        rss0 = ctx.server_rss_kb()
        workers: list[Worker] = []
        t0 = time.monotonic()
        try:
            for p, (a, b) in enumerate(split(subs, procs)):
                spec: JsonDict = {
                    "prefix": prefix,
                    "durable": False,
                    "tag": f"m{ctx.run}-{subs}-{p}",
                    "placement": p,
                    "per_stream": ctx.options.etcd_watches_per_stream,
                }
                spec |= (
                    {"kind": "prefix", "count": 1}
                    if subs == 1
                    else {"kind": "keys", "key0": a, "key1": b}
                )
                workers.append(ctx.subscriber(spec, f"many{subs}-sub{p}", ready_timeout_s=900))
            setup_s = time.monotonic() - t0
            time.sleep(1.0)  # let the servers settle before reading their memory
            rss1 = ctx.server_rss_kb()
            client_kb = sum(
                int(w.ready["rss_kb_after"]) - int(w.ready["rss_kb_before"]) for w in workers
            )
            # idle cost of holding the subscriptions
            t_a = time.monotonic()
            server_a, client_a = ctx.server_cpu(), subscriber_cpu(workers)
            time.sleep(2.0)
            server_b, client_b = ctx.server_cpu(), subscriber_cpu(workers)
            idle_s = time.monotonic() - t_a
            idle_server = (server_b - server_a) / idle_s
            idle_client = (client_b - client_a) / idle_s
            retries = sum(int(w.ready.get("retries", 0)) for w in workers)
            sub_cpu0 = subscriber_cpu(workers)
            server_cpu0 = ctx.server_cpu()
            threads0 = thread_cpu(ctx.cluster.pids())
            sub_threads0 = thread_cpu(w.proc.pid for w in workers)
            r = ctx.load(
                prefix=prefix,
                inflight=W4_INFLIGHT,
                seconds=o.seconds,
                cycle=n_keys,
            )
            _, sub_cpu1 = wait_received(workers, r["writes"], r["last_ack_ns"], o.drain_grace_s)
            server_cpu = ctx.server_cpu() - server_cpu0
            threads1 = thread_cpu(ctx.cluster.pids())
            sub_threads1 = thread_cpu(w.proc.pid for w in workers)
            reports = [
                w.call({"op": "report", "ranges": [[r["seq0"], r["seq_end"]]]}, 300)["ranges"][0]
                for w in workers
            ]
        finally:
            # The last phase of the run: 10,000 subscriptions are left to the cluster's
            # teardown (closing them one by one only measures the SDK's close).
            close_all(workers, unsubscribe=subs == 1, abandon=subs > 1)
        distinct = sum(int(x["distinct"]) for x in reports)
        last_ns = max(int(x["last_ns"]) for x in reports)
        span_s = max(1e-9, (last_ns - r["first_send_ns"]) / 1e9)
        cpu = server_cpu + (sub_cpu1 - sub_cpu0) + float(r["cpu_s"])
        kept_up = distinct >= r["writes"] and last_ns <= r["last_ack_ns"] + int(KEPT_UP_S * 1e9)
        f = ctx.figures
        f[f"w4.{subs}.events_per_s"] = distinct / span_s
        f[f"w4.{subs}.writes_per_s"] = r["writes_per_s"]
        f[f"w4.{subs}.events_per_cpu_s"] = distinct / cpu if cpu else float("nan")
        f[f"w4.{subs}.cores"] = cpu / span_s
        f[f"w4.{subs}.kept_up"] = float(kept_up)
        f[f"w4.{subs}.idle_server_cores"] = idle_server
        f[f"w4.{subs}.idle_client_cores"] = idle_client
        if subs > 1:
            f["w4.setup_retries"] = retries
            f["w4.server_kib_per_sub"] = (rss1 - rss0) / subs
            f["w4.client_kib_per_sub"] = client_kb / subs
            f["w4.setup_subs_per_s"] = subs / setup_s
        log(
            f"  {ctx.system} {subs:,} subscription(s): {f[f'w4.{subs}.events_per_s']:,.0f} "
            f"events/s ({distinct}/{r['writes']}), {f[f'w4.{subs}.events_per_cpu_s']:,.0f} "
            f"events per CPU-second (CPU s: servers {server_cpu:.1f}, subscribers "
            f"{sub_cpu1 - sub_cpu0:.1f}, writer {float(r['cpu_s']):.1f}), kept up {kept_up}, "
            f"idle: servers {idle_server:.2f} + "
            f"clients {idle_client:.2f} cores, "
            f"server RSS +{(rss1 - rss0) / 1024:.1f} MiB, client RSS +{client_kb / 1024:.1f} MiB, "
            f"setup {setup_s:.1f} s"
        )
        if distinct:
            for whose, before, after in (
                ("servers'", threads0, threads1),
                ("subscribers'", sub_threads0, sub_threads1),
            ):
                by_name = _per_event(before, after, distinct)
                log(f"    {whose} CPU per event by thread name: {by_name}")
    one, lots = "w4.1.events_per_cpu_s", f"w4.{o.many_subs}.events_per_cpu_s"
    if one in ctx.figures and lots in ctx.figures:
        ctx.figures["w4.per_core_ratio"] = ctx.figures[lots] / ctx.figures[one]


WORKLOADS: Final = {"1": durable_writes, "2": latency, "3": fanout, "4": many}
