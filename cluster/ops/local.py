"""The embedded default: a local cluster of node processes on 127.0.0.1 under one
data dir, built from the same pieces as a cluster across machines (docs/deploy.md):
`sevendb cluster up` writes a bundle per node (nodes/<id>/node.toml, its genesis,
secrets and certificate) and a client.toml, then runs each node as `python -m
sevendb.cluster.server.node --config nodes/<id>/node.toml`. TLS like any cluster,
with a CA of its own in the data dir (ca.pem, ca-key.pem); plaintext only with
`cluster up --insecure`, which says so."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from sevendb.cluster.common.auth import DEFAULT_PRINCIPAL, TOKEN_TTL_DEFAULT_S
from sevendb.cluster.common.bundle import (
    CA_FILE,
    CA_KEY_FILE,
    CLIENT_FILE,
    NODE_FILE,
    SECRETS_FILE,
    ClientConfig,
    ClusterSecrets,
    write_file,
    write_node_bundle,
)
from sevendb.cluster.common.layout import node_dir
from sevendb.cluster.common.topology import (
    META_VOTERS_DEFAULT,
    NODES_MAX,
    ClusterSpec,
    ConfigError,
    NodeSpec,
    new_cluster,
)
from sevendb.cluster.ops.admin import ClusterAdmin, Unreachable, client_tls
from sevendb.cluster.ops.deploy import (
    load_ca_files,
    node_tls,
    with_bucket_uuids,
    write_client_bundle,
)
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk.tls import TLS, sync_channel

HOST = "127.0.0.1"
NODE_MODULE = "sevendb.cluster.server.node"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORTS_PER_NODE = 4
"""gRPC, the first of the Raft block, metrics, metadata group (`allocate_ports`)."""
PORTS_END = 65000


def ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections (Linux's setting; IANA's
    range elsewhere). A node must not listen on one: any connection on the host may
    hold it at the moment the node binds (a start, or a restart after `cluster down`),
    and then the node cannot start."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        low, high = 49152, 65535
    return range(low, high + 1)


def allocate_ports(
    nodes: int, buckets: int, start: int = 21000, avoid: frozenset[int] = frozenset()
) -> list[int]:
    """Per node: a free gRPC port, a free block of `buckets` Raft ports, a free
    metrics port and a free metadata-group port, none of them in `avoid` (ports
    other nodes own while stopped) or in the kernel's ephemeral range. Where to begin
    depends on this process's id, so that clusters created side by side (tests)
    rarely probe the same ports.

    :raises ConfigError: no such ports are free between `start` and 65000.
    """
    ephemeral = ephemeral_ports()
    # The usable ports: stretches [first, end) below and above the ephemeral range.
    bounds = ((start, ephemeral.start), (max(start, ephemeral.stop), PORTS_END))
    stretches = [(first, end) for first, end in bounds if end - first > buckets + 2]
    span = sum(end - first for first, end in stretches)

    def locate(i: int) -> tuple[int, int]:
        """The `i`-th usable port (cyclic) and the end of its stretch."""
        i %= span
        for first, end in stretches:
            if i < end - first:
                return first + i, end
            i -= end - first
        raise AssertionError("unreachable")

    def free(port: int) -> bool:
        return port not in avoid and _port_free(port)

    ports: list[int] = []
    i = os.getpid() * 7
    for _ in range(2 * span):
        if len(ports) == PORTS_PER_NODE * nodes:
            break
        port, end = locate(i)
        if len(ports) % PORTS_PER_NODE != 1:
            if free(port):
                ports.append(port)
            i += 1
        elif port + buckets <= end and all(free(p) for p in range(port, port + buckets)):
            ports.append(port)
            i += buckets
        else:
            i += 1
    if len(ports) < PORTS_PER_NODE * nodes:
        raise ConfigError(
            f"not enough free ports for {nodes} node(s) of {buckets} bucket(s) between "
            f"{start} and {PORTS_END} outside the ephemeral range "
            f"{ephemeral.start}-{ephemeral.stop - 1}"
        )
    return ports


def local_secrets(data_dir: Path) -> ClusterSecrets:
    """The secrets of the local cluster in `data_dir`."""
    path = data_dir / SECRETS_FILE
    if not path.exists():
        raise ConfigError(
            f"no cluster in {data_dir} (no {SECRETS_FILE}); start one with "
            f"`sevendb cluster up --data {data_dir}`"
        )
    return ClusterSecrets.load(path)


def local_token(
    data_dir: Path, principal: str = DEFAULT_PRINCIPAL, ttl_s: float = TOKEN_TTL_DEFAULT_S
) -> str:
    """A token for `principal`, minted with the secrets file of the cluster in
    `data_dir` (its first token key; the admin key for admin)."""
    keyring = local_secrets(data_dir).keyring()
    return keyring.mint(principal, now_ms=time.time_ns() // 1_000_000, ttl_s=ttl_s)


def local_tls(data_dir: Path) -> TLS | None:
    """The TLS settings of the local cluster's client.toml (None: --insecure)."""
    return client_tls(ClientConfig.load(data_dir / CLIENT_FILE))


