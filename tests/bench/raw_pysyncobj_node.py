"""One process of the raw-pysyncobj baseline: bare replicated counters.

Default journal (in memory, nothing fsynced). `--conf` takes pysyncobj settings as
JSON (`bench_writes.py` passes the send tuning sevendb uses, so that the comparison
isolates durability and sevendb's layers). The process runs stock pysyncobj unless
`--sevendb-transport` is given: importing `sevendb.cluster.raft.replica` applies its
import-time patches, which change what every message costs (a newer pickle
protocol, frames no longer deflated). Before stop 25 the tuned runs got them
unasked, from importing `RaftTuning`.
Every process also reports the CPU it used while the writes ran (`cpu_s`: all its
threads, the ticks included), driving or not.
With several groups (one counter each, as sevendb has one Raft group per bucket)
the in-flight writes are split evenly between them. Each process drives the
groups it leads with a closed loop of its own and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable

from pysyncobj import SyncObj, SyncObjConf, replicated


class Counter(SyncObj):  # type: ignore[misc]
    def __init__(self, me: str, partners: list[str], conf: SyncObjConf) -> None:
        self.applied: Callable[[bytes], None] | None = None
        """Called with each payload as it is applied (`composed_node.py`'s watchers).
        Set before pysyncobj's constructor, which leaves what exists by then out of
        the replicated state."""
        super().__init__(me, partners, conf)
        self.value = 0

    @replicated  # type: ignore[untyped-decorator]
    def incr(self, payload: bytes) -> int:
        self.value += 1
        if self.applied is not None:
            self.applied(payload)
        return self.value


def drive(obj: Counter, inflight: int, seconds: float) -> tuple[int, float, list[float]]:
    """(errors, elapsed s, latencies ms) of a closed loop of `inflight` increments."""
    latencies: list[float] = []
    sem = threading.Semaphore(inflight)
    lock = threading.Lock()
    payload = b"x" * 100
    end = time.monotonic() + seconds
    errors = 0

    def done(start: float) -> object:
        def cb(result: object, error: int) -> None:
            nonlocal errors
            with lock:
                if error == 0:
                    latencies.append(1000 * (time.monotonic() - start))
                else:
                    errors += 1
            sem.release()

        return cb

    t0 = time.monotonic()
    while time.monotonic() < end:
        sem.acquire()
        obj.incr(payload, callback=done(time.monotonic()))
    for _ in range(inflight):
        sem.acquire()
    return errors, time.monotonic() - t0, latencies


def drive_all(groups: list[Counter], inflight: int, seconds: float) -> dict[str, object]:
    """Drive the groups this process leads, each from a thread of its own."""
    results: list[tuple[int, float, list[float]]] = []
    threads = []
    for i, group in enumerate(groups):
        # Group i's share of the in-flight writes (with 1 in flight, only group 0 runs).
        share = inflight // len(groups) + (i < inflight % len(groups))
        if group._isLeader() and share:
            threads.append(
                threading.Thread(
                    target=lambda g=group, n=share: results.append(drive(g, n, seconds))
                )
            )
    cpu0 = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not threads:
        time.sleep(seconds)  # replicating the others' writes, for the CPU figure
    latencies = [x for r in results for x in r[2]]
    return {
        "cpu_s": time.process_time() - cpu0,
        "groups_driven": len(threads),
        "ops": len(latencies),
        "ops_per_s": sum(len(r[2]) / r[1] for r in results),
        "errors": sum(r[0] for r in results),
        "latencies_ms": [round(x, 3) for x in latencies],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--me", required=True, help="this process's address in each group, comma-separated"
    )
    p.add_argument(
        "--partners", required=True, help="per group (';'-separated): the other addresses"
    )
    p.add_argument("--inflight", type=int, default=1)
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--conf", default="{}", help="SyncObjConf settings as a JSON object")
    p.add_argument("--sevendb-transport", action="store_true")
    args = p.parse_args()
    if args.sevendb_transport:
        import sevendb.cluster.raft.replica  # noqa: F401 - for its import-time patches
    conf = SyncObjConf(**json.loads(args.conf))
    groups = [
        Counter(me, partners.split(","), conf)
        for me, partners in zip(args.me.split(","), args.partners.split(";"), strict=True)
    ]
    deadline = time.monotonic() + 30
    while any(g._getLeader() is None or not g.isReady() for g in groups):
        if time.monotonic() > deadline:
            print(json.dumps({"error": "no leader"}), flush=True)
            return 1
        time.sleep(0.05)
    print(json.dumps(drive_all(groups, args.inflight, args.seconds)), flush=True)
    sys.stdin.read()  # keep replicating until the parent closes our stdin
    return 0


if __name__ == "__main__":
    sys.exit(main())
