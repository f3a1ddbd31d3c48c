"""Side-by-side benchmarks: sevendb against etcd 3.4 and NATS JetStream 2.9.

    python tests/bench/side_by_side.py [--runs 3] [--seconds 10] [--quick]
                                       [--only etcd,nats,sevendb] [--workloads 1,2,3,4]
                                       [--netns]
    python tests/bench/side_by_side.py --groups [--quick] [--runs N]

On a fresh Debian machine (as root) it installs etcd-server, etcd-client and
nats-server with apt-get when missing, and generates etcd's Python gRPC stubs into
~/.cache/sevendb-bench from the .proto files of Debian's golang-etcd-server-dev.
Python packages: nats-py and matplotlib (the `bench` extra) are pip-installed into
the running interpreter when missing.

Each run starts a fresh 3-node cluster of each system on 127.0.0.1 (one system at a
time; the order rotates between runs), drives the same workloads through Python
clients in separate processes, and stops the cluster (also on Ctrl-C or an error).
With --netns (root only) sevendb runs once more, its three nodes on three network
namespace hosts behind a bridge (`sevendb-netns`, one more column beside the loopback
sevendb one), and the lab goes with the cluster. `--only ...,floor` adds the stack's
parts joined (`composed_node.py`: stock pysyncobj with an fdatasyncing journal behind
a bare gRPC write stream and watch, nothing of sevendb's), the floor under what any
system on this stack can do (its writer sends the writes waiting in one message,
one entry on the nodes, as sevendb's SDK and batcher do); workloads 1 and 2 only.
The workloads:

1. durable writes/s and latency p50/p99 at 1, 32 and 64 writes in flight;
2. commit->application latency at 500 writes/s with one subscriber process;
3. events delivered/s to 100 subscribers of one prefix, all kept up;
4. events delivered/s, CPU and memory per subscription with 1 and 10,000
   subscriptions fed by the same write stream.

`--groups` runs `bench_groups.py` instead: consumer group throughput with 1, 2 and 4
member processes and durable-subscription resume after a consumer's kill -9.

It prints one table (median, min and max over runs, and the ratios sevendb/etcd and
sevendb/NATS computed within each run) and every target of issue 30's table with its
bound and whether it is met (`peers.report.target_list`), writes docs/benchmarks.md and
docs/benchmarks.png, and keeps the raw figures and client logs under
~/.cache/sevendb-bench/results/. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from peers import report
from peers.clusters import (
    Cluster,
    ComposedCluster,
    EtcdCluster,
    NatsCluster,
    NetnsSevendbCluster,
    SevendbCluster,
    netns_module,
)
from peers.common import (
    CACHE_DIR,
    CLIENT_CPU_S,
    SEVENDB_CLIENT_ENV,
    JsonDict,
    WorkerError,
    host_cpu,
    log,
    machine_summary,
    stop_all_tracked,
)
from peers.install import (
    InstallError,
    binary_version,
    debian_version,
    ensure_binaries,
    ensure_etcd_stubs,
    ensure_python_packages,
)
from peers.workloads import INFLIGHTS, LATENCY_RATE, W4_INFLIGHT, WORKLOADS, Context, Options

REPO = Path(__file__).resolve().parents[2]
SEVENDB_CLIENTS = {
    "async": "sevendb through its SDK's AsyncClient on the worker's loop",
    "thread": "sevendb through its SDK's Client (its loop in a thread of its own)",
}
DOC = REPO / "docs" / "benchmarks.md"
CHART = REPO / "docs" / "benchmarks.png"

METHOD = f"""## Method

