"""sevendb.sdk"""
