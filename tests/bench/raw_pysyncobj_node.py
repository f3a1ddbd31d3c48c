"""One process of the raw-pysyncobj baseline: a bare replicated counter.

Default journal (in memory, nothing fsynced); `--tuned` applies the same send
tuning sevendb uses, so the comparison isolates durability and sevendb's layers.
The process that becomes leader runs the closed-loop load itself and prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from pysyncobj import SyncObj, SyncObjConf, replicated


class Counter(SyncObj):  # type: ignore[misc]
    def __init__(self, me: str, partners: list[str], conf: SyncObjConf) -> None:
        super().__init__(me, partners, conf)
        self.value = 0

    @replicated  # type: ignore[untyped-decorator]
    def incr(self, payload: bytes) -> int:
        self.value += 1
        return self.value


def drive(obj: Counter, inflight: int, seconds: float) -> dict[str, float]:
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
                    latencies.append(time.monotonic() - start)
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
    elapsed = time.monotonic() - t0
    latencies.sort()
    n = len(latencies)
    return {
        "ops": n,
        "ops_per_s": n / elapsed,
        "errors": errors,
        "p50_ms": 1000 * latencies[n // 2] if n else 0.0,
        "p99_ms": 1000 * latencies[min(n - 1, int(n * 0.99))] if n else 0.0,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--me", required=True)
    p.add_argument("--partners", required=True)
    p.add_argument("--inflight", type=int, default=1)
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--tuned", action="store_true")
    args = p.parse_args()
    kw: dict[str, object] = {}
    if args.tuned:
        from sevendb.cluster.replica import RaftTuning

        # The same send/timing settings BucketReplica uses (not its journal, its
        # fsyncs or its group-commit draining).
        t = RaftTuning()
        kw = {
            "appendEntriesUseBatch": False,
            "appendEntriesPeriod": t.heartbeat_s,
            "autoTickPeriod": t.tick_s,
            "raftMinTimeout": t.election_min_s,
            "raftMaxTimeout": t.election_max_s,
            "connectionRetryTime": t.connection_retry_s,
        }
    conf = SyncObjConf(**kw)
    obj = Counter(args.me, args.partners.split(","), conf)
    deadline = time.monotonic() + 30
    while obj._getLeader() is None or not obj.isReady():
        if time.monotonic() > deadline:
            print(json.dumps({"error": "no leader"}), flush=True)
            return 1
        time.sleep(0.05)
    if obj._isLeader():
        print(json.dumps(drive(obj, args.inflight, args.seconds)), flush=True)
    else:
        print(json.dumps({"follower": True}), flush=True)
    sys.stdin.read()  # keep replicating until the parent closes our stdin
    return 0


if __name__ == "__main__":
    sys.exit(main())
