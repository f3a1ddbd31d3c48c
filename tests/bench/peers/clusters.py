"""Three-node clusters on 127.0.0.1, each in a fresh data dir, started and stopped by
the harness: etcd 3.4 and NATS JetStream 2.9 as in the peer baseline notes, and
sevendb through `sevendb.cluster.ops.local`; and sevendb once more with its three
nodes on three network-namespace hosts (`NetnsSevendbCluster`, root only)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from peers.common import JsonDict, free_ports, log, stop_process, track

if TYPE_CHECKING:
    from sevendb.cluster.common.bundle import ClientConfig

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
TESTS_DIR = Path(__file__).resolve().parents[2]


class Cluster(Protocol):
    name: str

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def pids(self) -> list[int]:
        """The server processes (for CPU and RSS)."""
        ...

    def conf(self) -> JsonDict:
        """What a client worker needs to reach the cluster."""
        ...


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    track(proc)
    return proc


def _tail(path: Path, lines: int = 10) -> str:
    try:
        return "\n    ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class _ServerProcesses:
    """A cluster of three server processes this harness spawned."""

    procs: list[subprocess.Popen[bytes]]

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


class EtcdCluster(_ServerProcesses):
    name = "etcd"

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "etcd"
        self.procs: list[subprocess.Popen[bytes]] = []
        ports = free_ports(6)
        self.client_urls = [f"http://127.0.0.1:{p}" for p in ports[:3]]
        self.peer_urls = [f"http://127.0.0.1:{p}" for p in ports[3:]]

    def start(self) -> None:
        self.dir.mkdir(parents=True)
        initial = ",".join(f"e{i + 1}={url}" for i, url in enumerate(self.peer_urls))
        for i in range(3):
            name = f"e{i + 1}"
            cmd = [
                "etcd",
                "--name",
                name,
                "--data-dir",
                str(self.dir / name),
                "--listen-client-urls",
                self.client_urls[i],
                "--advertise-client-urls",
                self.client_urls[i],
                "--listen-peer-urls",
                self.peer_urls[i],
                "--initial-advertise-peer-urls",
                self.peer_urls[i],
                "--initial-cluster",
                initial,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                "side-by-side",
                "--logger",
                "zap",
                "--log-outputs",
                str(self.dir / f"{name}.log"),
            ]
            self.procs.append(_spawn(cmd, self.dir / f"{name}.out"))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                out = subprocess.run(
                    [
                        "etcdctl",
                        "--endpoints",
                        ",".join(self.client_urls),
                        "endpoint",
                        "status",
                        "-w",
                        "json",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    env=dict(os.environ, ETCDCTL_API="3"),
                )
                statuses = json.loads(out.stdout) if out.returncode == 0 else []
            except (subprocess.TimeoutExpired, json.JSONDecodeError):
                statuses = []
            leaders = {s["Status"]["leader"] for s in statuses}
            if len(statuses) == 3 and len(leaders) == 1 and 0 not in leaders:
                return
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"etcd cluster not ready: {out.stderr.strip()[:300] if statuses == [] else ''}"
                    f"\n    {_tail(self.dir / 'e1.log')}"
                )
            time.sleep(0.2)

    def conf(self) -> JsonDict:
        return {"endpoints": [u.removeprefix("http://") for u in self.client_urls]}


class NatsCluster(_ServerProcesses):
    name = "nats"

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "nats"
        self.procs: list[subprocess.Popen[bytes]] = []
        ports = free_ports(9)
        self.client_ports = ports[:3]
        self.http_ports = ports[3:6]
        self.route_ports = ports[6:]

    def start(self) -> None:
        self.dir.mkdir(parents=True)
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in self.route_ports)
        for i in range(3):
            name = f"n{i + 1}"
            conf = self.dir / f"{name}.conf"
            conf.write_text(
                f"server_name: {name}\n"
                f"listen: 127.0.0.1:{self.client_ports[i]}\n"
                f"http: 127.0.0.1:{self.http_ports[i]}\n"
                "max_payload: 1MB\n"
                f'jetstream {{ store_dir: "{self.dir / name}", max_memory_store: 1GB, '
                "max_file_store: 8GB }\n"
                f"cluster {{ name: sidebyside, listen: 127.0.0.1:{self.route_ports[i]}, "
                f"routes: [{routes}] }}\n"
            )
            self.procs.append(
                _spawn(
                    ["nats-server", "-c", str(conf), "-l", str(self.dir / f"{name}.log")],
                    self.dir / f"{name}.out",
                )
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            ok = 0
            leader = ""
            for port in self.http_ports:
                try:
                    health = _get_json(f"http://127.0.0.1:{port}/healthz")
                    jsz = _get_json(f"http://127.0.0.1:{port}/jsz")
                except (OSError, ValueError):
                    continue
                if health.get("status") == "ok":
                    ok += 1
                leader = leader or str(jsz.get("meta_cluster", {}).get("leader", ""))
            if ok == 3 and leader:
                return
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"NATS cluster not ready\n    {_tail(self.dir / 'n1.log')}")
            time.sleep(0.2)

    def conf(self) -> JsonDict:
        return {
            "servers": {
                f"n{i + 1}": f"nats://127.0.0.1:{port}" for i, port in enumerate(self.client_ports)
            }
        }


class ComposedCluster(_ServerProcesses):
    """The stack's parts joined, nothing of sevendb's (`composed_node.py`, three
    processes): stock pysyncobj whose journal fdatasyncs, behind a bare gRPC write
    stream and watch. Its figures are the floor of a system built on this stack
    (docs/performance.md, "fourteenth session"); not run unless named."""

    name = "floor"

    def __init__(self, run_dir: Path, *, one_thread: bool = False) -> None:
        self.dir = run_dir / "floor"
        self.one_thread = one_thread
        self.procs: list[subprocess.Popen[bytes]] = []
        ports = free_ports(6)
        self.raft = [f"127.0.0.1:{p}" for p in ports[:3]]
        self.grpc = [f"127.0.0.1:{p}" for p in ports[3:]]
        self._conf: JsonDict = {}

    def start(self) -> None:
        from bench_writes import tuned_sends

        self.dir.mkdir(parents=True)
        for i, me in enumerate(self.raft):
            cmd = [
                sys.executable,
                str(Path(__file__).parent.parent / "composed_node.py"),
                "--me",
                me,
                "--partners",
                ",".join(a for a in self.raft if a != me),
                "--port",
                self.grpc[i].rsplit(":", 1)[1],
                "--journal",
                str(self.dir / f"journal{i}"),
                "--conf",
                json.dumps(tuned_sends()),
                *(["--one-thread"] if self.one_thread else []),
            ]
            self.procs.append(_spawn(cmd, self.dir / f"node{i}.log"))
        deadline = time.monotonic() + START_TIMEOUT_S
        ready: dict[str, bool] = {}
        while len(ready) < 3:
            for i, proc in enumerate(self.procs):
                log_path = self.dir / f"node{i}.log"
                for line in log_path.read_text(errors="replace").splitlines():
                    if line.startswith("{"):
                        ready[self.grpc[i]] = bool(json.loads(line)["leader"])
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"floor cluster not ready\n    {_tail(log_path)}")
            time.sleep(0.05)
        leader = next((address for address, leads in ready.items() if leads), None)
        if leader is None:
            raise RuntimeError("floor cluster: no node said it leads")
        self._conf = {"endpoints": self.grpc, "leader": leader}

    def conf(self) -> JsonDict:
        return self._conf


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=2) as response:  # loopback only
        data: dict[str, Any] = json.loads(response.read())
        return data


class SevendbCluster:
    name = "sevendb"

    def __init__(self, run_dir: Path, buckets: int) -> None:
        self.dir = run_dir / "sevendb"
        self.buckets = buckets
        self._conf: JsonDict = {}
        self._started = False

    def start(self) -> None:
        from sevendb.cluster.ops.local import cluster_up, local_token

        self._started = True
        # Plaintext, like the etcd and NATS it is measured against; measured once each
        # bucket's preferred node leads it (the peers hand no leadership over).
        spec = cluster_up(
            self.dir, nodes=3, buckets=self.buckets, replicas=3, insecure=True, settled=True
        ).spec
        self._conf = {
            "endpoints": [n.grpc_address for n in spec.nodes],
            "token": local_token(self.dir),
        }

    def stop(self) -> None:
        from sevendb.cluster.ops.local import cluster_down

        if self._started and (self.dir / "client.toml").exists():
            try:
                cluster_down(self.dir, progress=log)
            except Exception as exc:  # never leave nodes behind: kill what the pids name
                log(f"sevendb cluster_down failed ({exc!r}); killing its nodes")
                for pid in self.pids():
                    os.kill(pid, 9)

    def pids(self) -> list[int]:
        from sevendb.cluster.ops.local import local_nodes, running_pid

        return [p for n in local_nodes(self.dir) if (p := running_pid(self.dir, n)) is not None]

    def conf(self) -> JsonDict:
        return self._conf


class NetnsSevendbCluster:
    """sevendb's three nodes on three hosts of a `tests/netns.py` lab: one network
    namespace each, joined by a bridge, the nodes made by `sevendb cluster init
    --insecure` (plaintext, like the loopback cluster and the peers) and run with
    `sevendb node run --config`. The harness and its client workers stay on the
    machine's own network stack and reach the nodes through the bridge's address.
    Data dirs and the archive are on the same disk as the loopback cluster's."""

    name = "sevendb-netns"
    NODES = ("n1", "n2", "n3")

    def __init__(self, run_dir: Path, buckets: int) -> None:
        self.dir = run_dir / "sevendb-netns"
        self.buckets = buckets
        # the lab's names carry the harness's pid: a test can look for leftovers
        self.tag = f"b{os.getpid() % 100_000}"
        self.lab: Any = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._conf: JsonDict = {}

    def start(self) -> None:
        from sevendb.cluster.ops.local import local_token

        self.dir.mkdir(parents=True)
        self.lab = netns_module().NetLab(self.tag)
        hosts = {n: self.lab.add_host(n) for n in self.NODES}
        bundles = self.dir / "bundles"
        init = [sys.executable, "-m", "sevendb.cluster.ops.cli", "cluster", "init"]
        init += ["--out", str(bundles), "--buckets", str(self.buckets), "--insecure"]
        for node_id, host in hosts.items():
            init += ["--node", f"{node_id}={host.address}"]
        out = subprocess.run(init, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"sevendb cluster init failed: {out.stderr.strip()[-500:]}")
        for node_id, host in hosts.items():
            run = [sys.executable, "-m", "sevendb.cluster.ops.cli", "node", "run"]
            run += ["--config", str(bundles / node_id / "node.toml")]
            run += ["--archive-root", str(self.dir / "archive")]  # as the loopback's
            with open(self.dir / f"{node_id}.log", "ab") as node_log:
                proc = host.popen(
                    run,
                    stdout=node_log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            track(proc)
            self.procs[node_id] = proc
            log(f"  {self.name}: node {node_id} (pid {proc.pid}) on {host.address}")
        client = bundles / "client.toml"
        self._wait_ready(client)
        # A `cluster init` cluster lets in only its admin (docs/security.md): the
        # loopback's principal gets what `cluster up` gives it, read and write.
        from sevendb.cluster.common.acl import Grant, Permission
        from sevendb.cluster.ops.admin import ClusterAdmin

        with ClusterAdmin.from_config(_client_config(client)) as admin:
            for permission in (Permission.READ, Permission.WRITE):
                admin.grant(Grant("default", permission))
        self._conf = {
            "endpoints": list(_client_config(client).endpoints),
            "token": local_token(bundles / "n1"),  # the loopback's principal, not admin
        }

    def _wait_ready(self, client: Path) -> None:
        """Until every node answers and every bucket, and the metadata group on its
        voters, has a leader in each node's view."""
        from sevendb.cluster.ops.admin import ClusterAdmin

        deadline = time.monotonic() + START_TIMEOUT_S
        with ClusterAdmin.from_config(_client_config(client)) as admin:
            while True:
                missing = [f"{n} exited" for n, p in self.procs.items() if p.poll() is not None]
                for node_id, host in self.lab.hosts.items():
                    status = admin.status(f"{host.address}:7001", timeout_s=2)
                    if status is None:
                        missing.append(f"{node_id} not answering")
                    elif any(not r.leader for r in status.replicas) or (
                        status.meta_voter and not status.meta.leader
                    ):
                        missing.append(f"{node_id} sees no leader yet")
                if not missing:
                    log(f"  {self.name}: 3 nodes up on {self.lab.prefix}.0/24")
                    return
                if any("exited" in m for m in missing) or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.name} cluster not ready: {'; '.join(missing)}"
                        f"\n    {_tail(self.dir / 'n1.log')}"
                    )
                time.sleep(0.2)

    def stop(self) -> None:
        """SIGINT to every node (a clean stop without a drain, as `cluster down`),
        SIGKILL at the timeout; then the lab goes, and whatever of it an interrupted
        start left behind."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for node_id, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"  {self.name}: node {node_id} did not stop; killing it")
            stop_process(proc, grace_s=0.1)
        if self.lab is not None:
            self.lab.close()
        _sweep_lab(self.tag)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]

    def conf(self) -> JsonDict:
        return self._conf


def netns_module() -> Any:
    """tests/netns.py (the labs of the network-namespace tests)."""
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))
    import netns

    return netns


def _client_config(path: Path) -> ClientConfig:
    from sevendb.cluster.common.bundle import ClientConfig

    return ClientConfig.load(path)


def _sweep_lab(tag: str) -> None:
    """Delete what a lab with `tag` may have left (a start cut short between creating
    a namespace or the bridge and recording it)."""
    for name in netns_module().leftovers(tag):
        kind = "netns" if f"sdb{tag}-" in name else "link"
        subprocess.run(["ip", kind, "del", name], capture_output=True)
    bridge = f"sdb{tag}br"[:15]
    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    while subprocess.run(["iptables", "-D", *rule], capture_output=True).returncode == 0:
        pass
