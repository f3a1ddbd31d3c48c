"""The `sevendb` command line as a parser: help on every argument with its default,
`--version`, global flags before the command, values from a file or stdin, shell
completion (docs/operations.md, "The command line")."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import LocalCluster

from sevendb.cluster.ops import cli
from sevendb.cluster.server.node import build_parser as node_parser
from sevendb.outbox.errors import InvalidArgument


def _parsers(
    parser: argparse.ArgumentParser, path: str = "sevendb"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def _without_default(default: object) -> bool:
    return default in (None, argparse.SUPPRESS, []) or isinstance(default, bool)


@pytest.mark.parametrize("make", [cli.build_parser, node_parser])
def test_every_argument_has_help_and_shows_its_default(
    make: type[argparse.ArgumentParser],
) -> None:
    missing, hidden = [], []
    count = 0
    for path, parser in _parsers(make()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            count += 1
            name = f"{path} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                missing.append(name)
                continue
            text = formatter._expand_help(action)
            if not _without_default(action.default) and "default" not in text:
                hidden.append(f"{name}: {text!r}")
    assert count > 30
    assert not missing, f"arguments without help: {missing}"
    assert not hidden, f"defaults not shown: {hidden}"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"sevendb {cli._version()}"


def test_global_flags_before_or_after_the_command() -> None:
    parse = cli.parse_args
    assert parse(["--data", "d1", "status"]).data == "d1"
    assert parse(["status", "--data", "d2"]).data == "d2"
    assert parse(["--data", "d1", "status", "--data", "d2"]).data == "d2"
    args = parse(["--config", "c.toml", "--timeout", "2.5", "get", "k"])
    assert (args.config, args.timeout, args.key) == ("c.toml", 2.5, "k")
    assert parse(["get", "k"]).timeout == cli.DEFAULT_TIMEOUT_S
    assert parse(["status"]).principal is None  # the default principal, minted locally
    # `subscriptions` acts as the admin by default; that default leaked into every
    # command sharing the option (set on the shared action), so `write` acted as admin.
    assert parse(["write", "k", "v"]).principal is None
    assert parse(["--principal", "bob", "subscriptions", "list"]).principal == "bob"
    assert cli.leading_globals(["--data", "x", "--token=t", "spark", "audit"]) == (
        ["--data", "x", "--token=t"],
        ["spark", "audit"],
    )
    # A flag takes no value: the command after it is not swallowed as one.
    assert cli.leading_globals(["--insecure", "--data", "x", "spark", "audit"]) == (
        ["--insecure", "--data", "x"],
        ["spark", "audit"],
    )


def test_values_from_a_file_or_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "value.bin"
    path.write_bytes(b"\x00binary\xff")
    assert cli.read_value(f"@{path}") == b"\x00binary\xff"
    assert cli.read_value("@@handle") == b"@handle"
    assert cli.read_value("plain") == b"plain"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"from stdin\n")))
    assert cli.read_value("-") == b"from stdin\n"
    with pytest.raises(InvalidArgument, match="cannot read the file"):
        cli.read_value(f"@{tmp_path / 'missing'}")


def test_an_unreadable_value_file_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["--endpoints", "127.0.0.1:1", "write", "k", f"@{tmp_path / 'nope'}"])
    assert code == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read the file" in err[0]


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_scripts(shell: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["completion", shell]) == 0
    script = capsys.readouterr().out
    assert "sevendb" in script and "backup" in script and "subscribe" in script
    if shell == "bash":
        assert "complete " in script


@pytest.mark.slow
def test_global_flags_and_file_values_against_a_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = LocalCluster.start(tmp_path / "data", buckets=1)
    try:
        data = str(cluster.data_dir)
        value = tmp_path / "doc.json"
        value.write_bytes(b'{"a": 1}')
        assert cli.main(["--data", data, "write", "doc/1", f"@{value}"]) == 0
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"piped")))
        assert cli.main(["--data", data, "--timeout", "20", "write", "doc/2", "-"]) == 0
        capsys.readouterr()
        assert cli.main(["--data", data, "get", "doc/1"]) == 0
        assert json.loads(capsys.readouterr().out)["value"] == '{"a": 1}'
        assert cli.main(["get", "doc/2", "--data", data]) == 0
        assert json.loads(capsys.readouterr().out)["value"] == "piped"
        config = str(cluster.data_dir / "client.toml")
        assert cli.main(["--config", config, "status", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["unreachable"] == []
    finally:
        cluster.stop()
