"""sevendb.cluster.server: the node process - its replicas and notifiers, the gRPC
service, the write and SUBSCRIBE batchers, how requests fail at the edge, metrics and fault points.

The service (`service.py`) is split by concern: `rpc` (the guard: token, parsing),
`edge` (what every handler shares), `writes`, `reads`, `streams` and `sinks`
(subscription streams), `session`, `acks`, `admin`.

May import: `sevendb.cluster.raft`, `sevendb.cluster.archive`,
`sevendb.cluster.common`, `sevendb.notifier`, `sevendb.outbox`, `sevendb.proto`.
"""

import os

# A node's pyarrow (the archive writer) allocates from the C library's malloc, not
# from the mimalloc pool pyarrow picks by default: mimalloc kept what each archive
# pass freed, in per-thread heaps nothing else reuses, and a node's memory climbed
# with it for as long as the soak ran (docs/performance.md). pyarrow reads this once,
# when it is first imported: here, before any room of the node imports it. An
# operator's own ARROW_DEFAULT_MEMORY_POOL is kept.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

# A node forks a child process to pack each snapshot (`proto/threads.start_forked`),
# which never uses gRPC. gRPC's fork handlers would pause its threads around each
# fork, or, while they are busy, log that they skip that (once per snapshot). Off,
# a fork leaves gRPC alone. gRPC reads this when it is first imported: here too.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