* **Clusters.** Three server processes per system on 127.0.0.1, each in a fresh data dir
  for every run, default settings otherwise, and only one system running at a time.
  - **etcd:** Debian's `etcd` 3.4, members `--initial-cluster-state new`, defaults
    (heartbeat 100 ms, no auto-compaction). A write is acknowledged once a quorum has
    fsynced its WAL.
  - **NATS:** Debian's `nats-server` 2.9 with JetStream, stream `BENCH` (`bench.>`): R3,
    file storage, limits retention. Created once per run. It acknowledges a publish when
    an R3 quorum has stored it, **without fsync**: 2.9 syncs every 60 s.
  - **sevendb:** `sevendb.cluster.ops.local.cluster_up(data, nodes=3, buckets=B, replicas=3,
    settled=True)`, with B = `--sevendb-buckets` (1 by default: one Raft group, like etcd's
    cluster and the NATS stream; more buckets spread leaders over the processes, but on a
    2-core host they add per-entry work without adding cores). Measured once each bucket's
    preferred node leads it (`settled`: a fresh cluster hands leadership over about a
    second after its first election, and the peers hand none over). A write is
    acknowledged once it is fsynced on a majority and applied.
  - **sevendb, 3 netns hosts** (`--netns`, root only): the same sevendb, its three
    nodes on three Linux network namespaces of a `tests/netns.py` lab (a veth pair
    each, one bridge, a private /24), made by `sevendb cluster init --insecure
    --buckets B` and run with `sevendb node run --config`. Raft and client traffic
    cross the veths and the bridge instead of loopback; the clients stay on the host
    and reach the nodes through the bridge's address. The same disk, CPUs and
    workloads as the loopback cluster, so the column beside it shows what the
    network stack between the nodes costs, not what separate machines would give.
* **Clients.** All Python, each in its own process, so client CPU is visible:
  - **etcd:** `grpc.aio` stubs generated at run time from etcd's own .proto files.
  - **NATS:** `nats-py`.
  - **sevendb:** its SDK's `AsyncClient` (`write`, `subscribe`) on the worker's asyncio
    loop, as the etcd and NATS workers run theirs; `--sevendb-client thread` uses
    `Client.write_async` and `Client.subscribe` instead, whose loop runs in a thread of
    its own (every call and every event crosses threads). The Machine table says which.

  Writers run N concurrent writes as closed loops, or open loops at a fixed rate. They
  connect to the etcd leader, to the NATS stream leader, or through the SDK, which
  routes each write to its bucket's leader and coalesces concurrent writes.
* **Values.** Every write carries a ~100-byte value whose first 12 bytes are its
  sequence number, and subscribers join on it.
  - etcd and sevendb keys are `<workload>/<seq>`, or `<workload>/<seq mod 10,000>` in
    workload 4.
  - NATS subjects are `bench.<workload>.x`, or `bench.<workload>.<seq mod 10,000>`.
* **Subscribers.**
  - **etcd:** Watch streams, one bidi stream per watcher; the
    `--etcd-watches-per-stream` option multiplexes them instead (etcd's Watch
    carries many watchers per stream, as sevendb's Session carries many
    subscriptions).
  - **NATS:** push consumers with `DeliverPolicy.NEW` and explicit acks, each message
    acked. They are durable (R3) in workloads 2 and 3 and ephemeral in workload 4.
    10,000 R3 consumers would be 10,000 Raft groups.
  - **sevendb:** SDK subscriptions, each handing its events to a function
    (`on_event`, as a NATS push consumer's callback; iterated with `async for` before
    2026-11-28). A process's subscriptions share one `Session` call per node (the
    SDK's only way to subscribe). The SDK acks what was processed; there is no cursor file, so
    nothing is fsynced client-side.
  - Each system's subscriber sets up 64 subscriptions at a time (etcd and NATS: 64
    concurrent creations; sevendb: 64 concurrent `AsyncClient.subscribe` calls;
    before 2026-11-26, 64 for etcd, 32 for NATS and 16 for sevendb).

  etcd and NATS subscriber processes connect to a follower (workload 2), or
  round-robin over the members (workloads 3 and 4); the sevendb SDK follows each
  bucket's notifier lease holder by itself.
* **1. Durable writes.** For {", ".join(map(str, INFLIGHTS))} in flight, closed loops run
  for `--seconds`. The table gives writes acknowledged per second and per-write latency
  from send to ack. Server cores are the 3 servers' CPU seconds over the wall time,
  from /proc.
* **2. Latency.** The writer runs an open loop at {LATENCY_RATE:.0f} writes/s for
  `--seconds`, with one subscription on the prefix in another process.
  - **commit→application** is the subscriber's receive time (after the client library
    decoded the event and handed it to the application) minus the writer's ack receive
    time for the same write, on the same host clock (`time.time_ns`). It can be
    negative when the event overtakes the ack.
  - **send→application** starts at the writer's send instead.
  - **Kept up** means every write arrived, the last within 1 s of the last ack.
