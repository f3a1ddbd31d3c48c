"""sevendb.notifier"""
