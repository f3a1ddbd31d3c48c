"""A node's logs (cluster/server/logs.py): JSON lines by default, text on a terminal,
the ``[log]`` section, size-based rotation. tests/test_metrics.py reads a real node's
JSON log, its request lines included."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from sevendb.cluster.common.topology import ConfigError
from sevendb.cluster.server.config import load_node_config
from sevendb.cluster.server.logs import (
    REQUEST_LOGGER,
    LogFormat,
    LogLevel,
    LogSettings,
    configure_logging,
)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger(REQUEST_LOGGER).setLevel(logging.NOTSET)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_carry_node_bucket_and_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    configure_logging(LogSettings(), "n7")
    log = logging.getLogger("sevendb.test")
    log.info("bucket %d: replica %s started", 3, "127.0.0.1:1")
    log.warning("plain", extra={"bucket": 5, "event": "thing", "count": 2})
    log.debug("not written at INFO")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 3
    first, second, third = lines
    assert first["message"] == "bucket 3: replica 127.0.0.1:1 started"
    assert first["bucket"] == 3 and first["node"] == "n7" and first["level"] == "INFO"
    assert first["logger"] == "sevendb.test" and first["time"].endswith("Z")
    assert second["bucket"] == 5 and second["event"] == "thing" and second["count"] == 2
    assert "bucket" not in third and "ValueError: boom" in third["exc_info"]


def test_text_on_a_terminal_json_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    configure_logging(LogSettings(), "n1")
    logging.getLogger("sevendb.test").warning("bucket %d: hello", 1)
    line = terminal.getvalue().strip()
    assert line.endswith("WARNING sevendb.test: bucket 1: hello") and not line.startswith("{")
    piped = io.StringIO()
    monkeypatch.setattr("sys.stdout", piped)
    configure_logging(LogSettings(file="stdout", format=LogFormat.TEXT), "n1")
    logging.getLogger("sevendb.test").warning("asked for text")
    assert piped.getvalue().strip().endswith("WARNING sevendb.test: asked for text")


def test_a_log_file_is_rotated_by_size(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "node.log"
    configure_logging(LogSettings(file=str(path), max_bytes=2048, backups=2), "n1")
    log = logging.getLogger("sevendb.test")
    for i in range(200):
        log.info("line %d %s", i, "x" * 40)
    logging.getLogger().handlers[0].flush()
    assert path.stat().st_size <= 2048
    assert (tmp_path / "logs" / "node.log.1").is_file()
    assert (tmp_path / "logs" / "node.log.2").is_file()
    assert not (tmp_path / "logs" / "node.log.3").exists()
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["message"].startswith("line 199 ")


def test_the_request_log_alone_at_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    configure_logging(LogSettings(level=LogLevel.WARNING, requests=True), "n1")
    logging.getLogger(REQUEST_LOGGER).debug("Write by alice", extra={"code": "OK"})
    logging.getLogger("sevendb.other").info("not at WARNING")
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line["code"] == "OK" and line["level"] == "DEBUG"


def _config(tmp_path: Path, log_section: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(f'[node]\nid = "n1"\n\n[log]\n{log_section}\n')
    return path


def test_the_log_section(tmp_path: Path) -> None:
    config = load_node_config(
        _config(tmp_path, 'level = "DEBUG"\nfile = "logs/node.log"\nbackups = 3'),
        {"SEVENDB_LOG_FORMAT": "text"},
    )
    assert config.log.level is LogLevel.DEBUG and config.log.format is LogFormat.TEXT
    assert config.log.file == str(tmp_path / "logs" / "node.log") and config.log.backups == 3
    assert load_node_config(_config(tmp_path, ""), {}).log == LogSettings()
    with pytest.raises(ConfigError, match="'LOUD' is not one of"):
        load_node_config(_config(tmp_path, 'level = "LOUD"'), {})
    with pytest.raises(ConfigError, match="backups must be at least 1"):
        load_node_config(_config(tmp_path, "backups = 0"), {})
    with pytest.raises(ConfigError, match="unknown key 'colour'"):
        load_node_config(_config(tmp_path, 'colour = "red"'), {})
