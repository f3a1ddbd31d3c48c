"""Bundles: what `sevendb cluster init` and `sevendb node init` hand out.

    DIR/n1/node.toml      the node's configuration ([node] id, listen host, seeds, files)
    DIR/n1/genesis.json   the cluster as created (the same on every node; no secret)
    DIR/n1/secrets.toml   the cluster's secrets: Raft key, token key, admin key (0600)
    DIR/n1/ca.pem         the cluster's CA certificate (what every node and client trusts)
    DIR/n1/node.pem       the node's certificate (a SAN for every address it is reached at)
    DIR/n1/node-key.pem   its private key (0600)
    DIR/client.toml       endpoints, an admin token and the TLS files, for the CLI (0600)
    DIR/ca.pem            the CA certificate again, for clients
    DIR/admin.pem         a client certificate naming the admin principal (mTLS)
    DIR/admin-key.pem     its private key (0600)
    DIR/ca-key.pem        the CA's key, when `cluster init` made the CA (0600; keep it
                          off the nodes: `node init` and `sevendb cert` need it)

A cluster made with `--insecure` has no certificate and says `insecure = true` in
every node.toml and in client.toml. A secret file (TOML or PEM key) readable by
anyone but its owner is refused when read, with the `chmod` that fixes it.
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

from sevendb.cluster.common.auth import ADMIN_PRINCIPAL, Keyring
from sevendb.cluster.common.files import fsync_dir, write_synced
from sevendb.cluster.common.topology import ClusterSpec, ConfigError, NodeSpec

__all__ = [
    "ADMIN_CERT_FILE",
    "ADMIN_KEY_FILE",
    "ADMIN_TOKEN_TTL_S",
    "CA_FILE",
    "CA_KEY_FILE",
    "CLIENT_FILE",
    "GENESIS_FILE",
    "NODE_CERT_FILE",
    "NODE_FILE",
    "NODE_KEY_FILE",
    "SECRETS_FILE",
    "ClientConfig",
    "ClientTLS",
    "ClusterSecrets",
    "NodeTLS",
    "load_node_tls",
    "read_secret_bytes",
    "write_client_config",
    "write_node_bundle",
]

NODE_FILE: Final = "node.toml"
GENESIS_FILE: Final = "genesis.json"
SECRETS_FILE: Final = "secrets.toml"
CLIENT_FILE: Final = "client.toml"
CA_FILE: Final = "ca.pem"
CA_KEY_FILE: Final = "ca-key.pem"
NODE_CERT_FILE: Final = "node.pem"
NODE_KEY_FILE: Final = "node-key.pem"
ADMIN_CERT_FILE: Final = "admin.pem"
ADMIN_KEY_FILE: Final = "admin-key.pem"
ADMIN_TOKEN_TTL_S: Final = 365 * 24 * 3600
"""The admin token of a client bundle expires after a year (`sevendb token admin
--ttl ...` mints the next one through the cluster)."""
_SECRET_MODE: Final = 0o600


def _toml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(_toml_str(i) for i in items) + "]"


def write_file(path: Path, text: str | bytes, *, secret: bool = False) -> Path:
    """Write `path` atomically and durably; a secret is created 0600 from the start."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write_synced(tmp, text if isinstance(text, bytes) else text.encode())
    os.chmod(tmp, _SECRET_MODE if secret else 0o644)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def read_secret_bytes(path: Path, what: str = "secrets") -> bytes:
    """A file that holds a secret (a TOML of keys, a private key), refused if anyone
    but its owner may read it."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what} file") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{path}: holds {what} but is readable by others (mode {stat.S_IMODE(mode):o}); "
            f"run `chmod 600 {path}`"
        )
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None


def read_secret_file(path: Path) -> dict[str, object]:
    """A TOML file that holds secrets, refused if others may read it."""
    raw = read_secret_bytes(path)
    try:
        return tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None


def read_public(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what} file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None


@dataclass(frozen=True)
class ClusterSecrets:
    """Three keys for three jobs: a leak of one does not give the others away."""

    raft_password: str
    """Encrypts and authenticates Raft traffic between nodes (pysyncobj's AEAD)."""
    token_secret: str
    """Signs bearer tokens (the first token key: later ones live in the metadata)."""
    admin_secret: str
    """Signs the tokens of the privileged principals, admin and node."""

    @classmethod
    def new(cls) -> ClusterSecrets:
        return cls(*(secrets.token_urlsafe(32) for _ in range(3)))

    def keyring(self, records: dict[str, bytes] | None = None) -> Keyring:
        return Keyring.build(self.token_secret, self.admin_secret, records)

    def to_toml(self) -> str:
        return (
            "# sevendb cluster secrets: keep this file mode 0600\n"
            f"raft_password = {_toml_str(self.raft_password)}\n"
            f"token_secret = {_toml_str(self.token_secret)}\n"
            f"admin_secret = {_toml_str(self.admin_secret)}\n"
        )

    @classmethod
    def load(cls, path: Path) -> ClusterSecrets:
        raw = read_secret_file(path)
        try:
            found = cls(
                str(raw["raft_password"]), str(raw["token_secret"]), str(raw["admin_secret"])
            )
        except KeyError as exc:
            raise ConfigError(f"{path}: missing {exc.args[0]}") from None
        if not all((found.raft_password, found.token_secret, found.admin_secret)):
            raise ConfigError(f"{path}: empty secret")
        if len({found.raft_password, found.token_secret, found.admin_secret}) < 3:
            raise ConfigError(f"{path}: the three secrets must differ")
        return found


@dataclass(frozen=True)
class NodeTLS:
    """What a node's bundle carries of TLS: the CA it trusts and its own certificate."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def load_node_tls(ca: Path, cert: Path, key: Path) -> NodeTLS:
    """A node's TLS files, checked: the key 0600, the certificate issued by the CA
    and matching the key (ConfigError saying which file is wrong)."""
    from sevendb.cluster.common.tls import check_certificate  # the server's: cryptography

    found = NodeTLS(
        read_public(ca, "CA certificate"),
        read_public(cert, "certificate"),
        read_secret_bytes(key, "a private key"),
    )
    try:
        check_certificate(found.ca_pem, found.cert_pem, found.key_pem)
    except ConfigError as exc:
        raise ConfigError(f"{cert}: {exc} (CA {ca}, key {key})") from None
    return found


@dataclass(frozen=True)
class ClientTLS:
    """A client bundle's TLS files (absolute paths): the CA to trust and, optionally,
    a client certificate (mTLS)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def read(self) -> tuple[bytes, bytes | None, bytes | None]:
        """(CA, certificate, key) PEM bytes; the key refused unless mode 0600."""
        ca = read_public(self.ca, "CA certificate")
        if (self.cert is None) != (self.key is None):
            raise ConfigError("[tls] cert and key go together")
        if self.cert is None or self.key is None:
            return ca, None, None
        return (
            ca,
            read_public(self.cert, "certificate"),
            read_secret_bytes(self.key, "a private key"),
        )


@dataclass(frozen=True)
class ClientConfig:
    """What the CLI needs to reach a cluster: endpoints, a token, and TLS (None only
    when the file says `insecure = true`)."""

    endpoints: tuple[str, ...]
    token: str | None
    tls: ClientTLS | None

    def to_toml(self, base: Path) -> str:
        lines = [
            "# sevendb client configuration (sevendb --config FILE, or $SEVENDB_CONFIG)",
            f"endpoints = {_toml_list(self.endpoints)}",
        ]
        if self.token:
            lines.append(f"token = {_toml_str(self.token)}")
        if self.tls is None:
            lines.append("insecure = true  # plaintext: only for a cluster made with --insecure")
            return "\n".join(lines) + "\n"
        lines += ["", "[tls]", f"ca = {_toml_str(_relative(self.tls.ca, base))}"]
        if self.tls.cert is not None and self.tls.key is not None:
            lines.append(f"cert = {_toml_str(_relative(self.tls.cert, base))}")
            lines.append(f"key = {_toml_str(_relative(self.tls.key, base))}")
        return "\n".join(lines) + "\n"

    @classmethod
    def load(cls, path: Path) -> ClientConfig:
        raw = read_secret_file(path)
        unknown = set(raw) - {"endpoints", "token", "insecure", "tls"}
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)}")
        endpoints = raw.get("endpoints")
        token = raw.get("token")
        if (
            not isinstance(endpoints, list)
            or not endpoints
            or not all(isinstance(e, str) for e in endpoints)
        ):
            raise ConfigError(f"{path}: endpoints must be a non-empty list of host:port")
        if token is not None and (not isinstance(token, str) or not token):
            raise ConfigError(f"{path}: token must be a non-empty string")
        return cls(tuple(endpoints), token, _client_tls(path, raw))


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def _client_tls(path: Path, raw: dict[str, object]) -> ClientTLS | None:
    insecure = raw.get("insecure", False)
    table = raw.get("tls")
    if insecure is True:
        if table is not None:
            raise ConfigError(f"{path}: insecure = true and a [tls] table: choose one")
        return None
    if not isinstance(table, dict) or not isinstance(table.get("ca"), str):
        raise ConfigError(
            f"{path}: no [tls] table with ca = FILE (a cluster made with --insecure says "
            "insecure = true instead)"
        )
    unknown = set(table) - {"ca", "cert", "key"}
    if unknown:
        raise ConfigError(f"{path}: unknown keys in [tls]: {sorted(unknown)}")
    base = path.parent

    def file(name: str) -> Path | None:
        value = table.get(name)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{path}: [tls] {name} must be a file name")
        return base / value

    ca = file("ca")
    assert ca is not None
    cert, key = file("cert"), file("key")
    if (cert is None) != (key is None):
        raise ConfigError(f"{path}: [tls] cert and key go together")
    return ClientTLS(ca, cert, key)


