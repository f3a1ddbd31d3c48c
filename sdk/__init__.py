"""sevendb.sdk: the client library.

May import: `sevendb.proto`, `sevendb.outbox`.
"""
