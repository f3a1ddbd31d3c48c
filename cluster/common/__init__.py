"""sevendb.cluster.common: the ground every cluster room stands on - the cluster's
topology and placement, where a node keeps its files, bearer tokens, and helpers
that write files durably.

May import: `sevendb.outbox`, `sevendb.proto`.
"""
