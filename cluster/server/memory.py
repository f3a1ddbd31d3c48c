"""Memory dumps: what a live node's heap holds, and what grew since the last look.

    kill -USR2 <node pid>          # writes <data_dir>/memory/<UTC time>.txt

A dump gives the process's RSS, the blocks the Python allocator holds
(`sys.getallocatedblocks`), glibc malloc's bytes in use and free but kept (gRPC,
protobuf, OpenSSL and Python's objects over 512 bytes live there), pyarrow's
allocated bytes (part of malloc's when its pool is the system's), the live
objects the collector tracks by type and how each count changed since the previous
dump; and, when the node traces allocations
(``[node] tracemalloc_frames`` > 0, `tracemalloc` started before the node is
built), the traced total, the allocation sites holding the most memory, and the
sites that grew most since the previous dump with their tracebacks. RSS that climbs
while the traced bytes and the object counts stay flat is the allocator (or native
code, gRPC's C core), not Python objects kept alive. ``[node] memory_dump_s`` writes
one every so many seconds as well. docs/operations.md, "Memory".
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import gc
import logging
import re
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Final, cast

__all__ = ["MemoryDumps", "rss_bytes"]

log = logging.getLogger("sevendb.memory")

TOP: Final = 30
"""Rows per table in a dump."""
SHAPE_ITEMS: Final = 4
HOLDER_SAMPLES: Final = 3
HOLDER_DEPTH: Final = 6
MAPPINGS: Final = 8
_MAPPING: Final = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")
_IGNORED: Final = (
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    tracemalloc.Filter(False, "<unknown>"),
)


def rss_bytes() -> int:
    """The process's resident set (Linux ``/proc``; 0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return cast(Callable[[], _MallInfo2], function)


_MALLINFO2: Final = _mallinfo2()


def malloc_lines() -> list[str]:
    """glibc's malloc totals over every arena (`mallinfo2`): bytes in use (Python's
    large objects, gRPC, protobuf, OpenSSL), bytes free but kept, bytes mmapped.
    Nothing where the C library is not glibc."""
    if _MALLINFO2 is None:
        return []
    info = _MALLINFO2()
    return [
        f"malloc_in_use_bytes {info.uordblks + info.hblkhd}",
        f"malloc_free_kept_bytes {info.fordblks}",
        f"malloc_mmapped_bytes {info.hblkhd}",
    ]


def arrow_lines() -> list[str]:
    """pyarrow's default pool: the bytes it has allocated (from malloc on a node, whose
    archive writer sets the pool to the C library's; docs/operations.md), and the
    pool's name. Nothing if pyarrow was not imported."""
    arrow = sys.modules.get("pyarrow")
    if arrow is None:
        return []
    pool = arrow.default_memory_pool()
    return [f"arrow_allocated_bytes {pool.bytes_allocated()}", f"arrow_pool {pool.backend_name}"]


def mapping_lines(top: int = MAPPINGS) -> list[str]:
    """The process's anonymous mappings holding the most resident memory (Linux
    ``/proc``): glibc's heap and arenas, Python's 1 MiB arenas, and allocators of
    their own (pyarrow's mimalloc reserves 1 GiB at once)."""
    rows: list[tuple[int, int, str]] = []
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return []
    current: list[int | str] | None = None
    for line in text.splitlines():
        head = _MAPPING.match(line)
        if head is not None:
            name = head.group(3).strip()
            size = int(head.group(2), 16) - int(head.group(1), 16)
            current = None if name.startswith("/") else [size, name or "[anon]"]
        elif current is not None and line.startswith("Rss:"):
            rows.append((int(line.split()[1]) * 1024, int(current[0]), str(current[1])))
            current = None
    rows.sort(reverse=True)
    return [f"{rss:>12}  of {size:>12}  {name}" for rss, size, name in rows[:top]]


def _type_name(obj: object) -> str:
    kind = type(obj)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def object_counts() -> collections.Counter[str]:
    """Live objects the collector tracks, by type (not those `gc.freeze` moved to the
    permanent generation: what start-up built)."""
    return collections.Counter(_type_name(o) for o in gc.get_objects())


def _shape(obj: object) -> str:
    """A type, with a container's length and the types of its first items."""
    name = _type_name(obj)
    if isinstance(obj, tuple | list):
        items = ", ".join(_type_name(item) for item in obj[:SHAPE_ITEMS])
        return f"{name}[{len(obj)}]({items}{', ...' if len(obj) > SHAPE_ITEMS else ''})"
    if isinstance(obj, dict):
        keys = ", ".join(repr(k)[:40] for k in list(obj)[:SHAPE_ITEMS])
        return f"{name}[{len(obj)}]({keys}{', ...' if len(obj) > SHAPE_ITEMS else ''})"
    return name


def _holder(obj: object, skip: set[int]) -> str:
    """What refers to `obj` (skipping the dump's own lists): a container's shape, and
    for a dict its owner's type (an instance's attributes)."""
    held = []
    for referrer in gc.get_referrers(obj):
        if id(referrer) in skip or _is_frame(referrer):
            continue
        text = _shape(referrer)
        if isinstance(referrer, dict):
            owners = [_type_name(o) for o in gc.get_referrers(referrer) if id(o) not in skip]
            text += f" of {', '.join(owners[:3]) or '?'}"
        held.append(text)
    return "; ".join(held[:SHAPE_ITEMS]) or "(nothing the collector tracks)"


