"""Bearer tokens: who a request comes from.

A token is ``<principal>.<mac>``: the principal's name and an HMAC-SHA256 of it
under a key derived from the cluster secret, so every node can check a token
without a shared table, and minting one needs the secret (`sevendb token NAME`
reads it from the data dir). Subscriptions belong to the principal that created
them; no other principal can reconnect to, acknowledge or end them.

Clients send ``authorization: Bearer <token>`` as gRPC metadata.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from collections.abc import Iterable
from typing import Final

AUTH_METADATA_KEY: Final = "authorization"
PRINCIPAL_RE: Final = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
DEFAULT_PRINCIPAL: Final = "default"
ADMIN_PRINCIPAL: Final = "admin"
"""The principal allowed to change membership, epochs and placement."""
NODE_PRINCIPAL: Final = "node"
"""How nodes identify themselves to each other (following the metadata)."""
_MAC_HEX_CHARS: Final = 40


class AuthError(ValueError):
    """A missing, malformed or forged token; the message says which."""


@functools.lru_cache(maxsize=4)
def _key(cluster_secret: str) -> bytes:
    return hashlib.sha256(b"sevendb-auth/v1\x00" + cluster_secret.encode()).digest()


def _mac(cluster_secret: str, principal: str) -> str:
    digest = hmac.new(_key(cluster_secret), principal.encode(), hashlib.sha256).hexdigest()
    return digest[:_MAC_HEX_CHARS]


def check_principal(principal: str) -> str:
    if not PRINCIPAL_RE.fullmatch(principal):
        raise AuthError(f"principal {principal!r}: 1-64 characters of letters, digits and _ . @ -")
    return principal


def mint_token(cluster_secret: str, principal: str) -> str:
    """The token that authenticates ``principal`` to the cluster with this secret."""
    return f"{check_principal(principal)}.{_mac(cluster_secret, principal)}"


@functools.lru_cache(maxsize=4096)
def verify_token(cluster_secret: str, token: str) -> str:
    """The principal a token names, if the cluster with this secret minted it.
    (Verified tokens are cached; a refused one raises every time.)"""
    principal, dot, mac = token.rpartition(".")
    if not dot or not principal:
        raise AuthError("malformed token: expected <principal>.<mac>")
    check_principal(principal)
    if not hmac.compare_digest(mac, _mac(cluster_secret, principal)):
        raise AuthError(f"token for {principal!r} was not minted by this cluster")
    return principal


def principal_from_metadata(cluster_secret: str, metadata: Iterable[tuple[str, object]]) -> str:
    """The authenticated principal of a call, from its ``authorization`` metadata."""
    for key, value in metadata:
        if key == AUTH_METADATA_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise AuthError("authorization metadata must be 'Bearer <token>'")
            return verify_token(cluster_secret, token.strip())
    raise AuthError("no token: send 'authorization: Bearer <token>' (see `sevendb token`)")


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),)


__all__ = [
    "ADMIN_PRINCIPAL",
    "AUTH_METADATA_KEY",
    "DEFAULT_PRINCIPAL",
    "AuthError",
    "auth_metadata",
    "check_principal",
    "mint_token",
    "principal_from_metadata",
    "verify_token",
]
