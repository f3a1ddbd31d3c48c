"""Regenerate (or check) the committed Python code for the sevendb wire contract.

``proto/sevendb.proto`` is compiled with ``grpc_tools.protoc`` into three files that
are committed next to it:

* ``sevendb_pb2.py``      -- messages (``--python_out``)
* ``sevendb_pb2.pyi``     -- type stubs for the messages (``--pyi_out``)
* ``sevendb_pb2_grpc.py`` -- the SevenDB service stub/servicer (``--grpc_python_out``)

The folder ``proto/`` installs as the package ``sevendb.proto``, so the generated
modules must import each other as ``sevendb.proto.sevendb_pb2``. protoc derives
import paths from the .proto's path relative to the include root, so the .proto is
copied into a temporary include tree at ``<tmp>/sevendb/proto/sevendb.proto`` and
compiled with ``-I <tmp>``; the outputs are taken from ``<tmp>/sevendb/proto/``.

Usage::

    python deploy/gen_proto.py            # rewrite proto/*_pb2* from proto/sevendb.proto
    python deploy/gen_proto.py --check    # exit 1 (with a diff) if they are stale

``--proto-dir DIR`` points both modes at another folder holding ``sevendb.proto``
and the committed outputs (the tests use it on a scratch copy).

The output depends only on the .proto and on the pinned grpcio-tools version, so
running it twice gives byte-identical files.
"""

from __future__ import annotations

import argparse
import difflib
import shlex
import sys
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROTO_DIR = ROOT / "proto"
PROTO_NAME = "sevendb.proto"
# Where the .proto sits inside the include tree; this is what makes the generated
# code say `from sevendb.proto import sevendb_pb2`.
PACKAGE_PATH = Path("sevendb") / "proto"
OUTPUTS = ("sevendb_pb2.py", "sevendb_pb2.pyi", "sevendb_pb2_grpc.py")


def generate(proto_dir: Path) -> dict[str, bytes]:
    """Compile ``proto_dir/sevendb.proto`` and return ``{output name: contents}``."""
    from grpc_tools import protoc  # dev dependency; imported lazily for a clear error

    source = proto_dir / PROTO_NAME
    if not source.is_file():
        raise SystemExit(f"gen_proto: {source} does not exist")
    # The well-known types (google/protobuf/*.proto) ship inside grpc_tools.
    wkt_include = str(resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory(prefix="sevendb-proto-") as tmp_name:
        tmp = Path(tmp_name)
        package_dir = tmp / PACKAGE_PATH
        package_dir.mkdir(parents=True)
        (package_dir / PROTO_NAME).write_bytes(source.read_bytes())
        argv = [
            "grpc_tools.protoc",
            f"-I{tmp}",
            f"-I{wkt_include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            (PACKAGE_PATH / PROTO_NAME).as_posix(),
        ]
        status = protoc.main(argv)
        if status != 0:
            raise SystemExit(f"gen_proto: protoc failed with exit status {status}")
        outputs: dict[str, bytes] = {}
        for name in OUTPUTS:
            produced = package_dir / name
            if not produced.is_file():
                raise SystemExit(f"gen_proto: protoc did not produce {name}")
            outputs[name] = produced.read_bytes()
        return outputs


def fix_command(proto_dir: Path) -> str:
    """The command that regenerates ``proto_dir``'s outputs."""
    argv = ["python", "deploy/gen_proto.py"]
    if proto_dir.resolve() != DEFAULT_PROTO_DIR:
        argv += ["--proto-dir", str(proto_dir)]
    return shlex.join(argv)


def check(proto_dir: Path) -> int:
    """Return 0 if the committed outputs match a fresh generation, else 1 (with a diff)."""
    stale = False
    for name, fresh in generate(proto_dir).items():
        committed_path = proto_dir / name
        committed = committed_path.read_bytes() if committed_path.is_file() else None
        if committed == fresh:
            continue
        stale = True
        old_lines = [] if committed is None else _lines(committed)
        sys.stdout.writelines(
            difflib.unified_diff(
                old_lines,
                _lines(fresh),
                fromfile=f"{committed_path} (committed)",
                tofile=f"{committed_path} (generated)",
            )
        )
        if committed is None:
            print(f"gen_proto: {committed_path} is missing")
    if stale:
        print(
            f"gen_proto: generated code in {proto_dir} is out of date with {PROTO_NAME}; "
            f"run `{fix_command(proto_dir)}` and commit the result",
            file=sys.stderr,
        )
        return 1
    print(f"gen_proto: {', '.join(OUTPUTS)} are up to date")
    return 0


def write(proto_dir: Path) -> int:
    """Regenerate the outputs into ``proto_dir``, touching only files that change."""
    for name, fresh in generate(proto_dir).items():
        target = proto_dir / name
        if target.is_file() and target.read_bytes() == fresh:
            print(f"gen_proto: {target} unchanged")
            continue
        target.write_bytes(fresh)
        print(f"gen_proto: wrote {target}")
    return 0


def _lines(data: bytes) -> list[str]:
    text = data.decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 with a diff if the committed outputs are stale",
    )
    parser.add_argument(
        "--proto-dir",
        type=Path,
        default=DEFAULT_PROTO_DIR,
        help=f"folder with {PROTO_NAME} and its committed outputs (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    proto_dir: Path = args.proto_dir
    return check(proto_dir) if args.check else write(proto_dir)


if __name__ == "__main__":
    sys.exit(main())
