"""Benchmark: how long a COMMIT whose caller goes away mid-call takes to be visible.

    .venv/bin/python tests/bench/bench_txn_cancel.py [--trials 40]

A local cluster (3 nodes, 2 buckets, fsync on, TLS) on this host. Each trial writes
one key in a transaction of its own transactional id, sends the COMMIT as a raw
`Txn` call, cancels the call 0-9 ms later (as a client killed inside its commit
does), then polls the key until it is visible. A COMMIT cancelled before the node
read it is never decided (counted apart). Prints the delays: a few milliseconds
when the node finishes the call whoever waits for it, the transaction driver's
period (DRIVER_PERIOD_S, 0.5 s) when the cancel stops the node between the decision
and the markers. Not a test: figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_writes import machine, pct
from cluster_harness import LocalCluster

from sevendb.cluster.common.auth import auth_metadata
from sevendb.proto import sevendb_pb2 as pb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=40, help="commits to cancel")
    args = parser.parse_args()
    cluster = LocalCluster.start(Path(tempfile.mkdtemp()) / "data", buckets=2)
    delays: list[float] = []
    undecided = 0
    try:
        cluster.wait_settled()
        with cluster.client() as client:
            stub = cluster.stub(cluster.spec.nodes[0].grpc_address)
            metadata = auth_metadata(cluster.token())
            for trial in range(args.trials):
                txn_id, key = f"cancel-{trial}", f"cancel/{trial}"
                txn = client.transaction(txn_id)
                txn.put(key, b"1")
                epoch = client._core._txn_sessions[txn_id].epoch
                commit = pb.TxnRequest(
                    action=pb.TxnRequest.COMMIT,
                    transactional_id=txn_id,
                    epoch=epoch,
                    number=txn.number,
                )
                call = stub.Txn.future(commit, metadata=metadata, timeout=10)
                time.sleep(0.001 * (trial % 10))
                call.cancel()
                cancelled = time.perf_counter()
                while client.get(key) is None:
                    if time.perf_counter() - cancelled > 3:
                        undecided += 1
                        break
                    time.sleep(0.002)
                else:
                    delays.append((time.perf_counter() - cancelled) * 1000)
    finally:
        cluster.stop()
    print(machine())
    print(f"{args.trials} commits cancelled by their caller; {undecided} never decided")
    if delays:
        delays.sort()
        slow = sum(1 for d in delays if d > 100)
        print(
            f"visible after p50 {pct(delays, 50):.0f} ms, p90 {pct(delays, 90):.0f} ms, "
            f"max {max(delays):.0f} ms; {slow} of {len(delays)} after more than 100 ms"
        )


if __name__ == "__main__":
    main()
