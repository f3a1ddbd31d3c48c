"""RaftLoop: one thread ticks every Raft replica of a process (a node's buckets).

Real pysyncobj groups in this process over the encrypted TCP transport, as in
test_replica.py: three loops stand for three nodes, each hosting a replica of two
buckets.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_replica import BUCKET_UUID, FAST, PASSWORD, free_ports, num, wait_until, write

from sevendb.cluster.raft.replica import BucketReplica, RaftLoop
from sevendb.outbox.model import Applied

BUCKETS = (0, 1)


class Nodes:
    """Three loops ("nodes"), each with one replica of every bucket in `BUCKETS`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.loops = [RaftLoop(f"raft-test-{n}") for n in range(3)]
        ports = iter(free_ports(3 * len(BUCKETS)))
        self.addrs = {b: [f"127.0.0.1:{next(ports)}" for _ in range(3)] for b in BUCKETS}
        self.threads: dict[tuple[int, int], set[threading.Thread]] = {}
        self.replicas: dict[tuple[int, int], BucketReplica] = {}
        for n in range(3):
            for b in BUCKETS:
                self.start(n, b)

    def start(self, n: int, bucket: int) -> BucketReplica:
        seen = self.threads.setdefault((n, bucket), set())

        def on_applied(_applied: Applied) -> None:
            seen.add(threading.current_thread())

        replica = BucketReplica(
            bucket=bucket,
            bucket_uuid=f"{BUCKET_UUID}-{bucket}",
            self_addr=self.addrs[bucket][n],
            partners=self.addrs[bucket],
            data_dir=self.root / f"node-{n}" / f"bucket-{bucket}",
            password=PASSWORD,
            tuning=FAST,
            on_applied=on_applied,
            loop=self.loops[n],
        )
        self.replicas[n, bucket] = replica
        return replica

    def leader(self, bucket: int) -> BucketReplica:
        def one() -> bool:
            leaders = [r for (_, b), r in self.replicas.items() if b == bucket and r.is_leader]
            return len(leaders) == 1 and leaders[0].wait_ready(0)

        wait_until(one, what=f"a ready leader of bucket {bucket}")
        return next(r for (_, b), r in self.replicas.items() if b == bucket and r.is_leader)

    def applied_everywhere(self, bucket: int, index: int) -> None:
        wait_until(
            lambda: all(
                num(r, "applied_index") >= index
                for (_, b), r in self.replicas.items()
                if b == bucket
            ),
            what=f"bucket {bucket} applied through {index} on every live replica",
        )

    def close(self) -> None:
        for replica in self.replicas.values():
            replica.close()
        for loop in self.loops:
            loop.close()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    n = Nodes(tmp_path)
    try:
        yield n
    finally:
        n.close()


def _os_name(thread: threading.Thread) -> str:
    return Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()


def test_each_loop_applies_for_all_its_buckets_in_its_one_thread(nodes: Nodes) -> None:
    for bucket in BUCKETS:
        for i in range(5):
            outcome = nodes.leader(bucket).propose(write(f"b{bucket}-k{i}"))
            assert outcome.error is None
        nodes.applied_everywhere(bucket, outcome.commit_index)
    for n, loop in enumerate(nodes.loops):
        threads = nodes.threads[n, 0] | nodes.threads[n, 1]
        assert threads == {loop._thread}, f"node {n} applied in {threads}"
        assert _os_name(loop._thread) == f"raft-test-{n}"
    # No replica started a tick thread of its own (pysyncobj's autoTick).
    assert not [t for t in threading.enumerate() if "_autoTickThread" in repr(t._target)]  # type: ignore[attr-defined]