def shape_lines(objects: list[object], type_name: str, top: int) -> list[str]:
    """The objects of `type_name` by shape, and what holds a few of the commonest."""
    mine = [o for o in objects if _type_name(o) == type_name]
    shapes = collections.Counter(_shape(o) for o in mine)
    lines = [f"# {type_name}, the type that grew most, by shape"]
    lines += [f"{n:>10}  {shape}" for shape, n in shapes.most_common(top)]
    if not shapes:
        return lines
    commonest = shapes.most_common(1)[0][0]
    samples = [o for o in mine if _shape(o) == commonest][-HOLDER_SAMPLES:]
    skip = {id(objects), id(mine), id(samples)}
    lines += ["", f"# what holds the newest {len(samples)} of {commonest}"]
    lines += [f"  {_holder(o, skip)}" for o in samples]
    lines += ["", "# and what holds that, up the chain from the newest"]
    obj: object = samples[-1]
    for _ in range(HOLDER_DEPTH):
        referrers = gc.get_referrers(obj)
        skip.add(id(referrers))
        up = next((r for r in referrers if id(r) not in skip and not _is_frame(r)), None)
        if up is None:
            break
        obj = up
        lines.append(f"  <- {_shape(obj)}")
    return lines


def _is_frame(obj: object) -> bool:
    return type(obj).__name__ == "frame"


class MemoryDumps:
    """Writes dumps into `directory`, each compared with the one before.

    `frames` > 0 starts `tracemalloc` with that many frames per allocation (call it
    before building what should be traced; tracing costs CPU and memory on every
    allocation: a diagnostic, not a default).
    """

    def __init__(self, directory: Path, frames: int = 0, top: int = TOP) -> None:
        self.directory = directory
        self.top = top
        if frames > 0 and not tracemalloc.is_tracing():
            tracemalloc.start(frames)
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] | None = None
        self._previous = directory / "previous.tracemalloc"
        """The last dump's snapshot, kept on disk: held in memory, its traces (tuples)
        would count among the live objects of the next dump."""
        self._previous.unlink(missing_ok=True)
        self._written = 0

    def dump(self) -> Path:
        """Write one dump; returns its path. Safe to call from any thread."""
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._written += 1
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            path = self.directory / f"{stamp}-{self._written:04d}.txt"
            path.write_text("\n".join(self._lines()) + "\n", encoding="utf-8")
        log.info("memory dump written to %s", path)
        return path

    def _lines(self) -> list[str]:
        lines = [
            f"rss_bytes {rss_bytes()}",
            f"allocated_blocks {sys.getallocatedblocks()}",
            *malloc_lines(),
            *arrow_lines(),
        ]
        lines += ["", "# anonymous mappings by resident bytes (resident, size)", *mapping_lines()]
        unreachable = gc.collect()  # what is left is alive, not garbage awaiting a collection
        objects = gc.get_objects()
        counts = collections.Counter(_type_name(o) for o in objects)
        lines += [
            f"gc_collected {unreachable}",
            f"gc_objects {sum(counts.values())}",
            "",
            "# objects by type, after a full collection",
        ]
        lines += [f"{n:>10}  {name}" for name, n in counts.most_common(self.top)]
        if self._counts is not None:
            grown = counts.copy()
            grown.subtract(self._counts)
            lines += ["", "# objects by type, change since the previous dump"]
            changes = sorted(grown.items(), key=lambda kv: -abs(kv[1]))[: self.top]
            lines += [f"{n:>+10}  {name}" for name, n in changes if n]
            if changes and changes[0][1] > 0:
                lines += ["", *shape_lines(objects, max(changes, key=lambda kv: kv[1])[0], 10)]
        del objects
        self._counts = counts
        if tracemalloc.is_tracing():
            lines += self._traced_lines()
        return lines

    def _traced_lines(self) -> list[str]:
        current, peak = tracemalloc.get_traced_memory()
        snapshot = tracemalloc.take_snapshot().filter_traces(_IGNORED)
        lines = ["", f"traced_bytes {current} (peak {peak})", "", "# allocation sites by size"]
        for stat in snapshot.statistics("lineno")[: self.top]:
            lines.append(f"{stat.size:>12}  {stat.count:>9}  {stat.traceback[0]}")
        if self._previous.exists():
            previous = tracemalloc.Snapshot.load(str(self._previous))
            lines += ["", "# allocation sites, growth since the previous dump (bytes, blocks)"]
            diffs = snapshot.compare_to(previous, "traceback")[: self.top]
            del previous
            for diff in diffs:
                lines.append(f"{diff.size_diff:>+12}  {diff.count_diff:>+9}  {diff.size:>12}")
                # file:line only: reading the source lines would fill linecache, here
                lines += [f"      {frame}" for frame in reversed(diff.traceback)]
        snapshot.dump(str(self._previous))
        return lines
