"""The client host's side of the network-namespace tests (tests/test_netns.py): run
inside the client namespace, it talks to the cluster with nothing but a client bundle.

    python netns_client.py load CLIENT_TOML OUT PREFIX SECONDS   # acked keys, one per line
    python netns_client.py tail CLIENT_TOML OUT CURSOR QUERY     # events, one JSON line each

`load` writes PREFIX<i> keys as fast as one writer can for SECONDS (retrying with
the same producer sequence after an unknown outcome, so nothing applies twice) and
appends each acknowledged key to OUT. `tail` subscribes with a cursor file and
appends every event's changes to OUT until SIGTERM (or the file STOP next to OUT).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from sevendb.cluster.common.bundle import ClientConfig
from sevendb.cluster.ops.admin import client_tls
from sevendb.sdk import Client, SevenDBError


def load(config: ClientConfig, out: Path, prefix: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    with (
        Client(list(config.endpoints), token=config.token, tls=client_tls(config)) as client,
        out.open("a") as acked,
    ):
        producer = client.producer()
        i = 0
        while time.monotonic() < deadline:
            key = f"{prefix}{i:06d}"
            try:
                producer.put(key, b"v")
            except SevenDBError as exc:
                print(f"write {key}: {exc}", file=sys.stderr, flush=True)
                time.sleep(0.1)
                continue  # the same key again: the producer retries idempotently
            acked.write(key + "\n")
            acked.flush()
            i += 1


def tail(config: ClientConfig, out: Path, cursor: Path, query: str) -> None:
    stop = out.with_name("STOP")
    stopping = False

    def end(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, end)
    with (
        Client(list(config.endpoints), token=config.token, tls=client_tls(config)) as client,
        out.open("a") as seen,
    ):
        sub = client.subscribe(query, cursor=cursor)
        print("subscribed", flush=True)
        while not stopping and not stop.exists():
            event = sub.poll(0.5)
            if event is None:
                continue
            for change in event.changes:
                line = {"seq": event.emit_seq.pack(), "key": change.key, "bucket": event.bucket}
                seen.write(json.dumps(line) + "\n")
            seen.flush()
        sub.close()


def main(argv: list[str]) -> int:
    command, config = argv[0], ClientConfig.load(Path(argv[1]))
    if command == "load":
        load(config, Path(argv[2]), argv[3], float(argv[4]))
    elif command == "tail":
        tail(config, Path(argv[2]), Path(argv[3]), argv[4])
    else:
        raise SystemExit(f"unknown command {command!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
