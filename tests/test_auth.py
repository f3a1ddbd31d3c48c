"""Bearer tokens: minted with the cluster secret, verified by every node."""

from __future__ import annotations

import pytest

from sevendb.cluster.common.auth import AuthError, mint_token, principal_from_metadata, verify_token


def test_a_minted_token_names_its_principal() -> None:
    token = mint_token("secret", "alice")
    assert verify_token("secret", token) == "alice"
    assert principal_from_metadata("secret", [("authorization", f"Bearer {token}")]) == "alice"


@pytest.mark.parametrize(
    "token",
    [
        "alice",  # no mac
        ".abc",  # no principal
        "alice.0000",  # wrong mac
        mint_token("other-cluster", "alice"),  # another cluster's secret
        mint_token("secret", "bob").replace("bob", "alice", 1),  # renamed
    ],
)
def test_forged_or_malformed_tokens_are_refused(token: str) -> None:
    with pytest.raises(AuthError):
        verify_token("secret", token)


def test_metadata_must_carry_a_bearer_token() -> None:
    with pytest.raises(AuthError, match="no token"):
        principal_from_metadata("secret", [])
    with pytest.raises(AuthError, match="Bearer"):
        principal_from_metadata("secret", [("authorization", "Basic abc")])


def test_principal_names_are_checked() -> None:
    with pytest.raises(AuthError):
        mint_token("secret", "has space")
    with pytest.raises(AuthError):
        mint_token("secret", "x" * 65)
