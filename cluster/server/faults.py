"""Fault points for crash tests against real processes (FoundationDB's BUGGIFY, made
explicit): a node started with ``SEVENDB_TEST_FAULTS=1`` checks, at a few named
points, whether a file ``<node dir>/fault-<name>`` exists; if it does, the file is
removed (so a restarted node does not fire again) and the process kills itself
with SIGKILL - a crash at exactly that point. Off (no file system access at all)
unless the environment variable is set.

Points: ``kill-before-send`` - the lease holder has outboxed rows ready for a client
stream and dies before sending any of them (the crash between OUTBOX_WRITE and send
of docs/emission.md, FTO-02); ``kill-after-txn-decision`` - the node that took a
transaction's COMMIT or ABORT dies once the decision is committed, before writing any
marker (docs/transactions.md: the coordinator's leader finishes it);
``kill-before-txn-decision`` - the node that took a transaction's COMMIT or ABORT dies
before proposing the decision (the transaction stays open: its timeout aborts it, or
its producer's retried call decides it).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Final

ENV: Final = "SEVENDB_TEST_FAULTS"
KILL_BEFORE_SEND: Final = "kill-before-send"
KILL_AFTER_TXN_DECISION: Final = "kill-after-txn-decision"
KILL_BEFORE_TXN_DECISION: Final = "kill-before-txn-decision"


def fault_file(node_dir: Path, name: str) -> Path:
    return node_dir / f"fault-{name}"


class FaultPoints:
    def __init__(self, node_dir: Path, enabled: bool) -> None:
        self._dir = node_dir
        self.enabled = enabled

    @classmethod
    def from_env(cls, node_dir: Path) -> FaultPoints:
        return cls(node_dir, os.environ.get(ENV) == "1")

    def fire(self, name: str) -> None:
        """Die here (SIGKILL) if the fault is armed."""
        if not self.enabled:
            return
        path = fault_file(self._dir, name)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = [
    "ENV",
    "KILL_AFTER_TXN_DECISION",
    "KILL_BEFORE_SEND",
    "KILL_BEFORE_TXN_DECISION",
    "FaultPoints",
    "fault_file",
]
