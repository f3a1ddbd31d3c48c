"""Bundles: what `sevendb cluster init` and `sevendb node init` hand out.

    DIR/n1/node.toml      the node's configuration ([node] id, listen host, seeds, files)
    DIR/n1/genesis.json   the cluster as created (the same on every node; no secret)
    DIR/n1/secrets.toml   the cluster's secrets (mode 0600)
    DIR/client.toml       endpoints and an admin token, for the `sevendb` CLI (mode 0600)

A secret file readable by anyone but its owner is refused when read, with the
`chmod` that fixes it.
"""

from __future__ import annotations

import os
import secrets
import stat
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sevendb.cluster.common.auth import ADMIN_PRINCIPAL, mint_token
from sevendb.cluster.common.files import fsync_dir, write_synced
from sevendb.cluster.common.topology import ClusterSpec, ConfigError, NodeSpec

__all__ = [
    "CLIENT_FILE",
    "GENESIS_FILE",
    "NODE_FILE",
    "SECRETS_FILE",
    "ClientConfig",
    "ClusterSecrets",
    "write_client_config",
    "write_node_bundle",
]

NODE_FILE: Final = "node.toml"
GENESIS_FILE: Final = "genesis.json"
SECRETS_FILE: Final = "secrets.toml"
CLIENT_FILE: Final = "client.toml"
_SECRET_MODE: Final = 0o600


def _toml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(_toml_str(i) for i in items) + "]"


def write_file(path: Path, text: str, *, secret: bool = False) -> Path:
    """Write `path` atomically and durably; a secret is created 0600 from the start."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write_synced(tmp, text.encode())
    os.chmod(tmp, _SECRET_MODE if secret else 0o644)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def read_secret_file(path: Path) -> dict[str, object]:
    """A TOML file that holds secrets, refused if others may read it."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such secrets file") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{path}: holds secrets but is readable by others (mode {stat.S_IMODE(mode):o}); "
            f"run `chmod 600 {path}`"
        )
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None


@dataclass(frozen=True)
class ClusterSecrets:
    raft_password: str
    """Encrypts and authenticates Raft traffic between nodes."""
    token_secret: str
    """Signs bearer tokens."""

    @classmethod
    def new(cls) -> ClusterSecrets:
        return cls(secrets.token_urlsafe(32), secrets.token_urlsafe(32))

    def to_toml(self) -> str:
        return (
            "# sevendb cluster secrets: keep this file mode 0600\n"
            f"raft_password = {_toml_str(self.raft_password)}\n"
            f"token_secret = {_toml_str(self.token_secret)}\n"
        )

    @classmethod
    def load(cls, path: Path) -> ClusterSecrets:
        raw = read_secret_file(path)
        try:
            found = cls(str(raw["raft_password"]), str(raw["token_secret"]))
        except KeyError as exc:
            raise ConfigError(f"{path}: missing {exc.args[0]}") from None
        if not found.raft_password or not found.token_secret:
            raise ConfigError(f"{path}: empty secret")
        return found


@dataclass(frozen=True)
class ClientConfig:
    """What the CLI needs to reach a cluster: endpoints and a token."""

    endpoints: tuple[str, ...]
    token: str

    def to_toml(self) -> str:
        return (
            "# sevendb client configuration (sevendb --config FILE, or $SEVENDB_CONFIG)\n"
            f"endpoints = {_toml_list(self.endpoints)}\n"
            f"token = {_toml_str(self.token)}\n"
        )

    @classmethod
    def load(cls, path: Path) -> ClientConfig:
        raw = read_secret_file(path)
        endpoints = raw.get("endpoints")
        token = raw.get("token")
        if (
            not isinstance(endpoints, list)
            or not endpoints
            or not all(isinstance(e, str) for e in endpoints)
        ):
            raise ConfigError(f"{path}: endpoints must be a non-empty list of host:port")
        if not isinstance(token, str) or not token:
            raise ConfigError(f"{path}: token missing")
        return cls(tuple(endpoints), token)


def write_node_bundle(
    out: Path,
    genesis: ClusterSpec,
    node: NodeSpec,
    cluster_secrets: ClusterSecrets,
    *,
    seeds: Sequence[str] = (),
    listen_host: str | None = None,
    data_dir: str = "data",
    extra: str = "",
) -> Path:
    """Write `node`'s bundle into `out` (created); returns its node.toml. `genesis` is
    the cluster as created (the same file on every node, whenever it joined); `seeds`
    default to the metadata voters' client addresses; `listen_host` to the node's
    advertised host; `extra` is appended to node.toml's [node] section."""
    seeds = (
        list(seeds)
        or [n.grpc_address for n in genesis.meta_voters if n.node_id != node.node_id]
        or [n.grpc_address for n in genesis.nodes if n.node_id != node.node_id]
    )
    write_file(out / GENESIS_FILE, genesis.to_json() + "\n")
    write_file(out / SECRETS_FILE, cluster_secrets.to_toml(), secret=True)
    text = (
        f"# sevendb node {node.node_id} of cluster {genesis.cluster_id} "
        "(sevendb node run --config THIS_FILE)\n"
        "[node]\n"
        f"id = {_toml_str(node.node_id)}\n"
        f"data_dir = {_toml_str(data_dir)}\n"
        f"listen_host = {_toml_str(listen_host or node.host)}\n"
        f"seeds = {_toml_list(seeds)}\n"
        f"genesis = {_toml_str(GENESIS_FILE)}\n"
        f"secrets = {_toml_str(SECRETS_FILE)}\n"
    )
    return write_file(out / NODE_FILE, text + extra)


def write_client_config(path: Path, spec: ClusterSpec, cluster_secrets: ClusterSecrets) -> Path:
    """A client bundle with every node's endpoint and an admin token."""
    token = mint_token(cluster_secrets.token_secret, ADMIN_PRINCIPAL)
    config = ClientConfig(tuple(n.grpc_address for n in spec.nodes), token)
    return write_file(path, config.to_toml(), secret=True)
