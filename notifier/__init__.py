"""sevendb.notifier: the emitting side of a bucket - the pure decisions of the
notifier lease, streams and acks (`core`), and the host that performs them against
any `sevendb.outbox.replica.Replica` (`host`).

May import: `sevendb.outbox`, `sevendb.proto`.
"""