def test_closing_a_replica_leaves_its_loop_ticking_the_others(nodes: Nodes) -> None:
    leader = nodes.leader(0)
    n = next(n for (n, b), r in nodes.replicas.items() if b == 0 and r is not leader)
    nodes.replicas.pop((n, 0)).close()
    # Nothing listens on its port any more: the loop destroyed its transport (the
    # connections it had accepted linger in TIME_WAIT, hence SO_REUSEADDR).
    host, port = nodes.addrs[0][n].rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
        s.listen()
    # The same loop still ticks this node's replica of bucket 1, and bucket 0 commits
    # on its two remaining replicas.
    for bucket in BUCKETS:
        outcome = nodes.leader(bucket).propose(write(f"after-close-{bucket}"))
        assert outcome.error is None
        nodes.applied_everywhere(bucket, outcome.commit_index)
    assert num(nodes.replicas[n, 1], "applied_index") >= outcome.commit_index
    assert nodes.loops[n]._thread.is_alive()


def test_a_failing_tick_is_logged_and_the_loop_goes_on(
    nodes: Nodes, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    leader = nodes.leader(1)
    n = next(n for (n, b), r in nodes.replicas.items() if b == 1 and r is leader)
    broken = nodes.replicas[n, 0]._node
    calls = [0]

    def failing_tick(time_to_wait: float = 0.0) -> None:
        calls[0] += 1
        raise RuntimeError("tick bug")

    monkeypatch.setattr(broken, "_onTick", failing_tick)
    with caplog.at_level(logging.ERROR, logger="sevendb.cluster.raft"):
        wait_until(lambda: calls[0] >= 2, what="the broken replica to be ticked again")
        # Its neighbour in the same loop still leads and commits.
        outcome = leader.propose(write("beside-a-broken-tick"))
        assert outcome.error is None
    assert "bucket 0: a Raft tick failed" in caplog.text
    monkeypatch.undo()  # the class's tick again: the replica catches up
    nodes.applied_everywhere(0, nodes.leader(0).propose(write("healed")).commit_index)


def test_a_taken_address_fails_with_a_clear_error_and_leaves_no_thread(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        before = set(threading.enumerate())
        with pytest.raises(OSError, match=f"bucket 3: cannot bind {addr}"):
            BucketReplica(
                bucket=3,
                bucket_uuid=BUCKET_UUID,
                self_addr=addr,
                partners=[addr],
                data_dir=tmp_path / "r",
                password=PASSWORD,
                tuning=dataclasses.replace(FAST, bind_retries=2, bind_retry_s=0.05),
            )
        wait_until(lambda: set(threading.enumerate()) <= before, what="its loop to end")
    # The data dir is not left locked.
    replica = BucketReplica(
        bucket=3,
        bucket_uuid=BUCKET_UUID,
        self_addr=f"127.0.0.1:{free_ports(1)[0]}",
        partners=[],
        data_dir=tmp_path / "r",
        password=PASSWORD,
        tuning=FAST,
    )
    replica.close()


def test_a_failing_socket_callback_pauses_that_replica_instead_of_spinning(
    nodes: Nodes, caplog: pytest.LogCaptureFixture
) -> None:
    """A callback that raises before it reads leaves its fd readable: polled again at
    once, it would fail in a busy loop. The replica's sockets are read again only at
    its next tick, with the callbacks its transport subscribed."""
    leader = nodes.leader(0)
    n = next(n for (n, b), r in nodes.replicas.items() if b == 0 and r is leader)
    loop, node = nodes.loops[n], leader._node
    pipe = node._SyncObj__pipeNotifier._PipeNotifier__pipeR
    calls = [0]

    def raising(fd: int, mask: int) -> None:
        calls[0] += 1
        raise RuntimeError("callback bug")

    def break_it() -> None:
        loop._fds[pipe] = (node, raising)
        os.write(node._SyncObj__pipeNotifier._PipeNotifier__pipeW, b"x")

    with caplog.at_level(logging.ERROR, logger="sevendb.cluster.raft"):
        loop._call(break_it)
        wait_until(lambda: calls[0] >= 1, what="the broken callback to run")
        outcome = leader.propose(write("after-a-callback-bug"))  # the pipe works again
    assert outcome.error is None
    assert calls[0] == 1
    assert "bucket 0: a Raft socket callback failed" in caplog.text