* **3. Fan-out.** The 100 subscriptions of one prefix are spread over 4 subscriber
  processes. The writer steps its rate up from 50 writes/s by a factor of 1.41 (2 in
  `--quick`), each step lasting 3 s (2 s in `--quick`), until a step does not keep up:
  not every subscription received every event, or the last came more than 1 s after
  the last ack.
  - The figure is the delivered events/s of the best step that kept up: events over
    the time from the step's first send to its last receive.
  - A step whose acknowledged writes fall below half its target rate also ends the
    ramp (the writes themselves are saturated), and so does a 60 s budget (40 s in
    `--quick`).
* **4. 1 → 10,000 subscriptions** (`--subs`). The same write stream is used twice:
  {W4_INFLIGHT} in flight for `--seconds`, with keys cycling over 10,000.
  - First it goes to one subscription on the workload's prefix.
  - Then it goes to 10,000 subscriptions of one key each, in 4 processes of 2,500, so
    every write is one event to exactly one subscription.
  - **Events per CPU-second** divides the events by the CPU seconds of the 3 servers,
    the writer and the subscriber processes, from load start to the last event. The
    log also splits the servers' CPU per event by OS thread name (sevendb names its
    `raft`, `notifier-b<N>` and `archive-<node>` threads; the main thread with
    the gRPC loop keeps the process's name).
  - **Memory per subscription** is the 3 servers' RSS growth from before the
    subscriptions were made until 1 s after they were all up, over the count. The
    client figure is the subscriber processes' RSS growth, the same way. Whatever
    the servers free or allocate meanwhile (log compaction, allocator caches) also
    lands in this figure, so read its spread before comparing it.
  - Before each of the two, the harness waits until the servers use under 0.25
    cores together over a second (at most 120 s; the log says how long). sevendb
    archives what a workload delivered in the background: after workload 3's fan-out
    the three nodes' archive threads took 0.4-0.55 cores each for several seconds,
    which the idle and per-CPU figures below would otherwise count.
  - **Idle cores** is the CPU of servers and subscribers over 2 s with no writes.
  - sevendb's `Client.subscribe` gives up when a stream is not up within 30 s. The
    harness retries such a call up to twice and reports how many it retried.
  - The 10,000 subscriptions are not closed one by one: the cluster is stopped next.
* **Runs.** Every figure is the median of the runs, with min and max. Ratios are
  computed within a run, then summarised; none is given for commit→application p50,
  whose values sit around zero.
* **Caveats.** Everything shares one small host: servers, the writer, the subscribers,
  and any other work on the machine. Throughput is therefore the whole box's,
  including the Python clients. The peer baseline measured run-to-run spreads of
  1.5-2.5x on this kind of machine, so compare medians, and only within one page.
