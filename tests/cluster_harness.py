"""Real local clusters for tests: node processes on 127.0.0.1, kill -9, restart."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from sdk_facade import make_client

from sevendb.cluster.common.acl import Grant, Permission
from sevendb.cluster.common.topology import ClusterSpec
from sevendb.cluster.ops.admin import ClusterAdmin
from sevendb.cluster.ops.local import (
    cluster_down,
    cluster_up,
    local_admin,
    local_spec,
    local_tls,
    local_token,
    node_status,
    running_pid,
    wait_for_leaders,
)
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc
from sevendb.sdk.client import Client, RetryPolicy
from sevendb.sdk.tls import TLS, sync_channel

T = TypeVar("T")

STARTED: list[Path] = []
"""Data directories of the clusters the running test started (conftest reports their
node logs when it fails)."""


def wait_for(
    condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05
) -> T:
    """Poll until `condition()` is truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


class RawStream:
    """A raw server stream (a gRPC call) read in a thread: its messages, then how it
    ended."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.messages: list[Any] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()

    def first(self) -> Any:
        """Its first message (None if it ended without one)."""
        wait_for(lambda: self.messages or self.ended.is_set(), 30, "the stream's first answer")
        return self.messages[0] if self.messages else None

    def code(self) -> grpc.StatusCode:
        """OK once it answered; the status it ended with if it ended without a message."""
        self.first()
        return self.error.code() if self.error is not None else grpc.StatusCode.OK  # type: ignore[no-any-return]

    def events(self) -> list[pb.DataEvent]:
        return [e for m in list(self.messages) if m.HasField("events") for e in m.events.events]


@dataclass
class LocalCluster:
    data_dir: Path

    @classmethod
    def start(
        cls,
        data_dir: Path,
        *,
        nodes: int = 3,
        buckets: int = 2,
        insecure: bool = False,
        settled: bool = False,
    ) -> LocalCluster:
        STARTED.append(data_dir.resolve())
        # SEVENDB_TEST_INSECURE=1: every cluster plaintext (to measure what TLS costs
        # the suite; docs/benchmarks.md).
        insecure = insecure or os.environ.get("SEVENDB_TEST_INSECURE") == "1"
        cluster_up(
            data_dir,
            nodes=nodes,
            buckets=buckets,
            replicas=min(3, nodes),
            insecure=insecure,
            settled=settled,
        )
        return cls(data_dir.resolve())

    @property
    def tls(self) -> TLS | None:
        """The TLS settings of the cluster's client.toml (None: plaintext)."""
        return local_tls(self.data_dir)

    def channel(self, address: str) -> grpc.Channel:
        """A blocking channel to a node's client port, as the cluster's clients connect."""
        return sync_channel(address, self.tls)

    def stub(self, address: str) -> pb_grpc.SevenDBStub:
        return pb_grpc.SevenDBStub(self.channel(address))  # type: ignore[no-untyped-call]

    @property
    def spec(self) -> ClusterSpec:
        """The cluster's metadata as it is now (nodes and placement change with
        migrations), read from its nodes."""
        return local_spec(self.data_dir)

    def admin(self) -> ClusterAdmin:
        """An admin connection to the cluster (close it, or use it in a `with`)."""
        return local_admin(self.data_dir)

    def token(self, principal: str = "default") -> str:
        return local_token(self.data_dir, principal)

    def grant_all(self, *principals: str) -> None:
        """Let each of `principals` read and write every key (a local cluster lets
        only its default principal in: docs/security.md, "Access control")."""
        with self.admin() as admin:
            for principal in principals:
                for permission in (Permission.READ, Permission.WRITE):
                    admin.grant(Grant(principal, permission))

    def client(
        self, retry: RetryPolicy | None = None, principal: str = "default", kind: str = "sync"
    ) -> Client:
        """A `Client`; with `kind` "async" an `AsyncClient` behind the same calls
        (tests/sdk_facade.py), for tests parametrised over both."""
        return make_client(
            kind,
            [n.grpc_address for n in self.spec.nodes],
            token=self.token(principal),
            tls=self.tls,
            retry=retry,
        )

    def restart(self) -> None:
        cluster_up(self.data_dir)

    def stop(self) -> None:
        cluster_down(self.data_dir)

    def kill9(self, node_id: str) -> None:
        pid = running_pid(self.data_dir, node_id)
        assert pid is not None, f"{node_id} is not running"
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: running_pid(self.data_dir, node_id) is None, 10, f"{node_id} to die")

    @contextlib.contextmanager
    def paused(self, node_ids: list[str]) -> Iterator[None]:
        """SIGSTOP these nodes for the block (their Raft messages and gRPC calls wait)."""
        pids = [running_pid(self.data_dir, n) for n in node_ids]
        assert None not in pids, f"not all of {node_ids} are running"
        try:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
            yield
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)  # type: ignore[arg-type]

    def status(self, node_id: str, *, digests: bool = False) -> pb.StatusResponse | None:
        return node_status(self.spec.node(node_id).grpc_address, self.tls, digests=digests)

    def leader_node(self, bucket: int) -> str:
        """The node whose replica of `bucket` leads its Raft group (waits for one)."""
        return self._node_where(bucket, lambda r: r.is_leader, "a leader")

    def holder_node(self, bucket: int) -> str:
        """The node whose replica of `bucket` is emitting (holds the notifier lease)."""
        return self._node_where(bucket, lambda r: r.emitting, "a notifier lease holder")

    def _node_where(
        self, bucket: int, predicate: Callable[[pb.ReplicaStatus], bool], what: str
    ) -> str:
        def find() -> str | None:
            for node in self.spec.nodes:
                status = self.status(node.node_id)
                if status is None:
                    continue
                for r in status.replicas:
                    if r.bucket == bucket and predicate(r):
                        return node.node_id
            return None

        found = wait_for(find, 30, f"{what} for bucket {bucket}")
        assert found is not None
        return found

    def wait_settled(self, timeout_s: float = 30) -> None:
        """Until each bucket's preferred node leads it and holds its notifier lease: a
        fresh cluster hands leadership over ~2 s after start, and a test that reads
        one node's state right after an action wants no move in between."""
        wait_for_leaders(self.data_dir, timeout_s, settled=True)

    def converged(self) -> bool:
        """Every replica of every bucket applied the same log to the same digest."""
        per_bucket: dict[int, set[tuple[int, str]]] = {}
        for node in self.spec.nodes:
            status = self.status(node.node_id, digests=True)
            if status is None:
                return False
            for r in status.replicas:
                if r.quarantined:
                    return False
                per_bucket.setdefault(r.bucket, set()).add((r.applied_index, r.digest))
        return len(per_bucket) == len(self.spec.buckets) and all(
            len(v) == 1 for v in per_bucket.values()
        )

    def wait_converged(self, timeout_s: float = 60) -> None:
        wait_for(self.converged, timeout_s, "all replicas to converge", interval_s=0.2)
