"""The fixed folders install as sevendb.<folder>, and nothing else lands at top level."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_PACKAGES = {"tests", "deploy", "docs", "build", "dist"}


def test_package_list_matches_the_code_folders() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        p.name
        for p in ROOT.iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name not in NOT_PACKAGES
    }
    rooms = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for folder in folders
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert {f"sevendb.{r}" for r in rooms} == set(config["packages"])
    assert config["package-dir"] == {f"sevendb.{f}": f for f in folders}
    for folder in folders:
        assert (ROOT / folder / "py.typed").exists(), f"{folder} lacks py.typed"


def test_console_script_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["sevendb"] == "sevendb.cluster.ops.cli:main"


@pytest.mark.slow
def test_built_wheel_installs_only_the_sevendb_namespace(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("sevendb-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
        assert "sevendb/proto/sevendb.proto" in zf.namelist()
        assert "sevendb/outbox/py.typed" in zf.namelist()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"sevendb"}
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
    )
    # Import from outside the repository, with only the wheel's files on the path
    # (plus the venv's third-party dependencies).
    probe = (
        "import sevendb.sdk, sevendb.outbox.state, sevendb.proto.sevendb_pb2 as pb;"
        f"assert sevendb.sdk.__file__.startswith({str(target)!r}), sevendb.sdk.__file__;"
        "import importlib.util as u;"
        "assert u.find_spec('sdk') is None and u.find_spec('cluster') is None;"
        "print(pb.DESCRIPTOR.package)"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {probe}"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "sevendb.v1"