def write_node_bundle(
    out: Path,
    genesis: ClusterSpec,
    node: NodeSpec,
    cluster_secrets: ClusterSecrets,
    tls: NodeTLS | None,
    *,
    seeds: Sequence[str] = (),
    listen_host: str | None = None,
    data_dir: str = "data",
    extra: str = "",
) -> Path:
    """Write `node`'s bundle into `out` (created); returns its node.toml. `genesis` is
    the cluster as created (the same file on every node, whenever it joined); `tls`
    the node's certificate and the CA (None: a plaintext node, `insecure = true`);
    `seeds` default to the metadata voters' client addresses; `listen_host` to the
    node's advertised host; `extra` is appended to node.toml."""
    seeds = (
        list(seeds)
        or [n.grpc_address for n in genesis.meta_voters if n.node_id != node.node_id]
        or [n.grpc_address for n in genesis.nodes if n.node_id != node.node_id]
    )
    write_file(out / GENESIS_FILE, genesis.to_json() + "\n")
    write_file(out / SECRETS_FILE, cluster_secrets.to_toml(), secret=True)
    if tls is not None:
        write_file(out / CA_FILE, tls.ca_pem)
        write_file(out / NODE_CERT_FILE, tls.cert_pem)
        write_file(out / NODE_KEY_FILE, tls.key_pem, secret=True)
        transport = (
            f"tls_ca = {_toml_str(CA_FILE)}\n"
            f"tls_cert = {_toml_str(NODE_CERT_FILE)}\n"
            f"tls_key = {_toml_str(NODE_KEY_FILE)}\n"
        )
    else:
        transport = "insecure = true  # plaintext gRPC: made with --insecure\n"
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
        f"{transport}"
    )
    return write_file(out / NODE_FILE, text + extra)


