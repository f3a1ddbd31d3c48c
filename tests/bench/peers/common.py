"""Shared pieces: the workload key/value scheme, statistics, /proc readings, free
ports, and `Worker`, a client subprocess spoken to in JSON lines with timeouts."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

HERE: Final = Path(__file__).resolve().parent
BENCH_DIR: Final = HERE.parent
CACHE_DIR: Final = Path(
    os.environ.get("SEVENDB_BENCH_CACHE", Path.home() / ".cache" / "sevendb-bench")
)
VALUE_BYTES: Final = 100
SEVENDB_CLIENT_ENV: Final = "SEVENDB_BENCH_CLIENT"
"""Which SDK client the sevendb workers use: "async" (`AsyncClient` on the worker's
loop, the default) or "thread" (`Client`, its loop in a thread of its own)."""
SEQ_DIGITS: Final = 12
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
PAGE_KB: Final = os.sysconf("SC_PAGE_SIZE") // 1024

JsonDict = dict[str, Any]


# ---- the workload's keys and values ---------------------------------------------------


def value_of(seq: int) -> bytes:
    """~100 bytes: the write's sequence number first, so a subscriber knows which write
    an event came from (joined with the writer's send/ack times)."""
    head = str(seq).zfill(SEQ_DIGITS).encode()
    return head + b"x" * (VALUE_BYTES - len(head))


def seq_of(value: bytes) -> int:
    return int(value[:SEQ_DIGITS])


def key_of(prefix: str, seq: int, cycle: int) -> str:
    """etcd / sevendb key of write `seq`: unique, or one of `cycle` keys (`prefix/j`)."""
    return f"{prefix}/{seq % cycle if cycle else seq}"


# ---- statistics -------------------------------------------------------------------------


def pct(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an ascending sequence (nan if empty)."""
    if not sorted_values:
        return float("nan")
    rank = min(len(sorted_values) - 1, max(0, int(len(sorted_values) * p / 100.0)))
    return float(sorted_values[rank])


# ---- /proc ------------------------------------------------------------------------------


def _stat_cpu(stat: Path) -> float:
    """utime + stime from a /proc `stat` file."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (0 if it is gone)."""
    try:
        return _stat_cpu(Path(f"/proc/{pid}/stat"))
    except (OSError, IndexError):
        return 0.0


def thread_cpu(pids: Iterable[int]) -> dict[str, float]:
    """utime + stime of live processes' threads, summed by OS thread name without its
    suffix after the first `-` (`notifier-b0` and `notifier-b1` are `notifier`;
    unnamed threads carry the process's name). Threads that already ended are
    missing."""
    out: dict[str, float] = {}
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                name = (task / "comm").read_text().strip().split("-")[0]
                seconds = _stat_cpu(task / "stat")
            except (OSError, IndexError):
                continue
            out[name] = out.get(name, 0.0) + seconds
    return out


def rss_kb(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_KB
    except (OSError, IndexError, ValueError):
        return 0


def host_cpu() -> tuple[float, float, float]:
    """(busy, steal, total) CPU seconds of the whole host (all cores), from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return (0.0, 0.0, 0.0)
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    steal = fields[7] if len(fields) > 7 else 0
    total = sum(fields[:8])
    return ((total - idle - steal) / CLK_TCK, steal / CLK_TCK, total / CLK_TCK)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports the kernel says are free on 127.0.0.1 right now."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- processes ------------------------------------------------------------------------

_LIVE: set[subprocess.Popen[Any]] = set()
_LIVE_LOCK = threading.Lock()
CLIENT_CPU_S = [0.0]
"""CPU seconds of the client workers that have exited (for the host-noise figure)."""


def track(proc: subprocess.Popen[Any]) -> None:
    with _LIVE_LOCK:
        _LIVE.add(proc)


def untrack(proc: subprocess.Popen[Any]) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(proc)


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; only this process (it leads its own
    session, so its children go with it when they share the group)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
    untrack(proc)


def stop_all_tracked(keep: Collection[int] = ()) -> None:
    """Stop every process this harness started and still tracks, but those in `keep`."""
    with _LIVE_LOCK:
        procs = [p for p in _LIVE if p.pid not in keep]
    for proc in procs:
        stop_process(proc, grace_s=3.0)


class WorkerError(RuntimeError):
    pass


class Worker:
    """A client process (`python -m peers.worker`): commands on stdin, one JSON line
    per answer on stdout, every wait bounded; stderr goes to `log_path`."""

    def __init__(
        self,
        system: str,
        role: str,
        conf: JsonDict,
        log_path: Path,
        *,
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.name = f"{system}-{role}"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(BENCH_DIR), str(CACHE_DIR / "gen"), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "peers.worker",
                "--system",
                system,
                "--role",
                role,
                "--conf",
                json.dumps(conf),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,  # Ctrl-C reaches the harness only; it stops us
        )
        track(self.proc)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.log_path = log_path
        try:
            self.ready: JsonDict = self._answer(ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _answer(self, timeout_s: float) -> JsonDict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self.name}: no answer within {timeout_s:.0f} s{self._tail()}")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                raise WorkerError(f"{self.name}: exited ({self.proc.poll()}){self._tail()}")
            line = line.strip()
            if not line.startswith("{"):
                continue  # a library printed something
            answer: JsonDict = json.loads(line)
            if "error" in answer:
                raise WorkerError(f"{self.name}: {answer['error']}")
            return answer

    def _tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()[-15:]
        except OSError:
            return ""
        return ("; its log ends:\n    " + "\n    ".join(text)) if text else ""

    def call(self, command: JsonDict, timeout_s: float = 60.0) -> JsonDict:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(f"{self.name}: cannot send {command.get('op')}: {exc}") from None
        return self._answer(timeout_s)

    def close(self, command: JsonDict | None = None, timeout_s: float = 60.0) -> JsonDict:
        """Send `command` (e.g. quit), wait for its answer, then make sure it exits."""
        answer: JsonDict = {}
        CLIENT_CPU_S[0] += cpu_seconds(self.proc.pid)
        try:
            if command is not None and self.proc.poll() is None:
                answer = self.call(command, timeout_s)
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        finally:
            stop_process(self.proc)
            self._log.close()
        return answer


def machine_summary() -> JsonDict:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().splitlines()[0].split()[1])
        mem_gib = kb / 1024 / 1024
    return {"cores": os.cpu_count() or 0, "cpu": cpu, "mem_gib": round(mem_gib, 1)}
