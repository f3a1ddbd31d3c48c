"""Three-node clusters on 127.0.0.1, each in a fresh data dir, started and stopped by
the harness: etcd 3.4 and NATS JetStream 2.9 as in the peer baseline notes, and
sevendb through `sevendb.cluster.ops.local`."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from peers.common import JsonDict, free_ports, log, stop_process, track

START_TIMEOUT_S = 60.0


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
        # Plaintext, like the etcd and NATS it is measured against.
        spec = cluster_up(self.dir, nodes=3, buckets=self.buckets, replicas=3, insecure=True).spec
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
