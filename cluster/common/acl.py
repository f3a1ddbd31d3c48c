"""Access control: which principal may do what, to which keys (issue 29).

A grant is (principal, permission, resource):

* ``read``  on a key prefix: `Get`, `Range`, `Sync` (items filtered), subscribing to a
  key, a prefix or every key it covers, receiving each change a subscription delivers;
* ``write`` on a key prefix: `Write`, `WriteMany`, `WriteStream` (every op's key, SET or
  DEL), and - like Kafka since KIP-679 - idempotent producers: a principal that may
  write some keys may `InitProducer`;
* ``idempotent_write`` on the cluster: `InitProducer` without any write grant (seed 003's
  `IdempotentWrite`; a producer's writes still need ``write`` on their keys);
* ``admin`` on the cluster: administration (what the ``admin`` principal does).

The empty prefix is every key. The privileged principals ``admin`` and ``node`` are
allowed everything, and so is a principal granted ``admin``. Nothing else is allowed
unless granted: a fresh cluster lets only ``admin`` in. The genesis may name
principals allowed every key (``read``, ``write``, ``idempotent_write`` on ""): the
local cluster of `sevendb cluster up` names its ``default`` principal.

Grants are records of the metadata group, ``acl/<principal>/<permission>/<prefix>``
(the prefix is the rest of the key: it may hold ``/``), whose value is
``{"granted_ms": T}``, or ``{"revoked": true}`` to take back a grant the genesis makes.
Pure: no I/O.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from sevendb.cluster.common.auth import ADMIN_PRINCIPAL, PRIVILEGED, AuthError, check_principal
from sevendb.outbox import limits

__all__ = [
    "ACL_PREFIX",
    "Acl",
    "AclError",
    "Denied",
    "Grant",
    "Permission",
    "check_record",
    "full_access",
    "grant_record",
    "parse_record_key",
    "permission_of",
    "revoke_record",
]

log = logging.getLogger(__name__)

ACL_PREFIX: Final = "acl/"


class Permission(StrEnum):
    READ = "read"
    WRITE = "write"
    IDEMPOTENT_WRITE = "idempotent_write"
    ADMIN = "admin"

    @property
    def on_keys(self) -> bool:
        """Granted on a key prefix (else on the cluster)."""
        return self in (Permission.READ, Permission.WRITE)


class AclError(ValueError):
    """A grant that cannot be: an unknown permission, a prefix on a cluster permission,
    a malformed principal or record."""


@dataclass(frozen=True, slots=True, order=True)
class Grant:
    principal: str
    permission: Permission
    prefix: str = ""
    """The keys it covers (READ, WRITE): those starting with it; "" for every key and
    for the cluster permissions."""

    def __post_init__(self) -> None:
        try:
            check_principal(self.principal)
        except AuthError as exc:
            raise AclError(str(exc)) from None
        if not self.permission.on_keys and self.prefix:
            raise AclError(f"{self.permission} is granted on the cluster: it takes no prefix")
        if len(self.key.encode()) > limits.KEY_BYTES_MAX:
            raise AclError(f"prefix {self.prefix[:40]!r}...: too long")

    @property
    def key(self) -> str:
        """Its metadata record's key."""
        return f"{ACL_PREFIX}{self.principal}/{self.permission}/{self.prefix}"

    def describe(self) -> str:
        if self.permission.on_keys:
            where = f"prefix {self.prefix!r}" if self.prefix else "every key"
            return f"{self.principal} {self.permission} {where}"
        return f"{self.principal} {self.permission} (cluster)"


def permission_of(text: str) -> Permission:
    try:
        return Permission(text)
    except ValueError:
        raise AclError(
            f"unknown permission {text!r}: one of {', '.join(p.value for p in Permission)}"
        ) from None


def parse_record_key(key: str) -> Grant:
    """The grant an ``acl/`` record's key names (AclError if it names none)."""
    rest = key.removeprefix(ACL_PREFIX)
    parts = rest.split("/", 2)
    if not key.startswith(ACL_PREFIX) or len(parts) != 3:
        raise AclError(f"{key!r} is not acl/<principal>/<permission>/<prefix>")
    principal, permission, prefix = parts
    return Grant(principal, permission_of(permission), prefix)


def grant_record(grant: Grant, now_ms: int) -> tuple[str, bytes]:
    return grant.key, json.dumps({"granted_ms": now_ms}).encode()


def revoke_record(grant: Grant) -> tuple[str, bytes]:
    """The record that takes back a grant of the genesis."""
    return grant.key, json.dumps({"revoked": True}).encode()


