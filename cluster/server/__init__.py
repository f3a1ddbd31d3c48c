"""sevendb.cluster.server: the node process - its replicas and notifiers, the gRPC
service, the write batcher, how requests fail at the edge, metrics and fault points.

The service (`service.py`) is split by concern: `rpc` (the guard: token, parsing),
`edge` (what every handler shares), `writes`, `reads`, `streams` and `sinks`
(subscription streams), `session`, `acks`, `admin`.

May import: `sevendb.cluster.raft`, `sevendb.cluster.archive`,
`sevendb.cluster.common`, `sevendb.notifier`, `sevendb.outbox`, `sevendb.proto`.
"""
