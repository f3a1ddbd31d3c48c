"""sevendb.cluster.server: the node process - its replicas and notifiers, the gRPC
service, the write batcher, the error table at the edge, metrics and fault points.

May import: `sevendb.cluster.raft`, `sevendb.cluster.archive`,
`sevendb.cluster.common`, `sevendb.notifier`, `sevendb.outbox`, `sevendb.proto`.
"""