def local_admin(data_dir: Path, progress: Callable[[str], None] = lambda _: None) -> ClusterAdmin:
    """An admin connection to the local cluster in `data_dir` (its client.toml)."""
    return ClusterAdmin.from_config(ClientConfig.load(data_dir / CLIENT_FILE), progress)


def local_nodes(data_dir: Path) -> list[str]:
    """The ids of the nodes the local cluster in `data_dir` has bundles for."""
    return sorted(
        (p.parent.name for p in (data_dir / "nodes").glob(f"*/{NODE_FILE}")),
        key=lambda n: (len(n), n),
    )


def pid_file(data_dir: Path, node_id: str) -> Path:
    return node_dir(data_dir, node_id) / "node.pid"


def log_file(data_dir: Path, node_id: str) -> Path:
    return node_dir(data_dir, node_id) / "node.log"


def running_pid(data_dir: Path, node_id: str) -> int | None:
    path = pid_file(data_dir, node_id)
    try:
        pid = int(path.read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    try:  # a recycled pid is not our node
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid
    return pid if b"sevendb.cluster.server.node" in cmdline else None


def start_node(data_dir: Path, node_id: str) -> int:
    home = node_dir(data_dir, node_id)
    with open(log_file(data_dir, node_id), "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sevendb.cluster.server.node",
                "--config",
                str(home / NODE_FILE),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    pid_file(data_dir, node_id).write_text(str(proc.pid))
    return proc.pid


@dataclass(frozen=True)
class UpResult:
    spec: ClusterSpec
    created: bool
    started: list[str]


def _write_node(
    data_dir: Path,
    genesis: ClusterSpec,
    node: NodeSpec,
    secrets: ClusterSecrets,
    node_extra: str = "",
) -> None:
    """A local node's bundle: its data dir is its bundle's dir, every node archives
    under the cluster's one archive root, and its certificate comes from the data
    dir's CA (none if the cluster is --insecure)."""
    ca = None
    if (data_dir / CA_KEY_FILE).exists():
        ca = load_ca_files(data_dir / CA_FILE, data_dir / CA_KEY_FILE)
    write_node_bundle(
        node_dir(data_dir, node.node_id),
        genesis,
        node,
        secrets,
        None if ca is None else node_tls(ca, node),
        seeds=[n.grpc_address for n in genesis.nodes if n.node_id != node.node_id],
        data_dir=".",
        extra=node_extra + f'\n[archive]\nroot = "{data_dir / "archive"}"\n',
    )


def create_local_cluster(
    data_dir: Path,
    *,
    nodes: int,
    buckets: int,
    replicas: int,
    insecure: bool = False,
    bucket_uuids: Sequence[str] = (),
    node_extra: str = "",
) -> ClusterSpec:
    """Mint a cluster on 127.0.0.1 and write its bundles under `data_dir`: one per
    node in nodes/<id>/, the secrets, the CA (unless `insecure`) and a client.toml
    with an admin token and certificate. `bucket_uuids` and `node_extra` as for
    `deploy.cluster_init` (a restore)."""
    from sevendb.cluster.common.tls import new_ca

    if replicas > nodes:
        raise ConfigError(f"--replicas {replicas} needs at least as many --nodes (got {nodes})")
    ports = allocate_ports(nodes, buckets)
    specs = [
        NodeSpec(
            f"n{i + 1}",
            HOST,
            ports[PORTS_PER_NODE * i],
            ports[PORTS_PER_NODE * i + 1],
            ports[PORTS_PER_NODE * i + 2],
            meta_port=ports[PORTS_PER_NODE * i + 3] if i < META_VOTERS_DEFAULT else 0,
        )
        for i in range(nodes)
    ]
    # A local cluster is for its user: the default principal may use every key.
    spec = replace(
        new_cluster(nodes=specs, buckets=buckets, replicas=replicas),
        full_access=(DEFAULT_PRINCIPAL,),
    )
    if bucket_uuids:
        spec = with_bucket_uuids(spec, bucket_uuids)
    secrets = ClusterSecrets.new()
    ca = None
    if not insecure:
        ca = new_ca(spec.cluster_id)
        write_file(data_dir / CA_KEY_FILE, ca.key_pem, secret=True)
        write_file(data_dir / CA_FILE, ca.cert_pem)
    for node in spec.nodes:
        _write_node(data_dir, spec, node, secrets, node_extra)
    write_file(data_dir / SECRETS_FILE, secrets.to_toml(), secret=True)
    write_client_bundle(data_dir / CLIENT_FILE, spec, secrets, ca)
    return spec


def cluster_up(
    data_dir: Path,
    *,
    nodes: int = 3,
    buckets: int = 8,
    replicas: int = 3,
    timeout_s: float = START_TIMEOUT_S,
    insecure: bool = False,
    settled: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> UpResult:
    """Create (or restart) the cluster in `data_dir` (plaintext if made `insecure`);
    returns once every bucket has a leader on every node's view, and with `settled`
    once each is led, and emitted, by its preferred node (a fresh cluster hands
    leadership over about a second after its first election: what measures the
    cluster from its first request on wants that behind it). At the timeout the
    nodes this call started are stopped again (a failed `up` leaves nothing running
    that it started) and TimeoutError says what was missing."""
    data_dir = data_dir.resolve()
    created = not (data_dir / CLIENT_FILE).exists()
    if created:
        spec = create_local_cluster(
            data_dir, nodes=nodes, buckets=buckets, replicas=replicas, insecure=insecure
        )
        progress(
            f"created cluster {spec.cluster_id}: {nodes} nodes, {buckets} buckets, "
            f"{replicas} replicas each, in {data_dir}"
        )
        progress(
            f"access: principal {DEFAULT_PRINCIPAL!r} may read and write every key and init "
            f"producers (a local cluster's grant); others need `sevendb acl grant`"
        )
    else:
        progress(f"restarting the cluster in {data_dir}")
    if local_tls(data_dir) is None:
        progress(
            "INSECURE: this cluster's client port is plaintext (made with --insecure): "
            "tokens and data cross the network unencrypted"
        )
    else:
        progress(f"TLS: clients trust {data_dir / CA_FILE} (client.toml says so)")
    started = []
    for node_id in local_nodes(data_dir):
        if running_pid(data_dir, node_id) is None:
            pid = start_node(data_dir, node_id)
            started.append(node_id)
            progress(f"started node {node_id} (pid {pid})")
    try:
        spec = wait_for_leaders(data_dir, timeout_s, progress, settled=settled)
    except TimeoutError:
        stopped = stop_nodes(data_dir, started, progress=progress, drain=False)
        if stopped:
            progress(f"stopped the nodes this start started: {', '.join(stopped)}")
        raise
    return UpResult(spec, created, started)


def node_status(
    address: str, tls: TLS | None, timeout_s: float = 2.0, *, digests: bool = False
) -> pb.StatusResponse | None:
    """A node's Status (None if it does not answer); `digests` also computes each
    replica's state digest (a snapshot of the bucket: not for tight loops)."""
    with sync_channel(address, tls) as channel:
        try:
            response: pb.StatusResponse = pb_grpc.SevenDBStub(channel).Status(
                pb.StatusRequest(with_digests=digests), timeout=timeout_s
            )
            return response
        except grpc.RpcError:
            return None


def local_spec(data_dir: Path, timeout_s: float = 10.0) -> ClusterSpec:
    """The local cluster's current spec, read from any of its nodes (waits for one):
    that node's view, which answers while the metadata group has no majority (what
    finds the nodes, never what a change is based on)."""
    deadline = time.monotonic() + timeout_s
    with local_admin(data_dir) as admin:
        while True:
            try:
                return admin.read(linearizable=False).spec
            except (Unreachable, grpc.RpcError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def wait_for_leaders(
    data_dir: Path,
    timeout_s: float,
    progress: Callable[[str], None] = lambda _: None,
    *,
    settled: bool = False,
) -> ClusterSpec:
    """Until every node runs and answers and every bucket has a leader on each, and with
    `settled` until each bucket is led and emitted by its preferred node and no other;
    returns the cluster's spec."""
    deadline = time.monotonic() + timeout_s
    last = ""
    tls = local_tls(data_dir)
    while True:
        missing = []
        try:
            spec = local_spec(data_dir, timeout_s=0)
        except (Unreachable, grpc.RpcError):
            spec = None
            missing.append("no node answers yet")
        preferred = spec.preferred_leaders() if settled and spec is not None else {}
        for node in [] if spec is None else spec.nodes:
            if running_pid(data_dir, node.node_id) is None:
                missing.append(
                    f"{node.node_id}: not running (see {log_file(data_dir, node.node_id)})"
                )
                continue
            status = node_status(node.grpc_address, tls)
            if status is None:
                missing.append(f"{node.node_id}: not answering yet")
                continue
            leaderless = [r.bucket for r in status.replicas if not r.leader]
            if leaderless:
                missing.append(f"{node.node_id}: buckets {leaderless} have no leader yet")
            unsettled = [
                r.bucket
                for r in status.replicas
                if settled and not _settled(r, preferred[r.bucket] == node.node_id)
            ]
            if unsettled:
                missing.append(
                    f"{node.node_id}: buckets {unsettled} are not settled yet (led and emitted "
                    "from their preferred node only)"
                )
            if status.meta_voter and not status.meta.leader:
                missing.append(f"{node.node_id}: the metadata group has no leader yet")
        if spec is not None and not missing:
            return spec
        line = "; ".join(missing)
        if line != last:
            progress(f"waiting: {line}")
            last = line
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster not ready after {timeout_s:.0f}s: {line}")
        time.sleep(0.2)


def _settled(replica: pb.ReplicaStatus, preferred: bool) -> bool:
    """Whether a replica leads and emits exactly when it is its bucket's preferred one."""
    return replica.is_leader == preferred and replica.emitting == preferred


def cluster_down(
    data_dir: Path,
    timeout_s: float = STOP_TIMEOUT_S,
    progress: Callable[[str], None] = lambda _: None,
) -> list[str]:
    """Stop every node at once: SIGINT (a clean stop without a drain: there is no
    other node to hand anything to), SIGKILL what is still alive at the timeout."""
    data_dir = data_dir.resolve()
    local_secrets(data_dir)  # a clear error if there is no cluster here
    return stop_nodes(data_dir, local_nodes(data_dir), timeout_s, progress, drain=False)


def stop_nodes(
    data_dir: Path,
    node_ids: list[str],
    timeout_s: float = STOP_TIMEOUT_S,
    progress: Callable[[str], None] = lambda _: None,
    *,
    drain: bool = True,
) -> list[str]:
    """Stop these node processes cleanly (SIGKILL at the timeout): SIGTERM, each
    handing its leaderships and leases to the others first, or SIGINT without
    (`drain` False); returns the ids that were running."""
    pids = {n: running_pid(data_dir, n) for n in node_ids}
    alive = {node_id: pid for node_id, pid in pids.items() if pid is not None}
    for node_id, pid in alive.items():
        progress(f"stopping node {node_id} (pid {pid})")
        os.kill(pid, signal.SIGTERM if drain else signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        alive = {n: p for n, p in alive.items() if running_pid(data_dir, n) is not None}
        time.sleep(0.05)
    for node_id, pid in alive.items():
        progress(f"node {node_id} did not stop in {timeout_s:.0f}s; killing pid {pid}")
        os.kill(pid, signal.SIGKILL)
    for node_id in node_ids:
        pid_file(data_dir, node_id).unlink(missing_ok=True)
    return [n for n, p in pids.items() if p is not None]


def retire_node(
    data_dir: Path, node_id: str, progress: Callable[[str], None] = lambda _: None
) -> None:
    """Stop a node the cluster dropped and set its directory aside (nodes/.<id>-removed),
    so that `cluster up` no longer starts it."""
    stop_nodes(data_dir, [node_id], progress=progress)
    home = node_dir(data_dir, node_id)
    if home.exists():
        home.rename(home.with_name(f".{node_id}-removed-{time.time_ns()}"))


def add_node(
    data_dir: Path,
    timeout_s: float = START_TIMEOUT_S,
    progress: Callable[[str], None] = lambda _: None,
) -> NodeSpec:
    """Add a node to the local cluster's metadata, write its bundle and start it. It
    hosts nothing until buckets are placed on it (`sevendb rebalance`, `sevendb
    bucket migrate`)."""
    data_dir = data_dir.resolve()
    with local_admin(data_dir, progress) as admin:
        meta = admin.read()
        spec = meta.spec
        if len(spec.nodes) >= NODES_MAX:
            raise ConfigError(f"the cluster already has the most nodes allowed ({NODES_MAX})")
        taken = {int(n[1:]) for n in [*spec.node_ids, *local_nodes(data_dir)] if n[1:].isdigit()}
        node_id = f"n{max(taken, default=0) + 1}"
        used = frozenset(
            port
            for n in spec.nodes
            for port in (
                n.grpc_port,
                n.metrics_port,
                n.meta_port,
                *range(n.raft_port_base, n.raft_port_base + len(spec.buckets)),
            )
        )
        grpc_port, raft_base, metrics_port, _ = allocate_ports(1, len(spec.buckets), avoid=used)
        node = NodeSpec(node_id, HOST, grpc_port, raft_base, metrics_port)
        admin.save(meta, spec.with_node(node), wait=False)
    _write_node(data_dir, meta.genesis, node, local_secrets(data_dir))
    pid = start_node(data_dir, node_id)
    progress(f"started node {node_id} (pid {pid}) gRPC {node.grpc_address}")
    started = time.monotonic()
    tls = local_tls(data_dir)
    while node_status(node.grpc_address, tls) is None:
        elapsed = time.monotonic() - started
        # (Right after the fork the child's command line is still ours: wait a little
        # before reading a missing pid as a dead node.)
        if (elapsed > 2.0 and running_pid(data_dir, node_id) is None) or elapsed > timeout_s:
            raise TimeoutError(f"node {node_id} did not start; see {log_file(data_dir, node_id)}")
        time.sleep(0.1)
    return node
