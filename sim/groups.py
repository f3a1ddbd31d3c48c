"""Consumer groups under a seeded simulation (docs/sim.md, "Consumer groups").

One seed drives a few buckets - each the production `BucketStateMachine`, fed the
entries a node would commit (writes, `GROUP_BEAT`s, the group's durable `SUBSCRIBE`,
`OUTBOX_PURGE`s of acks) - and a group of members that join, beat, process, ack,
leave, die (silently: their streams stay attached until fenced) and pause (longer
than their session: deposed while they hold events, which they then process and
ack as if nothing happened). The node's part is what `cluster/server` does with the
same core calls: a group's Subscribe and acks pass `GroupTable.refuses`, an attach
fences the bucket's older stream, rows leave from the outbox after the stream's
position, acks are checked (`check_ack`) and purged.

The checker, outside the code under test, holds at every step:

* **one owner**: a row is delivered only on the stream of the bucket's current
  term - the member and generation the state machine names owner at that moment;
* **fenced acks**: an ack that moved a group's position came from the current term;
* **order**: each term's stream delivers its bucket's rows in order, chained, from
  right after the position the group had acknowledged when the term attached;
* **once**: no row is delivered again after an accepted ack covered it;
* **nothing lost**: at the end every committed change was processed by a member
  while it held the bucket's current term.

Broken variants (`bug`): ``deposed_ack`` lets a deposed member's ack through, and
``two_owners`` does not fence the older stream when a new owner attaches; the
checker catches each (tests/test_sim_groups.py).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from sevendb.outbox.emitseq import EmitSeq
from sevendb.outbox.entries import Ack, Entry, Lease, Op, OpKind, OutboxPurge, Subscribe, Write
from sevendb.outbox.groups import GroupBeat, GroupResult
from sevendb.outbox.model import AckStatus, OutboxRow, PurgeResult, SubscribeResult
from sevendb.outbox.query import Query, QueryKind, plan_query
from sevendb.outbox.state import BucketStateMachine

PRINCIPAL: Final = "app"
GROUP: Final = "workers"
QUERY: Final = Query(QueryKind.PREFIX, "g/")
STEP_MS: Final = 5
BUGS: Final = ("", "deposed_ack", "two_owners")


INVARIANTS: Final = ("one owner", "fenced acks", "order", "once", "nothing lost")


class Violation(Exception):
    """A group invariant (`INVARIANTS`) broken."""

    def __init__(self, invariant: str, message: str) -> None:
        assert invariant in INVARIANTS, invariant
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant


@dataclass(frozen=True, slots=True)
class GroupSimConfig:
    seed: int
    buckets: int
    writes: int
    members: int
    fault_ms: int
    timeout_ms: int
    bug: str = ""

    @classmethod
    def from_seed(cls, seed: int, bug: str = "") -> GroupSimConfig:
        if bug not in BUGS:
            raise ValueError(f"bug must be one of {BUGS}")
        rng = random.Random(seed)
        return cls(
            seed,
            buckets=rng.randint(1, 4),
            writes=rng.randint(40, 160),
            members=rng.randint(1, 3),
            fault_ms=rng.randint(1_000, 3_000),
            timeout_ms=rng.choice((100, 200, 300)),
            bug=bug,
        )


@dataclass(slots=True)
class _Stream:
    """A stream the node has attached for a bucket: its member's term and position."""

    member: str
    generation: int
    position: EmitSeq


@dataclass(slots=True)
class _Bucket:
    number: int
    sm: BucketStateMachine
    index: int = 0
    streams: list[_Stream] = field(default_factory=list)
    sub_id: str = ""


@dataclass(slots=True)
class _Member:
    name: str
    next_beat_ms: int = 0
    paused_until: int = 0
    dead: bool = False
    left: bool = False
    terms: dict[int, int] = field(default_factory=dict)
    """bucket -> the generation this member believes it owns."""
    held: dict[int, deque[OutboxRow]] = field(default_factory=dict)
    done: dict[int, EmitSeq] = field(default_factory=dict)
    """bucket -> the last row processed in the current term (to be acked)."""

    def active(self, now: int) -> bool:
        return not self.dead and not self.left and now >= self.paused_until


