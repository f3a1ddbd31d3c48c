"""`Client` writes against a real cluster: idempotent by default (a write whose answer
was lost, retried, applies once), in order through a failover with many in flight,
and bounded (a full write queue pushes back instead of growing)."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.sdk import (
    Client,
    DuplicateSequence,
    ResourceExhausted,
    WriteQueue,
    WriteResult,
    set_op,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(shared_cluster: LocalCluster) -> LocalCluster:
    return shared_cluster


class LossyProxy:
    """A TCP relay to one node in a thread (a network between client and node): with
    `answers_lost` set, what the node sends is dropped; `cut()` then closes every
    connection, as a failing link would, and relays new ones normally again."""

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

    def cut(self) -> None:
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
                    node = socket.create_connection(self._target)
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
            committed = []
            for key, future in futures:
                try:
                    committed.append((key, future.result(60)))
                except DuplicateSequence:  # committed; its result was not kept
                    committed.append((key, None))  # type: ignore[arg-type]
            assert len(committed) == len(futures)
            cluster.restart()
            records = {r.key: r for r in client.sync_bucket(0)}
            for key, result in committed:
                assert records[key].version == 1, f"{key} applied twice"
                if result is not None:
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
