"""Helpers of tests/bench/side_by_side.py: installing, running and driving etcd, NATS
JetStream and sevendb clusters side by side (see that script's docstring)."""
