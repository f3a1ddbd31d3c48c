"""BucketReplica: the pure bucket core replicated by real pysyncobj groups.

Several replicas run in this one process on 127.0.0.1 with distinct free ports; the
replication, elections, snapshots and catch-up are pysyncobj's real ones, over its
encrypted TCP transport. The helpers here are shared with test_raft_hardening.py.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pysyncobj.config import SERIALIZER_STATE

from sevendb.cluster.raft.replica import ApplyOutcome, BucketReplica, ReplicaUnavailable
from sevendb.cluster.raft.snapshots import SNAPSHOT_FILE, BackgroundSerializer
from sevendb.cluster.raft.transfer import TRANSFER_PAUSE_LAG
from sevendb.cluster.raft.tuning import RaftTuning, compaction_due, snapshot_wait_s
from sevendb.outbox.entries import ANY, Entry, Op, OpKind, Write, decode_entry, encode_entry
from sevendb.outbox.errors import LimitExceeded
from sevendb.outbox.model import Applied, WriteResult
from sevendb.outbox.state import BucketStateMachine

BUCKET_UUID = "bucket-test-0001"
PASSWORD = "test-cluster-password"

#: Faster elections than production so a test's leader change takes well under a second.
FAST = RaftTuning(
    heartbeat_s=0.05, tick_s=0.05, election_min_s=0.3, election_max_s=0.6, connection_retry_s=0.2
)


def fast(**overrides: Any) -> RaftTuning:
    return dataclasses.replace(FAST, **overrides)


# ------------------------------------------------------------------------ helpers


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(pred: Callable[[], object], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll ``pred`` until it is truthy; fail the test with ``what`` on the deadline."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or pred}")
        time.sleep(0.01)


def write(key: str, value: bytes = b"v", now_ms: int = 1_000) -> bytes:
    return encode_entry(Write((Op(OpKind.SET, key, value, ANY),), None, now_ms))


def num(replica: BucketReplica | None, key: str) -> int:
    """A numeric field of ``replica.status()``."""
    assert replica is not None
    value = replica.status()[key]
    assert isinstance(value, int), (key, value)
    return value


def members(replica: BucketReplica | None) -> list[str]:
    assert replica is not None
    value = replica.status()["members"]
    assert isinstance(value, list)
    return value


def state(replica: BucketReplica) -> tuple[int, str]:
    return replica.read(lambda sm: (sm.applied_index, sm.digest()))


class Cluster:
    """N replicas of one bucket in this process, each with its own data dir."""

    def __init__(self, root: Path, n: int = 3, tuning: RaftTuning = FAST) -> None:
        self.root = root
        self.tuning = tuning
        self.addrs = [f"127.0.0.1:{p}" for p in free_ports(n)]
        self.replicas: list[BucketReplica | None] = [None] * n
        self.applied: list[list[Applied]] = [[] for _ in range(n)]

    def data_dir(self, i: int) -> Path:
        return self.root / f"replica-{i}"

    def start(self, i: int, partners: list[str] | None = None) -> BucketReplica:
        assert self.replicas[i] is None
        replica = BucketReplica(
            bucket=0,
            bucket_uuid=BUCKET_UUID,
            self_addr=self.addrs[i],
            partners=self.addrs if partners is None else partners,
            data_dir=self.data_dir(i),
            password=PASSWORD,
            tuning=self.tuning,
            on_applied=self.applied[i].append,
        )
        self.replicas[i] = replica
        return replica

    def start_all(self) -> Cluster:
        for i in range(len(self.addrs)):
            self.start(i)
        return self

    def stop(self, i: int) -> None:
        replica = self.replicas[i]
        assert replica is not None
        replica.close()
        self.replicas[i] = None

    def close(self) -> None:
        for i, replica in enumerate(self.replicas):
            if replica is not None:
                replica.close()
                self.replicas[i] = None

    @property
    def live(self) -> list[BucketReplica]:
        return [r for r in self.replicas if r is not None]

    def index_of(self, replica: BucketReplica) -> int:
        return self.replicas.index(replica)

    def leader(self, timeout_s: float = 10.0) -> BucketReplica:
        """The one live replica that leads and is ready, once every live one agrees."""

        def agreed() -> bool:
            leaders = [r for r in self.live if r.is_leader]
            return (
                len(leaders) == 1
                and leaders[0].wait_ready(0)
                and all(r.leader == leaders[0].self_addr for r in self.live)
            )

        wait_until(agreed, timeout_s, "one agreed, ready leader")
        return next(r for r in self.live if r.is_leader)

    def followers(self) -> list[BucketReplica]:
        leader = self.leader()
        return [r for r in self.live if r is not leader]

    def converge(self, timeout_s: float = 10.0) -> str:
        """Wait until every live replica applied the same log; return the common digest."""
        leader = self.leader()

        def same() -> bool:
            target = num(leader, "commit_index")
            if any(r.status()["applied_index"] != target for r in self.live):
                return False
            return len({state(r) for r in self.live}) == 1

        wait_until(same, timeout_s, "replicas to converge")
        return state(leader)[1]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c.start_all()
    finally:
        c.close()


def raft_entry_bytes(replica: BucketReplica, index: int) -> bytes:
    """The entry bytes pysyncobj stored at raft ``index`` for our replicated method."""
    journal = replica._journal
    command, idx, _term = journal[index - journal[0][1]]
    assert idx == index
    assert command[:1] == b"\x00"  # pysyncobj _COMMAND_TYPE.REGULAR
    _func_id, args = pickle.loads(command[1:])
    (entry,) = args
    assert isinstance(entry, bytes)
    return entry


# -------------------------------------------------------------------------- tests


def test_propose_commits_and_applies_identically_on_every_replica(cluster: Cluster) -> None:
    leader = cluster.leader()
    follower = cluster.followers()[0]
    outcomes: list[ApplyOutcome] = []
    for n in range(10):
        source = leader if n % 2 else follower  # a follower forwards to the leader
        outcomes.append(source.propose(write(f"k{n}", b"value-%d" % n, 1_000 + n)))
    for outcome in outcomes:
        assert outcome.error is None and outcome.applied is not None
        assert isinstance(outcome.applied.result, WriteResult)
        assert outcome.applied.result.error is None
    indexes = [o.commit_index for o in outcomes]
    assert indexes == sorted(indexes) and len(set(indexes)) == len(indexes)

    digest = cluster.converge()
    # The commit index the core saw is the Raft log index of that very entry.
    for n, outcome in enumerate(outcomes):
        for replica in cluster.live:
            assert raft_entry_bytes(replica, outcome.commit_index) == write(
                f"k{n}", b"value-%d" % n, 1_000 + n
            )
    # Every replica holds byte-identical state, equal to replaying the log by hand.
    reference = BucketStateMachine(BUCKET_UUID)
    for n, outcome in enumerate(outcomes):
        reference.apply(outcome.commit_index, write(f"k{n}", b"value-%d" % n, 1_000 + n))
    assert reference.digest() == digest
    # on_applied saw every entry, in log order, on every replica.
    for applied in cluster.applied:
        assert [a.commit_index for a in applied] == indexes
    status = leader.status()
    assert status["is_leader"] and status["quarantined"] is None
    assert status["commit_index"] == status["applied_index"] == status["durable_index"]


def test_the_proposer_applies_the_entry_it_built_without_decoding_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sevendb.outbox.state as core

    decoded: list[bytes] = []

    def counting_decode(data: bytes) -> Entry:
        decoded.append(data)
        return decode_entry(data)

    monkeypatch.setattr(core, "decode_entry", counting_decode)
    leader = cluster.leader()
    built = [Write((Op(OpKind.SET, f"d{n}", b"v", ANY),), None, 2_000 + n) for n in range(4)]
    plain = [write(f"p{n}", b"v", 3_000 + n) for n in range(4)]
    futures = [leader.submit(encode_entry(e), e) for e in built]
    futures += [leader.submit(data) for data in plain]
    for future in futures:
        outcome = future.result(timeout=10)
        assert outcome.error is None and outcome.applied is not None
    cluster.converge()  # the same state on every replica, whichever path applied
    # Only the followers decode the entries the leader was handed decoded.
    assert [decoded.count(encode_entry(e)) for e in built] == [2] * len(built)
    assert [decoded.count(data) for data in plain] == [3] * len(plain)


def test_malformed_entry_is_an_error_outcome_and_the_group_moves_on(cluster: Cluster) -> None:
    leader = cluster.leader()
    before = leader.propose(write("a"))
    bad = leader.propose(b"\xc1 not msgpack")
    assert bad.applied is None and bad.error is not None
    assert bad.error.startswith("MalformedEntry")
    assert bad.commit_index > before.commit_index
    unknown = cluster.followers()[0].propose(encode_entry_of_unknown_type())
    assert unknown.error is not None and unknown.error.startswith("UnknownEntryType")
    after = leader.propose(write("b"))
    assert after.error is None and after.commit_index > unknown.commit_index
    cluster.converge()
    for replica in cluster.live:
        assert replica.status()["entry_errors"] == 2
        assert replica.quarantined is None
        assert replica.read(lambda sm: sm.get("b")) is not None


def encode_entry_of_unknown_type() -> bytes:
    import msgpack

    return msgpack.packb([1, 99, "x"], use_bin_type=True)


def test_a_restarted_follower_catches_up_from_its_data_dir(cluster: Cluster) -> None:
    leader = cluster.leader()
    for n in range(5):
        leader.propose(write(f"before-{n}"))
    cluster.converge()
    gone = cluster.index_of(cluster.followers()[0])
    cluster.stop(gone)
    for n in range(20):
        leader.propose(write(f"while-down-{n}"))
    restarted = cluster.start(gone)
    digest = cluster.converge()
    assert state(restarted)[1] == digest
    assert restarted.read(lambda sm: len(sm)) == 25
    # It replayed its own journal and fetched only what it missed.
    assert restarted.status()["snapshots_loaded"] == 0


def test_a_follower_catches_up_from_a_snapshot_after_compaction(tmp_path: Path) -> None:
    # A follower silent for longer than the cold replica window no longer holds the
    # leader's log (tests/test_raft_flow.py: one heard from recently does).
    c = Cluster(
        tmp_path,
        tuning=fast(compaction_min_entries=20, cold_replica_window_ms=300),
    ).start_all()
    try:
        leader = c.leader()
        for n in range(5):
            leader.propose(write(f"early-{n}"))
        c.converge()
        gone = c.index_of(c.followers()[0])
        last_seen = num(c.replicas[gone], "log_last_index")
        c.stop(gone)
        late = [f"late-{n}" for n in range(80)]
        for key in late:
            leader.propose(write(key))

        def compacted_past_the_follower() -> bool:
            # A snapshot taken while the follower was still warm (within the window
            # of its stop) kept its entries: later writes bring the next snapshot,
            # which no longer waits for it.
            late.append(f"late-{len(late)}")
            leader.propose(write(late[-1]))
            return num(leader, "log_first_index") > last_seen + 1

        wait_until(compacted_past_the_follower, what="leader compaction past the follower")
        assert not (c.data_dir(gone) / SNAPSHOT_FILE).exists()  # it never compacted itself
        restarted = c.start(gone)
        digest = c.converge()
        assert state(restarted)[1] == digest
        assert num(restarted, "snapshots_loaded") >= 1  # installed from the leader
        assert num(restarted, "snapshot_bytes") == (c.data_dir(gone) / SNAPSHOT_FILE).stat().st_size
        assert restarted.read(lambda sm: len(sm)) == 5 + len(late)
        # A restart from its own data dir (snapshot + journal) keeps everything.
        c.stop(gone)
        again = c.start(gone)
        assert c.converge() == digest
        assert again.read(lambda sm: len(sm)) == 5 + len(late)
    finally:
        c.close()


@pytest.mark.parametrize(
    ("entries", "log_bytes", "snapshot_bytes", "since_last_s", "ratio", "due"),
    [
        (21, 1_000, 0, 1.0, 1.0, True),  # no snapshot yet: entries decide
        (20, 1_000, 0, 1.0, 1.0, False),  # not more than compaction_min_entries
        (500, 40_000, 50_000, 1.0, 1.0, False),  # the log is smaller than the snapshot
        (500, 50_000, 50_000, 1.0, 1.0, True),
        (500, 40_000, 50_000, 1.0, 0.0, True),  # ratio 0: entries alone (pysyncobj's rule)
        (500, 40_000, 50_000, 1.0, 0.5, True),
        (3, 100, 50_000, 301.0, 1.0, True),  # compaction_min_time_s passed
        (5, 100_000, 50_000, 1.0, 1.0, True),  # few entries, compaction_min_log_bytes
        (5, 99_999, 50_000, 1.0, 1.0, False),
        (5, 150_000, 200_000, 1.0, 1.0, False),  # ... but fewer bytes than the snapshot
    ],
)
def test_a_snapshot_is_due_once_the_log_outgrows_the_last_one(
    entries: int, log_bytes: int, snapshot_bytes: int, since_last_s: float, ratio: float, due: bool
) -> None:
    tuning = fast(
        compaction_min_entries=20, compaction_log_ratio=ratio, compaction_min_log_bytes=100_000
    )
    assert (
        compaction_due(
            tuning,
            entries=entries,
            log_bytes=log_bytes,
            snapshot_bytes=snapshot_bytes,
            since_last_s=since_last_s,
        )
        is due
    )


def test_a_replica_waits_its_rank_times_the_stagger_before_its_snapshot() -> None:
    tuning = fast(snapshot_stagger_s=1.5)
    group = ["127.0.0.1:3", "127.0.0.1:1", "127.0.0.1:2"]
    assert [snapshot_wait_s(tuning, group, me) for me in sorted(group)] == [0.0, 1.5, 3.0]
    assert snapshot_wait_s(tuning, group, "127.0.0.1:9") == 0.0  # not (or no longer) a member
    assert snapshot_wait_s(fast(snapshot_stagger_s=0.0), group, "127.0.0.1:3") == 0.0
    with pytest.raises(ValueError, match="snapshot_stagger_s"):
        fast(snapshot_stagger_s=-1.0)


def test_the_replicas_of_a_group_snapshot_one_after_another(tmp_path: Path) -> None:
    """The replicas find a snapshot due at the same log index. They all wrote it at
    once, and on a 2-core host three processes packing a large state stalled writes
    on every node (docs/performance.md, "Writes stalled behind snapshots"). Now the
    first in address order starts at once and the others each wait their rank times
    `snapshot_stagger_s` (here far longer than the test): only the first has written
    one, though all are past the threshold and the group kept committing."""
    c = Cluster(tmp_path, tuning=fast(compaction_min_entries=20, snapshot_stagger_s=600.0))
    c.start_all()
    try:
        leader = c.leader()
        for n in range(30):
            leader.propose(write(f"k-{n}"))
        first = c.replicas[c.addrs.index(sorted(c.addrs)[0])]
        wait_until(lambda: num(first, "snapshots_written") == 1, what="the first snapshot")
        for n in range(30):  # more entries: still past the threshold, still waiting
            leader.propose(write(f"more-{n}"))
        c.converge()
        first_addr = sorted(c.addrs)[0]
        others = [num(r, "snapshots_written") for r in c.live if r.self_addr != first_addr]
        assert num(first, "snapshots_written") >= 1 and others == [0, 0]
    finally:
        c.close()


def test_a_negative_compaction_log_ratio_is_refused() -> None:
    with pytest.raises(ValueError, match="compaction_log_ratio"):
        fast(compaction_log_ratio=-1.0)


def test_replicas_snapshot_a_large_state_again_only_after_as_many_log_bytes(
    tmp_path: Path,
) -> None:
    """Entries alone (pysyncobj's rule) rewrite a large state every few entries; the
    replicas wait until the log holds as many bytes as their last snapshot. (No
    stagger: the byte counts below assume every replica snapshots at the same index.)"""
    c = Cluster(
        tmp_path, tuning=fast(compaction_min_entries=20, snapshot_stagger_s=0.0)
    ).start_all()
    try:
        leader = c.leader()
        big = b"x" * 4096
        for n in range(30):
            leader.propose(write(f"big-{n}", big))
        wait_until(
            lambda: all(num(r, "snapshots_written") == 1 for r in c.live),
            what="every replica's first snapshot",
        )
        sizes = [num(r, "snapshot_bytes") for r in c.live]
        assert all(size > 15 * 4096 for size in sizes), sizes  # taken after 20+ entries
        # 60 small entries: three times compaction_min_entries, a few KB.
        for n in range(60):
            leader.propose(write(f"small-{n}"))
        c.converge()
        assert all(num(r, "log_len") > 20 for r in c.live)
        assert all(num(r, "log_bytes") < size for r, size in zip(c.live, sizes, strict=True))
        assert [num(r, "snapshots_written") for r in c.live] == [1, 1, 1]
        # As many bytes again: the next snapshot.
        for n in range(40):
            leader.propose(write(f"big-{n}", big))
        wait_until(
            lambda: all(num(r, "snapshots_written") >= 2 for r in c.live),
            what="every replica's second snapshot",
        )
        assert all(num(r, "snapshot_bytes") > size for r, size in zip(c.live, sizes, strict=True))
        digest = c.converge()
        c.stop(0)
        restarted = c.start(0)  # the size of the snapshot it loads counts from here on
        assert c.converge() == digest
        assert num(restarted, "snapshot_bytes") == (c.data_dir(0) / SNAPSHOT_FILE).stat().st_size
    finally:
        c.close()


def test_a_log_of_few_large_entries_is_compacted_by_its_bytes(tmp_path: Path) -> None:
    """Batched entries carry many writes each: far fewer entries than
    `compaction_min_entries` can hold a large log (kept in memory). Once the log
    holds `compaction_min_log_bytes` (and as many bytes as the last snapshot), every
    replica snapshots and compacts it."""
    c = Cluster(
        tmp_path,
        tuning=fast(
            compaction_min_entries=1_000, compaction_min_log_bytes=64 * 1024, snapshot_stagger_s=0.0
        ),
    ).start_all()
    try:
        leader = c.leader()
        for n in range(24):  # 24 entries of 4 KiB: ~96 KiB
            leader.propose(write(f"big-{n}", b"x" * 4096))
        wait_until(
            lambda: all(num(r, "snapshots_written") >= 1 for r in c.live),
            what="every replica's snapshot",
        )
        c.converge()
        assert all(num(r, "log_bytes") < 64 * 1024 for r in c.live)
    finally:
        c.close()


def test_no_snapshot_is_installed_while_the_replica_writes_its_own(tmp_path: Path) -> None:
    """A follower's own snapshot is written in a thread (`BackgroundSerializer`).
    Had the leader's newer snapshot been installed meanwhile (and the journal cleared
    for it), that thread's rename would have put the older one back over it: after
    a restart, a gap between snapshot and journal. The install is refused until the
    thread is done, and the leader's resent transmission then lands whole."""
    dump = tmp_path / "snapshot"
    release = threading.Event()

    def serializer(tmp: str, data: object) -> Callable[[], None]:
        def write() -> None:
            release.wait(10)
            Path(tmp).write_bytes(b"own, older")

        return write

    ser = BackgroundSerializer(str(dump), 1024, False, serializer, None, None)
    assert ser.setTransmissionData((b"leader's ", True, False)) is False  # a first chunk...
    ser.serialize((None, "last", "prev", "cluster"), 7)  # ...then its own snapshot starts
    assert ser.setTransmissionData((b"newer", False, True)) is False  # refused, dropped
    assert not dump.exists()
    release.set()
    wait_until(lambda: ser.checkSerializing()[0] == SERIALIZER_STATE.SUCCESS)
    assert dump.read_bytes() == b"own, older"
    # What was left of the dropped transmission cannot complete it...
    assert ser.setTransmissionData((b"newer", False, True)) is False
    assert dump.read_bytes() == b"own, older"
    # ...the leader's next one, from its first chunk, does.
    assert ser.setTransmissionData((b"leader's ", True, False)) is False
    assert ser.setTransmissionData((b"newer", False, True)) is True
    assert dump.read_bytes() == b"leader's newer"


