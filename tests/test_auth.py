"""Bearer tokens: an expiry and a key id, keys that rotate, revocation, and an admin
key of its own (docs/security.md)."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from sevendb.cluster.common.auth import (
    ADMIN_PRINCIPAL,
    CLOCK_SKEW_MS,
    NODE_PRINCIPAL,
    AuthError,
    Keyring,
    Token,
    key_id,
    key_record,
    mint_token,
    parse_duration,
    principal_from_metadata,
    retired_record,
    revoked_record,
)

NOW = 1_750_000_000_000
HOUR = 3600.0


def ring(records: dict[str, bytes] | None = None) -> Keyring:
    return Keyring.build("token-secret", "admin-secret", records)


def test_a_minted_token_names_its_principal_key_and_expiry() -> None:
    token = ring().mint("alice", now_ms=NOW, ttl_s=HOUR)
    parsed = Token.parse(token)
    assert (parsed.principal, parsed.kid) == ("alice", key_id("token-secret"))
    assert (parsed.issued_ms, parsed.expires_ms) == (NOW, NOW + 3_600_000)
    assert ring().verify(token, now_ms=NOW + 1000) == "alice"
    metadata = [("authorization", f"Bearer {token}")]
    assert principal_from_metadata(ring(), metadata, now_ms=NOW) == "alice"


def test_a_principal_with_dots_keeps_them() -> None:
    token = ring().mint("svc.orders@eu", now_ms=NOW, ttl_s=HOUR)
    assert ring().verify(token, now_ms=NOW) == "svc.orders@eu"


def test_an_expired_token_is_refused_after_the_clock_skew_allowance() -> None:
    token = ring().mint("alice", now_ms=NOW, ttl_s=60)
    expires = NOW + 60_000
    assert ring().verify(token, now_ms=expires + CLOCK_SKEW_MS) == "alice"
    with pytest.raises(AuthError, match="expired"):
        ring().verify(token, now_ms=expires + CLOCK_SKEW_MS + 1)


def test_a_token_of_the_old_format_without_expiry_is_refused() -> None:
    """Before, a token was `<principal>.<mac>` and never expired."""
    key = hashlib.sha256(b"sevendb-auth/v1\x00token-secret").digest()
    old = "alice." + hmac.new(key, b"alice", hashlib.sha256).hexdigest()[:40]
    with pytest.raises(AuthError, match="malformed token"):
        ring().verify(old, now_ms=NOW)


@pytest.mark.parametrize(
    "token",
    [
        "alice",
        ".k0123456789.1.2.abc",
        "alice.kzzzzzzzzzz.1.2." + "0" * 40,
        mint_token("other-cluster", "alice", now_ms=NOW, ttl_s=HOUR),  # unknown key
        mint_token("token-secret", "bob", now_ms=NOW, ttl_s=HOUR).replace("bob", "alice", 1),
        mint_token("token-secret", "alice", now_ms=NOW, ttl_s=HOUR).replace(
            f".{NOW + 3_600_000}.", f".{NOW + 99_600_000}.", 1
        ),  # expiry extended
    ],
)
def test_forged_or_malformed_tokens_are_refused(token: str) -> None:
    with pytest.raises(AuthError):
        ring().verify(token, now_ms=NOW)


def test_only_the_admin_key_signs_admin_and_node_tokens() -> None:
    for principal in (ADMIN_PRINCIPAL, NODE_PRINCIPAL):
        token = ring().mint(principal, now_ms=NOW, ttl_s=HOUR)
        assert Token.parse(token).kid == key_id("admin-secret")
        assert ring().verify(token, now_ms=NOW) == principal
        forged = mint_token("token-secret", principal, now_ms=NOW, ttl_s=HOUR)
        with pytest.raises(AuthError, match="admin key"):
            ring().verify(forged, now_ms=NOW)


def test_a_rotated_key_signs_and_the_old_one_is_accepted_until_retired() -> None:
    old_token = ring().mint("alice", now_ms=NOW, ttl_s=HOUR)
    added = dict([key_record("second-secret", NOW + 1)])
    rotated = ring(added)
    new_token = rotated.mint("alice", now_ms=NOW + 2, ttl_s=HOUR)
    assert Token.parse(new_token).kid == key_id("second-secret")
    assert rotated.verify(old_token, now_ms=NOW + 3) == "alice"
    assert rotated.verify(new_token, now_ms=NOW + 3) == "alice"
    retired = ring({**added, **dict([retired_record(key_id("token-secret"), NOW + 4)])})
    assert retired.verify(new_token, now_ms=NOW + 5) == "alice"
    with pytest.raises(AuthError, match="was retired"):
        retired.verify(old_token, now_ms=NOW + 5)
    everything = ring(dict([retired_record(key_id("token-secret"), NOW)]))
    with pytest.raises(AuthError, match="every token key is retired"):
        everything.mint("alice", now_ms=NOW, ttl_s=HOUR)


def test_a_revoked_principal_s_earlier_tokens_are_refused_and_later_ones_not() -> None:
    before = ring().mint("alice", now_ms=NOW, ttl_s=HOUR)
    bob = ring().mint("bob", now_ms=NOW, ttl_s=HOUR)
    revoked = ring(dict([revoked_record("alice", NOW + 10)]))
    with pytest.raises(AuthError, match="revoked"):
        revoked.verify(before, now_ms=NOW + 20)
    assert revoked.verify(bob, now_ms=NOW + 20) == "bob"
    after = revoked.mint("alice", now_ms=NOW + 10, ttl_s=HOUR)
    assert revoked.verify(after, now_ms=NOW + 20) == "alice"
    with pytest.raises(AuthError, match="cannot be revoked"):
        revoked_record(NODE_PRINCIPAL, NOW)


def test_malformed_credential_records_are_ignored_not_fatal() -> None:
    records = {
        "auth/key/k0000000000": b"not json",
        "auth/key/k1111111111": b'{"secret": "does-not-match-its-id", "created_ms": 1}',
        "auth/revoked/alice": b'{"not_before_ms": "soon"}',
        "node/n1": b"{}",
    }
    keyring = ring(records)
    assert set(keyring.keys) == {key_id("token-secret")}
    assert keyring.revoked == {}


def test_metadata_must_carry_a_bearer_token() -> None:
    with pytest.raises(AuthError, match="no token"):
        principal_from_metadata(ring(), [], now_ms=NOW)
    with pytest.raises(AuthError, match="Bearer"):
        principal_from_metadata(ring(), [("authorization", "Basic abc")], now_ms=NOW)


def test_principal_names_ttls_and_durations_are_checked() -> None:
    with pytest.raises(AuthError):
        ring().mint("has space", now_ms=NOW, ttl_s=HOUR)
    with pytest.raises(AuthError):
        ring().mint("x" * 65, now_ms=NOW, ttl_s=HOUR)
    with pytest.raises(AuthError, match="> 0"):
        ring().mint("alice", now_ms=NOW, ttl_s=0)
    assert [parse_duration(t) for t in ("90", "90s", "15m", "12h", "30d")] == [
        90,
        90,
        900,
        43_200,
        2_592_000,
    ]
    for bad in ("", "0", "-5m", "1w", "h"):
        with pytest.raises(AuthError, match="duration"):
            parse_duration(bad)
    with pytest.raises(AuthError, match="not a key id"):
        retired_record("nope", NOW)
