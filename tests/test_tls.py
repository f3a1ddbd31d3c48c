"""Cluster certificates: a CA, node certificates with every advertised address,
principal certificates; an operator's CA that does not fit is refused."""

from __future__ import annotations

import ipaddress

import pytest
from cryptography import x509

from sevendb.cluster.common.tls import Issued, issue, load_ca, new_ca, principal_of
from sevendb.cluster.common.topology import ConfigError


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
