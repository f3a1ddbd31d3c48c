"""Where a key lives: the bucket it routes to. Shared by the nodes, which own the
buckets, and the SDK, which sends each request to its bucket's nodes."""

from __future__ import annotations

import xxhash

__all__ = ["bucket_of"]


def bucket_of(key: str, buckets: int) -> int:
    """The bucket a key routes to: xxh64 of its UTF-8 bytes modulo the bucket count."""
    return xxhash.xxh64_intdigest(key.encode("utf-8")) % buckets
