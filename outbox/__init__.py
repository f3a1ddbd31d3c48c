"""sevendb.outbox"""
