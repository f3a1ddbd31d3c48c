"""A node's logs: the ``[log]`` section of its configuration and the handlers it sets.

By default a node writes JSON lines to stderr, one object per record::

    {"time": "2026-11-25T22:06:09.390Z", "level": "WARNING", "logger": "sevendb.node",
     "message": "bucket 3: ...", "node": "n1", "bucket": 3, ...}

``node`` is the node's id, ``bucket`` the bucket the record is about when it says
(the ``bucket`` of `extra`, or a message that starts ``bucket %d``), ``exc_info``
the traceback, and any other `extra` field is a key of its own (the request log's
``method``, ``principal``, ``code``, ``duration_ms``, ``peer``). On a terminal
(``format = "auto"`` and stderr a tty) the lines are text instead. ``file`` sends
them to a file rotated by size (``max_bytes``, ``backups``), or to ``stdout``
(containers, journald). docs/operations.md, "Logs".
"""

from __future__ import annotations

import logging
import logging.handlers
import re
import sys
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, TextIO

from pythonjsonlogger.json import JsonFormatter

__all__ = [
    "REQUEST_LOGGER",
    "LogFormat",
    "LogLevel",
    "LogSettings",
    "configure_logging",
    "early_logging",
]

TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_BUCKET_MESSAGE: Final = re.compile(r"^(?:[\w ]+: )?bucket %d\b")
REQUEST_LOGGER: Final = "sevendb.request"


class LogLevel(StrEnum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"


class LogFormat(StrEnum):
    AUTO = "auto"
    """JSON, unless the lines go to stderr and stderr is a terminal: text."""
    JSON = "json"
    TEXT = "text"


@dataclass(frozen=True)
class LogSettings:
    """The ``[log]`` section."""

    level: LogLevel = LogLevel.INFO
    """The lowest level written (DEBUG, INFO, WARNING, ERROR, CRITICAL)."""
    format: LogFormat = LogFormat.AUTO
    """``json`` (one object per line), ``text``, or ``auto``: text on a terminal,
    JSON otherwise."""
    file: str = "stderr"
    """``stderr``, ``stdout`` (containers, journald) or a file, rotated when it
    reaches `max_bytes` (relative paths: to the config file's directory)."""
    max_bytes: int = 100 * 1024 * 1024
    """A log file is rotated at this size (``file.1``, ``file.2``, ...)."""
    backups: int = 5
    """Rotated files kept."""
    requests: bool = False
    """Log every finished gRPC call (method, principal, status, duration, peer) at
    DEBUG, whatever `level` says."""

    def __post_init__(self) -> None:
        if not self.file:
            raise ValueError("file must be stderr, stdout or a path")
        if self.max_bytes < 1024:
            raise ValueError(f"max_bytes must be at least 1024, got {self.max_bytes}")
        if self.backups < 1:
            raise ValueError(f"backups must be at least 1, got {self.backups}")


class _NodeJsonFormatter(JsonFormatter):
    """python-json-logger's formatter with the node's keys: ``time`` (UTC, ISO 8601,
    milliseconds), ``level``, ``logger``, ``message``, ``node``, ``bucket``."""

    def __init__(self, node_id: str) -> None:
        super().__init__(
            "{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger"},
            static_fields={"node": node_id},
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        log_data["time"] = (
            time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z"
        )
        super().add_fields(log_data, record, message_dict)
        bucket = _bucket_of(record)
        if bucket is not None:
            log_data["bucket"] = bucket


def _bucket_of(record: logging.LogRecord) -> Any:
    """The bucket a record is about: its ``bucket`` extra, or the first argument of a
    message that starts ``bucket %d`` (most of the node's lines do)."""
    bucket = getattr(record, "bucket", None)
    if bucket is not None:
        return bucket
    args = record.args
    if (
        isinstance(record.msg, str)
        and isinstance(args, tuple)
        and args
        and isinstance(args[0], int)
        and _BUCKET_MESSAGE.match(record.msg)
    ):
        return args[0]
    return None


def _formatter(settings: LogSettings, node_id: str, stream: TextIO | None) -> logging.Formatter:
    fmt = settings.format
    if fmt is LogFormat.AUTO:
        terminal = stream is not None and stream.isatty()
        fmt = LogFormat.TEXT if terminal else LogFormat.JSON
    if fmt is LogFormat.TEXT:
        return logging.Formatter(TEXT_FORMAT)
    return _NodeJsonFormatter(node_id)


def _handler(settings: LogSettings) -> tuple[logging.Handler, TextIO | None]:
    if settings.file == "stderr":
        return logging.StreamHandler(sys.stderr), sys.stderr
    if settings.file == "stdout":
        return logging.StreamHandler(sys.stdout), sys.stdout
    path = Path(settings.file)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(
        path, maxBytes=settings.max_bytes, backupCount=settings.backups, encoding="utf-8"
    )
    return handler, None


def configure_logging(settings: LogSettings, node_id: str) -> logging.Handler:
    """Replace the root logger's handlers with the one `settings` describe. Returns
    the handler."""
    handler, stream = _handler(settings)
    handler.setFormatter(_formatter(settings, node_id, stream))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(settings.level.value)
    requests = logging.getLogger(REQUEST_LOGGER)
    requests.setLevel(logging.DEBUG if settings.requests else logging.NOTSET)
    return handler


def early_logging() -> None:
    """Text on stderr until the configuration is read (its errors are logged)."""
    logging.basicConfig(level=logging.INFO, format=TEXT_FORMAT)
