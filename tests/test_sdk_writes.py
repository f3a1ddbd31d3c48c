"""`Client` writes against a real cluster: idempotent by default (a write whose answer
was lost, retried, applies once), in order through a failover with many in flight,
and bounded (a full write queue pushes back instead of growing)."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.outbox import limits
from sevendb.sdk import (
    Client,
    DuplicateSequence,
    Op,
    ResourceExhausted,
    WriteQueue,
    WriteResult,
    set_op,
)
from sevendb.sdk.producer import SEQUENCES_IN_FLIGHT_MAX

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(shared_cluster: LocalCluster) -> LocalCluster:
    return shared_cluster


class LossyProxy:
    """A TCP relay to one node in a thread (a network between client and node): with
    `answers_lost` set, what the node sends is dropped; `cut()` then closes every
    connection, as a failing link would, and relays new ones normally again (to
    another node, with `to`)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.answers_lost = False
        self._peer: dict[socket.socket, socket.socket] = {}
        self._to_client: set[socket.socket] = set()
        """Node-side sockets (what they read goes to the client)."""
        self._lock = threading.Lock()
        self._cutting = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def cut(self, to: str | None = None) -> None:
        if to is not None:
            host, port = to.rsplit(":", 1)
            self._target = (host, int(port))
        self._cutting.set()
        wait_for(lambda: not self._cutting.is_set(), 10, "the proxy to cut its links")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._listener.close()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        while not self._stop.is_set():
            if self._cutting.is_set():
                for linked in list(self._peer):
                    selector.unregister(linked)
                    linked.close()
                self._peer.clear()
                self._to_client.clear()
                self.answers_lost = False
                self._cutting.clear()
            for key, _ in selector.select(0.05):
                sock = key.fileobj
                if not isinstance(sock, socket.socket):
                    continue
                if sock is self._listener:
                    client, _ = self._listener.accept()
                    try:
                        node = socket.create_connection(self._target)
                    except OSError:  # the node is down: so is the link
                        client.close()
                        continue
                    self._peer[client], self._peer[node] = node, client
                    self._to_client.add(node)
                    selector.register(client, selectors.EVENT_READ)
                    selector.register(node, selectors.EVENT_READ)
                    continue
                if sock not in self._peer:
                    continue
                data = b""
                with contextlib.suppress(OSError):
                    data = sock.recv(65536)
                if not data:
                    for s in (sock, self._peer[sock]):
                        selector.unregister(s)
                        s.close()
                        self._to_client.discard(s)
                    peer = self._peer.pop(sock)
                    self._peer.pop(peer, None)
                    continue
                if sock in self._to_client and self.answers_lost:
                    continue  # the node's answer is lost on the way
                self._peer[sock].sendall(data)
        selector.close()


def keys_of_bucket(client: Client, bucket: int, prefix: str, count: int) -> list[str]:
    layout = client.layout()
    keys = (f"{prefix}{i}" for i in range(100_000))
    return [k for k in keys if layout.bucket_of(k) == bucket][:count]


def test_a_write_whose_answer_was_lost_applies_once_when_retried(cluster: LocalCluster) -> None:
    """The write commits, its answer never reaches the client, the link breaks, the
    client retries: a plain `put` applied a second time (version 2)."""
    with cluster.client() as direct:
        bucket = 0
        warm, key = keys_of_bucket(direct, bucket, "lost/", 2)
        leader = cluster.spec.node(cluster.leader_node(bucket)).grpc_address
        proxy = LossyProxy(leader)
        try:
            with Client([proxy.address], token=cluster.token(), tls=cluster.tls) as client:
                client.put(warm, b"w")  # producer initialised; the stream is up
                proxy.answers_lost = True
                pending = client.write_async([set_op(key, b"once")])
                wait_for(lambda: direct.get(key) is not None, 30, "the write to commit")
                assert not pending.done()  # its answer was lost
                proxy.cut()
                result = pending.result(30)
            assert result.duplicate  # the retry was answered with the original commit
            record = direct.get(key)
            assert record is not None and record.version == 1
            assert record.mod_commit_index == result.committed.commit_index
        finally:
            proxy.close()


