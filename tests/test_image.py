"""The container image and the compose file (deploy/): the image built with no
registry (deploy/image.sh: a debootstrap base, a wheelhouse made here), three nodes
from `sevendb cluster init --node n1=n1 ...` bundles under deploy/compose.yaml, the
CLI on their network from the client bundle. A write, a subscription, `docker kill`
of a leader's container, writes meanwhile, the container restarted, every replica
converged, every change delivered once.

Needs root (dockerd, debootstrap): a missing Docker, docker-compose or debootstrap
is installed by deploy/system-deps.sh; a daemon not running is started here and
stopped afterwards, IP forwarding and the iptables FORWARD policy it changed set back.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
from cluster_harness import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "deploy" / "compose.yaml"
IMAGE = "sevendb:test"
IMAGE_UID = 10001
NODES = ("n1", "n2", "n3")
BUCKETS = 2


def _run(argv: list[str], timeout: float = 600, **kwargs: Any) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out.stdout


def _docker_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def _forward_policy() -> str:
    first = _run(["iptables", "-S", "FORWARD"]).splitlines()[0]  # "-P FORWARD ACCEPT"
    return first.split()[-1]


def _prerequisites() -> None:
    if os.geteuid() != 0:
        raise RuntimeError("the image test needs root (dockerd, debootstrap)")
    tools = ("dockerd", "debootstrap", "iptables")
    if not all(shutil.which(t) for t in tools) or _compose() is None:
        subprocess.run(["bash", str(ROOT / "deploy" / "system-deps.sh")], check=True)
    missing = [t for t in tools if shutil.which(t) is None]
    if missing or _compose() is None:
        raise RuntimeError(f"missing {missing or 'docker-compose'} (deploy/system-deps.sh)")


def _compose() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    plugin = subprocess.run(["docker", "compose", "version"], capture_output=True)
    return ["docker", "compose"] if plugin.returncode == 0 else None


IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


@contextlib.contextmanager
def docker_daemon(log: Path) -> Iterator[None]:
    """A Docker daemon that answers: the running one, or one started for the block
    and stopped after it, with what it changed on the way in put back: IP forwarding
    (it turns it on) and the iptables FORWARD policy (it sets DROP when it did)."""
    if _docker_answers():
        yield
        return
    policy, forwarding = _forward_policy(), IP_FORWARD.read_text()
    with log.open("ab") as out:
        daemon = subprocess.Popen(
            ["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for(_docker_answers, 60, "dockerd to answer", 0.2)
        yield
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        IP_FORWARD.write_text(forwarding)
        if _forward_policy() != policy:
            _run(["iptables", "-P", "FORWARD", policy])


@dataclass
class Deployment:
    compose_argv: list[str]
    env: dict[str, str]
    cli: str = ""
    """A container on the cluster's network, with the client bundle, to exec the CLI in."""

    def compose(self, *args: str) -> str:
        return _run([*self.compose_argv, *args], env=self.env)

    def container(self, node: str) -> str:
        return self.compose("ps", "-q", node).strip()

    def sevendb(self, *args: str, timeout: float = 120) -> str:
        return _run(["docker", "exec", self.cli, "sevendb", *args], timeout=timeout)

    def status(self) -> dict[str, Any] | None:
        """`sevendb status --json`, or None while a node does not answer."""
        out = subprocess.run(
            ["docker", "exec", self.cli, "sevendb", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return json.loads(out.stdout) if out.returncode == 0 else None

    def leader_of(self, bucket: int) -> str:
        def find() -> str | None:
            replicas = (self.status() or {"buckets": {}})["buckets"].get(str(bucket), [])
            return next((r["node"] for r in replicas if r["is_leader"]), None)

        found = wait_for(find, 90, f"a leader of bucket {bucket}", 0.5)
        assert found is not None
        return found

    def converged(self) -> bool:
        """Every bucket on every node, with one applied index and one digest."""
        status = self.status()
        if status is None:
            return False
        buckets = status["buckets"]
        if sorted(buckets) != [str(b) for b in range(BUCKETS)]:
            return False
        for replicas in buckets.values():
            if sorted(r["node"] for r in replicas) != list(NODES):
                return False
            if any(r["quarantined"] or not r["leader"] for r in replicas):
                return False
            if len({(r["applied_index"], r["digest"]) for r in replicas}) != 1:
                return False
        return True


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    _prerequisites()
    compose = _compose()
    assert compose is not None
    root = tmp_path_factory.mktemp("image")
    with docker_daemon(root / "dockerd.log"):
        _run(
            ["bash", str(ROOT / "deploy" / "image.sh"), IMAGE],
            env={**os.environ, "PYTHON": sys.executable},
            timeout=1200,
        )
        bundles = root / "bundles"
        init = [sys.executable, "-m", "sevendb.cluster.ops.cli", "cluster", "init"]
        init += ["--out", str(bundles), "--buckets", str(BUCKETS), "--listen-host", "0.0.0.0"]
        for node in NODES:
            init += ["--node", f"{node}={node}"]
        _run(init)
        # The image's user reads the bundles (secrets.toml is 0600).
        _run(["chown", "-R", f"{IMAGE_UID}:{IMAGE_UID}", str(bundles)])
        project = f"sevendbtest{os.getpid()}"
        env = {**os.environ, "SEVENDB_BUNDLES": str(bundles), "SEVENDB_IMAGE": IMAGE}
        d = Deployment([*compose, "--project-name", project, "--file", str(COMPOSE_FILE)], env)
        try:
            d.compose("up", "-d")
            d.cli = d.compose(
                "run", "-d", "--rm", "--entrypoint", "sleep", "cli", "infinity"
            ).strip()
            wait_for(d.converged, 120, "every replica up with a leader", 0.5)
            yield d
        finally:
            for node in NODES:
                print(
                    f"---- {node} (tail)\n"
                    + subprocess.run(
                        [*d.compose_argv, "logs", "--no-color", "--tail", "30", node],
                        env=env,
                        capture_output=True,
                        text=True,
                    ).stdout
                )
            if d.cli:
                subprocess.run(["docker", "rm", "-f", d.cli], capture_output=True)
            d.compose("down", "--volumes", "--remove-orphans", "--timeout", "5")


class Tail:
    """`sevendb subscribe QUERY` in the CLI container; its lines on a queue."""

    def __init__(self, d: Deployment, query: str) -> None:
        self.proc = subprocess.Popen(
            ["docker", "exec", d.cli, "sevendb", "subscribe", query, "--cursor", "/tmp/cursor"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.errors: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for stream, into in ((self.proc.stdout, self.lines), (self.proc.stderr, self.errors)):
            threading.Thread(target=self._pump, args=(stream, into), daemon=True).start()
        wait_for(self._subscribed, 60, "the subscription", 0.1)
        self.events: list[dict[str, Any]] = []

    @staticmethod
    def _pump(stream: IO[str], into: queue.Queue[str]) -> None:
        for line in stream:
            into.put(line)

    def _subscribed(self) -> bool:
        while not self.errors.empty():
            if self.errors.get().startswith("subscribed"):
                return True
        assert self.proc.poll() is None, "sevendb subscribe exited"
        return False

    def keys(self) -> list[str]:
        while not self.lines.empty():
            self.events.append(json.loads(self.lines.get()))
        return [e["key"] for e in self.events]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_the_image_runs_the_node_unprivileged_from_the_mounted_bundle(d: Deployment) -> None:
    node = d.container("n1")
    assert _run(["docker", "exec", node, "id", "-u"]).strip() == str(IMAGE_UID)
    # PID 1 is the node (`sevendb node run` execs it), so SIGTERM reaches it.
    cmdline = _run(["docker", "exec", node, "cat", "/proc/1/cmdline"]).split("\0")
    assert cmdline[1:5] == [
        "-m",
        "sevendb.cluster.server.node",
        "--config",
        "/etc/sevendb/node.toml",
    ]
    # The bundle is read-only, the data lives in the volume.
    touched = subprocess.run(["docker", "exec", node, "touch", "/etc/sevendb/x"])
    assert touched.returncode != 0
    assert "meta" in _run(["docker", "exec", node, "ls", "/var/lib/sevendb"]).split()


def test_write_subscribe_kill_restart_converge(d: Deployment) -> None:
    tail = Tail(d, "prefix:img/")
    try:
        for i in range(3):
            assert json.loads(d.sevendb("write", f"img/{i}", "before"))["version"] == 1
        victim = d.leader_of(0)
        container = d.container(victim)
        _run(["docker", "kill", container])
        # Two of three nodes still commit: these writes wait out the election.
        for i in range(3, 6):
            assert json.loads(d.sevendb("write", f"img/{i}", "during"))["version"] == 1
        _run(["docker", "start", container])
        wait_for(d.converged, 120, "every replica to converge after the restart", 0.5)
        wanted = [f"img/{i}" for i in range(6)]
        wait_for(lambda: set(wanted) <= set(tail.keys()), 60, "every write delivered", 0.2)
        assert sorted(tail.keys()) == wanted, "a change was delivered twice"
        assert json.loads(d.sevendb("get", "img/4"))["value"] == "during"
    finally:
        tail.close()
