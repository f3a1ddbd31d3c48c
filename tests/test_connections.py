"""Connections are let go of: a closed client closes its own at once, and a node
closes those of clients that vanished or went idle.

* Before, a `Client` that had subscribed left one connection per node open after
  `close()` (its session calls, held by reference cycles and by tasks left in its
  stopped loop) until Python's garbage collector found them, and each node held it
  too, with its TLS buffers: the nodes' native memory crept by ~0.6 MB a minute in
  the soak, whose churn opens and closes subscribing clients (docs/performance.md).
* A node kept a connection open for as long as its peer's kernel did: one whose
  process hung, or whose host went away without closing, for ever. It now pings a
  connection with calls open (`keepalive_ms`) and closes one with none
  (`connection_idle_ms`; docs/limits.md)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.sdk import AsyncClient

pytestmark = pytest.mark.slow


def _connections_to(ports: set[int], pid: int | str = "self") -> int:
    """The established TCP connections of process `pid` to any of `ports`."""
    fds = Path(f"/proc/{pid}/fd")
    inodes = set()
    for fd in os.listdir(fds):
        try:
            target = os.readlink(fds / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            port = int(fields[2].rsplit(":", 1)[1], 16)
            if fields[3] == "01" and fields[9] in inodes and port in ports:
                count += 1
    return count


def _ports(cluster: LocalCluster) -> set[int]:
    """The cluster's client ports."""
    return {int(n.grpc_address.rsplit(":", 1)[1]) for n in cluster.spec.nodes}


def test_a_closed_client_leaves_no_connection_open(shared_cluster: LocalCluster) -> None:
    ports = _ports(shared_cluster)
    before = _connections_to(ports)
    gc.disable()  # what is freed must be freed by closing, not by a collection
    try:
        kept = []
        for i in range(3):
            client = shared_cluster.client()
            sub = client.subscribe(f"prefix:close/{i}/")
            client.put(f"close/{i}/k", b"v")
            assert sub.poll(30) is not None
            assert _connections_to(ports) > before
            client.close()
            kept.append((client, sub))  # still referenced, as in an application's locals
        wait_for(
            lambda: _connections_to(ports) <= before,
            30,
            "the closed clients' connections to close",
        )
    finally:
        gc.enable()


def test_a_closed_async_client_leaves_no_connection_open(shared_cluster: LocalCluster) -> None:
    """The same for an `AsyncClient`, whose loop is the application's and goes on."""
    ports = _ports(shared_cluster)
    endpoints = [n.grpc_address for n in shared_cluster.spec.nodes]
    before = _connections_to(ports)

    async def main() -> None:
        kept = []
        for i in range(3):
            client = AsyncClient(endpoints, token=shared_cluster.token(), tls=shared_cluster.tls)
            sub = await client.subscribe(f"prefix:aclose/{i}/")
            await client.put(f"aclose/{i}/k", b"v")
            await asyncio.wait_for(anext(sub), 30)
            assert _connections_to(ports) > before
            await client.close()
            kept.append((client, sub))
        deadline = asyncio.get_running_loop().time() + 30
        while _connections_to(ports) > before:
            assert asyncio.get_running_loop().time() < deadline, "connections left open"
            await asyncio.sleep(0.1)  # the loop must run for the calls to end

    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One node that pings after a second, waits a second for the answer, and closes a
    connection idle for a second."""
    env = {
        "SEVENDB_SERVER_KEEPALIVE_MS": "1000",
        "SEVENDB_SERVER_KEEPALIVE_TIMEOUT_MS": "1000",
        "SEVENDB_SERVER_CONNECTION_IDLE_MS": "1000",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        cluster = LocalCluster.start(tmp_path_factory.mktemp("strict") / "data", nodes=1)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_hung_subscribers_connection_is_closed_by_the_node(strict: LocalCluster) -> None:
    """A subscriber process stopped (SIGSTOP: its kernel still answers TCP, it does
    not answer gRPC's pings) has its connection closed by the node, within about
    keepalive_ms + keepalive_timeout_ms; before, it stayed open for good."""
    ports = _ports(strict)
    subscriber = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sevendb.cluster.ops.cli",
            "subscribe",
            "prefix:hung/",
            "--data",
            str(strict.data_dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert subscriber.stderr is not None
        for line in subscriber.stderr:  # its streams are up once it says so
            if b"subscribed to prefix:hung/" in line:
                break
        assert _connections_to(ports, subscriber.pid) >= 1
        subscriber.send_signal(signal.SIGSTOP)
        wait_for(
            lambda: _connections_to(ports, subscriber.pid) == 0,
            30,
            "the node to close the hung subscriber's connection",
        )
    finally:
        subscriber.kill()
        subscriber.wait()


def test_an_idle_connection_is_closed_and_the_next_call_connects_again(
    strict: LocalCluster,
) -> None:
    address = strict.spec.nodes[0].grpc_address
    ports = _ports(strict)  # its one node
    with strict.admin() as admin:
        assert admin.status(address) is not None
        assert _connections_to(ports) >= 1
        wait_for(lambda: _connections_to(ports) == 0, 30, "the idle connection to be closed")
        assert admin.status(address) is not None  # a new connection
