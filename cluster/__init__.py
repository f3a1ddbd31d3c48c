"""sevendb.cluster: everything that runs or operates a node, one room per job.

* `common` - the shared ground: topology, the data dir's layout, tokens, durable files.
* `raft` - one bucket's replica over pysyncobj (the only importer of pysyncobj).
* `server` - the node process: gRPC service, write batching, metrics, fault points.
* `archive` - the drained-outbox archive and the Spark jobs over it.
* `ops` - the operator's tools (CLI, local clusters, migrations, demo): clients of
  the server, never importing `server` or `raft`.

The arrows between rooms are drawn in docs/architecture.md and enforced by
tests/test_architecture.py.
"""
