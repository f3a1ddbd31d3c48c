"""The stage probe of `bench_write_path.py`; not used by the product.

Python imports this module at start-up in every process whose PYTHONPATH holds its
directory. With `SEVENDB_STAGE_PROBE_DIR` set, it wraps each function named in
`SEVENDB_STAGE_PROBE` ("module:Class.method" or "module:function", comma-separated)
as soon as its module has been imported, and appends one line per call to
`<dir>/<pid>.tsv`: the function's name, a label (the type of a Raft message, for
handlers taking one), the call's start and end on `time.monotonic_ns` (one clock for
every process of the host) and the thread's name. Lines are written every half
second and at exit. Wrapping costs ~1 µs per call.
"""

from __future__ import annotations

import atexit
import builtins
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

DIR_ENV = "SEVENDB_STAGE_PROBE_DIR"
FUNCTIONS_ENV = "SEVENDB_STAGE_PROBE"

_records: list[tuple[str, str, int, int, str]] = []


def _flush(directory: str) -> None:
    if not _records:
        return
    taken = _records[:]
    del _records[: len(taken)]
    with open(os.path.join(directory, f"{os.getpid()}.tsv"), "a") as out:
        out.writelines("\t".join(map(str, record)) + "\n" for record in taken)


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    now = time.monotonic_ns

    @functools.wraps(fn)
    def probed(*args: Any, **kwargs: Any) -> Any:
        started = now()
        try:
            return fn(*args, **kwargs)
        finally:
            message = next((a for a in args[1:3] if isinstance(a, dict)), None)
            label = str(message.get("type", "")) if message is not None else ""
            _records.append((name, label, started, now(), threading.current_thread().name))

    return probed


def install(specs: list[str]) -> list[str]:
    """Wrap each of `specs` whose module is imported; returns those still to wrap."""
    left = []
    for spec in specs:
        module_name, _, path = spec.partition(":")
        owner_name, _, attr = path.rpartition(".")
        module = sys.modules.get(module_name)
        owner = getattr(module, owner_name, None) if owner_name else module
        if owner is None or not hasattr(owner, attr):
            left.append(spec)
            continue
        setattr(owner, attr, _wrap(path, getattr(owner, attr)))
    return left


def start(directory: str, specs: list[str]) -> None:
    """Wrap `specs` as their modules load; record into `directory`."""
    pending = install(specs)
    original_import = builtins.__import__

    def importing(*args: Any, **kwargs: Any) -> Any:
        nonlocal pending
        module = original_import(*args, **kwargs)
        if pending:
            pending = install(pending)
            if not pending:
                builtins.__import__ = original_import
        return module

    if pending:
        builtins.__import__ = importing

    def flusher() -> None:
        while True:
            time.sleep(0.5)
            _flush(directory)

    threading.Thread(target=flusher, name="stage-probe", daemon=True).start()
    atexit.register(_flush, directory)


if os.environ.get(DIR_ENV) and os.environ.get(FUNCTIONS_ENV):
    start(os.environ[DIR_ENV], [s for s in os.environ[FUNCTIONS_ENV].split(",") if s])
