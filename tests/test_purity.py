"""The deterministic core imports no I/O, clock, randomness, threads or adapters."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BANNED = {
    "socket",
    "threading",
    "asyncio",
    "time",
    "random",
    "os",
    "uuid",
    "secrets",
    "datetime",
    "subprocess",
    "multiprocessing",
    "selectors",
    "signal",
    "io",
    "pathlib",
    "shutil",
    "tempfile",
    "grpc",
    "pysyncobj",
    "logging",
}
CORE = [
    *sorted((ROOT / "outbox").glob("*.py")),
    ROOT / "sdk" / "cursor.py",
    ROOT / "sdk" / "progress.py",
    ROOT / "sdk" / "handover.py",
    ROOT / "notifier" / "core.py",
]


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_imports_nothing_banned(path: Path) -> None:
    assert not imported_modules(path) & BANNED


def test_the_ban_bites(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom os import path\nfrom grpc import aio\n")
    assert imported_modules(bad) & BANNED == {"time", "os", "grpc"}
