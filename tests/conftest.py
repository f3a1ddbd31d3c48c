import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

# tests/helpers.py is shared by the test modules.
sys.path.insert(0, str(Path(__file__).parent))

from cluster_harness import STARTED, LocalCluster

from sevendb.cluster.ops.local import log_file
from sevendb.sdk import Client

_LOG_LINES = 80


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that started clusters reports the end of each node's log (a CI
    failure is then readable without the machine it ran on)."""
    report = yield
    if report.failed:
        for data_dir in STARTED:
            for node_dir in sorted((data_dir / "nodes").glob("*")):
                path = log_file(data_dir, node_dir.name)
                if path.is_file():
                    lines = path.read_text(errors="replace").splitlines()[-_LOG_LINES:]
                    report.sections.append((f"{path} (last {len(lines)} lines)", "\n".join(lines)))
    return report


@pytest.fixture(autouse=True)
def _forget_started_clusters() -> Iterator[None]:
    STARTED.clear()
    yield


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One local cluster (3 nodes, 2 buckets, settled) shared by the tests of a module
    that take `shared_cluster`: for tests that each use keys of their own."""
    c = LocalCluster.start(tmp_path_factory.mktemp("module") / "data", buckets=2)
    try:
        c.wait_settled()
        yield c
    finally:
        c.stop()


@pytest.fixture
def shared_cluster(module_cluster: LocalCluster) -> LocalCluster:
    STARTED.append(module_cluster.data_dir)  # a failing test reports the node logs
    return module_cluster


@pytest.fixture
def shared_client(shared_cluster: LocalCluster) -> Iterator[Client]:
    with shared_cluster.client() as c:
        yield c
