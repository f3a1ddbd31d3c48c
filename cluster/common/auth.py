"""Bearer tokens: who a request comes from, until when, and under which key.

A token is ``<principal>.<kid>.<issued_ms>.<expires_ms>.<mac>``: the principal's
name, the id of the key that signed it, when it was minted and when it expires
(Unix milliseconds), and an HMAC-SHA256 of all four under that key. Every node
checks a token without a shared table of tokens, against its `Keyring`:

* **keys**: the token key of the cluster's secrets file (`token_secret`), plus the
  keys added through the metadata group (`auth/key/<kid>` records, `sevendb token
  rotate`): all of them are accepted, the newest signs; a key named by an
  `auth/retired/<kid>` record is no longer accepted (`sevendb token retire KID`).
  Rotation therefore needs no restart: add a key, let the old tokens expire (or
  re-mint them), retire the old key.
* **the privileged principals** ``admin`` and ``node`` are signed by the separate
  admin key (`admin_secret`), never by a token key: whoever can mint ordinary
  tokens cannot mint an administrator's.
* **revocations**: an ``auth/revoked/<principal>`` record holds a time; that
  principal's tokens minted before it are refused (`sevendb token revoke NAME`).

Clients send ``authorization: Bearer <token>`` as gRPC metadata. A key id is
derived from the key (`key_id`), so nothing has to be configured to name one.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

AUTH_METADATA_KEY: Final = "authorization"
PRINCIPAL_RE: Final = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
DEFAULT_PRINCIPAL: Final = "default"
ADMIN_PRINCIPAL: Final = "admin"
"""The principal allowed to change membership, epochs, placement and credentials."""
NODE_PRINCIPAL: Final = "node"
"""How nodes identify themselves to each other (following the metadata, forwarding)."""
PRIVILEGED: Final = frozenset({ADMIN_PRINCIPAL, NODE_PRINCIPAL})
"""Principals whose tokens only the admin key signs."""
TOKEN_TTL_DEFAULT_S: Final = 24 * 3600
CLOCK_SKEW_MS: Final = 60_000
"""A token is accepted this long past its expiry (clocks of machines differ)."""
KEY_PREFIX: Final = "auth/key/"
RETIRED_PREFIX: Final = "auth/retired/"
REVOKED_PREFIX: Final = "auth/revoked/"
AUTH_PREFIX: Final = "auth/"
_MAC_HEX_CHARS: Final = 40
_KID_RE: Final = re.compile(r"k[0-9a-f]{10}")

log = logging.getLogger(__name__)


class AuthError(ValueError):
    """A missing, malformed, forged, expired or revoked token; the message says which."""


def check_principal(principal: str) -> str:
    if not PRINCIPAL_RE.fullmatch(principal):
        raise AuthError(f"principal {principal!r}: 1-64 characters of letters, digits and _ . @ -")
    return principal


def key_id(secret: str) -> str:
    """The id a key goes by in tokens and records (derived: reveals nothing of it)."""
    return "k" + hashlib.sha256(b"sevendb-kid/v1\x00" + secret.encode()).hexdigest()[:10]


@functools.lru_cache(maxsize=16)
def _mac_key(secret: str) -> bytes:
    return hashlib.sha256(b"sevendb-auth/v2\x00" + secret.encode()).digest()


def _mac(secret: str, body: str) -> str:
    return hmac.new(_mac_key(secret), body.encode(), hashlib.sha256).hexdigest()[:_MAC_HEX_CHARS]


@dataclass(frozen=True, slots=True)
class Token:
    """What a token says (its signature not yet checked)."""

    principal: str
    kid: str
    issued_ms: int
    expires_ms: int
    body: str
    mac: str

    @classmethod
    def parse(cls, token: str) -> Token:
        parts = token.rsplit(".", 4)
        if len(parts) != 5 or not all(parts):
            raise AuthError(
                "malformed token: expected <principal>.<kid>.<issued>.<expires>.<mac> "
                "(a token of an older sevendb? mint a new one: `sevendb token NAME`)"
            )
        principal, kid, issued, expires, mac = parts
        check_principal(principal)
        if not _KID_RE.fullmatch(kid) or not issued.isdigit() or not expires.isdigit():
            raise AuthError("malformed token: bad key id or times")
        return cls(principal, kid, int(issued), int(expires), token[: -len(mac) - 1], mac)


def mint_token(secret: str, principal: str, *, now_ms: int, ttl_s: float) -> str:
    """A token for `principal` signed by `secret`, valid for `ttl_s` from `now_ms`."""
    if not ttl_s > 0:
        raise AuthError(f"a token's time to live must be > 0 s, not {ttl_s}")
    body = f"{check_principal(principal)}.{key_id(secret)}.{now_ms}.{now_ms + int(ttl_s * 1000)}"
    return f"{body}.{_mac(secret, body)}"


@functools.lru_cache(maxsize=4096)
def _signed_by(secret: str, token: str) -> bool:
    parsed = Token.parse(token)
    return hmac.compare_digest(parsed.mac, _mac(secret, parsed.body))


def _json_object(raw: bytes) -> dict[str, object]:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{value!r} is not an integer")
    return value


@dataclass(frozen=True)
class Keyring:
    """The keys and revocations a node checks tokens against (module docstring)."""

    admin_secret: str
    keys: Mapping[str, tuple[str, int]]
    """kid -> (secret, created_ms) of every accepted token key."""
    signing_kid: str | None
    """The newest accepted key (None when every key is retired)."""
    revoked: Mapping[str, int] = field(default_factory=dict)
    """principal -> the time before which its tokens are refused (ms)."""
    retired: frozenset[str] = frozenset()

    @classmethod
    def build(
        cls, token_secret: str, admin_secret: str, records: Mapping[str, bytes] | None = None
    ) -> Keyring:
        """The keyring of a cluster whose secrets file holds these keys and whose
        metadata holds `records` (the ``auth/`` ones matter; a malformed one is
        logged and ignored)."""
        keys = {key_id(token_secret): (token_secret, 0)}
        retired: set[str] = set()
        revoked: dict[str, int] = {}
        for key, raw in sorted((records or {}).items()):
            if not key.startswith(AUTH_PREFIX):
                continue
            try:
                value = _json_object(raw)
                if key.startswith(KEY_PREFIX):
                    secret = value["secret"]
                    if not isinstance(secret, str) or key_id(secret) != key[len(KEY_PREFIX) :]:
                        raise ValueError("the key does not match its id")
                    keys[key_id(secret)] = (secret, _int(value["created_ms"]))
                elif key.startswith(RETIRED_PREFIX):
                    retired.add(key[len(RETIRED_PREFIX) :])
                elif key.startswith(REVOKED_PREFIX):
                    revoked[key[len(REVOKED_PREFIX) :]] = _int(value["not_before_ms"])
            except (ValueError, KeyError, TypeError) as exc:
                log.error("ignoring the malformed credentials record %r: %s", key, exc)
        accepted = {kid: v for kid, v in keys.items() if kid not in retired}
        newest = max(accepted, key=lambda kid: (accepted[kid][1], kid), default=None)
        return cls(admin_secret, accepted, newest, revoked, frozenset(retired))

    def mint(self, principal: str, *, now_ms: int, ttl_s: float = TOKEN_TTL_DEFAULT_S) -> str:
        """A token for `principal`: signed by the admin key for ``admin`` and ``node``,
        else by the newest token key."""
        if principal in PRIVILEGED:
            return mint_token(self.admin_secret, principal, now_ms=now_ms, ttl_s=ttl_s)
        if self.signing_kid is None:
            raise AuthError("every token key is retired: add one (`sevendb token rotate`)")
        secret = self.keys[self.signing_kid][0]
        return mint_token(secret, principal, now_ms=now_ms, ttl_s=ttl_s)

    def verify(self, token: str, *, now_ms: int) -> str:
        """The principal `token` authenticates now; AuthError saying why if none."""
        parsed = Token.parse(token)
        principal = parsed.principal
        if principal in PRIVILEGED:
            secret: str | None = self.admin_secret
            if parsed.kid != key_id(self.admin_secret):
                raise AuthError(
                    f"token for {principal!r} is not signed by this cluster's admin key"
                )
        else:
            found = self.keys.get(parsed.kid)
            if found is None:
                why = (
                    "was retired" if parsed.kid in self.retired else "is not one of this cluster's"
                )
                raise AuthError(
                    f"token for {principal!r} is signed by key {parsed.kid}, which {why}; "
                    "mint a new one (`sevendb token NAME`)"
                )
            secret = found[0]
        if not _signed_by(secret, token):
            raise AuthError(f"token for {principal!r} was not minted by this cluster")
        if now_ms > parsed.expires_ms + CLOCK_SKEW_MS:
            raise AuthError(
                f"token for {principal!r} expired {(now_ms - parsed.expires_ms) // 1000} s ago; "
                "mint a new one (`sevendb token NAME --ttl ...`)"
            )
        not_before = self.revoked.get(principal)
        if not_before is not None and principal != NODE_PRINCIPAL and parsed.issued_ms < not_before:
            raise AuthError(
                f"the tokens of {principal!r} minted before {not_before} ms were revoked; "
                "mint a new one"
            )
        return principal


# ---- the metadata records of `Keyring` (values of compare-and-set writes) ---------------


def key_record(secret: str, now_ms: int) -> tuple[str, bytes]:
    """The record that adds a token key (it signs from then on: the newest)."""
    body = json.dumps({"secret": secret, "created_ms": now_ms}, sort_keys=True)
    return f"{KEY_PREFIX}{key_id(secret)}", body.encode()


def retired_record(kid: str, now_ms: int) -> tuple[str, bytes]:
    if not _KID_RE.fullmatch(kid):
        raise AuthError(f"{kid!r} is not a key id (k and 10 hex digits: `sevendb token keys`)")
    return f"{RETIRED_PREFIX}{kid}", json.dumps({"retired_ms": now_ms}).encode()


def revoked_record(principal: str, now_ms: int) -> tuple[str, bytes]:
    if check_principal(principal) == NODE_PRINCIPAL:
        raise AuthError("the node principal cannot be revoked (rotate admin_secret instead)")
    return f"{REVOKED_PREFIX}{principal}", json.dumps({"not_before_ms": now_ms}).encode()


def token_from_metadata(metadata: Iterable[tuple[str, object]]) -> str | None:
    """The bearer token of a call's metadata, None if it has none; AuthError when the
    ``authorization`` value is not ``Bearer <token>``."""
    for key, value in metadata:
        if key == AUTH_METADATA_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise AuthError("authorization metadata must be 'Bearer <token>'")
            return token.strip()
    return None


def principal_from_metadata(
    keyring: Keyring, metadata: Iterable[tuple[str, object]], *, now_ms: int
) -> str:
    """The authenticated principal of a call, from its ``authorization`` metadata."""
    token = token_from_metadata(metadata)
    if token is None:
        raise AuthError("no token: send 'authorization: Bearer <token>' (see `sevendb token`)")
    return keyring.verify(token, now_ms=now_ms)


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),)


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``30d`` -> seconds (> 0)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise AuthError(f"a duration is a number > 0 with s, m, h or d after it, not {text!r}")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    return float(match.group(1)) * unit


__all__ = [
    "ADMIN_PRINCIPAL",
    "AUTH_METADATA_KEY",
    "AUTH_PREFIX",
    "DEFAULT_PRINCIPAL",
    "KEY_PREFIX",
    "NODE_PRINCIPAL",
    "PRIVILEGED",
    "RETIRED_PREFIX",
    "REVOKED_PREFIX",
    "TOKEN_TTL_DEFAULT_S",
    "AuthError",
    "Keyring",
    "Token",
    "auth_metadata",
    "check_principal",
    "key_id",
    "key_record",
    "mint_token",
    "parse_duration",
    "principal_from_metadata",
    "retired_record",
    "revoked_record",
    "token_from_metadata",
]
