"""Every bad input of docs/errors.md, one test per row: a one-line error, the exit
code (CLI) or error type (SDK) the table says, and nothing changed. The CLI runs as
a process (`python -m sevendb.cluster.ops.cli`) against one shared local cluster;
rows that need no cluster (a bad principal, a dead endpoint) run without one."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster_harness import LocalCluster, wait_for

from sevendb.sdk import Client, InvalidArgument, PreconditionFailed

pytestmark = pytest.mark.slow


@dataclass
class Run:
    code: int
    out: str
    err: str
    seconds: float

    def one_line_error(self, *parts: str) -> None:
        """Exactly one line on stderr, no traceback, and it says `parts`."""
        lines = self.err.strip().splitlines()
        assert len(lines) == 1, self.err
        assert "Traceback" not in self.err
        for part in parts:
            assert part in lines[0], lines[0]


def sevendb(*args: str, data: Path | None = None) -> Run:
    cmd = [sys.executable, "-m", "sevendb.cluster.ops.cli", *args]
    if data is not None:
        cmd += ["--data", str(data)]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def subscriptions(shared_cluster: LocalCluster) -> int:
    """Subscriptions held by the buckets' leaders."""
    total = 0
    for bucket in range(len(shared_cluster.spec.buckets)):
        status = shared_cluster.status(shared_cluster.leader_node(bucket))
        assert status is not None
        total += next(r.subscriptions for r in status.replicas if r.bucket == bucket)
    return total


# ---- --expect-version 0: must not exist (etcd's reading) ---------------------------------


def test_cli_expect_version_zero_writes_an_absent_key(
    shared_cluster: LocalCluster, shared_client: Client
) -> None:
    """It was refused ("an exact expected version must be >= 1")."""
    run = sevendb("write", "ev0/new", "v", "--expect-version", "0", data=shared_cluster.data_dir)
    assert run.code == 0, run.err
    record = shared_client.get("ev0/new")
    assert record is not None and record.version == 1


def test_cli_expect_version_zero_refuses_an_existing_key(
    shared_cluster: LocalCluster, shared_client: Client
) -> None:
    shared_client.put("ev0/old", b"kept")
    run = sevendb("write", "ev0/old", "lost", "--expect-version", "0", data=shared_cluster.data_dir)
    assert run.code == 1
    run.one_line_error("PreconditionFailed", "not-exists")
    record = shared_client.get("ev0/old")
    assert record is not None and (record.value, record.version) == (b"kept", 1)


def test_sdk_expect_version_zero_on_put_and_delete(shared_client: Client) -> None:
    assert shared_client.put("ev0/sdk", b"1", expected_version=0).versions == {"ev0/sdk": 1}
    with pytest.raises(PreconditionFailed):
        shared_client.put("ev0/sdk", b"2", expected_version=0)
    with pytest.raises(PreconditionFailed):
        shared_client.delete("ev0/sdk", expected_version=0)  # it exists: kept
    record = shared_client.get("ev0/sdk")
    assert record is not None and (record.value, record.version) == (b"1", 1)
    shared_client.delete("ev0/absent", expected_version=0)  # absent, as required: a no-op


# ---- contradictory or malformed conditions -------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--if-absent", "--expect-version", "3"], "contradict"),
        (["--expect-version", "-5"], "expected_version must be >= 0"),
    ],
)
def test_cli_a_bad_condition_is_refused_and_writes_nothing(
    shared_cluster: LocalCluster, shared_client: Client, flags: list[str], says: str
) -> None:
    """`--if-absent --expect-version 3` was accepted and wrote the key."""
    key = f"cond/{flags[-1]}"
    run = sevendb("write", key, "v", *flags, data=shared_cluster.data_dir)
    assert run.code == 2
    run.one_line_error("InvalidArgument", says)
    assert shared_client.get(key) is None


def test_sdk_a_bad_condition_is_refused_and_writes_nothing(shared_client: Client) -> None:
    with pytest.raises(InvalidArgument, match="contradict"):
        shared_client.put("cond/sdk", b"v", must_not_exist=True, expected_version=3)
    with pytest.raises(InvalidArgument, match="must be >= 0"):
        shared_client.delete("cond/sdk", expected_version=-5)
    assert shared_client.get("cond/sdk") is None


