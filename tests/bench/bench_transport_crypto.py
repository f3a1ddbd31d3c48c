"""Micro-benchmark: what protecting one Raft message costs, pysyncobj's AEAD (as
sevendb patches it: AES-256-GCM, a random nonce and a timestamp per message) against
TLS 1.3 records (Python's `ssl`, which is what pysyncobj's sockets would have to use),
for the sizes Raft sends: heartbeats and small appends up to large batches.

    .venv/bin/python tests/bench/bench_transport_crypto.py [--seconds 1]

Per size: microseconds per message to seal and open it (both ends, one core), and
the throughput that makes in MB/s; for TLS also the handshake (a connection's set-up,
paid again on every reconnect). Not a test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import ssl
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sevendb.cluster.common.tls import issue, new_ca
from sevendb.cluster.raft.patches import _aead_encryptor

SIZES = (64, 512, 4096, 65536)


def _per_message(fn: Callable[[], None], seconds: float) -> float:
    """Microseconds per call of `fn`, over about `seconds`."""
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(100):
            fn()
        n += 100
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed / n * 1e6


def aead(size: int, seconds: float) -> float:
    encryptor = _aead_encryptor("bench-password")
    data = os.urandom(size)

    def one() -> None:
        token = encryptor.encrypt_at_time(data, int(time.time()))
        encryptor.extract_timestamp(token)
        encryptor.decrypt(token)

    return _per_message(one, seconds)


class _TlsPair:
    """A client and a server TLS 1.3 connection joined in memory (no socket: only
    the record layer and the handshake are measured)."""

    def __init__(self, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> None:
        self.c_in, self.c_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.s_in, self.s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.client = client_ctx.wrap_bio(self.c_in, self.c_out, server_hostname="localhost")
        self.server = server_ctx.wrap_bio(self.s_in, self.s_out, server_side=True)
        for _ in range(10):
            for end in (self.client, self.server):
                with contextlib.suppress(ssl.SSLWantReadError):
                    end.do_handshake()
            self._pump()
            if self._done():
                return
        raise RuntimeError("the handshake did not finish")

    def _done(self) -> bool:
        try:
            self.client.do_handshake()
            self.server.do_handshake()
        except ssl.SSLWantReadError:
            return False
        return True

    def _pump(self) -> None:
        self.s_in.write(self.c_out.read())
        self.c_in.write(self.s_out.read())

    def send(self, data: bytes) -> None:
        self.client.write(data)
        self.s_in.write(self.c_out.read())
        got = 0
        while got < len(data):
            got += len(self.server.read(len(data) - got))


def _contexts(tmp: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    ca = new_ca("bench")
    node = issue(ca, "n1", hosts=["localhost"])
    (tmp / "ca.pem").write_bytes(ca.cert_pem)
    (tmp / "node.pem").write_bytes(node.cert_pem)
    (tmp / "node-key.pem").write_bytes(node.key_pem)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_3
    server.load_cert_chain(tmp / "node.pem", tmp / "node-key.pem")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    client.load_verify_locations(tmp / "ca.pem")
    return server, client


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server_ctx, client_ctx = _contexts(Path(tmp))
        pair = _TlsPair(server_ctx, client_ctx)
        cipher = pair.client.cipher()
        t0, handshakes = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.seconds:
            _TlsPair(server_ctx, client_ctx)
            handshakes += 1
        handshake_ms = (time.perf_counter() - t0) / handshakes * 1e3
        print(f"load average: {os.getloadavg()[0]:.2f}; TLS cipher {cipher}")
        print(f"TLS 1.3 handshake (ECDSA P-256, both ends, in memory): {handshake_ms:.2f} ms")
        print("\n| message bytes | AEAD us/msg | AEAD MB/s | TLS us/msg | TLS MB/s | TLS/AEAD |")
        print("|---|---|---|---|---|---|")
        for size in SIZES:
            a = aead(size, args.seconds)
            data = os.urandom(size)
            t = _per_message(lambda d=data: pair.send(d), args.seconds)  # type: ignore[misc]
            print(
                f"| {size} | {a:.2f} | {size / a:,.0f} | {t:.2f} | {size / t:,.0f} | {t / a:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
