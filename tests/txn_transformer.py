"""The consume-transform-produce process of tests/test_txn_eos.py (and the example of
docs/transactions.md): reads `in/` keys through a durable subscription, writes each
change's transform under `out/` and acknowledges the input in one transaction, so
each input is reflected in the output exactly once however often it is killed.

    python tests/txn_transformer.py DATA_DIR [JITTER_S]

JITTER_S (default 0): sleep up to this long, at random, between the steps of each
transaction, so that a kill lands inside one.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from sevendb.cluster.ops.local import local_spec, local_tls, local_token
from sevendb.sdk import AckMode, Client, SubscribeOptions, SubscriptionBroken


def transform(value: bytes) -> bytes:
    return b"T(" + value + b")"


def run(data: Path, jitter_s: float) -> None:
    spec = local_spec(data)
    endpoints = [n.grpc_address for n in spec.nodes]
    with Client(endpoints, token=local_token(data, "default"), tls=local_tls(data)) as client:
        options = SubscribeOptions(ack=AckMode.EXPLICIT)
        client.init_transactions("xform-app")  # aborts a killed predecessor's transaction
        while True:
            try:
                sub = client.subscribe("prefix:in/", durable="xform", options=options)
                break
            except SubscriptionBroken:  # the killed instance's stream is still attached
                time.sleep(0.2)
        print("subscribed", flush=True)
        for event in sub:
            with client.transaction("xform-app") as txn:
                for change in event.changes:
                    txn.put("out/" + change.key, transform(change.value))
                    time.sleep(random.uniform(0, jitter_s))
                txn.ack(event)  # the input's ack commits with the output
                time.sleep(random.uniform(0, jitter_s))
            sub.ack(event)  # processed: only after the commit


if __name__ == "__main__":
    run(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