"""


class Interrupted(Exception):
    pass


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _while_stopping)  # a second Ctrl-C must not cut the cleanup short
    raise Interrupted(signal.Signals(signum).name)


def _while_stopping(signum: int, _frame: FrameType | None) -> None:
    log(f"{signal.Signals(signum).name}: still stopping what was started, please wait")


def versions(systems: list[str]) -> JsonDict:
    def pkg(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        commit += " + uncommitted changes" if dirty else ""
    etcd = nats = "not run"
    if "etcd" in systems:
        etcd = f"{binary_version(['etcd', '--version'])} (Debian {debian_version('etcd-server')})"
    if "nats" in systems:
        nats = (
            f"{binary_version(['nats-server', '--version'])} "
            f"(Debian {debian_version('nats-server')})"
        )
    return {
        "python": f"{platform.python_version()} ({sys.executable})",
        "etcd": etcd,
        "nats": nats,
        "sevendb": f"{pkg('sevendb')} at {commit or 'unknown commit'}",
        "clients": f"grpcio {pkg('grpcio')}, protobuf {pkg('protobuf')}, nats-py {pkg('nats-py')}; "
        + SEVENDB_CLIENTS[os.environ.get(SEVENDB_CLIENT_ENV, "async")],
    }


def make_cluster(system: str, where: Path, buckets: int) -> Cluster:
    if system == "etcd":
        return EtcdCluster(where)
    if system == "nats":
        return NatsCluster(where)
    if system == "sevendb-netns":
        return NetnsSevendbCluster(where, buckets)
    if system == "floor":
        return ComposedCluster(where)
    return SevendbCluster(where, buckets)


def run_system(
    system: str, run: int, options: Options, workloads: list[str], buckets: int, logs: Path
) -> JsonDict:
    where = Path(tempfile.mkdtemp(prefix=f"sevendb-bench-{system}-"))
    cluster = make_cluster(system, where, buckets)
    ctx = Context(system, cluster, options, logs, run)
    errors: dict[str, str] = {}
    busy0, steal0, total0 = host_cpu()
    own0 = CLIENT_CPU_S[0] + time.process_time()
    server_cpu = 0.0
    t0 = time.monotonic()
    try:
        log(f"run {run + 1}: starting {system}")
        cluster.start()
        for w in workloads:
            try:
                WORKLOADS[w](ctx)
            except (WorkerError, RuntimeError, TimeoutError, KeyError, ValueError) as exc:
                errors[w] = f"{type(exc).__name__}: {exc}"
                log(f"  {system} workload {w} failed: {errors[w]}")
                with contextlib.suppress(WorkerError):
                    ctx.drop_writer()
        with contextlib.suppress(WorkerError):
            ctx.drop_writer()
    finally:
        servers: list[int] = []
        with contextlib.suppress(Exception):
            servers = cluster.pids()
        stop_all_tracked(keep=servers)  # the clients first
        with contextlib.suppress(Exception):
            server_cpu = ctx.server_cpu()  # started with this run: their whole CPU
        cluster.stop()
        stop_all_tracked()
        for sub in ("etcd", "nats"):  # keep the servers' logs
            for f in (where / sub).glob("*.log"):
                shutil.copy(f, logs / f"run{run}-{f.name}")
        for f in (where / "sevendb" / "nodes").glob("*/node.log"):
            shutil.copy(f, logs / f"run{run}-sevendb-{f.parent.name}.log")
        for f in (where / "sevendb-netns").glob("*.log"):
            shutil.copy(f, logs / f"run{run}-sevendb-netns-{f.name}")
        shutil.rmtree(where, ignore_errors=True)
    busy1, steal1, total1 = host_cpu()
    wall = time.monotonic() - t0
    own = server_cpu + CLIENT_CPU_S[0] + time.process_time() - own0
    total = max(1.0, total1 - total0)
    return {
        "figures": ctx.figures,
        "errors": errors,
        "wall_s": wall,
        "host_busy_pct": 100 * (busy1 - busy0) / total,
        "host_steal_pct": 100 * (steal1 - steal0) / total,
        # CPU used by processes this harness did not start, in cores on average
        "other_cores": max(0.0, (busy1 - busy0) - own) / wall,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, help="runs per system (default 3, --quick 1)")
    p.add_argument("--seconds", type=float, help="load duration (default 10, --quick 3)")
    p.add_argument("--quick", action="store_true", help="1 short run, for development")
    p.add_argument(
        "--only", default="etcd,nats,sevendb", help="systems, comma-separated (also: floor)"
    )
    p.add_argument("--workloads", default="1,2,3,4", help="which of the 4, comma-separated")
    p.add_argument(
        "--netns",
        action="store_true",
        help="also sevendb on 3 network-namespace hosts (root; same as adding sevendb-netns "
        "to --only)",
    )
    p.add_argument("--subs", type=int, default=10_000, help="subscriptions in workload 4")
    p.add_argument("--fanout-subs", type=int, default=100, help="subscribers in workload 3")
    p.add_argument("--sevendb-buckets", type=int, default=1)
    p.add_argument(
        "--sevendb-client",
        choices=("async", "thread"),
        default="async",
        help="the SDK client of the sevendb workers: AsyncClient on the worker's asyncio loop "
        "(as the etcd and NATS workers run theirs), or Client (its loop in a thread of its own)",
    )
    p.add_argument("--etcd-watches-per-stream", type=int, default=1)
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/ alone")
    p.add_argument(
        "--groups",
        action="store_true",
        help="sevendb alone: consumer group throughput with 1, 2 and 4 members and durable "
        "resume after a consumer's kill -9 (tests/bench/bench_groups.py; --quick: a small "
        "backlog)",
    )
    p.add_argument(
        "--report-only", type=Path, help="rewrite the doc and chart from a saved results file"
    )
    args = p.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    args.seconds = args.seconds or (3.0 if args.quick else 10.0)
    return args


def write_outputs(results: JsonDict, no_doc: bool) -> None:
    print("\n" + report.console(results), flush=True)
    if no_doc:
        return
    DOC.write_text(report.markdown(results, METHOD))
    try:
        report.chart(results, CHART)
    except ImportError as exc:
        log(f"no chart ({exc}): pip install matplotlib")
    log(f"wrote {DOC.relative_to(REPO)} and {CHART.relative_to(REPO)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ[SEVENDB_CLIENT_ENV] = args.sevendb_client  # read by the workers it starts
    if args.groups:  # sevendb's consumer groups (etcd has none; NATS's are not driven here)
        from bench_groups import bench

        bench(300 if args.quick else 2000, 4, [1, 2, 4], 1.0, args.runs)
        return 0
    if args.report_only:
        write_outputs(json.loads(args.report_only.read_text()), args.no_doc)
        return 0
    only = args.only.split(",") + (["sevendb-netns"] if args.netns else [])
    unknown = sorted(set(only) - set(report.SYSTEMS))
    if unknown:
        print(f"unknown systems {unknown}: pick from {list(report.SYSTEMS)}", file=sys.stderr)
        return 2
    systems = [s for s in report.SYSTEMS if s in only]
    workloads = [w for w in "1234" if w in args.workloads.split(",")]
    if not systems or not workloads:
        print("nothing to run: check --only and --workloads", file=sys.stderr)
        return 2
    why = netns_module().missing_prerequisites() if "sevendb-netns" in systems else None
    if why is not None:
        print(f"cannot run sevendb-netns: {why}", file=sys.stderr)
        return 2
    options = Options(
        seconds=args.seconds,
        quick=args.quick,
        fanout_subs=args.fanout_subs,
        many_subs=args.subs,
        etcd_watches_per_stream=args.etcd_watches_per_stream,
    )
    if args.quick:
        options.fanout_factor = 2.0
        options.fanout_phase_s = 2.0
        options.fanout_budget_s = 40.0
        options.drain_grace_s = 5.0
    for sig in (
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
    ):  # also when started in the background
        signal.signal(sig, _on_signal)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = CACHE_DIR / "results" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        ensure_binaries(systems)
        ensure_python_packages(systems)
        if "etcd" in systems:
            ensure_etcd_stubs()
    except InstallError as exc:
        print(f"cannot prepare the peers: {exc}", file=sys.stderr)
        return 1
    results: JsonDict = {
        "mode": "quick" if args.quick else "full",
        "command": "python tests/bench/side_by_side.py " + shlex.join(sys.argv[1:]),
        "machine": machine_summary(),
        "versions": versions(systems),
        "load": "load average at start {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
        "options": {
            "runs": args.runs,
            "seconds": args.seconds,
            "many_subs": args.subs,
            "fanout_subs": args.fanout_subs,
            "sevendb_buckets": args.sevendb_buckets,
            "workloads": workloads,
        },
        "runs": {s: [] for s in systems},
    }
    interrupted = ""
    try:
        for run in range(args.runs):
            order = systems[run % len(systems) :] + systems[: run % len(systems)]
            for system in order:
                results["runs"][system].append(
                    run_system(system, run, options, workloads, args.sevendb_buckets, out_dir)
                )
                (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    except (KeyboardInterrupt, Interrupted) as exc:
        interrupted = str(exc) or "interrupted"
        log(f"{interrupted}: stopping; everything started was stopped")
    finally:
        stop_all_tracked()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M %Z")
    results["wall_min"] = (time.monotonic() - started) / 60
    steal = [r["host_steal_pct"] for rs in results["runs"].values() for r in rs]
    busy = [r["host_busy_pct"] for rs in results["runs"].values() for r in rs]
    other = [r["other_cores"] for rs in results["runs"].values() for r in rs]
    if busy:
        results["load"] += (
            f"; over each system's run: host CPU busy {min(busy):.0f}-{max(busy):.0f}%, "
            f"steal {min(steal):.1f}-{max(steal):.1f}%, processes this harness did not "
            f"start {min(other):.2f}-{max(other):.2f} cores"
        )
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    for system, runs in results["runs"].items():
        for i, r in enumerate(runs):
            for w, error in r["errors"].items():
                log(f"run {i + 1} {system} workload {w} failed: {error}")
    log(f"raw results and client/server logs: {out_dir}")
    write_outputs(results, args.no_doc or bool(interrupted))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
