"""sevendb.cluster.ops: the operator's tools - the `sevendb` CLI, local clusters,
bucket migrations, the demo. Clients of the server: they talk to nodes over gRPC
and start them as processes, and never import `server` or `raft`.

May import: `sevendb.cluster.archive`, `sevendb.cluster.common`, `sevendb.sdk`,
`sevendb.outbox`, `sevendb.proto`.
"""