@dataclass(slots=True)
class GroupReport:
    config: GroupSimConfig
    violation: Violation | None
    rows: int
    deliveries: int
    rebalances: int
    deaths: int
    pauses: int

    def line(self) -> str:
        head = f"seed {self.config.seed}: "
        if self.violation is not None:
            return head + f"VIOLATION {self.violation}"
        return head + (
            f"ok: {self.rows} rows, {self.deliveries} deliveries, {self.rebalances} "
            f"rebalances, {self.deaths} deaths, {self.pauses} pauses"
        )


class GroupChecker:
    """The invariants of the module docstring, from what the simulation reports."""

    def __init__(self, *, check_acks: bool = True) -> None:
        self.check_acks = check_acks
        """False: leave the fenced-acks invariant to its effects (nothing lost, once)."""
        self.written: set[tuple[int, EmitSeq]] = set()
        self.processed: set[tuple[int, EmitSeq]] = set()
        self.covered: dict[int, EmitSeq] = {}
        """bucket -> the group position an accepted ack moved it to."""
        self.terms: dict[tuple[int, str, int], EmitSeq] = {}
        """(bucket, member, generation) -> the last row delivered on that term."""
        self.deliveries = 0

    def on_rows(self, bucket: int, rows: tuple[OutboxRow, ...]) -> None:
        self.written.update((bucket, r.emit_seq) for r in rows)

    def on_attach(self, bucket: int, member: str, gen: int, after: EmitSeq) -> None:
        covered = self.covered.get(bucket)
        if covered is not None and after < covered:
            raise Violation(
                "order",
                f"bucket {bucket}: {member}@{gen} attached at {after}, "
                f"behind the acknowledged {covered}",
            )
        self.terms[bucket, member, gen] = after

    def on_deliver(
        self, b: _Bucket, member: str, gen: int, row: OutboxRow, owner: tuple[str, int] | None
    ) -> None:
        self.deliveries += 1
        if owner != (member, gen):
            raise Violation(
                "one owner",
                f"bucket {b.number}: {row.emit_seq} delivered to {member}@{gen}, "
                f"the owner is {owner}",
            )
        last = self.terms[b.number, member, gen]
        if row.prev_emit_seq != last or row.emit_seq <= last:
            raise Violation(
                "order",
                f"bucket {b.number}: {member}@{gen} got {row.emit_seq} (prev "
                f"{row.prev_emit_seq}) after {last}",
            )
        covered = self.covered.get(b.number)
        if covered is not None and row.emit_seq <= covered:
            raise Violation(
                "once", f"bucket {b.number}: {row.emit_seq} delivered again after ack {covered}"
            )
        self.terms[b.number, member, gen] = row.emit_seq

    def on_process(self, bucket: int, row: OutboxRow, current: bool) -> None:
        if current:
            self.processed.add((bucket, row.emit_seq))

    def on_ack_accepted(
        self, bucket: int, member: str, gen: int, up_to: EmitSeq, owner: tuple[str, int] | None
    ) -> None:
        if self.check_acks and owner != (member, gen):
            raise Violation(
                "fenced acks",
                f"bucket {bucket}: ack {up_to} of {member}@{gen} accepted; the owner is {owner}",
            )
        self.covered[bucket] = up_to

    def final(self) -> None:
        lost = sorted(self.written - self.processed)
        if lost:
            raise Violation(
                "nothing lost",
                f"{len(lost)} rows never processed by their bucket's owner, first {lost[0]}",
            )


