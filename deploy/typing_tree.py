"""Lay out .venv/typing/sevendb/<folder> symlinks so mypy sees installed module names."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    tree = ROOT / ".venv" / "typing" / "sevendb"
    tree.mkdir(parents=True, exist_ok=True)
    for package, folder in mapping.items():
        link = tree / package.split(".", 1)[1]
        target = ROOT / folder
        if link.is_symlink() and link.resolve() == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)


if __name__ == "__main__":
    main()