def lose_answers_then_cut(
    cluster: LocalCluster,
    direct: Client,
    warm: str,
    writes: list[tuple[str, Sequence[Op]]],
    window: int = 0,
    cut: Callable[[LossyProxy], None] = LossyProxy.cut,
) -> tuple[list[Future[WriteResult]], int]:
    """Pipeline `writes` (of bucket 0) through a relay to its leader that loses every
    answer; once the first `window` (the SDK's `sequences_in_flight` over the relay,
    if given; SEQUENCES_IN_FLIGHT_MAX otherwise) committed, `cut` the link, so that
    the SDK sends again what it sent. Their futures, once all are answered, and how
    many sequences the SDK had taken before the cut."""
    leader = cluster.spec.node(cluster.leader_node(0)).grpc_address
    proxy = LossyProxy(leader)
    try:
        with Client([proxy.address], token=cluster.token(), tls=cluster.tls) as client:
            client.put(warm, b"w")  # the producer is initialised, the stream is up
            if window:
                client._pipeline()._window = window
            sequences = client._producer.bucket(0)
            first = sequences.next_seq
            proxy.answers_lost = True
            futures = [client.write_async(ops) for _, ops in writes]
            expected = min(len(writes), window or SEQUENCES_IN_FLIGHT_MAX)
            wait_for(lambda: sequences.next_seq - first >= expected, 10, "writes to be sent")
            # Writes leave in order: once the last one sent committed, all sent did.
            last = writes[expected - 1][0]
            wait_for(lambda: direct.get(last) is not None, 30, "the writes to commit")
            taken = sequences.next_seq - first
            assert not any(f.done() for f in futures)  # every answer was lost
            cut(proxy)
            for future in futures:
                with contextlib.suppress(Exception):
                    future.result(60)
            return futures, taken
    finally:
        proxy.close()


def test_more_writes_than_a_node_keeps_results_of_committed_once_answers_lost(
    cluster: LocalCluster,
) -> None:
    """3 times the window of pipelined writes of one bucket; their answers lost, the link
    cut, all retried: each is answered success, with its original commit. With every
    write in flight and 5 results kept per producer, all but the last 5 retried
    raised `DuplicateSequence` although they had committed (once). Now the SDK sends
    a bucket's writes at most `SEQUENCES_IN_FLIGHT_MAX` sequences ahead of the
    oldest unanswered one, and a node keeps that many results."""
    with cluster.client() as direct:
        warm, *keys = keys_of_bucket(direct, 0, "window/", 3 * SEQUENCES_IN_FLIGHT_MAX + 1)
        writes: list[tuple[str, Sequence[Op]]] = [(k, [set_op(k, b"v")]) for k in keys]
        futures, sent = lose_answers_then_cut(cluster, direct, warm, writes)
        results = [f.result(0) for f in futures]
        records = {r.key: r for r in direct.sync_bucket(0) if r.key.startswith("window/")}
    for key, result in zip(keys, results, strict=True):
        assert result.position_known and result.versions == {key: 1}
        assert records[key].version == 1, f"{key} applied twice"
        assert records[key].mod_commit_index == result.committed.commit_index
    assert sent == SEQUENCES_IN_FLIGHT_MAX  # the rest waited for answers
    assert all(r.duplicate for r in results[:sent]) and not any(r.duplicate for r in results[sent:])
    indexes = [r.committed.commit_index for r in results]
    assert indexes == sorted(indexes)


def test_writes_whose_answers_were_lost_are_answered_once_by_the_next_leader(
    tmp_path: Path,
) -> None:
    """As above, but the leader is killed (kill -9) after the writes committed: the
    new leader answers their retries from the results it applied itself."""
    cluster = LocalCluster.start(tmp_path / "data", buckets=2)

    def kill_the_leader(proxy: LossyProxy) -> None:
        old = cluster.leader_node(0)
        cluster.kill9(old)
        proxy.cut(to=cluster.spec.node(cluster.leader_node(0)).grpc_address)

    try:
        cluster.wait_settled()
        with cluster.client() as direct:
            warm, *keys = keys_of_bucket(direct, 0, "kill/", 3 * SEQUENCES_IN_FLIGHT_MAX + 1)
            writes: list[tuple[str, Sequence[Op]]] = [(k, [set_op(k, b"v")]) for k in keys]
            futures, sent = lose_answers_then_cut(
                cluster, direct, warm, writes, cut=kill_the_leader
            )
            results = [f.result(0) for f in futures]
            records = {r.key: r for r in direct.sync_bucket(0) if r.key.startswith("kill/")}
        assert sent == SEQUENCES_IN_FLIGHT_MAX
        assert all(r.duplicate for r in results[:sent])
        for key, result in zip(keys, results, strict=True):
            assert records[key].version == 1, f"{key} applied twice"
            assert records[key].mod_commit_index == result.committed.commit_index
    finally:
        cluster.stop()


