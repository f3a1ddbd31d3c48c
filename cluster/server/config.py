"""A node's configuration: its own TOML file, `SEVENDB_*` variables and flags.

    sevendb node run --config /etc/sevendb/node.toml [--raft-heartbeat-s 0.2 ...]
    sevendb node run --config node.toml --print-config

Sections: ``[node]`` (`NodeSettings`: identity, addresses, files), ``[raft]``
(`RaftTuning`), ``[notifier]`` (`NotifierSettings`), ``[archive]``
(`ArchiveSettings`), ``[server]`` (`ServerLimits`) and ``[log]`` (`LogSettings`).
Precedence, highest first: flag, environment, file, default
(`sevendb.cluster.common.settings`). Relative paths in the file are relative to the
file's directory. docs/deploy.md lists every key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sevendb.cluster.archive.writer import ArchiveSettings
from sevendb.cluster.common.settings import Layers, Settings
from sevendb.cluster.common.topology import ConfigError
from sevendb.cluster.raft.replica import RaftTuning
from sevendb.cluster.server.logs import LogSettings
from sevendb.cluster.server.overload import ServerLimits
from sevendb.notifier.host import NotifierSettings

__all__ = ["SECTIONS", "NodeConfig", "NodeSettings", "load_node_config"]


@dataclass(frozen=True)
class NodeSettings:
    """The ``[node]`` section."""

    id: str = ""
    """This node's id in the cluster's metadata (required)."""
    data_dir: Path = Path("data")
    """Where this node keeps its replicas, its metadata cache and its archive."""
    listen_host: str = "127.0.0.1"
    """The address the node binds its gRPC, Raft and metrics ports to (``0.0.0.0``:
    every interface). Its ports are the ones the cluster's metadata advertises."""
    seeds: tuple[str, ...] = ()
    """gRPC endpoints (host:port) of other nodes, to learn the cluster's metadata
    from when this node is not a metadata voter or has none cached yet."""
    genesis: Path = Path("genesis.json")
    """The cluster as `sevendb cluster init` created it (the same file on every node)."""
    secrets: Path = Path("secrets.toml")
    """The cluster's secrets (mode 0600)."""
    tls_ca: Path = Path("ca.pem")
    """The cluster's CA certificate: what this node trusts (clients' certificates,
    other nodes)."""
    tls_cert: Path = Path("node.pem")
    """This node's certificate (served on the client port, presented to other nodes)."""
    tls_key: Path = Path("node-key.pem")
    """Its private key (mode 0600)."""
    insecure: bool = False
    """Plaintext gRPC, no certificate (a cluster made with `--insecure`)."""
    client_certs: bool = False
    """Require a certificate from the cluster's CA of every client (mTLS for all:
    a call's principal is its certificate's name unless it sends a token). Without
    it, clients authenticate with tokens over TLS."""
    drain_s: float = 5.0
    """On SIGTERM: how long the node may take to hand its leaderships and notifier
    leases to other replicas before it exits anyway (usually well under a second;
    with the 2 s the last calls get, within Docker's default 10 s stop timeout)."""
    restore: Path | None = None
    """Restore seeds from `sevendb backup restore`: a bucket placed here whose data
    does not exist yet starts from its seed (docs/operations.md)."""
    ready_lag_max: int = 1000
    """``/readyz`` answers 503 while a local replica has applied fewer than its
    leader's commit index minus this many entries (docs/operations.md)."""
    tracemalloc_frames: int = 0
    """Trace every Python allocation with this many frames (0: off), so that a
    memory dump (SIGUSR2, `memory_dump_s`) lists the allocation sites that grew.
    A diagnostic: tracing costs CPU and memory on every allocation
    (docs/operations.md, "Memory")."""
    memory_dump_s: float = 0.0
    """Also write a memory dump every this many seconds (0: only on SIGUSR2) into
    ``<data_dir>/memory/``."""

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("id is required (this node's id in the cluster)")
        if self.insecure and self.client_certs:
            raise ValueError("client_certs needs TLS: it cannot be set with insecure = true")
        if not 0 <= self.drain_s <= 3600:
            raise ValueError(f"drain_s must be 0..3600, got {self.drain_s}")
        if self.ready_lag_max < 0:
            raise ValueError(f"ready_lag_max must be >= 0, got {self.ready_lag_max}")
        if not 0 <= self.tracemalloc_frames <= 100:
            raise ValueError(f"tracemalloc_frames must be 0..100, got {self.tracemalloc_frames}")
        if self.memory_dump_s < 0:
            raise ValueError(f"memory_dump_s must be >= 0, got {self.memory_dump_s}")


SECTIONS: Mapping[str, type[Any]] = {
    "node": NodeSettings,
    "raft": RaftTuning,
    "notifier": NotifierSettings,
    "archive": ArchiveSettings,
    "server": ServerLimits,
    "log": LogSettings,
}


@dataclass(frozen=True)
class NodeConfig:
    node: NodeSettings
    raft: RaftTuning
    notifier: NotifierSettings
    archive: ArchiveSettings
    server: ServerLimits
    log: LogSettings
    settings: Settings
    """Where each value came from (`Settings.explain` for ``--print-config``)."""


def load_node_config(
    path: Path | None, environ: Mapping[str, str], flags: Mapping[str, str] | None = None
) -> NodeConfig:
    """Resolve a node's settings; relative paths are made absolute against the config
    file's directory (the working directory without a file). Raises ConfigError."""
    try:
        settings = Settings(Layers.read(path, environ, flags), SECTIONS)
    except ConfigError as exc:
        if path is not None and str(path) not in str(exc):
            raise ConfigError(f"{path}: {exc}") from None
        raise
    base = (path.parent if path is not None else Path.cwd()).resolve()
    node = settings.section("node", NodeSettings)
    node = dataclasses.replace(
        node,
        data_dir=base / node.data_dir,
        genesis=base / node.genesis,
        secrets=base / node.secrets,
        tls_ca=base / node.tls_ca,
        tls_cert=base / node.tls_cert,
        tls_key=base / node.tls_key,
        restore=None if node.restore is None else base / node.restore,
    )
    raft = settings.section("raft", RaftTuning)
    notifier = settings.section("notifier", NotifierSettings)
    if settings.origins["notifier"]["stall_window_ms"].layer != "default":
        raise ConfigError("notifier.stall_window_ms is raft.stall_window_ms; set that one")
    notifier = dataclasses.replace(notifier, stall_window_ms=raft.stall_window_ms)
    archive = settings.section("archive", ArchiveSettings)
    server = settings.section("server", ServerLimits)
    log = settings.section("log", LogSettings)
    if log.file not in ("stderr", "stdout"):
        log = dataclasses.replace(log, file=str(base / log.file))
    return NodeConfig(node, raft, notifier, archive, server, log, settings)
