"""The operator's connection to a running cluster, from any machine: the cluster's
metadata read from any node, changed by compare-and-set through the metadata group,
and waits for the nodes to converge on a change.

    admin = ClusterAdmin(["10.0.0.1:7001"], token, tls=TLS.from_files(ca="ca.pem"))
    admin = ClusterAdmin.from_config(ClientConfig.load(Path("bundles/client.toml")))
    meta = admin.read()                                  # spec + records + version, current
    admin.save(meta, meta.spec.with_node(node))          # refused if it changed meanwhile

Two operators changing the cluster at once cannot both win: each write names the
version of every record it changes, and the loser gets `MetadataConflict` (re-run
the command: every operation here is derived from the cluster's state).

Credentials are administered here too (docs/security.md): `mint_token` (through a
node, which holds the keys), `rotate_token_key`, `retire_token_key` and `revoke`
(records of the metadata group every node follows).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import grpc

from sevendb.cluster.common.acl import (
    Acl,
    Grant,
    full_access,
    grant_record,
    revoke_record,
)
from sevendb.cluster.common.auth import (
    DEFAULT_PRINCIPAL,
    KEY_PREFIX,
    auth_metadata,
    key_record,
    retired_record,
    revoked_record,
)
from sevendb.cluster.common.bundle import ClientConfig
from sevendb.cluster.common.meta import changes, overlay
from sevendb.cluster.common.topology import ClusterSpec, ConfigError
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk.tls import TLS, sync_channel

__all__ = ["ClusterAdmin", "ClusterMeta", "MetadataConflict", "Unreachable", "client_tls"]

T = TypeVar("T")
CALL_TIMEOUT_S: Final = 10.0
CONVERGE_TIMEOUT_S: Final = 30.0
WRITE_RETRY_S: Final = 30.0
"""How long a metadata write waits for the metadata group to have a leader."""


class MetadataConflict(ConfigError):
    """The metadata changed between reading it and writing it (another operator)."""


class Unreachable(ConfigError):
    """No endpoint could serve the request (each one's answer is in the message)."""


@dataclass(frozen=True)
class ClusterMeta:
    version: int
    records: dict[str, tuple[bytes, int]]
    genesis: ClusterSpec
    spec: ClusterSpec


def client_tls(config: ClientConfig) -> TLS | None:
    """The SDK's TLS settings of a client bundle (None: it says insecure = true)."""
    if config.tls is None:
        return None
    ca, cert, key = config.tls.read()
    return TLS(ca, cert, key)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class ClusterAdmin:
    """See the module docstring. `tls` as for `sevendb.sdk.Client` (None: plaintext)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        token: str | None,
        *,
        tls: TLS | None,
        timeout_s: float = CALL_TIMEOUT_S,
        progress: Callable[[str], None] = lambda _: None,
    ) -> None:
        if not endpoints:
            raise ConfigError("no endpoints to reach the cluster")
        self.endpoints = list(endpoints)
        self.tls = tls
        self.metadata = auth_metadata(token) if token else ()
        self.timeout_s = timeout_s
        self.progress = progress
        self._channels: dict[str, grpc.Channel] = {}

    @classmethod
    def from_config(
        cls, config: ClientConfig, progress: Callable[[str], None] = lambda _: None
    ) -> ClusterAdmin:
        """An admin connection from a client bundle (its endpoints, token and TLS)."""
        return cls(list(config.endpoints), config.token, tls=client_tls(config), progress=progress)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def __enter__(self) -> ClusterAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stub(self, address: str) -> pb_grpc.SevenDBStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = sync_channel(address, self.tls)
        return pb_grpc.SevenDBStub(channel)

    def any_node(self, call: Callable[[pb_grpc.SevenDBStub], T]) -> T:
        """`call` on the first endpoint that answers (UNAVAILABLE/DEADLINE: the next)."""
        errors = []
        for endpoint in self.endpoints:
            try:
                return call(self.stub(endpoint))
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                errors.append(f"{endpoint}: {code.name}: {exc.details()}")
        raise Unreachable("no node could serve the request: " + "; ".join(errors))

    # ---- metadata ------------------------------------------------------------------

    def read(self, *, linearizable: bool = True) -> ClusterMeta:
        """The cluster's metadata, with every change committed before the call (a
        round through the metadata group: a node just back from a partition answers
        with what it missed, so a compare-and-set based on it is not refused for a
        stale version). `linearizable=False`: the answering node's view, which may lag,
        and is there while the group has no quorum (for showing, not for changing)."""
        request = pb.MetaReadRequest(linearizable=linearizable)
        response: pb.MetaReadResponse = self._while_leaderless(
            lambda s: s.MetaRead(request, metadata=self.metadata, timeout=self.timeout_s)
        )
        genesis = ClusterSpec.from_json(response.genesis, "the cluster's genesis")
        records = {r.key: (r.value, r.version) for r in response.records}
        spec = overlay(genesis, {k: v for k, (v, _) in records.items()})
        found = ClusterMeta(response.version, records, genesis, spec)
        self._learn(found.spec)
        return found

    def _learn(self, spec: ClusterSpec) -> None:
        """Add the cluster's nodes to the endpoints tried (given one, learn the rest)."""
        for node in spec.nodes:
            if node.grpc_address not in self.endpoints:
                self.endpoints.append(node.grpc_address)

    def save(self, meta: ClusterMeta, new: ClusterSpec, *, wait: bool = True) -> ClusterMeta:
        """Write what turns `meta.spec` into `new`, provided nothing changed since
        `meta` was read; then (with `wait`) wait until the reachable nodes converged.
        Returns the metadata as written."""
        new.validate()
        ops = []
        for key, value in changes(meta.spec, new).items():
            expected = meta.records[key][1] if key in meta.records else 0
            if value is None:
                ops.append(pb.MetaOp(key=key, delete=True, expected_version=expected))
            else:
                ops.append(pb.MetaOp(key=key, value=value, expected_version=expected))
        if not ops:
            return meta
        response = self._write(meta, new, ops)
        if wait:
            self.wait_converged(response.version, new)
        return self.read()

    def _write(
        self, meta: ClusterMeta, new: ClusterSpec, ops: list[pb.MetaOp]
    ) -> pb.MetaWriteResponse:
        """MetaWrite, retried while the metadata group has no leader (a refusal that
        changed nothing) for up to `WRITE_RETRY_S`. After an outcome left unknown, the
        metadata is read again: a write that landed is taken as done."""
        request = pb.MetaWriteRequest(ops=ops)
        try:
            answer: pb.MetaWriteResponse = self._while_leaderless(
                lambda s: s.MetaWrite(request, metadata=self.metadata, timeout=self.timeout_s)
            )
            return answer
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return self._conflict_or_done(new)
            raise
        except Unreachable as exc:
            if "outcome is unknown" in str(exc):
                landed = self.read()
                if landed.spec == new:
                    return pb.MetaWriteResponse(version=landed.version)
            raise  # not (yet) made: say so, with each node's answer

    def _while_leaderless(self, call: Callable[[pb_grpc.SevenDBStub], T]) -> T:
        """`any_node(call)`, retried while the metadata group has no leader (a refusal
        that changed nothing) for up to `WRITE_RETRY_S`."""
        deadline = time.monotonic() + WRITE_RETRY_S
        while True:
            try:
                return self.any_node(call)
            except Unreachable as exc:
                said = str(exc)
                if (
                    "nothing was changed" not in said
                    or "outcome is unknown" in said
                    or time.monotonic() > deadline
                ):
                    raise
                self.progress("  the metadata group has no leader yet; retrying")
                time.sleep(0.5)

    def _conflict_or_done(self, new: ClusterSpec) -> pb.MetaWriteResponse:
        """After a refused or unknown write: done if the metadata now says `new`."""
        current = self.read()
        if current.spec == new:
            return pb.MetaWriteResponse(version=current.version)
        raise MetadataConflict(
            "the cluster's metadata changed while this command ran (another "
            "operator?); run the command again"
        )

    def wait_converged(
        self, version: int, spec: ClusterSpec, timeout_s: float = CONVERGE_TIMEOUT_S
    ) -> None:
        """Until every node of `spec` that answers has converged on `version` (a node
        that does not answer is reported and skipped: it converges when it is back)."""
        deadline = time.monotonic() + timeout_s
        while True:
            behind = []
            for node in spec.nodes:
                status = self.status(node.grpc_address, timeout_s=2.0)
                if status is not None and status.meta_version < version:
                    behind.append(node.node_id)
            if not behind:
                return
            if time.monotonic() > deadline:
                self.progress(
                    f"  nodes {', '.join(behind)} have not seen metadata version {version} "
                    f"after {timeout_s:.0f} s; they will when they reach a metadata voter"
                )
                return
            time.sleep(0.1)

    # ---- nodes ---------------------------------------------------------------------

    def status(
        self, address: str, *, timeout_s: float = 5.0, digests: bool = False
    ) -> pb.StatusResponse | None:
        """A node's Status, or None if it does not answer."""
        try:
            response: pb.StatusResponse = self.stub(address).Status(
                pb.StatusRequest(with_digests=digests), timeout=timeout_s
            )
        except grpc.RpcError:
            return None
        return response

    # ---- credentials (docs/security.md) ---------------------------------------------

    def mint_token(self, principal: str, ttl_s: float) -> pb.MintTokenResponse:
        """A token for `principal`, minted by a node with the keys in force."""
        request = pb.MintTokenRequest(principal=principal, ttl_s=max(1, round(ttl_s)))
        response: pb.MintTokenResponse = self.any_node(
            lambda s: s.MintToken(request, metadata=self.metadata, timeout=self.timeout_s)
        )
        return response

    def signing_key(self) -> str:
        """The id of the key that signs new tokens (asked by minting a throwaway one)."""
        return self.mint_token(DEFAULT_PRINCIPAL, 1).key_id

    def token_keys(self) -> dict[str, str]:
        """kid -> state of the keys the metadata knows ("added" or "retired"); the
        secrets file's key shows only once retired."""
        meta = self.read()
        keys = {
            k.removeprefix(KEY_PREFIX): "added" for k in meta.records if k.startswith(KEY_PREFIX)
        }
        for key in meta.records:
            if key.startswith("auth/retired/"):
                keys[key.removeprefix("auth/retired/")] = "retired"
        return keys

    def _set_record(self, record: tuple[str, bytes], expected_version: int | None) -> int:
        key, value = record
        op = pb.MetaOp(key=key, value=value)
        if expected_version is not None:
            op.expected_version = expected_version
        request = pb.MetaWriteRequest(ops=[op])
        response: pb.MetaWriteResponse = self.any_node(
            lambda s: s.MetaWrite(request, metadata=self.metadata, timeout=self.timeout_s)
        )
        return response.version

    def rotate_token_key(self, *, wait: bool = True) -> tuple[str, str]:
        """Add a new token key, which signs from then on; every key before it is still
        accepted until retired. (previous signer, new key id)."""
        previous = self.signing_key()
        key, value = key_record(secrets.token_urlsafe(32), _now_ms())
        version = self._set_record((key, value), 0)
        if wait:
            self.wait_converged(version, self.read().spec)
        return previous, key.removeprefix(KEY_PREFIX)

    def retire_token_key(self, kid: str, *, wait: bool = True) -> None:
        """Refuse the tokens `kid` signed, on every node. Not the key that signs now
        (rotate first)."""
        record = retired_record(kid, _now_ms())
        if self.signing_key() == kid:
            raise ConfigError(f"{kid} signs new tokens: `sevendb token rotate` first")
        version = self._set_record(record, None)
        if wait:
            self.wait_converged(version, self.read().spec)

    def revoke(self, principal: str, *, wait: bool = True) -> int:
        """Refuse `principal`'s tokens (and client certificates) issued before now, on
        every node; returns the time (ms) before which they are refused."""
        now = _now_ms()
        version = self._set_record(revoked_record(principal, now), None)
        if wait:
            self.wait_converged(version, self.read().spec)
        return now

    # ---- access control (docs/security.md, "Access control") ---------------------------

    def acl(self) -> Acl:
        """The grants in force (the genesis's and the metadata's)."""
        return _acl_of(self.read())

    def grant(self, grant: Grant, *, wait: bool = True) -> bool:
        """Grant `grant` on every node; False if it was in force already (nothing written)."""
        return self._change_grant(grant, add=True, wait=wait)

    def revoke_grant(self, grant: Grant, *, wait: bool = True) -> bool:
        """Take `grant` back on every node; False if it was not in force."""
        return self._change_grant(grant, add=False, wait=wait)

    def _change_grant(self, grant: Grant, *, add: bool, wait: bool) -> bool:
        """A grant of the genesis is taken back by a ``revoked`` record (and given
        again by deleting it); any other is a record of its own. Compare-and-set on
        the record's version: two operators never both win."""
        meta = self.read()
        if (grant in _acl_of(meta).grants) == add:
            return False
        held = meta.records.get(grant.key)
        expected = held[1] if held is not None else 0
        if (grant in full_access_of(meta.genesis)) == add:
            version = self._delete_record(grant.key, expected)
        elif add:
            version = self._set_record(grant_record(grant, _now_ms()), expected)
        else:
            version = self._set_record(revoke_record(grant), expected)
        if wait:
            self.wait_converged(version, meta.spec)
        return True

    def _delete_record(self, key: str, expected_version: int) -> int:
        op = pb.MetaOp(key=key, delete=True, expected_version=expected_version)
        request = pb.MetaWriteRequest(ops=[op])
        response: pb.MetaWriteResponse = self.any_node(
            lambda s: s.MetaWrite(request, metadata=self.metadata, timeout=self.timeout_s)
        )
        return response.version


def _acl_of(meta: ClusterMeta) -> Acl:
    return Acl.build(meta.genesis.full_access, {k: v for k, (v, _) in meta.records.items()})


def full_access_of(genesis: ClusterSpec) -> frozenset[Grant]:
    """The grants a genesis makes."""
    return frozenset(g for p in genesis.full_access for g in full_access(p))
