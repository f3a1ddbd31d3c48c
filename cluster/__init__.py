"""sevendb.cluster"""
