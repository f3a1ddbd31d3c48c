"""Memory dumps (cluster/server/memory.py): what grew between two dumps is named by
type and, with tracing on, by the line that allocated it."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from sevendb.cluster.common.topology import ConfigError
from sevendb.cluster.server.config import load_node_config
from sevendb.cluster.server.memory import MemoryDumps

SOURCE = Path(__file__).read_text().splitlines()


class Kept:
    """What the test keeps alive between two dumps."""

    def __init__(self, n: int) -> None:
        self.payload = [n] * 100


@pytest.fixture
def no_tracing() -> Iterator[None]:
    assert not tracemalloc.is_tracing()
    yield
    tracemalloc.stop()


def _section(text: str, title: str) -> list[str]:
    lines = text.split(f"# {title}\n", 1)[1].split("\n\n", 1)[0]
    return lines.splitlines()


def test_a_dump_names_what_grew_since_the_one_before(tmp_path: Path, no_tracing: None) -> None:
    dumps = MemoryDumps(tmp_path / "memory", frames=3)
    first = dumps.dump().read_text()
    assert first.startswith("rss_bytes ")
    assert "gc_collected" in first
    assert "traced_bytes" in first
    assert "change since the previous dump" not in first  # nothing to compare with yet
    kept = [Kept(n) for n in range(5000)]
    second = dumps.dump().read_text()
    changes = _section(second, "objects by type, change since the previous dump")
    assert any(line.split() == ["+5000", f"{__name__}.Kept"] for line in changes), changes
    growth = _section(second, "allocation sites, growth since the previous dump (bytes, blocks)")
    assert growth and int(growth[0].split()[0]) > 5000 * 100 * 8  # the lists, the largest
    payload_line = next(n for n, line in enumerate(SOURCE, 1) if "self.payload =" in line)
    assert growth[1].strip() == f"{__file__}:{payload_line}", growth  # most recent first
    assert len(list((tmp_path / "memory").glob("*.txt"))) == 2
    del kept


def test_without_tracing_a_dump_counts_objects_only(tmp_path: Path) -> None:
    assert not tracemalloc.is_tracing()
    text = MemoryDumps(tmp_path, frames=0).dump().read_text()
    assert "# objects by type" in text
    if sys.platform.startswith("linux"):  # glibc's totals, and where the memory lies
        assert "malloc_free_kept_bytes" in text
        mappings = _section(text, "anonymous mappings by resident bytes (resident, size)")
        assert any(line.endswith("[heap]") for line in mappings), mappings
    assert "traced_bytes" not in text
    assert not tracemalloc.is_tracing()


def test_the_settings_are_checked(tmp_path: Path) -> None:
    config = load_node_config(
        None,
        {
            "SEVENDB_NODE_ID": "n1",
            "SEVENDB_NODE_TRACEMALLOC_FRAMES": "8",
            "SEVENDB_NODE_MEMORY_DUMP_S": "300",
        },
    )
    assert (config.node.tracemalloc_frames, config.node.memory_dump_s) == (8, 300.0)
    with pytest.raises(ConfigError, match="tracemalloc_frames"):
        load_node_config(None, {"SEVENDB_NODE_ID": "n1", "SEVENDB_NODE_TRACEMALLOC_FRAMES": "-1"})
    with pytest.raises(ConfigError, match="memory_dump_s"):
        load_node_config(None, {"SEVENDB_NODE_ID": "n1", "SEVENDB_NODE_MEMORY_DUMP_S": "-5"})


class Registry:
    """Holds what the test adds, as a leaking registry would."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, list[int]]] = []


def test_a_dump_says_what_holds_the_type_that_grew_most(tmp_path: Path) -> None:
    dumps = MemoryDumps(tmp_path)
    dumps.dump()
    registry = Registry()
    shared: list[int] = []  # (a tuple of atoms only is not tracked by the collector)
    registry.entries.extend((n, shared) for n in range(20_000))
    text = dumps.dump().read_text()
    shapes = _section(text, "tuple, the type that grew most, by shape")
    count, shape = shapes[0].split(maxsplit=1)
    assert int(count) >= 20_000 and shape == "tuple[2](int, list)", shapes
    chain = _section(text, "and what holds that, up the chain from the newest")
    assert chain[:2] == [
        "  <- list[20000](tuple, tuple, tuple, tuple, ...)",
        f"  <- {__name__}.Registry",
    ], chain
    del registry


def test_a_node_allocates_pyarrow_memory_from_the_system_allocator() -> None:
    """mimalloc, pyarrow's default, kept what the archive writer freed: a node's
    memory climbed with it (docs/performance.md, the soak)."""
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    code = (
        "import sevendb.cluster.server.node, pyarrow as pa; "
        "print(pa.default_memory_pool().backend_name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "system"
    env["ARROW_DEFAULT_MEMORY_POOL"] = "mimalloc"  # an operator's choice is kept
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "mimalloc"


def test_a_dump_counts_what_pyarrow_allocated() -> None:
    import pyarrow as pa

    from sevendb.cluster.server.memory import arrow_lines

    before = dict(line.split() for line in arrow_lines())
    held = pa.allocate_buffer(8 * 1024 * 1024)
    after = dict(line.split() for line in arrow_lines())
    assert int(after["arrow_allocated_bytes"]) >= int(before["arrow_allocated_bytes"]) + held.size
    assert after["arrow_pool"] == pa.default_memory_pool().backend_name
    del held
