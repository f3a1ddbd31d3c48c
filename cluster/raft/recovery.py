"""What a replica does about disk damage (docs/raft.md, "Disk faults").

A replica that lost entries it had acknowledged must not count as holding them
(Alagappan et al., "Protocol-Aware Recovery for Consensus-Based Storage", FAST '18):
until its leader has sent them again it neither serves nor campaigns, and it votes
only for a candidate whose log reaches what it had acknowledged. Replicas tell each
other what they hold (and what they lost) in their keep-alives; when no reachable
replica holds every acknowledged entry, the bucket answers DATA_LOSS until one comes
back or an operator accepts the loss (`sevendb bucket recover`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .sidecars import Position

__all__ = [
    "ACCEPT_LOSS",
    "DECISION_FILE",
    "KEEP_ALIVE",
    "UNKNOWN_INDEX",
    "Recovery",
    "write_decision",
]

logger = logging.getLogger(__name__)

KEEP_ALIVE: Final = "sevendb_keep_alive"
"""The type of the message members send each other a few times per connection timeout
(idle links stay up: docs/raft.md, hazard 8), which also carries what each holds."""
DECISION_FILE: Final = "RECOVER"
"""An operator's decision, written into the replica's data dir by `sevendb bucket
recover` and read within a second."""
ACCEPT_LOSS: Final = "accept-loss"
UNKNOWN_INDEX: Final = 0xFFFFFFFFFFFFFFFF
"""The index of a claim known only to exceed everything this replica knows of."""


def write_decision(data_dir: Path, decision: str) -> Path:
    """Leave an operator's decision for the replica in `data_dir` (read within a
    second, then renamed to ``RECOVER.done``)."""
    path = data_dir / DECISION_FILE
    body = json.dumps({"decision": decision, "at_ms": time.time_ns() // 1_000_000})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(body)
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class _Claim:
    last: Position
    need: Position | None
    heard_s: float


def _index(position: Position) -> str:
    return "an unknown index" if position[1] == UNKNOWN_INDEX else f"index {position[1]}"


def _position(raw: object) -> Position | None:
    if isinstance(raw, list | tuple) and len(raw) == 2 and all(type(v) is int for v in raw):
        return (raw[0], raw[1])
    return None


class Recovery:
    """One replica's state of repair and its view of its bucket's replicas. Mutated in
    the tick thread; read from any thread (single attribute reads)."""

    def __init__(self, bucket: int, self_addr: str, data_dir: Path, grace_s: float) -> None:
        self.bucket = bucket
        self.self_addr = self_addr
        self._decision = data_dir / DECISION_FILE
        self._grace_s = grace_s
        self._fresh_s = 3 * grace_s
        self.need: Position | None = None
        """The last position this replica had acknowledged and no longer holds."""
        self.lost_after = 0
        """The index its log ended at when the loss was found."""
        self.repairs = 0
        """Times damage was found on this replica (each logged at ERROR)."""
        self.votes_refused = 0
        """Votes refused while repairing (the candidate's log was too short)."""
        self.data_loss: str | None = None
        """Why the bucket refuses with DATA_LOSS, seen from here (None: it does not)."""
        self._loss_since: float | None = None
        self._peers: dict[str, _Claim] = {}
        self._next_check_s = 0.0

    # -- found at startup ------------------------------------------------------------

    def found(self, problems: Sequence[str], need: Position | None, last: Position) -> None:
        """Damage found when the replica opened its files (logged at ERROR)."""
        if not problems and need is None:
            return
        self.repairs += 1
        self.need, self.lost_after = need, last[1]
        if need is None:
            outcome = "nothing it had acknowledged is lost; repaired in place"
        else:
            outcome = (
                f"it lost acknowledged entries after index {last[1]} (it had acknowledged "
                f"through {_index(need)}): until its leader has sent them again it does not "
                "serve, campaign, or vote for a replica without them"
            )
        logger.error(
            "bucket %d replica %s: disk damage found: %s; %s",
            self.bucket,
            self.self_addr,
            "; ".join(problems) or "acknowledged entries missing",
            outcome,
        )

    # -- what a damaged replica may do ---------------------------------------------

    def may_vote_for(self, candidate_last: Position) -> bool:
        """A replica that lost acknowledged entries votes only for a candidate whose
        log reaches them (Raft's "at least as up to date" against what it had, not
        what it has): its vote then stands for the entries it acknowledged."""
        return self.need is None or candidate_last >= self.need

    def repaired(self, durable: Position, leader: str | None) -> bool:
        """True once, when the log holds (durably) what was lost again."""
        if self.need is None or durable < self.need:
            return False
        logger.error(
            "bucket %d replica %s: repaired by %s: it holds every entry it had "
            "acknowledged again (through index %d); it serves and votes again",
            self.bucket,
            self.self_addr,
            leader or "its leader",
            durable[1],
        )
        self.need = None
        return True

    def not_serving(self) -> str | None:
        """Why this replica refuses reads and writes (None: it does not, for this)."""
        if self.data_loss is None and self.need is not None:
            return (
                f"repairing: lost acknowledged entries after index {self.lost_after} (had "
                f"acknowledged through {_index(self.need)}); its leader is sending them again"
            )
        return self.data_loss

    # -- what the bucket's replicas hold -------------------------------------------

    def keep_alive(self, last: Position) -> dict[str, Any]:
        return {"type": KEEP_ALIVE, "last": list(last), "need": self.need and list(self.need)}

    def heard(self, peer: str, message: dict[str, Any]) -> None:
        last = _position(message.get("last"))
        if last is not None:  # an older node sends a bare keep-alive
            self._peers[peer] = _Claim(last, _position(message.get("need")), time.monotonic())

    def judge(self, last: Position, leader_known: bool, members: Sequence[str]) -> None:
        """Decide whether the bucket is in DATA_LOSS, as far as this replica sees:
        someone lost acknowledged entries, no leader is known, and no reachable
        replica's log reaches them, for longer than the grace period."""
        now = time.monotonic()
        fresh = {
            p: c for p, c in self._peers.items() if p in members and now - c.heard_s < self._fresh_s
        }
        needs = [n for n in (self.need, *(c.need for c in fresh.values())) if n is not None]
        if (
            not needs
            or leader_known
            or any(held >= max(needs) for held in (last, *(c.last for c in fresh.values())))
        ):
            self._loss_since = None
            if self.data_loss is not None:
                logger.warning("bucket %d: no longer in DATA_LOSS", self.bucket)
                self.data_loss = None
            return
        if self._loss_since is None:
            self._loss_since = now
        if now - self._loss_since < self._grace_s or self.data_loss is not None:
            return
        self.data_loss = self._verdict(max(needs), last, fresh, members)
        logger.error("%s", self.data_loss)

    def leader_seen(self) -> None:
        """A leader is there (it holds every committed entry): no DATA_LOSS."""
        self._loss_since = None
        if self.data_loss is not None:
            logger.warning("bucket %d: a leader is back: no longer in DATA_LOSS", self.bucket)
            self.data_loss = None

    def _verdict(
        self, need: Position, last: Position, fresh: dict[str, _Claim], members: Sequence[str]
    ) -> str:
        views = {self.self_addr: _Claim(last, self.need, 0.0), **fresh}
        parts = []
        for addr, claim in sorted(views.items()):
            if claim.need is not None:
                parts.append(
                    f"{addr} lost acknowledged entries (holds through index {claim.last[1]}, "
                    f"had acknowledged through {_index(claim.need)})"
                )
            else:
                parts.append(f"{addr} holds through index {claim.last[1]}")
        away = sorted(set(members) - set(views))
        return (
            f"DATA_LOSS: bucket {self.bucket}: no reachable replica holds every acknowledged "
            f"entry (through {_index(need)}, term {need[0]}): "
            + "; ".join(parts)
            + (f"; not reachable: {', '.join(away)}" if away else "")
            + f". Start the missing replicas, or accept the loss with `sevendb bucket recover "
            f"{self.bucket} --accept-loss` (docs/raft.md)"
        )

    # -- the operator's decision ----------------------------------------------------

    def decision_due(self) -> bool:
        """Whether to look for an operator's decision now (about once a second)."""
        now = time.monotonic()
        if now < self._next_check_s:
            return False
        self._next_check_s = now + 1.0
        return self._decision.exists()

    def take_decision(self) -> str | None:
        """Read and retire the decision file (renamed to ``RECOVER.done``)."""
        try:
            decision = json.loads(self._decision.read_text()).get("decision")
        except (OSError, ValueError, AttributeError) as exc:
            logger.error("bucket %d: unreadable %s ignored: %s", self.bucket, self._decision, exc)
            decision = None
        with contextlib.suppress(OSError):
            self._decision.replace(self._decision.with_name(DECISION_FILE + ".done"))
        return decision if isinstance(decision, str) else None

    def accept_loss(self) -> None:
        """The operator accepts that the entries this replica lost are gone."""
        if self.need is None:
            logger.warning(
                "bucket %d replica %s: the operator accepted the loss of entries; this "
                "replica lost none",
                self.bucket,
                self.self_addr,
            )
            return
        logger.critical(
            "bucket %d replica %s: the operator accepted the loss of the entries it had "
            "acknowledged after index %d%s; it votes and campaigns with what it holds",
            self.bucket,
            self.self_addr,
            self.lost_after,
            f" (through {_index(self.need)})",
        )
        self.need = None
        self._loss_since = None
        self.data_loss = None