def test_a_retry_whose_result_the_node_no_longer_keeps_is_not_a_failure(
    cluster: LocalCluster,
) -> None:
    """Cannot happen within the window (a node keeps as many results); a client with
    a larger one makes it happen. A retry answered DUPLICATE_SEQUENCE committed once:
    an unconditional write succeeds, its position unknown; a conditional one may
    have been refused by its precondition instead, and raises `DuplicateSequence`
    saying so (docs/errors.md)."""
    kept = limits.PRODUCER_RESULTS_CACHED
    with cluster.client() as direct:
        warm, *keys = keys_of_bucket(direct, 0, "lost-result/", kept + 4)
        writes: list[tuple[str, Sequence[Op]]] = [(k, [set_op(k, b"v")]) for k in keys]
        writes[1] = (keys[1], [set_op(keys[1], b"v", must_not_exist=True)])
        futures, sent = lose_answers_then_cut(cluster, direct, warm, writes, window=kept + 10)
        records = {r.key: r for r in direct.sync_bucket(0) if r.key.startswith("lost-result/")}
    assert sent == len(writes)
    unknown = futures[0].result(0)
    assert unknown.duplicate and not unknown.position_known and unknown.versions == {}
    with pytest.raises(DuplicateSequence, match=r"reached the log once.*read its keys"):
        futures[1].result(0)
    assert futures[2].result(0).duplicate and not futures[2].result(0).position_known
    for key, future in zip(keys[3:], futures[3:], strict=True):
        assert future.result(0).duplicate and future.result(0).position_known
        assert future.result(0).committed.commit_index == records[key].mod_commit_index
    assert all(records[key].version == 1 for key in keys)


def test_many_writes_in_flight_through_a_leader_kill_apply_once_each(tmp_path: Path) -> None:
    """Pipelined writes (write_async) ride over kill -9 of their bucket's leader: each
    commits exactly once, in submission order per bucket (a producer's sequence must
    reach the log in order: failed writes are retried together, in order)."""
    cluster = LocalCluster.start(tmp_path / "data", buckets=2)
    try:
        cluster.wait_settled()
        with cluster.client() as client:
            keys = keys_of_bucket(client, 0, "flood/", 3000)
            client.put(keys[0], b"warm")
            futures: list[tuple[str, Future[WriteResult]]] = []
            killed = False
            for i, key in enumerate(keys[1:]):
                futures.append((key, client.write_async([set_op(key, b"v")])))
                if i == 800 and not killed:
                    cluster.kill9(cluster.leader_node(0))
                    killed = True
                if i % 100 == 0:
                    time.sleep(0.01)  # a steady stream, not one burst
            # Every write answered success (with 5 results kept per producer, some
            # committed ones raised DuplicateSequence), with its original commit.
            committed = [(key, future.result(60)) for key, future in futures]
            cluster.restart()
            records = {r.key: r for r in client.sync_bucket(0)}
            for key, result in committed:
                assert records[key].version == 1, f"{key} applied twice"
                assert records[key].mod_commit_index == result.committed.commit_index
            indexes = [records[key].mod_commit_index for key, _ in futures]
            assert indexes == sorted(indexes)  # in submission order
    finally:
        cluster.stop()


def queued(cluster: LocalCluster, queue: WriteQueue) -> Client:
    endpoints = [n.grpc_address for n in cluster.spec.nodes]
    return Client(endpoints, token=cluster.token(), tls=cluster.tls, write_queue=queue)


def test_a_full_write_queue_blocks_then_refuses_and_sends_nothing(cluster: LocalCluster) -> None:
    """While no node answers, writes pile up: the queue held them all (unbounded);
    now a write beyond `max_writes` waits `wait_s`, then raises, unsent."""
    with queued(cluster, WriteQueue(max_writes=5, wait_s=0.5)) as client:
        keys = keys_of_bucket(client, 1, "full/", 7)
        client.put(keys[0], b"warm")
        with cluster.paused([n.node_id for n in cluster.spec.nodes]):
            held = [client.write_async([set_op(k, b"v")]) for k in keys[1:6]]
            started = time.monotonic()
            with pytest.raises(ResourceExhausted, match="write queue is full"):
                client.write_async([set_op(keys[6], b"refused")])
            assert 0.5 <= time.monotonic() - started < 5
        for future in held:
            assert future.result(30).versions
        assert client.get(keys[6]) is None  # the refused write was never sent


def test_a_write_waiting_for_room_goes_out_once_there_is_room(cluster: LocalCluster) -> None:
    with queued(cluster, WriteQueue(max_writes=2, wait_s=30)) as client:
        keys = keys_of_bucket(client, 1, "room/", 4)
        client.put(keys[0], b"warm")
        later: list[Future[WriteResult]] = []
        with cluster.paused([n.node_id for n in cluster.spec.nodes]):
            first = [client.write_async([set_op(k, b"v")]) for k in keys[1:3]]
            waiter = threading.Thread(
                target=lambda: later.append(client.write_async([set_op(keys[3], b"v")]))
            )
            waiter.start()
            waiter.join(0.5)
            assert waiter.is_alive()  # blocked: the queue is full
        waiter.join(30)
        assert [f.result(30).bucket for f in (*first, *later)] == [1, 1, 1]
