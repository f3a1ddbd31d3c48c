"""sevendb.cluster.archive: the drained outbox - purged rows written to Parquet
segments by every node - and the Spark jobs that read them (docs/spark.md).

May import: `sevendb.cluster.common`, `sevendb.outbox`, `sevendb.proto`.
"""
