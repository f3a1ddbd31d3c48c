"""A node process: hosts this node's replica of every bucket placed on it, and the
gRPC API. Started by `sevendb cluster up`; `python -m sevendb.cluster.node`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path

import grpc

from sevendb.cluster.replica import BucketReplica, RaftTuning
from sevendb.cluster.service import NodeService
from sevendb.cluster.topology import ClusterSpec, ConfigError
from sevendb.proto import sevendb_pb2_grpc as pb_grpc

log = logging.getLogger("sevendb.node")

GRPC_WORKERS = 32
GRPC_MESSAGE_BYTES_MAX = 4 * 1024 * 1024
"""Larger requests are refused by gRPC itself (RESOURCE_EXHAUSTED), before parsing."""


def node_dir(data_dir: Path, node_id: str) -> Path:
    return data_dir / "nodes" / node_id


TUNING_ENV_PREFIX = "SEVENDB_RAFT_"


def tuning_from_env(environ: Mapping[str, str]) -> RaftTuning:
    """RaftTuning with overrides from SEVENDB_RAFT_<FIELD> (e.g. SEVENDB_RAFT_HEARTBEAT_S)."""
    fields = {f.name: f for f in dataclasses.fields(RaftTuning)}
    overrides: dict[str, object] = {}
    for name, raw in environ.items():
        if not name.startswith(TUNING_ENV_PREFIX):
            continue
        field = name[len(TUNING_ENV_PREFIX) :].lower()
        if field not in fields:
            raise ConfigError(
                f"{name}: unknown Raft setting; known: "
                + ", ".join(TUNING_ENV_PREFIX + f.upper() for f in fields)
            )
        kind = int if fields[field].type in (int, "int") else float
        try:
            overrides[field] = kind(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: expected {kind.__name__}") from None
    try:
        return RaftTuning(**overrides)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"Raft settings from the environment: {exc}") from None


def serve(data_dir: Path, node_id: str, stop: threading.Event) -> int:
    spec = ClusterSpec.load(data_dir)
    tuning = tuning_from_env(os.environ)
    node = spec.node(node_id)
    home = node_dir(data_dir, node_id)
    home.mkdir(parents=True, exist_ok=True)
    replicas: dict[int, BucketReplica] = {}
    for bucket in spec.buckets:
        if node_id not in bucket.nodes:
            continue
        me = node.raft_address(bucket.bucket)
        partners = [a for a in spec.replica_addresses(bucket.bucket) if a != me]
        replicas[bucket.bucket] = BucketReplica(
            bucket=bucket.bucket,
            bucket_uuid=bucket.bucket_uuid,
            self_addr=me,
            partners=partners,
            data_dir=home / f"bucket-{bucket.bucket}",
            password=spec.password,
            tuning=tuning,
        )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=GRPC_WORKERS, thread_name_prefix="grpc"),
        options=[
            ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
            ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
            ("grpc.so_reuseport", 0),
        ],
    )
    service = NodeService(spec, node_id, replicas)
    pb_grpc.add_SevenDBServicer_to_server(service, server)
    if server.add_insecure_port(node.grpc_address) == 0:
        log.critical("cannot bind gRPC on %s", node.grpc_address)
        return 1
    server.start()
    log.info(
        "node %s serving gRPC on %s with %d replicas", node_id, node.grpc_address, len(replicas)
    )
    stop.wait()
    log.info("node %s stopping", node_id)
    server.stop(grace=2).wait()
    service.close()
    for replica in replicas.values():
        replica.close()
    log.info("node %s stopped", node_id)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sevendb-node", description=__doc__)
    parser.add_argument("--data", type=Path, required=True, help="cluster data dir")
    parser.add_argument("--node-id", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        return serve(args.data.resolve(), args.node_id, stop)
    except ConfigError as exc:
        log.critical("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
