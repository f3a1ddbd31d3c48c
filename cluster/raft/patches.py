"""Small patches of pysyncobj 0.3.17's module globals, applied once at import
(`install_patches`): our journal, a faster pickle protocol, one key derivation per
password and AES-256-GCM instead of Fernet, snapshots written in a thread, and
messages sent as stored zlib streams. Why each: docs/raft.md ("Smaller fixes")."""

from __future__ import annotations

import functools
import os
import struct
import zlib
from typing import Final

import pysyncobj.pickle as _pysyncobj_pickle
import pysyncobj.syncobj as _pysyncobj
import pysyncobj.tcp_connection as _pysyncobj_tcp
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.pbkdf2 import PBKDF2HMAC

from .journal import DurableJournal
from .snapshots import BackgroundSerializer

__all__ = [
    "StoredZlib",
    "install_patches",
]

_KDF_SALT: Final = b"sevendb-raft-transport/v1"
_TIMESTAMP = struct.Struct(">Q")
_NONCE_BYTES: Final = 12


class _AeadEncryptor:
    """pysyncobj's transport encryptor (the three methods tcp_connection.py uses),
    as AES-256-GCM: ``timestamp (8) | nonce (12) | ciphertext+tag``, the timestamp
    authenticated as associated data. pysyncobj checks timestamps never go
    backwards per connection and prefixes each message with the connection's random
    key (replay protection), as with Fernet."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def encrypt_at_time(self, data: bytes, timestamp: int) -> bytes:
        header = _TIMESTAMP.pack(timestamp)
        nonce = os.urandom(_NONCE_BYTES)
        return header + nonce + self._aead.encrypt(nonce, data, header)

    def extract_timestamp(self, token: bytes) -> int:
        # Authenticated by decrypt() right after (a forged header fails there).
        return int(_TIMESTAMP.unpack_from(token)[0])

    def decrypt(self, token: bytes) -> bytes:
        header = token[: _TIMESTAMP.size]
        nonce = token[_TIMESTAMP.size : _TIMESTAMP.size + _NONCE_BYTES]
        return self._aead.decrypt(nonce, token[_TIMESTAMP.size + _NONCE_BYTES :], header)


def _aead_encryptor(password: str | bytes) -> _AeadEncryptor:
    secret = password if isinstance(password, bytes) else password.encode()
    kdf = PBKDF2HMAC(algorithm=hashes.SHA256(), length=32, salt=_KDF_SALT, iterations=200_000)
    return _AeadEncryptor(kdf.derive(secret))


class StoredZlib:
    """Stands in for the ``zlib`` module in pysyncobj's transport, which deflates
    every message at level 3 before encrypting it (tcp_connection.py:144, 291).

    Deflate sets up ~256 KiB of state per call: 42-56 µs for a message of 100 bytes to
    3 KB on this VM, against 1-2 µs here, and in a loaded leader one such call per
    message sent. Messages are now zlib streams of stored (uncompressed) blocks
    with the smallest window and memory level. Any zlib reads them, so nodes on
    either side of an upgrade understand each other; what arrives is inflated by
    zlib as before, deflated or not. Raft messages travel between the nodes of one
    cluster, where bytes are cheaper than the tick thread's CPU."""

    @staticmethod
    def compress(data: bytes, level: int = -1) -> bytes:
        stored = zlib.compressobj(0, zlib.DEFLATED, 9, 1)
        return stored.compress(data) + stored.flush()

    decompress = staticmethod(zlib.decompress)


def install_patches() -> None:
    """Five small, idempotent patches of pysyncobj module globals.

    1. ``createJournal`` (syncobj.py:166) returns a :class:`DurableJournal` passed as
       ``conf.journalFile`` as is, so the adapter owns the journal object.
    2. pysyncobj pickles commands and messages with protocol 2 (pickle.py), which
       stores ``bytes`` as latin-1 text: up to 2x larger and slower. Every node runs
       this module, and any protocol unpickles, so we use the interpreter's default.
    3. ``getEncryptor`` runs PBKDF2 (100k iterations, ~30 ms) for every SyncObj; one
       node hosts a replica per bucket with the same password, so derive once. And
       the encryptor is AES-256-GCM (:class:`_AeadEncryptor`) instead of Fernet:
       Fernet (AES-CBC + HMAC + base64 in several Python-level steps) cost ~16% of a
       loaded leader's GIL time, one AEAD call costs a few microseconds.
    4. ``Serializer`` (syncobj.py:198) is :class:`BackgroundSerializer`: snapshots
       are written outside the tick thread.
    5. The transport's ``zlib`` (tcp_connection.py:4) is :class:`StoredZlib`:
       messages are no longer deflated.
    """
    if getattr(_pysyncobj, "_sevendb_patched", False):
        return
    original_create = _pysyncobj.createJournal

    def create_journal(journal_file: object) -> object:
        if isinstance(journal_file, DurableJournal):
            return journal_file
        return original_create(journal_file)

    _pysyncobj.createJournal = create_journal
    vars(_pysyncobj_pickle)["__protocol"] = _pysyncobj_pickle.pickle.DEFAULT_PROTOCOL
    _pysyncobj.getEncryptor = functools.lru_cache(maxsize=8)(_aead_encryptor)
    _pysyncobj.Serializer = BackgroundSerializer
    _pysyncobj_tcp.zlib = StoredZlib
    _pysyncobj._sevendb_patched = True


install_patches()
