"""TLS settings of a `Client`: which certificate authority to trust, and the client
certificate to present (mTLS), if any.

    Client(endpoints, token=token, tls=TLS.from_files(ca="bundles/ca.pem"))
    Client(endpoints, tls=TLS.from_files(ca="ca.pem", cert="alice.pem", key="alice-key.pem"))
    Client(endpoints, token=token)              # TLS, trusting the system's CAs
    Client(endpoints, token=token, tls=None)    # plaintext: a cluster made --insecure

TLS is the default; plaintext only when asked for by name (``tls=None``).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
from grpc import aio

from sevendb.outbox.errors import InvalidArgument

__all__ = ["SYSTEM_ROOTS", "TLS", "aio_channel", "credentials", "sync_channel"]


@dataclass(frozen=True, slots=True)
class TLS:
    """PEM bytes: `ca` the certificates to trust (None: the system's), `cert` and
    `key` a client certificate and its key (both or neither)."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def __post_init__(self) -> None:
        for name in ("ca", "cert", "key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bytes):
                raise InvalidArgument(f"TLS {name} must be PEM bytes (TLS.from_files reads files)")
        if (self.cert is None) != (self.key is None):
            raise InvalidArgument("a client certificate needs its key, and a key its certificate")

    @classmethod
    def from_files(
        cls,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
    ) -> TLS:
        """Read the PEM files; the key is refused if anyone but its owner may read it."""
        return cls(
            _read(ca, "CA certificate"),
            _read(cert, "certificate"),
            _read(key, "private key", secret=True),
        )


SYSTEM_ROOTS: Final = TLS()
"""TLS trusting the system's certificate authorities, no client certificate (the
default of `Client`)."""


def _read(path: str | Path | None, what: str, *, secret: bool = False) -> bytes | None:
    if path is None:
        return None
    path = Path(path)
    try:
        mode = path.stat().st_mode
        if secret and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InvalidArgument(
                f"{path}: a private key readable by others (mode {stat.S_IMODE(mode):o}); "
                f"run `chmod 600 {path}`"
            )
        return path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read the {what} ({exc.strerror})") from None


def credentials(tls: TLS) -> grpc.ChannelCredentials:
    """gRPC's channel credentials for `tls`."""
    return grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)


def sync_channel(address: str, tls: TLS | None) -> grpc.Channel:
    """A blocking channel to `address`: TLS unless `tls` is None."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials(tls))


def aio_channel(address: str, tls: TLS | None) -> aio.Channel:
    """An asyncio channel to `address`: TLS unless `tls` is None."""
    if tls is None:
        return aio.insecure_channel(address)
    return aio.secure_channel(address, credentials(tls))
