"""sevendb.sim"""
