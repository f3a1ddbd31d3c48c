"""Benchmark: what one journal append plus fdatasync costs, and ways to pay less.

    .venv/bin/python tests/bench/bench_fsync.py [--ops 2000] [--files 4] [--dir DIR]

Each case appends `--bytes` (200) records and makes each durable with fdatasync, as
a Raft journal does per batch (cluster/raft/journal.py):

1. growing: appended at the end of a file that grows (what the journal does now);
   every fdatasync also commits the new file size;
2. preallocated: written into a file whose blocks were allocated and zero-filled
   beforehand, so an fdatasync writes the data only;
3. with `--files` journals (a node's buckets), one record each per round: synced one
   after another from one thread (a node's `RaftLoop` ticks its replicas that way),
   or all at once from one thread per file (fdatasync releases the GIL; the file
   system can commit them together).

Prints p50 / p99 per fdatasync and rounds per second. Not a test: nothing is
asserted. `--dir` must be on the disk the nodes use (the default is the system's
temporary directory).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench_writes import machine
from peers.common import pct

PREALLOCATE_CHUNK = 1 << 20


def _open(path: Path, preallocate: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    if preallocate:
        zeros = b"\0" * PREALLOCATE_CHUNK
        for offset in range(0, preallocate, PREALLOCATE_CHUNK):
            os.pwrite(fd, zeros, offset)
        os.fsync(fd)
    return fd


def one_file(where: Path, ops: int, record: bytes, preallocate: bool) -> list[float]:
    """Microseconds per append+fdatasync, one file."""
    fd = _open(where / "journal", ops * len(record) if preallocate else 0)
    out = []
    try:
        for i in range(ops):
            t0 = time.perf_counter_ns()
            os.pwrite(fd, record, i * len(record))
            os.fdatasync(fd)
            out.append((time.perf_counter_ns() - t0) / 1000)
    finally:
        os.close(fd)
    return out


def many_files(
    where: Path, ops: int, record: bytes, files: int, parallel: bool, preallocate: bool = False
) -> tuple[list[float], float]:
    """Microseconds per round (one record synced in each file), and rounds per second."""
    size = ops * len(record) if preallocate else 0
    fds = [_open(where / f"journal-{n}", size) for n in range(files)]
    rounds: list[float] = []
    try:
        if parallel:
            start = threading.Barrier(files + 1)
            done = threading.Barrier(files + 1)

            def worker(fd: int) -> None:
                for i in range(ops):
                    start.wait()
                    os.pwrite(fd, record, i * len(record))
                    os.fdatasync(fd)
                    done.wait()

            threads = [threading.Thread(target=worker, args=(fd,)) for fd in fds]
            for t in threads:
                t.start()
            t_all = time.perf_counter()
            for _ in range(ops):
                t0 = time.perf_counter_ns()
                start.wait()
                done.wait()
                rounds.append((time.perf_counter_ns() - t0) / 1000)
            for t in threads:
                t.join()
        else:
            t_all = time.perf_counter()
            for i in range(ops):
                t0 = time.perf_counter_ns()
                for fd in fds:
                    os.pwrite(fd, record, i * len(record))
                    os.fdatasync(fd)
                rounds.append((time.perf_counter_ns() - t0) / 1000)
        elapsed = time.perf_counter() - t_all
    finally:
        for fd in fds:
            os.close(fd)
    return rounds, ops / elapsed


def case(label: str, run: Callable[[Path], list[float]], base: Path) -> None:
    with tempfile.TemporaryDirectory(dir=base) as where:
        values = run(Path(where))
    p50, p99 = statistics.median(values), pct(sorted(values), 99)
    print(f"{label:52} p50 {p50:7.0f} us   p99 {p99:7.0f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--bytes", type=int, default=200)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = p.parse_args()
    record = os.urandom(args.bytes)
    print(machine())
    print(f"load average {os.getloadavg()[0]:.2f}; {args.ops} records of {args.bytes} bytes")
    for preallocate in (False, True, False, True):  # alternated: the disk drifts
        label = "1 file, " + ("preallocated" if preallocate else "growing")
        case(
            label,
            functools.partial(one_file, ops=args.ops, record=record, preallocate=preallocate),
            args.dir,
        )
    for parallel in (False, True, False, True):
        with tempfile.TemporaryDirectory(dir=args.dir) as where:
            rounds, rate = many_files(Path(where), args.ops, record, args.files, parallel)
        how = "at once, a thread each" if parallel else "one after another"
        print(
            f"{args.files} files, one record each, synced {how:23}"
            f" p50 {statistics.median(rounds):7.0f} us   p99 {pct(sorted(rounds), 99):7.0f} us"
            f"   {rate:,.0f} rounds/s"
        )


if __name__ == "__main__":
    main()
