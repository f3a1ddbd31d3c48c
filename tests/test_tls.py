"""Cluster certificates: a CA, node certificates with every advertised address,
principal certificates; an operator's CA that does not fit is refused."""

from __future__ import annotations

import ipaddress
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509

from sevendb.cluster.common.auth import Token
from sevendb.cluster.common.bundle import ClientConfig, ClientTLS, ClusterSecrets, load_node_tls
from sevendb.cluster.common.tls import (
    Issued,
    issue,
    load_ca,
    new_ca,
    peer_identity,
    principal_of,
)
from sevendb.cluster.common.topology import ConfigError
from sevendb.cluster.ops.deploy import cluster_init


def test_a_node_certificate_names_every_address_and_chains_to_the_ca() -> None:
    ca = new_ca("c1")
    node = issue(ca, "n1", hosts=["10.0.0.1", "node1.example"])
    cert = x509.load_pem_x509_certificate(node.cert_pem)
    ca_cert, _ = load_ca(ca)
    cert.verify_directly_issued_by(ca_cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert "node1.example" in san.get_values_for_type(x509.DNSName)
    assert principal_of(node.cert_pem) == "n1"


def test_a_principal_certificate_is_for_clients_only() -> None:
    ca = new_ca("c1")
    alice = x509.load_pem_x509_certificate(issue(ca, "alice", server=False).cert_pem)
    usages = alice.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]


def test_a_ca_whose_key_does_not_match_is_refused() -> None:
    a, b = new_ca("a"), new_ca("b")
    with pytest.raises(ConfigError, match="does not match"):
        issue(Issued(a.cert_pem, b.key_pem), "n1")
    with pytest.raises(ConfigError, match="not PEM"):
        issue(Issued(b"junk", a.key_pem), "n1")


def test_cluster_init_writes_a_ca_node_certificates_and_a_client_bundle(tmp_path: Path) -> None:
    """Before, bundles held no certificate and client.toml no TLS: everything was
    plaintext."""
    out = tmp_path / "bundles"
    cluster_init(
        out,
        ["n1=10.0.0.1", "n2=node2.example:7002"],
        buckets=1,
        replicas=2,
        meta_voters=1,
        sans=["sevendb.example"],
    )
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    for node_id, host in (("n1", "10.0.0.1"), ("n2", "node2.example")):
        bundle = out / node_id
        tls = load_node_tls(bundle / "ca.pem", bundle / "node.pem", bundle / "node-key.pem")
        cert = x509.load_pem_x509_certificate(tls.cert_pem)
        cert.verify_directly_issued_by(ca)
        names = {
            str(n.value)
            for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        }
        assert {host, "sevendb.example", "localhost", "127.0.0.1"} <= names
        assert stat.S_IMODE((bundle / "node-key.pem").stat().st_mode) == 0o600
        assert peer_identity(tls.cert_pem).is_node
    for secret in ("client.toml", "admin-key.pem", "ca-key.pem"):
        assert stat.S_IMODE((out / secret).stat().st_mode) == 0o600
    config = ClientConfig.load(out / "client.toml")
    assert config.tls == ClientTLS(out / "ca.pem", out / "admin.pem", out / "admin-key.pem")
    admin = peer_identity(config.tls.read()[1] or b"")
    assert (admin.principal, admin.is_node) == ("admin", False)
    assert config.token is not None and Token.parse(config.token).principal == "admin"


def test_an_insecure_cluster_says_so_and_has_no_certificate(tmp_path: Path) -> None:
    out = tmp_path / "bundles"
    cluster_init(out, ["n1=10.0.0.1"], buckets=1, replicas=1, meta_voters=1, insecure=True)
    assert not list(out.rglob("*.pem"))
    assert "insecure = true" in (out / "n1" / "node.toml").read_text()
    assert ClientConfig.load(out / "client.toml").tls is None
    with pytest.raises(ConfigError, match="--insecure makes no certificate"):
        cluster_init(tmp_path / "x", ["n1=h"], buckets=1, replicas=1, insecure=True, sans=["a"])


def test_an_operators_own_ca_issues_the_certificates(tmp_path: Path) -> None:
    own = new_ca("operator")
    out = tmp_path / "bundles"
    cluster_init(out, ["n1=10.0.0.1"], buckets=1, replicas=1, meta_voters=1, ca=own)
    assert (out / "ca.pem").read_bytes() == own.cert_pem
    assert not (out / "ca-key.pem").exists()  # the operator keeps their key
    node = x509.load_pem_x509_certificate((out / "n1" / "node.pem").read_bytes())
    node.verify_directly_issued_by(load_ca(own)[0])


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda b: os.chmod(b / "node-key.pem", 0o640), "readable by others"),
        (lambda b: (b / "ca.pem").write_bytes(new_ca("x").cert_pem), "not issued by"),
        (
            lambda b: (b / "node-key.pem").write_bytes(issue(new_ca("y"), "n1").key_pem),
            "does not match",
        ),
        (lambda b: (b / "node.pem").unlink(), "no such certificate file"),
    ],
)
def test_a_node_s_tls_files_are_checked(
    tmp_path: Path, change: Callable[[Path], object], why: str
) -> None:
    cluster_init(tmp_path / "b", ["n1=10.0.0.1"], buckets=1, replicas=1, meta_voters=1)
    bundle = tmp_path / "b" / "n1"
    change(bundle)
    with pytest.raises(ConfigError, match=why):
        load_node_tls(bundle / "ca.pem", bundle / "node.pem", bundle / "node-key.pem")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('endpoints = ["a:1"]\n', "no \\[tls\\] table"),
        ('endpoints = ["a:1"]\ninsecure = true\n[tls]\nca = "ca.pem"\n', "choose one"),
        ('endpoints = ["a:1"]\n[tls]\nca = "ca.pem"\ncert = "c.pem"\n', "go together"),
        ('endpoints = ["a:1"]\n[tls]\nca = "ca.pem"\nverify = false\n', "unknown keys"),
        ('endpoints = ["a:1"]\nsecret = 1\ninsecure = true\n', "unknown keys"),
    ],
)
def test_a_client_bundle_s_tls_table_is_checked(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "client.toml"
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match=why):
        ClientConfig.load(path)


def test_the_three_secrets_are_required_and_distinct(tmp_path: Path) -> None:
    """Before, one file held two secrets and no admin key."""
    path = tmp_path / "secrets.toml"
    for text, why in (
        ('raft_password = "a"\ntoken_secret = "b"\n', "missing admin_secret"),
        ('raft_password = "a"\ntoken_secret = "a"\nadmin_secret = "c"\n', "must differ"),
    ):
        path.write_text(text)
        os.chmod(path, 0o600)
        with pytest.raises(ConfigError, match=why):
            ClusterSecrets.load(path)
