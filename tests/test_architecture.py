"""The rooms of the code and the arrows between them (docs/architecture.md).

Every first-party import is an edge from the importing module's room to the
imported module's room; an edge not in `ALLOWED` fails, and so does any cycle
between rooms. Third-party packages that only one room may load are pinned too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("outbox", "proto", "sdk", "notifier", "cluster", "sim")

ROOMS = (
    "cluster.common",
    "cluster.raft",
    "cluster.server",
    "cluster.archive",
    "cluster.ops",
    "outbox",
    "proto",
    "sdk",
    "notifier",
    "sim",
    "cluster",
)
"""The most specific room first: a module belongs to the first room its name starts with."""

ALLOWED: dict[str, set[str]] = {
    "cluster": set(),  # the folder's own __init__: a docstring naming its rooms
    "outbox": set(),
    "proto": {"outbox"},
    "sdk": {"proto", "outbox"},
    "notifier": {"proto", "outbox"},
    "cluster.common": {"proto", "outbox"},
    "cluster.raft": {"cluster.common", "proto", "outbox"},
    "cluster.archive": {"cluster.common", "proto", "outbox"},
    "cluster.server": {
        "cluster.raft",
        "cluster.archive",
        "cluster.common",
        "notifier",
        "proto",
        "outbox",
    },
    "cluster.ops": {"cluster.archive", "cluster.common", "sdk", "proto", "outbox"},
    "sim": {"notifier", "sdk", "proto", "outbox"},
}
"""Which rooms each room may import (besides itself)."""

ONLY_IN: dict[str, str] = {"pysyncobj": "cluster.raft"}
"""Third-party packages that exactly one room may import."""

CLIENT_MUST_NOT_LOAD = ("pysyncobj", "pyarrow", "prometheus_client", "cryptography", "pyspark")


def room_of(module: str) -> str | None:
    name = module.removeprefix("sevendb.")
    for room in ROOMS:
        if name == room or name.startswith(room + "."):
            return room
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "sevendb." + ".".join(parts)


def imports(path: Path, name: str) -> Iterator[str]:
    """Absolute names of every module `path` (module `name`) imports, at any depth."""
    package = name.rsplit(".", 1)[0] if path.name != "__init__.py" else None
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                assert node.module is not None
                yield node.module
                continue
            base = (package or name).split(".")
            base = base[: len(base) - (node.level - 1)]
            yield ".".join([*base, *([node.module] if node.module else [])])


def production_files() -> list[tuple[Path, str]]:
    paths = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))
    return [(p, module_name(p)) for p in paths]


def edges(
    files: list[tuple[Path, str]] | None = None,
) -> Iterator[tuple[Path, str, str, str]]:
    """(file, its room, imported module, that module's room or '' if third-party)."""
    for path, name in production_files() if files is None else files:
        src = room_of(name)
        assert src is not None, f"{path} is in no room"
        for target in imports(path, name):
            if target.startswith("sevendb."):
                dst = room_of(target)
                assert dst is not None, f"{path} imports {target}, which is in no room"
                yield path, src, target, dst
            else:
                yield path, src, target, ""


def test_every_first_party_import_follows_an_allowed_arrow() -> None:
    wrong = [
        f"{p.relative_to(ROOT)}: {src} -> {dst} ({target})"
        for p, src, target, dst in edges()
        if dst and dst != src and dst not in ALLOWED[src]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_allowed_arrows_have_no_cycle() -> None:
    seen: dict[str, int] = {}

    def visit(room: str, path: tuple[str, ...]) -> None:
        if seen.get(room) == 2:
            return
        assert seen.get(room) != 1, f"cycle: {' -> '.join((*path, room))}"
        seen[room] = 1
        for nxt in sorted(ALLOWED[room]):
            visit(nxt, (*path, room))
        seen[room] = 2

    for room in ALLOWED:
        visit(room, ())


@pytest.mark.parametrize("package", sorted(ONLY_IN))
def test_third_party_packages_stay_in_their_room(package: str) -> None:
    wrong = [
        f"{p.relative_to(ROOT)} imports {target}"
        for p, src, target, dst in edges()
        if not dst and target.split(".")[0] == package and src != ONLY_IN[package]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_bites(tmp_path: Path) -> None:
    assert room_of("sevendb.cluster.raft.replica") == "cluster.raft"
    assert room_of("sevendb.cluster.server") == "cluster.server"
    assert "cluster.server" not in ALLOWED["sdk"]
    assert "cluster.raft" not in ALLOWED["notifier"]
    fake = tmp_path / "probe.py"
    fake.write_text("from sevendb.cluster.raft.replica import BucketReplica\nimport pysyncobj\n")
    found = [(src, target, dst) for _, src, target, dst in edges([(fake, "sevendb.sdk.probe")])]
    assert found == [
        ("sdk", "sevendb.cluster.raft.replica", "cluster.raft"),
        ("sdk", "pysyncobj", ""),
    ]
    relative = tmp_path / "rel.py"
    relative.write_text("from .journal import DurableJournal\nfrom ..common import files\n")
    pairs = [(t, d) for _, _, t, d in edges([(relative, "sevendb.cluster.raft.replica")])]
    assert pairs == [
        ("sevendb.cluster.raft.journal", "cluster.raft"),
        ("sevendb.cluster.common", "cluster.common"),
    ]


def test_the_client_loads_no_server_package() -> None:
    """`import sevendb.sdk` (the whole client) loads nothing a node alone needs."""
    probe = (
        "import sys, sevendb.sdk, sevendb.sdk.client, sevendb.sdk.subscription;"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True
    ).stdout.split()
    loaded = {m.split(".")[0] for m in out} | {m for m in out if m.startswith("sevendb.")}
    assert not loaded & set(CLIENT_MUST_NOT_LOAD)
    assert not [m for m in loaded if m.startswith(("sevendb.cluster", "sevendb.notifier"))]