class GroupSimulation:
    """One seed's run (see the module docstring)."""

    def __init__(self, config: GroupSimConfig, *, check_acks: bool = True) -> None:
        self.config = config
        self.rng = random.Random(config.seed * 7919 + 34)
        self.now = 0
        self.buckets = [
            _Bucket(n, BucketStateMachine(f"bucket-{n}")) for n in range(config.buckets)
        ]
        self.members: dict[str, _Member] = {}
        self.checker = GroupChecker(check_acks=check_acks)
        self.rebalances = self.deaths = self.pauses = 0
        self._joined = 0
        self._written = 0
        for b in self.buckets:
            self._commit(b, Lease("node-1", 0))

    # ---- the node ------------------------------------------------------------------------

    def _commit(self, b: _Bucket, entry: Entry) -> object:
        b.index += 1
        applied = b.sm.apply_entry(b.index, entry)
        if isinstance(entry, Write) and b.sub_id:
            self.checker.on_rows(b.number, b.sm.subs.outbox_rows(b.sub_id))
        return applied.result

    def _owner(self, b: _Bucket) -> tuple[str, int] | None:
        return b.sm.groups.owner(PRINCIPAL, GROUP)

    def _beat(self, m: _Member, b: _Bucket, leaving: bool = False) -> GroupResult:
        entry = GroupBeat(
            PRINCIPAL, GROUP, m.name, b.number, self.config.timeout_ms, leaving, self.now
        )
        result = self._commit(b, entry)
        assert isinstance(result, GroupResult)
        return result

    def _subscribe(self, m: _Member, b: _Bucket, gen: int) -> bool:
        """A member's Subscribe of its term: refused unless current; then the stream
        attaches after the group's acknowledged position, fencing the older one."""
        if b.sm.groups.refuses(PRINCIPAL, GROUP, (m.name, gen)) is not None:
            return False
        entry = Subscribe(
            f"{m.name}-{b.number}", PRINCIPAL, QUERY, plan_query(QUERY).plan_hash, self.now, GROUP
        )
        result = self._commit(b, entry)
        assert isinstance(result, SubscribeResult) and result.error is None, result
        b.sub_id = result.sub_id
        sub = b.sm.subs.get(b.sub_id)
        assert sub is not None
        if self.config.bug != "two_owners":
            b.streams.clear()
        b.streams.append(_Stream(m.name, gen, sub.acked))
        self.checker.on_attach(b.number, m.name, gen, sub.acked)
        m.held[b.number] = deque()
        m.done.pop(b.number, None)
        return True

    def _ack(self, m: _Member, b: _Bucket, gen: int, up_to: EmitSeq) -> None:
        fenced = b.sm.groups.refuses(PRINCIPAL, GROUP, (m.name, gen)) is not None
        if fenced and self.config.bug != "deposed_ack":
            return  # GROUP_FENCED
        if b.sm.subs.check_ack(b.sub_id, PRINCIPAL, up_to).status is not AckStatus.ACCEPTED:
            return
        owner = self._owner(b)
        result = self._commit(
            b, OutboxPurge(b.sm.lease_index, (Ack(b.sub_id, PRINCIPAL, up_to),), now_ms=self.now)
        )
        assert isinstance(result, PurgeResult)
        if result.acks and result.acks[0].status is AckStatus.ACCEPTED:
            self.checker.on_ack_accepted(b.number, m.name, gen, up_to, owner)

    def _deliver(self) -> None:
        for b in self.buckets:
            if self.config.bug != "two_owners":  # a stream of an ended term is closed
                b.streams = [
                    s
                    for s in b.streams
                    if b.sm.groups.refuses(PRINCIPAL, GROUP, (s.member, s.generation)) is None
                ]
            for stream in b.streams:
                rows = b.sm.subs.outbox_rows(b.sub_id, after=stream.position)
                for row in rows:
                    self.checker.on_deliver(
                        b, stream.member, stream.generation, row, self._owner(b)
                    )
                    member = self.members.get(stream.member)
                    if member is not None and member.terms.get(b.number) == stream.generation:
                        member.held[b.number].append(row)
                    stream.position = row.emit_seq

    # ---- the members -----------------------------------------------------------------------

    def _member_step(self, m: _Member) -> None:
        if self.now >= m.next_beat_ms:
            m.next_beat_ms = self.now + self.config.timeout_ms // 3
            for b in self.buckets:
                self._follow(m, b, self._beat(m, b))
        for b in self.buckets:
            gen = m.terms.get(b.number)
            held = m.held.get(b.number)
            if gen is None or not held:
                continue
            for _ in range(self.rng.randint(0, 3)):
                if not held:
                    break
                row = held.popleft()
                self.checker.on_process(b.number, row, self._owner(b) == (m.name, gen))
                m.done[b.number] = row.emit_seq
            if b.number in m.done and self.rng.random() < 0.5:
                self._ack(m, b, gen, m.done.pop(b.number))

    def _follow(self, m: _Member, b: _Bucket, now: GroupResult) -> None:
        gen = m.terms.get(b.number)
        mine = now.owner == m.name
        if gen is not None and (not mine or gen != now.generation):
            del m.terms[b.number]  # deposed: what it holds is dropped, never processed
            m.held.pop(b.number, None)
            m.done.pop(b.number, None)
            self.rebalances += 1
        if mine and gen != now.generation:
            m.terms[b.number] = now.generation
            if not self._subscribe(m, b, now.generation):
                del m.terms[b.number]
            self.rebalances += 1

    def _leave(self, m: _Member) -> None:
        for b in self.buckets:
            gen = m.terms.get(b.number)
            if gen is not None and b.number in m.done:
                self._ack(m, b, gen, m.done.pop(b.number))
        for b in self.buckets:
            self._beat(m, b, leaving=True)
        m.left = True
        m.terms.clear()

    def _join(self) -> None:
        name = f"m{self._joined:02d}"
        self._joined += 1
        self.members[name] = _Member(name, next_beat_ms=self.now)

    # ---- the run ---------------------------------------------------------------------------

    def _fault(self) -> None:
        live = [m for m in self.members.values() if not m.dead and not m.left]
        roll = self.rng.random()
        if roll < 0.3 or not live:
            self._join()
        elif roll < 0.5:
            self._leave(self.rng.choice(live))
        elif roll < 0.75:
            self.rng.choice(live).dead = True
            self.deaths += 1
        else:
            victim = self.rng.choice(live)
            victim.paused_until = self.now + self.config.timeout_ms * self.rng.randint(1, 4)
            self.pauses += 1

    def _write(self) -> None:
        b = self.rng.choice(self.buckets)
        self._written += 1
        op = Op(OpKind.SET, f"g/{self._written}", b"x")
        self._commit(b, Write((op,), now_ms=self.now))

    def step(self, faults: bool) -> None:
        self.now += STEP_MS
        if faults and self.rng.random() < STEP_MS / 150:
            self._fault()
        if self._written < self.config.writes and self.rng.random() < 0.5:
            self._write()
        for m in sorted(self.members.values(), key=lambda m: m.name):
            if m.active(self.now):
                self._member_step(m)
        self._deliver()

    def run(self) -> GroupReport:
        violation = None
        try:
            for _ in range(self.config.members):
                self._join()
            while self.now < self.config.fault_ms:
                self.step(faults=True)
            self._join()  # at least one member lives on
            limit = self.now + 20 * self.config.timeout_ms + 5_000
            while self._written < self.config.writes or (
                self.checker.written - self.checker.processed and self.now < limit
            ):
                self.step(faults=False)
            self.checker.final()
        except Violation as exc:
            violation = exc
        return GroupReport(
            self.config,
            violation,
            len(self.checker.written),
            self.checker.deliveries,
            self.rebalances,
            self.deaths,
            self.pauses,
        )


def run_seed(seed: int, bug: str = "", *, check_acks: bool = True) -> GroupReport:
    return GroupSimulation(GroupSimConfig.from_seed(seed, bug), check_acks=check_acks).run()


def main(argv: list[str] | None = None) -> int:
    """``python -m sevendb.sim.groups --seeds 200 [--start N] [--bug NAME]``."""
    parser = argparse.ArgumentParser(prog="python -m sevendb.sim.groups")
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--bug", choices=BUGS, default="")
    args = parser.parse_args(argv)
    failed = 0
    for seed in range(args.start, args.start + args.seeds):
        report = run_seed(seed, args.bug)
        if report.violation is not None:
            failed += 1
            print(report.line())
    print(f"{args.seeds} seeds, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "BUGS",
    "INVARIANTS",
    "Violation",
    "GroupChecker",
    "GroupReport",
    "GroupSimConfig",
    "GroupSimulation",
    "run_seed",
]