# ---- subscribe: a bad query, a corrupt cursor --------------------------------------------


@pytest.mark.parametrize("query", ["bogus", "key:"])
def test_cli_subscribe_to_a_bad_query(shared_cluster: LocalCluster, query: str) -> None:
    before = subscriptions(shared_cluster)
    run = sevendb("subscribe", query, "--count", "1", data=shared_cluster.data_dir)
    assert run.code == 2
    run.one_line_error("InvalidArgument", "query must be key:K, prefix:P or all")
    assert subscriptions(shared_cluster) == before


@pytest.mark.parametrize(
    "content",
    [
        b"garbage\n",
        b"\xff\xfe",
        b'{"format": 2, "cursors": [{"sub_id": "a", "bucket": 0, "name": "all", '
        b'"position": ["x", 1]}]}',
    ],
)
def test_cli_subscribe_with_a_corrupt_cursor_file(
    shared_cluster: LocalCluster, tmp_path: Path, content: bytes
) -> None:
    cursor = tmp_path / "corrupt.cursor"
    cursor.write_bytes(content)
    before = subscriptions(shared_cluster)
    run = sevendb("subscribe", "all", "--cursor", str(cursor), data=shared_cluster.data_dir)
    assert run.code == 2
    run.one_line_error("CursorStoreError", str(cursor))
    assert cursor.read_bytes() == content  # not reset, not rewritten
    assert subscriptions(shared_cluster) == before


def test_cli_subscribe_without_a_cursor_ends_its_subscription(shared_cluster: LocalCluster) -> None:
    """Every `sevendb subscribe --count` used to leave one subscription per bucket
    behind on the cluster."""
    with shared_cluster.client() as client:
        client.put("tail/1", b"v")
    wait_for(lambda: subscriptions(shared_cluster) == 0, 30, "no subscriptions")
    run = sevendb("subscribe", "all", "--idle-exit", "0.5", data=shared_cluster.data_dir)
    assert run.code == 0, run.err
    wait_for(lambda: subscriptions(shared_cluster) == 0, 30, "the subscriptions to be ended")


# ---- token, timeouts, usage -----------------------------------------------------------------


def test_cli_token_for_a_bad_principal_name(tmp_path: Path) -> None:
    """It printed a Python traceback (the data dir is not even read)."""
    run = sevendb("token", "bad name!", data=tmp_path / "nowhere")
    assert run.code == 2
    run.one_line_error("AuthError", "principal 'bad name!'")
    assert run.out == ""


@pytest.fixture
def dead_endpoint() -> str:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize("command", [["get", "k"], ["write", "k", "v"], ["subscribe", "all"]])
def test_cli_a_dead_endpoint_fails_within_the_timeout(
    dead_endpoint: str, command: list[str]
) -> None:
    """30 s of silence, then a retry message; now 5 s by default (here --timeout 1)."""
    run = sevendb(*command, "--endpoints", dead_endpoint, "--timeout", "1")
    assert run.code == 3
    run.one_line_error("cannot reach the cluster", dead_endpoint, "within 1 s")
    assert run.seconds < 10


def test_cli_the_default_timeout_is_five_seconds(dead_endpoint: str) -> None:
    run = sevendb("get", "k", "--endpoints", dead_endpoint)
    assert run.code == 3
    run.one_line_error("within 5 s")
    assert run.seconds < 15


@pytest.mark.parametrize(
    "args",
    [
        ["get", "k", "--timeout", "0"],
        ["get", "k", "--timeout", "soon"],
        ["write", "k", "v", "--expect-version", "three"],
        ["write", "k"],
        ["subscribe", "all", "--bogus-flag"],
    ],
)
def test_cli_usage_errors_are_one_line(args: list[str]) -> None:
    run = sevendb(*args, "--endpoints", "127.0.0.1:1")
    assert run.code == 2
    run.one_line_error("see sevendb")
