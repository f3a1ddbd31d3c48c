"""Getting the peers onto a fresh machine: Debian's etcd and nats-server packages, and
Python gRPC stubs for etcd's v3 API generated at run time from the .proto files of
Debian's golang-etcd-server-dev (nothing of etcd is kept in this repository)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Final

from peers.common import BENCH_DIR, CACHE_DIR, log

APT_TIMEOUT_S: Final = 900
PIP_TIMEOUT_S: Final = 900
PYPROJECT: Final = BENCH_DIR.parent.parent / "pyproject.toml"
PROTO_PACKAGE: Final = "golang-etcd-server-dev"
GO_SRC: Final = Path("usr/share/gocode/src/go.etcd.io/etcd")
PROTOS: Final = {
    "kv.proto": GO_SRC / "mvcc/mvccpb/kv.proto",
    "auth.proto": GO_SRC / "auth/authpb/auth.proto",
    "rpc.proto": GO_SRC / "etcdserver/etcdserverpb/rpc.proto",
}
STUB_PACKAGE: Final = "etcdbench"
"""The generated modules are `etcdbench.rpc_pb2` etc. under CACHE_DIR/gen."""


class InstallError(RuntimeError):
    pass


def _run(cmd: list[str], timeout_s: float, cwd: Path | None = None) -> None:
    log("$ " + " ".join(cmd))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        result = subprocess.run(
            cmd, cwd=cwd, env=env, timeout=timeout_s, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired:
        raise InstallError(f"{cmd[0]} did not finish within {timeout_s:.0f} s") from None
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-10:])
        raise InstallError(f"{' '.join(cmd)} failed ({result.returncode}):\n{tail}")


_apt_updated = False


def _apt_update() -> None:
    global _apt_updated
    if not _apt_updated:
        _run(["apt-get", "update", "-q"], APT_TIMEOUT_S)
        _apt_updated = True


def ensure_binaries(systems: list[str]) -> None:
    """apt-get install what `systems` need and is missing (as root)."""
    wanted: dict[str, str] = {}
    if "etcd" in systems:
        wanted |= {"etcd": "etcd-server", "etcdctl": "etcd-client"}
    if "nats" in systems:
        wanted |= {"nats-server": "nats-server"}
    missing = sorted({pkg for binary, pkg in wanted.items() if shutil.which(binary) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise InstallError(
            f"missing {', '.join(missing)}: run `apt-get install -y {' '.join(missing)}` as root"
        )
    _apt_update()
    _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], APT_TIMEOUT_S)


def ensure_python_packages(systems: list[str]) -> None:
    """pip install the `bench` extra of pyproject.toml into this interpreter when a
    module the run needs (nats-py for NATS, matplotlib for the chart) is missing."""
    needed = ["matplotlib"] + (["nats"] if "nats" in systems else [])
    if all(importlib.util.find_spec(module) is not None for module in needed):
        return
    with PYPROJECT.open("rb") as f:
        specs = tomllib.load(f)["project"]["optional-dependencies"]["bench"]
    _run([sys.executable, "-m", "pip", "install", "-q", *specs], PIP_TIMEOUT_S)
    importlib.invalidate_caches()


def _proto_sources() -> Path:
    """A root holding PROTOS: the installed package, else the .deb extracted into the
    cache (downloaded with apt-get, its many Go dependencies not needed)."""
    if all((Path("/") / p).is_file() for p in PROTOS.values()):
        return Path("/")
    root = CACHE_DIR / "etcd-proto-deb"
    if all((root / p).is_file() for p in PROTOS.values()):
        return root
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob("*.deb"):
        old.unlink()
    try:
        _run(["apt-get", "download", "-q", PROTO_PACKAGE], APT_TIMEOUT_S, cwd=root)
    except InstallError:
        _apt_update()
        _run(["apt-get", "download", "-q", PROTO_PACKAGE], APT_TIMEOUT_S, cwd=root)
    debs = sorted(root.glob(f"{PROTO_PACKAGE}_*.deb"))
    if not debs:
        raise InstallError(f"apt-get download {PROTO_PACKAGE} left no .deb in {root}")
    _run(["dpkg-deb", "-x", str(debs[-1]), str(root)], 120)
    missing = [str(p) for p in PROTOS.values() if not (root / p).is_file()]
    if missing:
        raise InstallError(f"{debs[-1].name} lacks {', '.join(missing)}")
    return root


_HTTP_OPTION = re.compile(r"option\s*\(google\.api\.http\)\s*=\s*\{")


def _drop_http_options(text: str) -> str:
    """Remove every `option (google.api.http) = {...};` (its braces may nest)."""
    while (match := _HTTP_OPTION.search(text)) is not None:
        depth, end = 1, match.end()
        while depth:
            if end >= len(text):
                raise InstallError("unbalanced google.api.http option in etcd's rpc.proto")
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        semicolon = re.match(r"\s*;", text[end:])
        text = text[: match.start()] + text[end + (semicolon.end() if semicolon else 0) :]
    return text


def strip_proto(text: str) -> str:
    """Drop what only Go and the JSON gateway use (gogoproto and google.api options,
    and their imports) and re-root the imports under `STUB_PACKAGE`."""
    text = _drop_http_options(text)
    text = re.sub(r'import\s+"(gogoproto/gogo|google/api/annotations)\.proto"\s*;', "", text)
    text = re.sub(r"option\s*\(gogoproto\.[a-z_]+\)\s*=\s*[a-z]+\s*;", "", text)
    text = re.sub(r"\s*\[\s*\(gogoproto\.[^\]]*\]", "", text)
    text = text.replace('import "etcd/mvcc/mvccpb/kv.proto"', f'import "{STUB_PACKAGE}/kv.proto"')
    text = text.replace(
        'import "etcd/auth/authpb/auth.proto"', f'import "{STUB_PACKAGE}/auth.proto"'
    )
    if "gogoproto" in text or "google.api" in text:
        raise InstallError("etcd .proto still mentions gogoproto/google.api after stripping")
    return text


def ensure_etcd_stubs() -> Path:
    """Generate (once per input) the etcd stubs; returns the dir to put on sys.path."""
    gen = CACHE_DIR / "gen"
    stamp = gen / STUB_PACKAGE / ".stamp"
    root = _proto_sources()
    texts = {name: strip_proto((root / path).read_text()) for name, path in PROTOS.items()}
    import grpc_tools  # grpcio-tools: already a sevendb dev dependency
    from google import protobuf

    digest = hashlib.sha256(
        ("".join(texts.values()) + protobuf.__version__ + str(grpc_tools.__file__)).encode()
    ).hexdigest()
    if stamp.is_file() and stamp.read_text() == digest:
        return gen
    src = CACHE_DIR / "proto-src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(gen / STUB_PACKAGE, ignore_errors=True)
    (src / STUB_PACKAGE).mkdir(parents=True)
    (gen / STUB_PACKAGE).mkdir(parents=True)
    for name, text in texts.items():
        (src / STUB_PACKAGE / name).write_text(text)
    _run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{src}",
            f"--python_out={gen}",
            f"--grpc_python_out={gen}",
            *(f"{STUB_PACKAGE}/{name}" for name in texts),
        ],
        120,
    )
    stamp.write_text(digest)
    log(f"generated etcd gRPC stubs in {gen / STUB_PACKAGE}")
    return gen


def binary_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    match = re.search(r"v?(\d+\.\d+\.\d+)", out)
    return match.group(1) if match else out.strip()[:40]


def debian_version(package: str) -> str:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.strip()
