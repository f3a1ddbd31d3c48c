"""Every bound the core enforces, as named constants (units last in the name).

Requests beyond these are refused with a clear error before they reach the log;
the state machine checks them again when it decodes an entry, so a bad entry can
never change state.
"""

from __future__ import annotations

from typing import Final

KEY_BYTES_MAX: Final = 1024
"""Longest key, in UTF-8 bytes."""
VALUE_BYTES_MAX: Final = 64 * 1024
"""Largest value: small domain facts, like an event store's 64 KiB record."""
OPS_PER_WRITE_MAX: Final = 256
"""Most SET/DEL operations in one atomic write."""
WRITE_VALUE_BYTES_MAX: Final = 1024 * 1024
"""Most value bytes in one atomic write (all ops together)."""
WRITES_PER_BATCH_MAX: Final = 1024
"""Most client writes the server batches into one WRITE_BATCH entry."""
SUBSCRIBES_PER_BATCH_MAX: Final = 1024
"""Most SUBSCRIBEs one SUBSCRIBE_BATCH entry carries."""
ENTRY_BYTES_MAX: Final = 2 * 1024 * 1024
"""Largest encoded log entry the core will decode."""
SUBSCRIPTIONS_PER_BUCKET_MAX: Final = 65_536
"""Most live subscriptions in one bucket (a prefix query counts in every bucket)."""
PRODUCERS_PER_BUCKET_MAX: Final = 65_536
"""Most idempotent producers one bucket remembers."""
PRODUCER_RESULTS_CACHED: Final = 1024
"""Results remembered per producer, so a retried duplicate gets its original answer."""
ID_BYTES_MAX: Final = 128
"""Longest sub_id, node id or bucket uuid."""
PRINCIPAL_BYTES_MAX: Final = 256
"""Longest authenticated principal name."""
ACKS_PER_PURGE_MAX: Final = 4096
"""Most acknowledgements batched into one OUTBOX_PURGE entry."""
EXPIRES_PER_PURGE_MAX: Final = 4096
"""Most subscriptions (and, separately, most producers) expired by one OUTBOX_PURGE."""
TOUCHES_PER_PURGE_MAX: Final = 4096
"""Most keep-alives (attached subscriptions with nothing to acknowledge) in one
OUTBOX_PURGE."""
EXPIRED_REMEMBERED_MAX: Final = 4096
"""Expired subscriptions a bucket remembers (sub_id and owner, nothing else), so that
their Reconnect is answered STALE_SEQUENCE; an older one is answered
SUBSCRIPTION_NOT_FOUND. Neither counts toward SUBSCRIPTIONS_PER_BUCKET_MAX."""
SYNC_LIMIT_DEFAULT: Final = 100
"""Items per Sync page when the client does not say."""
SYNC_LIMIT_MAX: Final = 1000
"""Sync limits are clamped to this."""
STALL_WINDOW_MS_DEFAULT: Final = 24 * 3600 * 1000
"""A subscription that acknowledged nothing this long (and, with nothing to
acknowledge, had no client attached) is expired and deleted (docs/contract.md §8)."""
PRODUCER_IDLE_MS_DEFAULT: Final = 24 * 3600 * 1000
"""An idempotent producer that wrote nothing this long is forgotten (Kafka keeps a
producer's state a day by default too); its next write is UNKNOWN_PRODUCER."""
TXN_TIMEOUT_MS_MAX: Final = 15 * 60 * 1000
"""Longest transaction timeout a transactional id may ask for (the default is 60 s,
`entries.TXN_TIMEOUT_MS_DEFAULT`)."""
TXN_PENDING_PER_PRODUCER_MAX: Final = 5
"""Transactions of one transactional id not yet complete (open, or decided and
awaiting markers): one more is refused TOO_MANY_TRANSACTIONS."""
TXN_BUCKETS_MAX: Final = 256
"""Most buckets one transaction spans."""
TXN_OPS_PER_BUCKET_MAX: Final = 4096
"""Most ops one transaction keeps pending in one bucket."""
TXN_BYTES_PER_BUCKET_MAX: Final = 4 * 1024 * 1024
"""Most value bytes one transaction keeps pending in one bucket."""
TXN_IDS_PER_BUCKET_MAX: Final = 65_536
"""Most transactional ids one coordinator bucket remembers."""
TXN_ENDED_REMEMBERED_MAX: Final = 65_536
"""Transactional ids a participant bucket remembers the last ended transaction of."""
TXN_ACKS_PER_WRITE_MAX: Final = 64
"""Most subscription acks one transactional write carries (consume-transform-produce)."""
