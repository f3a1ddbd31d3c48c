"""The permission logic of access control (cluster/common/acl.py): deterministic, no I/O;
and the grants a new genesis makes (`cluster init`, `cluster up`: files in tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sevendb.cluster.common.acl import (
    Acl,
    AclError,
    Denied,
    Grant,
    Permission,
    check_record,
    grant_record,
    parse_record_key,
    revoke_record,
)
from sevendb.cluster.common.topology import ClusterSpec
from sevendb.cluster.ops.deploy import cluster_init
from sevendb.cluster.ops.local import create_local_cluster

READ, WRITE, IDEMPOTENT, ADMIN = (
    Permission.READ,
    Permission.WRITE,
    Permission.IDEMPOTENT_WRITE,
    Permission.ADMIN,
)


def _acl(*grants: Grant, full: tuple[str, ...] = ()) -> Acl:
    return Acl.build(full, dict(grant_record(g, 1) for g in grants))


def test_a_fresh_cluster_allows_only_the_privileged_principals() -> None:
    acl = _acl()
    for permission in Permission:
        assert acl.allows("admin", permission, "any/key")
        assert not acl.allows("alice", permission, "any/key")
    assert acl.allows("node", READ, "k") and acl.allows("node", WRITE, "k")
    assert not acl.is_admin("node") and acl.is_admin("admin")


def test_read_and_write_go_by_key_prefix() -> None:
    acl = _acl(Grant("alice", READ, "orders/"), Grant("alice", WRITE, "orders/eu/"))
    assert acl.allows("alice", READ, "orders/1") and acl.allows("alice", READ, "orders/")
    assert not acl.allows("alice", READ, "order") and not acl.allows("alice", READ, "users/1")
    assert acl.allows("alice", WRITE, "orders/eu/7")
    assert not acl.allows("alice", WRITE, "orders/us/7")
    assert not acl.allows("bob", READ, "orders/1")  # grants are per principal


def test_write_implies_idempotent_producers_and_nothing_else() -> None:
    """Like Kafka since KIP-679: a principal that may write some keys may init
    producers; idempotent_write alone gives no key."""
    writer = _acl(Grant("alice", WRITE, "x/"))
    assert writer.allows("alice", IDEMPOTENT) and not writer.allows("alice", READ, "x/1")
    producer_only = _acl(Grant("bob", IDEMPOTENT))
    assert producer_only.allows("bob", IDEMPOTENT)
    assert not producer_only.allows("bob", WRITE, "x/1")
    assert not _acl(Grant("carol", READ)).allows("carol", IDEMPOTENT)


def test_the_admin_permission_allows_everything() -> None:
    acl = _acl(Grant("ops", ADMIN))
    assert acl.is_admin("ops")
    assert all(acl.allows("ops", p, "k") for p in Permission)


def test_a_subscription_prefix_must_be_covered_whole() -> None:
    acl = _acl(Grant("alice", READ, "orders/"))
    acl.check_prefix("alice", "orders/")
    acl.check_prefix("alice", "orders/eu/")
    with pytest.raises(Denied, match="read permission on every key under 'o'"):
        acl.check_prefix("alice", "o")  # some keys under it she may read, not all
    with pytest.raises(Denied, match="every key"):
        acl.check_prefix("alice", "")
    _acl(Grant("bob", READ)).check_prefix("bob", "")


def test_a_refusal_names_the_missing_permission_and_the_grant() -> None:
    with pytest.raises(Denied) as denied:
        _acl().check("alice", WRITE, "orders/1")
    assert denied.value.permission is WRITE
    assert str(denied.value) == (
        "principal 'alice' lacks the write permission on key 'orders/1' "
        "(an admin can grant it: `sevendb acl grant alice write --prefix PREFIX`)"
    )
    with pytest.raises(Denied, match="idempotent_write permission on the cluster"):
        _acl().check("alice", IDEMPOTENT)


def test_the_genesis_full_access_and_its_revocation() -> None:
    full = _acl(full=("default",))
    assert full.allows("default", READ, "a") and full.allows("default", WRITE, "b")
    assert full.allows("default", IDEMPOTENT) and not full.is_admin("default")
    key, value = revoke_record(Grant("default", WRITE))
    revoked = Acl.build(("default",), {key: value})
    assert revoked.allows("default", READ, "a") and not revoked.allows("default", WRITE, "b")


def test_records_round_trip_and_bad_ones_are_refused_or_ignored() -> None:
    grant = Grant("alice", READ, "a/b/c")  # a prefix may hold slashes
    key, value = grant_record(grant, 5)
    assert key == "acl/alice/read/a/b/c" and parse_record_key(key) == grant
    check_record(key, value)
    check_record(key, None)
    for bad_key in ("acl/alice", "acl/alice/fly/x", "acl/al ice/read/", "acl/alice/admin/x"):
        with pytest.raises(AclError):
            check_record(bad_key, value)
    for bad_value in (b"{", b"[]", b'{"granted_ms": "1"}', b'{"granted_ms": 1, "x": 2}'):
        with pytest.raises(AclError):
            check_record(key, bad_value)
    # A malformed record in the metadata is ignored (logged), the rest holds.
    acl = Acl.build((), {key: value, "acl/bob/read/": b"nonsense", "node/n1": b"{}"})
    assert acl.grants == frozenset({grant})


def test_bad_grants_are_refused() -> None:
    with pytest.raises(AclError, match="takes no prefix"):
        Grant("alice", ADMIN, "x/")
    with pytest.raises(AclError, match="principal"):
        Grant("not a name", READ)
    assert json.loads(grant_record(Grant("a", READ), 7)[1]) == {"granted_ms": 7}


def test_cluster_init_lets_only_admin_in_and_cluster_up_its_default_principal(
    tmp_path: Path,
) -> None:
    """The genesis of `sevendb cluster init` grants nothing; a local cluster's grants
    its default principal every key (and survives the genesis file's round trip)."""
    made = cluster_init(tmp_path / "b", ["n1=127.0.0.1:1"], buckets=1, replicas=1, insecure=True)
    assert made.full_access == ()
    assert '"full_access"' not in made.to_json()  # specs without it read as before
    fresh = Acl.build(made.full_access, {})
    assert not fresh.allows("default", READ, "k") and fresh.allows("admin", WRITE, "k")
    local = create_local_cluster(tmp_path / "l", nodes=1, buckets=1, replicas=1, insecure=True)
    assert local.full_access == ("default",)
    assert ClusterSpec.from_json(local.to_json()).full_access == ("default",)
    acl = Acl.build(local.full_access, {})
    assert acl.allows("default", WRITE, "any") and not acl.allows("alice", READ, "any")
