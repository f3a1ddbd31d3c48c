"""One subscriber process of bench_emission.py: N SDK subscriptions on one query,
every event processed (and so persisted-then-acked by the SDK), receive times kept.

Prints ``READY`` once every subscription's streams are up, then consumes until its
stdin closes; then closes the subscriptions (final acks) and prints one JSON line:
events per subscription, first/last receive time, and (bucket, commit index,
receive ns) of subscription 0's events for latency joins.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from sevendb.sdk import TLS, Client, SubscribeOptions, Subscription


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoints", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--query", required=True)
    p.add_argument("--subs", type=int, default=1)
    p.add_argument("--ca", help="the cluster's CA file (TLS)")
    p.add_argument("--insecure", action="store_true", help="plaintext")
    args = p.parse_args()
    tls = None if args.insecure else TLS.from_files(ca=args.ca)
    client = Client(args.endpoints.split(","), token=args.token, tls=tls)
    options = SubscribeOptions(ack_every_events=512, ack_interval_s=0.01)
    subs: list[Subscription] = [
        client.subscribe(args.query, name=f"bench-{i}", options=options) for i in range(args.subs)
    ]
    counts = [0] * len(subs)
    first_ns: list[int] = []
    last_ns = [0]
    trace: list[tuple[int, int, int]] = []
    stop = threading.Event()
    lock = threading.Lock()

    def consume(i: int, sub: Subscription) -> None:
        while not stop.is_set():
            event = sub.poll(0.05)
            if event is None:
                continue
            now = time.time_ns()
            counts[i] += len(event.changes)
            if i == 0:
                trace.append((event.bucket, event.emit_seq.commit_index, now))
            with lock:
                if not first_ns:
                    first_ns.append(now)
                last_ns[0] = max(last_ns[0], now)

    # A few consumer threads, each iterating a share of the subscriptions in turn.
    groups = [subs[i::4] for i in range(min(4, len(subs)))]

    def consume_group(g: int, group: list[Subscription]) -> None:
        if len(group) == 1:
            consume(g, group[0])
            return
        while not stop.is_set():
            idle = True
            for j, sub in enumerate(group):
                event = sub.poll(0)
                if event is None:
                    continue
                idle = False
                now = time.time_ns()
                index = g + 4 * j
                counts[index] += len(event.changes)
                if index == 0:
                    trace.append((event.bucket, event.emit_seq.commit_index, now))
                with lock:
                    if not first_ns:
                        first_ns.append(now)
                    last_ns[0] = max(last_ns[0], now)
            if idle:
                time.sleep(0.001)

    threads = [
        threading.Thread(target=consume_group, args=(g, group), daemon=True)
        for g, group in enumerate(groups)
    ]
    for t in threads:
        t.start()
    print("READY", flush=True)
    for command in sys.stdin:  # "count" -> events so far; EOF -> finish
        if command.strip() == "count":
            print(sum(counts), flush=True)
    stop.set()
    for t in threads:
        t.join(10)
    for sub in subs:
        sub.unsubscribe()  # leave nothing behind for the next phase
    client.close()
    print(
        json.dumps(
            {
                "counts": counts,
                "first_ns": first_ns[0] if first_ns else 0,
                "last_ns": last_ns[0],
                "trace": trace,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