def write_client_config(
    path: Path,
    spec: ClusterSpec,
    cluster_secrets: ClusterSecrets,
    *,
    now_ms: int,
    ca_pem: bytes | None,
    admin_cert: tuple[bytes, bytes] | None = None,
) -> Path:
    """A client bundle: every node's endpoint, an admin token (valid for
    `ADMIN_TOKEN_TTL_S`), and with `ca_pem` the CA (ca.pem beside it) and the admin's
    client certificate and key (`admin_cert`: admin.pem, admin-key.pem). Without
    `ca_pem`, a plaintext (`insecure = true`) bundle."""
    base = path.parent
    token = cluster_secrets.keyring().mint(ADMIN_PRINCIPAL, now_ms=now_ms, ttl_s=ADMIN_TOKEN_TTL_S)
    tls = None
    if ca_pem is not None:
        write_file(base / CA_FILE, ca_pem)
        tls = ClientTLS(base / CA_FILE)
        if admin_cert is not None:
            write_file(base / ADMIN_CERT_FILE, admin_cert[0])
            write_file(base / ADMIN_KEY_FILE, admin_cert[1], secret=True)
            tls = ClientTLS(base / CA_FILE, base / ADMIN_CERT_FILE, base / ADMIN_KEY_FILE)
    config = ClientConfig(tuple(n.grpc_address for n in spec.nodes), token, tls)
    return write_file(path, config.to_toml(base), secret=True)