def test_writes_commit_while_a_snapshot_is_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot is written outside the tick thread: a leader making one still
    commits writes and sends heartbeats (written in the tick thread, a large one
    held them back for up to a second and followers started elections). It is
    packed in a child process: in a thread of the node, hundreds of milliseconds of
    Python held the Raft loop's and the gRPC loop's GIL back, and writes slowed to
    tens of milliseconds meanwhile (docs/performance.md, "Snapshots packed in a
    child process")."""
    held = tmp_path / "held"  # files, not events: the child has memory of its own
    release = tmp_path / "release"
    later = BucketStateMachine.snapshot_later

    def slow_snapshot_later(sm: BucketStateMachine) -> Callable[[], bytes]:
        make = later(sm)

        def slow() -> bytes:
            held.write_text(str(os.getpid()))
            deadline = time.monotonic() + 30
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            return make()

        return slow

    monkeypatch.setattr(BucketStateMachine, "snapshot_later", slow_snapshot_later)
    c = Cluster(tmp_path, tuning=fast(compaction_min_entries=20)).start_all()
    try:
        leader = c.leader()
        n = 0
        while not held.exists():  # until some replica starts a snapshot
            leader.propose(write(f"k{n}"), timeout_s=5)
            n += 1
        wait_until(lambda: held.read_text() != "", what="the packing process's pid")
        assert int(held.read_text()) != os.getpid()
        for _ in range(30):  # every replica's snapshot may be held here: none waits
            outcome = leader.propose(write(f"k{n}"), timeout_s=5)
            assert outcome.error is None
            n += 1
        assert sum(num(r, "snapshots_written") for r in c.live) == 0
        release.touch()
        wait_until(
            lambda: all(num(r, "snapshots_written") >= 1 for r in c.live),
            what="every replica to finish its snapshot",
        )
        wait_until(lambda: num(leader, "log_first_index") > 1, what="the leader to compact")
        digest = c.converge()
        c.stop(0)
        restarted = c.start(0)
        assert c.converge() == digest
        assert num(restarted, "snapshots_loaded") == 1  # its own, written in the background
    finally:
        release.touch()
        c.close()


def test_the_tick_thread_copies_nothing_for_a_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child process is forked the moment pysyncobj asks for a snapshot and
    takes the state from its own copy of the memory: the tick thread takes no
    references first (5-17 ms of it, with the GIL held, for ~250k keys; the whole
    node's Raft loop waited). The snapshot is still of that moment: a restarted
    replica loads it and converges."""
    calls = tmp_path / "calls"  # a file: the child's memory is its own
    later = BucketStateMachine.snapshot_later

    def noted(sm: BucketStateMachine) -> Callable[[], bytes]:
        with open(calls, "a") as out:
            out.write(f"{os.getpid()}\n")
        return later(sm)

    monkeypatch.setattr(BucketStateMachine, "snapshot_later", noted)
    c = Cluster(tmp_path, tuning=fast(compaction_min_entries=20)).start_all()
    try:
        leader = c.leader()
        n, deadline = 0, time.monotonic() + 30
        while not all(num(r, "snapshots_written") >= 1 for r in c.live):
            assert time.monotonic() < deadline, "every replica should have written a snapshot"
            assert leader.propose(write(f"k{n}"), timeout_s=5).error is None
            n += 1
        pids = calls.read_text().split()
        assert pids and str(os.getpid()) not in pids  # only children packed
        digest = c.converge()
        c.stop(0)
        restarted = c.start(0)
        assert c.converge() == digest
        assert num(restarted, "snapshots_loaded") == 1
    finally:
        c.close()


def test_proposals_work_after_a_leader_change(cluster: Cluster) -> None:
    old = cluster.leader()
    old_index = cluster.index_of(old)
    old.propose(write("first"))
    cluster.converge()
    term = num(old, "term")
    cluster.stop(old_index)
    new = cluster.leader()
    assert new.self_addr != cluster.addrs[old_index]
    assert num(new, "term") > term
    outcome = cluster.followers()[0].propose(write("second"))
    assert outcome.error is None
    new.propose(write("third"))
    rejoined = cluster.start(old_index)
    digest = cluster.converge()
    assert state(rejoined)[1] == digest
    assert rejoined.read(
        lambda sm: sorted(k for k in ("first", "second", "third") if sm.get(k))
    ) == ["first", "second", "third"]


def test_followers_learn_a_commit_after_commit_notify_s_not_the_idle_heartbeat(
    tmp_path: Path,
) -> None:
    """An apply brings the leader's next AppendEntries forward to `commit_notify_s`, but
    the poll that ends the tick was sized before the apply: without a wake-up it slept
    up to the idle heartbeat, so a proposal through a follower (answered once the
    follower applies it) took up to a heartbeat. With a 1 s heartbeat, twenty such
    proposals took 4-5 s; now each takes about `commit_notify_s` (10 ms)."""
    cluster = Cluster(
        tmp_path,
        tuning=fast(
            heartbeat_s=1.0,
            tick_s=1.0,
            election_min_s=3.5,
            election_max_s=4.5,
            connection_timeout_s=6.0,
        ),
    ).start_all()
    try:
        cluster.leader(timeout_s=30)  # the first election takes 3.5-4.5 s here
        follower = cluster.followers()[0]
        started = time.monotonic()
        for i in range(20):
            assert follower.propose(write(f"via-follower-{i}")).error is None
        elapsed = time.monotonic() - started
        assert elapsed < 4.0, f"20 proposals through a follower took {elapsed:.1f} s"
    finally:
        cluster.close()


def test_leadership_transfer_to_a_lagging_member_keeps_writes_flowing(
    cluster: Cluster,
) -> None:
    """A transfer waits for the target to come within TRANSFER_PAUSE_LAG entries
    before it holds new writes back (`transfer_pauses` counts the holds); until then
    writes commit as usual. Once the target is back and caught up, leadership moves
    to it after a hold."""
    leader = cluster.leader()
    target_index = cluster.index_of(cluster.followers()[0])
    target_addr = cluster.addrs[target_index]
    cluster.stop(target_index)
    for n in range(TRANSFER_PAUSE_LAG + 10):
        assert leader.propose(write(f"behind-{n}")).error is None
    leader.transfer_leadership(target_addr, timeout_s=60)
    # The target is down, so far behind: writes are not held for the transfer.
    for n in range(20):
        assert leader.propose(write(f"during-{n}"), timeout_s=5).error is None
    assert num(leader, "transfer_pauses") == 0
    assert leader.is_leader
    cluster.start(target_index)
    wait_until(lambda: leader.leader == target_addr, 30, "leadership to move to the target")
    assert num(leader, "transfer_pauses") >= 1
    new = cluster.leader()
    assert new.self_addr == target_addr
    assert new.propose(write("after")).error is None
    cluster.converge()


def test_a_transfer_after_idle_follower_links_wins_the_first_election(tmp_path: Path) -> None:
    """pysyncobj drops a link that read nothing for connection_timeout_s, and only
    notices when it sends. Followers never talk to each other, so the first vote
    request after a quiet spell was lost: with 4 members the target of a transfer
    got 2 of the 3 votes it needs, and won only an election timeout later (or another
    member did). Members now exchange keep-alives, so the first election wins."""
    c = Cluster(tmp_path, n=4, tuning=fast(connection_timeout_s=0.8))
    try:
        c.start_all()
        leader = c.leader()
        term = num(leader, "term")
        # The precondition itself, not a synchronisation: links between followers
        # stay quiet for longer than connection_timeout_s.
        time.sleep(2.0)
        target = c.followers()[0]
        leader.transfer_leadership(target.self_addr, timeout_s=10)
        wait_until(lambda: target.is_leader, 10, "the target to lead")
        assert num(target, "term") == term + 1, "the target needed more than one election"
    finally:
        c.close()


def test_a_retired_replica_takes_no_leadership_and_hands_its_own_away(cluster: Cluster) -> None:
    """A drained node's replicas are retired (`BucketReplica.retire`) while its client
    port closes. CI once saw another node's leader balancing hand a bucket straight
    back to the node that had just drained: it led bucket 0 and held its lease with
    no client port. A transfer to a retired replica now leaves leadership where it
    is, and a retired leader hands it away; both still replicate."""
    leader = cluster.leader()
    target = cluster.followers()[0]
    target.retire()
    leader.transfer_leadership(target.self_addr, timeout_s=2)
    deadline = time.monotonic() + 3  # the transfer's whole window, and then some
    while time.monotonic() < deadline:
        assert not target.is_leader
        time.sleep(0.05)
    assert leader.is_leader and leader.propose(write("kept")).error is None
    leader.retire()
    wait_until(lambda: not leader.is_leader, 10, "the retired leader to hand over")
    new = cluster.leader()
    assert new not in (leader, target)
    assert new.propose(write("moved")).error is None
    cluster.converge()


def test_a_full_cluster_restart_keeps_state_and_term(cluster: Cluster) -> None:
    leader = cluster.leader()
    for n in range(10):
        leader.propose(write(f"k{n}"))
    digest = cluster.converge()
    term = num(leader, "term")
    cluster.close()
    cluster.start_all()
    leader = cluster.leader()
    assert cluster.converge() == digest
    assert num(leader, "term") > term
    assert leader.propose(write("after")).error is None


def test_api_edges(cluster: Cluster, tmp_path: Path) -> None:
    leader = cluster.leader()
    status = leader.status()
    for key in (
        "leader",
        "term",
        "commit_index",
        "applied_index",
        "log_len",
        "has_quorum",
        "epoch",
        "quarantined",
        "fsyncs",
        "members",
    ):
        assert key in status
    assert status["members"] == sorted(cluster.addrs)
    assert status["epoch"] == 1 and status["has_quorum"] is True
    with pytest.raises(TypeError):
        leader.propose("not bytes")  # type: ignore[arg-type]
    with pytest.raises(LimitExceeded):
        leader.propose(b"x" * (2 * 1024 * 1024 + 1))
    # The data dir is locked against a second replica.
    with pytest.raises(RuntimeError, match="in use"):
        BucketReplica(
            bucket=0,
            bucket_uuid=BUCKET_UUID,
            self_addr=f"127.0.0.1:{free_ports(1)[0]}",
            partners=[],
            data_dir=cluster.data_dir(0),
            password=PASSWORD,
        )
    with pytest.raises(ValueError, match="password"):
        BucketReplica(
            bucket=0,
            bucket_uuid=BUCKET_UUID,
            self_addr="127.0.0.1:1",
            partners=[],
            data_dir=tmp_path / "nopw",
            password="",
        )
    with pytest.raises(ValueError, match="host:port"):
        BucketReplica(
            bucket=0,
            bucket_uuid=BUCKET_UUID,
            self_addr="localhost",
            partners=[],
            data_dir=tmp_path / "badaddr",
            password=PASSWORD,
        )
    with pytest.raises(ValueError):
        RaftTuning(heartbeat_s=0.2, election_min_s=0.5)
    # A proposal blocked on a closing replica fails instead of hanging.
    follower = cluster.followers()[0]
    index = cluster.index_of(follower)
    cluster.stop(index)
    follower.close()  # idempotent
    with pytest.raises(ReplicaUnavailable) as info:
        follower.propose(write("x"))
    assert info.value.reason == "closed"


def test_reads_are_consistent_under_concurrent_applies(cluster: Cluster) -> None:
    leader = cluster.leader()
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            seen.append(leader.read(lambda sm: sm.applied_index))
            time.sleep(0.001)  # pacing only: leave the GIL to the tick threads

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for n in range(30):
            leader.propose(write(f"k{n}"))
    finally:
        stop.set()
        thread.join()
    assert seen == sorted(seen)  # reads never see the apply order go backwards
