"""A closed client lets go of its connections at once, not when Python's garbage
collector next finds them. Before: a `Client` that had subscribed left one
connection per node open after `close()` (its session calls, held by reference
cycles and by tasks left in its stopped loop), and each node held it too, with
its TLS buffers: the nodes' native memory crept by ~0.6 MB a minute in the soak,
whose churn opens and closes subscribing clients (docs/performance.md)."""

from __future__ import annotations

import asyncio
import gc
import os
from pathlib import Path

import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.sdk import AsyncClient

pytestmark = pytest.mark.slow


def _connections_to(ports: set[int]) -> int:
    """This process's established TCP connections to any of `ports`."""
    fds = Path("/proc/self/fd")
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


def test_a_closed_client_leaves_no_connection_open(shared_cluster: LocalCluster) -> None:
    ports = {int(n.grpc_address.rsplit(":", 1)[1]) for n in shared_cluster.spec.nodes}
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
    ports = {int(n.grpc_address.rsplit(":", 1)[1]) for n in shared_cluster.spec.nodes}
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