def check_record(key: str, value: bytes | None) -> None:
    """AclError unless (key, value) is a valid ``acl/`` record (None: a deletion)."""
    parse_record_key(key)
    if value is None:
        return
    try:
        body = json.loads(value)
    except ValueError:
        raise AclError(f"{key!r}: the value is not JSON") from None
    if body != {"revoked": True} and not (
        isinstance(body, dict)
        and set(body) == {"granted_ms"}
        and isinstance(body["granted_ms"], int)
        and not isinstance(body["granted_ms"], bool)
    ):
        raise AclError(f'{key!r}: the value must be {{"granted_ms": <int>}} or {{"revoked": true}}')


class Denied(Exception):
    """A refusal: `permission` on `resource` is missing for `principal`."""

    def __init__(self, principal: str, permission: Permission, resource: str) -> None:
        self.principal, self.permission, self.resource = principal, permission, resource
        hint = (
            f"`sevendb acl grant {principal} {permission}"
            + (" --prefix PREFIX" if permission.on_keys else "")
            + "`"
        )
        if permission is Permission.IDEMPOTENT_WRITE:  # what every SDK write needs first
            hint = f"`sevendb acl grant {principal} write --prefix PREFIX`, which includes it"
        super().__init__(
            f"principal {principal!r} lacks the {permission} permission on {resource} "
            f"(an admin can grant it: {hint})"
        )


def full_access(principal: str) -> tuple[Grant, ...]:
    """What the genesis gives a principal it names: every key, and producers."""
    return (
        Grant(principal, Permission.READ),
        Grant(principal, Permission.WRITE),
        Grant(principal, Permission.IDEMPOTENT_WRITE),
    )


@dataclass(frozen=True)
class Acl:
    """The grants in force (see the module docstring)."""

    grants: frozenset[Grant] = frozenset()
    _prefixes: Mapping[tuple[str, Permission], tuple[str, ...]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @classmethod
    def of(cls, grants: Iterable[Grant]) -> Acl:
        table: dict[tuple[str, Permission], list[str]] = {}
        unique = frozenset(grants)
        for g in sorted(unique):
            table.setdefault((g.principal, g.permission), []).append(g.prefix)
        return cls(unique, {k: tuple(v) for k, v in table.items()})

    @classmethod
    def build(cls, genesis_full: Iterable[str], records: Mapping[str, bytes]) -> Acl:
        """The ACL of a genesis naming `genesis_full` (full access) and metadata
        `records` (the ``acl/`` ones matter; a malformed one is logged and ignored)."""
        grants: set[Grant] = set()
        for principal in genesis_full:
            try:
                grants.update(full_access(principal))
            except AclError as exc:
                log.error("ignoring the genesis's full access of %r: %s", principal, exc)
        for key, raw in sorted(records.items()):
            if not key.startswith(ACL_PREFIX):
                continue
            try:
                check_record(key, raw)
                grant = parse_record_key(key)
            except AclError as exc:
                log.error("ignoring the malformed access-control record %r: %s", key, exc)
                continue
            if json.loads(raw) == {"revoked": True}:
                grants.discard(grant)
            else:
                grants.add(grant)
        return cls.of(grants)

    def _has(self, principal: str, permission: Permission, key: str = "") -> bool:
        prefixes = self._prefixes.get((principal, permission))
        return prefixes is not None and key.startswith(prefixes)  # one C call for all

    def is_admin(self, principal: str) -> bool:
        """May `principal` administer the cluster: ``admin``, or granted ``admin``
        (the ``node`` principal may use every key, but administers nothing)."""
        return principal == ADMIN_PRINCIPAL or self._has(principal, Permission.ADMIN)

    def allows(self, principal: str, permission: Permission, key: str = "") -> bool:
        """May `principal` use `permission` on `key` (the cluster permissions: "")?"""
        if principal in PRIVILEGED or self.is_admin(principal):
            return True
        if permission is Permission.ADMIN:
            return False
        if permission is Permission.IDEMPOTENT_WRITE:
            return self._has(principal, permission) or bool(
                self._prefixes.get((principal, Permission.WRITE))
            )
        return self._has(principal, permission, key)

    def check(self, principal: str, permission: Permission, key: str = "") -> None:
        """Denied unless `allows`."""
        if not self.allows(principal, permission, key):
            resource = f"key {key!r}" if permission.on_keys else "the cluster"
            raise Denied(principal, permission, resource)

    def check_prefix(self, principal: str, prefix: str) -> None:
        """Denied unless `principal` may read every key starting with `prefix` (a
        subscription to it: one grant must cover it whole)."""
        if not self.allows(principal, Permission.ADMIN) and not self._has(
            principal, Permission.READ, prefix
        ):
            what = f"every key under {prefix!r}" if prefix else "every key"
            raise Denied(principal, Permission.READ, what)

    def of_principal(self, principal: str | None = None) -> list[Grant]:
        """The grants (of `principal`), sorted."""
        return sorted(g for g in self.grants if principal is None or g.principal == principal)
