"""sevendb.cluster.raft: one bucket's Raft replica - pysyncobj 0.3.17, hardened
(docs/raft.md), with a journal that fsyncs and the node's shared Raft loop. The
only room that imports pysyncobj.

May import: `sevendb.cluster.common`, `sevendb.outbox`, `sevendb.proto`.
"""
