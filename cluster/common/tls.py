"""Certificates for a cluster: a CA of its own, and certificates it issues to nodes
(server and client use, a SAN for every advertised address) and to principals
(client use, the principal's name as the common name, for mTLS).

`sevendb cluster init` makes the CA unless the operator brings one (`--ca-cert`,
`--ca-key`); `sevendb node init` and `sevendb cert` issue more. Keys are ECDSA P-256,
certificates SHA-256-signed, PEM-encoded.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sevendb.cluster.common.topology import ConfigError

__all__ = [
    "CA_DAYS",
    "CERT_DAYS",
    "Issued",
    "PeerIdentity",
    "check_certificate",
    "issue",
    "load_ca",
    "new_ca",
    "peer_identity",
    "principal_of",
]

CA_DAYS = 3650
CERT_DAYS = 825


@dataclass(frozen=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def new_ca(cluster_id: str, days: int = CA_DAYS) -> Issued:
    """A self-signed CA for one cluster."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"sevendb CA {cluster_id}")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


SigningKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def _spki(key: object) -> bytes:
    assert isinstance(key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey)
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def load_ca(ca: Issued) -> tuple[x509.Certificate, SigningKey]:
    """The CA's certificate and key (an operator's own CA may use RSA); ConfigError
    when they are not PEM or do not belong together."""
    try:
        cert = x509.load_pem_x509_certificate(ca.cert_pem)
        key = serialization.load_pem_private_key(ca.key_pem, password=None)
    except ValueError as exc:
        raise ConfigError(f"the CA certificate or key is not PEM: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ConfigError("the CA key must be an EC or RSA private key")
    if _spki(cert.public_key()) != _spki(key.public_key()):
        raise ConfigError("the CA key does not match the CA certificate")
    return cert, key


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def issue(
    ca: Issued,
    common_name: str,
    *,
    hosts: Sequence[str] = (),
    server: bool = True,
    days: int = CERT_DAYS,
) -> Issued:
    """A certificate signed by `ca` for `common_name`: with `server`, valid for
    serving (SANs: `hosts`, plus localhost) and as a client (node to node); else a
    client certificate naming a principal."""
    ca_cert, ca_key = load_ca(ca)
    key = _key()
    now = _now()
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + (
        [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if server:
        builder = builder.add_extension(
            _san([*dict.fromkeys([*hosts, "localhost", "127.0.0.1"])]), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def check_certificate(ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> None:
    """ConfigError unless `cert_pem` was issued by the CA `ca_pem`, is valid now and
    belongs with `key_pem`."""
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as exc:
        raise ConfigError(f"not PEM: {exc}") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError("the certificate was not issued by the cluster's CA") from None
    now = _now()
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ConfigError(f"the certificate is not valid now (until {cert.not_valid_after_utc})")
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) or _spki(
        cert.public_key()
    ) != _spki(key.public_key()):
        raise ConfigError("the key does not match the certificate")


def principal_of(cert_pem: bytes) -> str:
    """The common name of a client certificate (the principal it authenticates)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise ConfigError("the certificate has no common name")
    return str(names[0].value)


@dataclass(frozen=True)
class PeerIdentity:
    """Who a verified client certificate names: a node (a certificate for serving,
    which only nodes are issued) or a principal (its common name), and since when
    the certificate is valid (a revocation refuses certificates issued before it)."""

    principal: str
    is_node: bool
    not_before_ms: int


@functools.lru_cache(maxsize=1024)
def peer_identity(cert_pem: bytes) -> PeerIdentity:
    """The identity of a certificate the TLS layer already verified against the
    cluster's CA. ConfigError if it names no principal."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise ConfigError(f"the peer's certificate is not PEM: {exc}") from None
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        is_node = ExtendedKeyUsageOID.SERVER_AUTH in usages
    except x509.ExtensionNotFound:
        is_node = False
    not_before = int(cert.not_valid_before_utc.timestamp() * 1000)
    return PeerIdentity(principal_of(cert_pem), is_node, not_before)
