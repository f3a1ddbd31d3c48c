"""Hosts for tests that cross a real network boundary: Linux network namespaces on
one bridge (root only; CI runs as root).

    with NetLab() as lab:
        n1 = lab.add_host("n1")          # a namespace with its own address, e.g. 10.x.y.1
        proc = n1.popen(["python", "-m", "..."])
        lab.partition(n1)                # drop everything in and out of n1
        lab.heal(n1)

Each lab has a bridge, one veth pair per host, addresses from a private /24 that
exists only inside its namespaces (the bridge has one too, so the test process can
reach the hosts), and iptables/tc rules set inside the hosts' namespaces. Closing the
lab kills what its hosts still run and deletes the namespaces, the bridge and the
FORWARD rule it added.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TOOLS = ("ip", "iptables", "tc")


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(argv), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def missing_prerequisites() -> str | None:
    """Why this machine cannot run a lab (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian: apt-get install iproute2 iptables)"
    return None


@dataclass
class Host:
    lab: NetLab
    name: str
    netns: str
    address: str
    veth: str
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    delayers: list[subprocess.Popen[Any]] = field(default_factory=list)

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(argv), **kwargs)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside this host, in a process group of its own (so a kill
        takes its children too)."""
        proc = subprocess.Popen(self.argv(argv), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def kill9(self, proc: subprocess.Popen[Any]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def shell(self, command: str) -> None:
        _run(self.argv(["sh", "-c", command]))


class NetLab:
    """A bridge and the namespaces attached to it; see the module docstring."""

    def __init__(self, tag: str | None = None) -> None:
        why = missing_prerequisites()
        if why is not None:
            raise RuntimeError(f"cannot build a network lab: {why}")
        self.tag = tag or f"{os.getpid() % 100_000}"
        self.bridge = f"sdb{self.tag}br"[:15]
        third = os.getpid() % 250 + 1
        self.prefix = f"10.213.{third}"
        self.hosts: dict[str, Host] = {}
        self._forward_rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.prefix}.254/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        # Once dockerd has run, FORWARD drops by default and bridged frames pass it.
        _run(["iptables", "-I", *self._forward_rule])

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        """A new namespace on the bridge, with loopback up and the next address."""
        index = len(self.hosts) + 1
        netns = f"sdb{self.tag}-{name}"
        veth = f"sdb{self.tag}v{index}"[:15]
        peer = f"{veth}p"[:15] if len(veth) < 15 else f"sdb{index}{self.tag}p"[:15]
        address = f"{self.prefix}.{index}"
        _run(["ip", "netns", "add", netns])
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
        _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
        _run(["ip", "link", "set", peer, "netns", netns])
        host = Host(self, name, netns, address, veth)
        host.shell(
            f"ip link set lo up && ip link set {peer} name eth0 && "
            f"ip addr add {address}/24 dev eth0 && ip link set eth0 up"
        )
        self.hosts[name] = host
        return host

    # ---- faults -------------------------------------------------------------------

    def partition(self, host: Host) -> None:
        """Drop every packet into and out of `host` (loopback excepted)."""
        host.shell("iptables -A INPUT -i eth0 -j DROP && iptables -A OUTPUT -o eth0 -j DROP")

    def block_port(self, host: Host, port: int) -> None:
        """Drop TCP to and from `port` on `host` (one service cut off, the rest not)."""
        host.shell(
            f"iptables -A INPUT -i eth0 -p tcp --dport {port} -j DROP && "
            f"iptables -A INPUT -i eth0 -p tcp --sport {port} -j DROP && "
            f"iptables -A OUTPUT -o eth0 -p tcp --dport {port} -j DROP && "
            f"iptables -A OUTPUT -o eth0 -p tcp --sport {port} -j DROP"
        )

    def partition_outbound(self, host: Host) -> None:
        """Asymmetric: `host` hears everyone, nobody hears it (its sends are dropped)."""
        host.shell("iptables -A OUTPUT -o eth0 -j DROP")

    def netem(
        self, host: Host, *, delay_ms: int = 0, jitter_ms: int = 0, loss_pct: float = 0
    ) -> None:
        """Delay and lose `host`'s outgoing packets. This kernel has no netem qdisc:
        loss is iptables' `statistic` match, delay a `netdelay.py` process holding
        each packet on an NFQUEUE inside the host."""
        if loss_pct:
            host.shell(
                "iptables -A OUTPUT -o eth0 -m statistic --mode random "
                f"--probability {loss_pct / 100:.4f} -j DROP"
            )
        if delay_ms or jitter_ms:
            queue = 1000 + len(host.procs)
            delayer = host.popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("netdelay.py")),
                    str(queue),
                    str(delay_ms),
                    str(jitter_ms),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert delayer.stdout is not None
            if delayer.stdout.readline().strip() != "ready":
                raise RuntimeError(f"netdelay.py did not start in {host.name}")
            host.shell(f"iptables -A OUTPUT -o eth0 -j NFQUEUE --queue-num {queue}")
            host.delayers.append(delayer)

    def heal(self, host: Host) -> None:
        """Undo `partition`, `partition_outbound` and `netem` on `host`."""
        host.shell("iptables -F INPUT && iptables -F OUTPUT")
        for delayer in host.delayers:
            host.kill9(delayer)
        host.delayers.clear()

    # ---- teardown -----------------------------------------------------------------

    def close(self) -> None:
        for host in self.hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    host.kill9(proc)
            # Whatever else still runs in the namespace (a daemonised child).
            pids = _run(["ip", "netns", "pids", host.netns], check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run(["ip", "link", "del", host.veth], check=False)
            _run(["ip", "netns", "del", host.netns], check=False)
        self.hosts.clear()
        _run(["iptables", "-D", *self._forward_rule], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)


def leftovers(tag: str) -> list[str]:
    """Namespaces and links a lab with `tag` left behind (for the teardown test)."""
    names = [n.split()[0] for n in _run(["ip", "netns", "list"]).stdout.splitlines() if n]
    links = Path("/sys/class/net")
    return [n for n in names if n.startswith(f"sdb{tag}-")] + [
        p.name for p in links.iterdir() if p.name.startswith(f"sdb{tag}")
    ]
