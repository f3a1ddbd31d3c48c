"""Delay a network namespace's outgoing packets: `tc netem` for kernels without it.

This machine's kernel has no netem qdisc, so a `NetLab` host's delay is made here:
iptables sends the host's outgoing packets to an NFQUEUE, and this process, running
inside the host's namespace, lets each one go `delay_ms` (plus up to `jitter_ms`)
after it arrived. Loss needs no helper (iptables' `statistic` match).

    python tests/netdelay.py QUEUE DELAY_MS [JITTER_MS]
"""

from __future__ import annotations

import heapq
import itertools
import random
import select
import signal
import sys
import time
from typing import Any

from netfilterqueue import COPY_META, NetfilterQueue


def main(argv: list[str]) -> int:
    queue, delay_ms = int(argv[0]), float(argv[1])
    jitter_ms = float(argv[2]) if len(argv) > 2 else 0.0
    due: list[tuple[float, int, Any]] = []
    order = itertools.count()
    rng = random.Random(queue)

    def arrived(packet: Any) -> None:
        wait_s = (delay_ms + rng.uniform(0, jitter_ms)) / 1000
        heapq.heappush(due, (time.monotonic() + wait_s, next(order), packet))

    nfq = NetfilterQueue()
    nfq.bind(queue, arrived, max_len=65536, mode=COPY_META)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fd = nfq.get_fd()
    print("ready", flush=True)
    try:
        while True:
            timeout = max(0.0, due[0][0] - time.monotonic()) if due else None
            readable, _, _ = select.select([fd], [], [], timeout)
            if readable:
                nfq.run(block=False)
            now = time.monotonic()
            while due and due[0][0] <= now:
                heapq.heappop(due)[2].accept()
    finally:
        nfq.unbind()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
