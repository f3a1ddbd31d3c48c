"""sevendb.cluster.archive: the drained outbox - purged rows written to Parquet
segments by every node, kept and compacted per node - and the Spark jobs that read
them (docs/spark.md). `format.py` defines the schema and layout both sides use.

May import: `sevendb.cluster.common`, `sevendb.outbox`, `sevendb.proto`.
"""
