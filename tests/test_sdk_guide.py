"""docs/sdk.md runs: its ```python blocks, in order, as one session against a real
local cluster (TLS, a token), each failing the test if it raises; and the guide
shows every public call of the SDK's client classes."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from cluster_harness import LocalCluster

import sevendb.sdk
from sevendb.sdk import AsyncClient, Client, Subscription

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "sdk.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def blocks() -> list[tuple[int, str]]:
    """(line number, code) of each python block of the guide."""
    text = GUIDE.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def test_the_guide_has_examples_and_each_compiles() -> None:
    found = blocks()
    assert len(found) >= 15
    for line, code in found:
        compile(code, f"{GUIDE}:{line}", "exec")


def _public_calls(cls: type) -> set[str]:
    return {
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    }


@pytest.mark.parametrize("cls", [Client, AsyncClient, Subscription])
def test_the_guide_shows_every_public_call(cls: type) -> None:
    code = "\n".join(code for _, code in blocks())
    missing = {name for name in _public_calls(cls) if f".{name}" not in code}
    assert missing == set(), f"{cls.__name__} calls with no example in docs/sdk.md"


@pytest.mark.slow
def test_every_example_of_the_guide_runs(
    shared_cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a reader would run them: the cluster's endpoints, a token and its CA file in
    the environment, a working directory of their own (the cursor files)."""
    tls = shared_cluster.tls
    assert tls is not None and tls.ca is not None  # clusters in tests use TLS
    ca = tmp_path / "ca.pem"
    ca.write_bytes(tls.ca)
    endpoints = ",".join(n.grpc_address for n in shared_cluster.spec.nodes)
    monkeypatch.setenv("SEVENDB_ENDPOINTS", endpoints)
    monkeypatch.setenv("SEVENDB_TOKEN", shared_cluster.token())
    monkeypatch.setenv("SEVENDB_CA", str(ca))
    monkeypatch.chdir(tmp_path)
    session: dict[str, object] = {"__name__": "guide"}
    try:
        for line, code in blocks():
            try:
                exec(compile(code, f"{GUIDE}:{line}", "exec"), session)
            except Exception as exc:
                raise AssertionError(f"the example at docs/sdk.md:{line} raised {exc!r}") from exc
    finally:
        for value in session.values():  # a failed example may leave a client open
            if isinstance(value, sevendb.sdk.Client):
                value.close()
