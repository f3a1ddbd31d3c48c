"""sevendb.outbox: the deterministic core and its vocabulary - log entries, the
bucket state machine, queries and plans, emit sequences, errors, limits, key
routing, and the replica contract. No I/O, clock, randomness or threads
(tests/test_purity.py).

May import: nothing first-party.
"""
