"""A node process: hosts this node's replica of every bucket placed on it, their
notifiers, its member of the metadata group (on a voter), the gRPC API and the
metrics endpoint. Runs in the foreground from its own configuration:
`sevendb node run --config node.toml` (`python -m sevendb.cluster.server.node
--config node.toml`; see `sevendb.cluster.server.config` and docs/deploy.md).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from sevendb.cluster.archive.writer import ArchiveWriter
from sevendb.cluster.common.acl import ACL_PREFIX, Acl
from sevendb.cluster.common.auth import NODE_PRINCIPAL, Keyring, auth_metadata
from sevendb.cluster.common.backup import read_image, read_manifest
from sevendb.cluster.common.bundle import ClusterSecrets, NodeTLS, load_node_tls
from sevendb.cluster.common.settings import flags_from_args, section_flags
from sevendb.cluster.common.topology import ClusterSpec, ConfigError
from sevendb.cluster.raft.replica import BucketReplica, RaftLoop
from sevendb.cluster.raft.snapshots import seed_replica
from sevendb.cluster.server.config import SECTIONS, NodeConfig, load_node_config
from sevendb.cluster.server.edge import now_ms
from sevendb.cluster.server.faults import KILL_BEFORE_SEND, FaultPoints
from sevendb.cluster.server.health import HealthServer, readiness
from sevendb.cluster.server.logs import configure_logging, early_logging
from sevendb.cluster.server.memory import MemoryDumps
from sevendb.cluster.server.meta import ClusterView, MetaFollower, MetaMember, MetaState
from sevendb.cluster.server.metrics import NodeMetrics
from sevendb.cluster.server.service import NodeService
from sevendb.notifier.host import BucketNotifier
from sevendb.outbox.model import Applied

log = logging.getLogger("sevendb.node")

GRPC_MESSAGE_BYTES_MAX = 4 * 1024 * 1024
"""Larger requests are refused by gRPC itself (RESOURCE_EXHAUSTED), before parsing."""
GC_THRESHOLDS = (20_000, 10, 10)
"""CPython's collection thresholds for a serving node (default 700, 10, 10). Every
open stream keeps ~100 tracked objects alive (10,000 subscriptions: ~1 million). With
the default young threshold the objects of events in flight were promoted fast
enough to force a full collection every ~3 s of load, each up to 0.5 s with every
thread of the node stopped (late heartbeats). With 20,000: one full collection in
the same run instead of 12, no pause over 70 ms, and more events per CPU-second
(docs/performance.md, stop 19)."""
STOP_GRACE_S = 2.0
"""How long calls still running when the node stops (after the drain) may finish."""
NODE_TOKEN_TTL_S = 600.0
"""The token a node sends other nodes (following the metadata) is minted per request."""
HEALTH_EVERY_S = 0.5
HEALTH_SERVICES = ("", "sevendb.v1.SevenDB")
"""What `grpc.health.v1` answers for: the server as a whole, and the API."""
JOIN_TIMEOUT_S = 60.0
"""How long a node that is not in the genesis waits to learn its place from the
metadata voters before giving up."""


class HandoverPacer:
    """When a node may hand a bucket's leadership to its preferred replica again.

    The first hand-over is due at once; each later one waits twice as long as the one
    before (from `base_s` up to `max_s`), and a hand-over that held for `max_s`
    resets the wait. Measured with 10,000 subscriptions on one bucket: the preferred
    replica lost leadership 2-4 s after each hand-over (its tick thread paused by
    snapshots while every stream reconnected to it) and was handed the bucket back 2 s
    later, about forty times, so the streams never settled (80-190 subscriptions set
    up per second, 0.6-0.9 cores burnt while idle, events lost to the run's
    deadline); with the bucket left where an election put it, 620 per second and
    0.06 cores.
    """

    def __init__(self, base_s: float, max_s: float) -> None:
        self._base_s = base_s
        self._max_s = max_s
        self._last: dict[int, tuple[float, float]] = {}
        """bucket -> (time of the last hand-over, the wait that followed it)."""

    def due(self, bucket: int, now: float) -> bool:
        last = self._last.get(bucket)
        return last is None or now >= last[0] + last[1]

    def handed_over(self, bucket: int, now: float) -> float:
        """Record a hand-over; returns the wait before the next one."""
        last = self._last.get(bucket)
        if last is None or now - last[0] >= last[1] + self._max_s:
            wait_s = self._base_s
        else:
            wait_s = min(self._max_s, max(self._base_s, 2 * last[1]))
        self._last[bucket] = (now, wait_s)
        return wait_s


class Node:
    """Everything one node process runs; `start_background()`, `serve()`, then
    `stop_replicas()`.

    Which replicas run here follows the cluster's metadata (`ClusterView`): at
    start, and at every newer version, replicas newly placed on this node start,
    replicas no longer placed here stop and their data is deleted (a migration
    removes a member from its Raft group before it edits the placement), and
    migration hold points are applied. The replica and notifier maps are replaced,
    never mutated, so readers on other threads see one or the other.
    """

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        settings = config.node
        self.node_id = settings.id
        self.home = settings.data_dir
        self.home.mkdir(parents=True, exist_ok=True)
        self.secrets = ClusterSecrets.load(settings.secrets)
        self.tls: NodeTLS | None = (
            None
            if settings.insecure
            else load_node_tls(settings.tls_ca, settings.tls_cert, settings.tls_key)
        )
        self.channel_credentials: grpc.ChannelCredentials | None = (
            None
            if self.tls is None
            else grpc.ssl_channel_credentials(self.tls.ca_pem, self.tls.key_pem, self.tls.cert_pem)
        )
        """How this node reaches others' client ports: TLS presenting its certificate."""
        self.view = ClusterView(ClusterSpec.load(settings.genesis), self.home)
        self._keyring = (self.view.state.version, self._keyring_of(self.view.state))
        self._acl = (self.view.state.version, self._acl_of(self.view.state))
        self.draining = False
        self._follower: MetaFollower | None = self._new_follower()
        if self.node_id not in self.view.spec.node_ids:  # joined after the genesis
            self._follower.fetch(lambda spec: self.node_id in spec.node_ids, JOIN_TIMEOUT_S)
        self.spec = self.view.spec
        self.me = self.spec.node(self.node_id)
        self.tuning = config.raft
        self._settings = config.notifier
        self._limits = config.server
        self._stopping = threading.Event()
        self._reload_lock = threading.Lock()
        self._faults = FaultPoints.from_env(self.home)
        self.replicas: dict[int, BucketReplica] = {}
        self.notifiers: dict[int, BucketNotifier] = {}
        self.raft_loop = RaftLoop()
        """Ticks every replica of this node (see `RaftLoop`)."""
        self._started = False
        root = config.archive.root or self.home / "archive"
        self.archive = ArchiveWriter(root, self.node_id, config.archive)
        self.metrics = NodeMetrics(self.node_id)
        self.metrics.watch(self.local_replicas, self.archive, self.tuning.stall_window_ms)
        self.http: HealthServer | None = None
        self.meta: MetaMember | None = None
        try:
            if self.me.meta_port:
                self._follower = None
                self.meta = MetaMember(
                    self.view,
                    self.node_id,
                    self.home,
                    self.secrets.raft_password,
                    self.tuning,
                    self.raft_loop,
                )
            self.reload()
        except BaseException:
            self.stop_replicas()
            raise
        self.view.listen(lambda _: self._reload_logged())
        self.service = NodeService(self, self.metrics, self._limits, self._faults)

    # ---- credentials ------------------------------------------------------------------

    @property
    def keyring(self) -> Keyring:
        """The token keys and revocations in force: the secrets file's keys and the
        metadata's ``auth/`` records, as of the view's version."""
        state = self.view.state
        version, keyring = self._keyring
        if version != state.version:
            keyring = self._keyring_of(state)
            self._keyring = (state.version, keyring)
        return keyring

    def _keyring_of(self, state: MetaState) -> Keyring:
        return self.secrets.keyring({k: v for k, (v, _) in state.records.items()})

    @property
    def acl(self) -> Acl:
        """The access-control grants in force: the genesis's and the metadata's
        ``acl/`` records, as of the view's version."""
        state = self.view.state
        version, acl = self._acl
        if version != state.version:
            acl = self._acl_of(state)
            self._acl = (state.version, acl)
        return acl

    def _acl_of(self, state: MetaState) -> Acl:
        records = {k: v for k, (v, _) in state.records.items() if k.startswith(ACL_PREFIX)}
        return Acl.build(self.view.genesis.full_access, records)

    def _node_metadata(self) -> tuple[tuple[str, str], ...]:
        """A fresh node token, for this node's own calls to other nodes."""
        token = self.keyring.mint(NODE_PRINCIPAL, now_ms=now_ms(), ttl_s=NODE_TOKEN_TTL_S)
        return auth_metadata(token)

    def _new_follower(self) -> MetaFollower:
        return MetaFollower(
            self.view, self._node_metadata, self.config.node.seeds, self.channel_credentials
        )

    def local_replicas(self) -> Iterator[tuple[str, BucketReplica]]:
        """Every replica this node runs now, by its ``bucket`` label in `/metrics`:
        the buckets' by number, the metadata group's member as ``meta``."""
        for bucket, replica in sorted(self.replicas.items()):
            yield str(bucket), replica
        if self.meta is not None:
            yield "meta", self.meta.replica

    def not_ready(self) -> list[str]:
        """Why this node is not ready for traffic (`/readyz`; empty: ready)."""
        return readiness(self.local_replicas, self.config.node.ready_lag_max)

    # ---- replicas follow the spec ------------------------------------------------------

    def reload(self) -> list[int]:
        """Converge the local replicas on the view's spec; returns the buckets hosted."""
        with self._reload_lock:
            spec = self.view.spec
            self.spec = spec
            self.me = spec.node(self.node_id)
            wanted = {b.bucket for b in spec.buckets if self.node_id in b.nodes}
            for bucket in sorted(set(self.replicas) - wanted):
                self._stop_replica(bucket, delete=True)
            for bucket in sorted(wanted - set(self.replicas)):
                self._start_replica(bucket)
            for bucket, replica in self.replicas.items():
                migration = spec.migration(bucket)
                replica.migration_hold_point = None if migration is None else migration.hold_point
            self._delete_stray_data(wanted)
            return sorted(self.replicas)

    def _seed(self, bucket: int, data_dir: Path) -> None:
        """A bucket that has no data here yet starts from its restore seed, if
        `[node] restore` has one (`sevendb backup restore`)."""
        seeds = self.config.node.restore
        if seeds is None or data_dir.exists():
            return
        image = read_manifest(seeds, complete=False).image(bucket)
        if image is None:
            return
        expected = self.spec.buckets[bucket].bucket_uuid
        if image.bucket_uuid != expected:
            raise ConfigError(
                f"{seeds}: bucket {bucket}'s seed is of bucket {image.bucket_uuid}, "
                f"not {expected}: seeds of another cluster"
            )
        core = read_image(seeds, image)
        seed_replica(
            data_dir, image.bucket_uuid, core, image.index, self.spec.replica_addresses(bucket)
        )
        log.info("bucket %d: starting from the restored backup (log index %d)", bucket, image.index)

    def _start_replica(self, bucket: int) -> None:
        spec = self.spec
        me = self.me.raft_address(bucket)
        self._seed(bucket, self.home / f"bucket-{bucket}")
        # The hook is in place before the replica replays its log: the archive must
        # see every purge (the notifier is attached once it exists).
        notifier_slot: list[BucketNotifier] = []
        replica = BucketReplica(
            bucket=bucket,
            bucket_uuid=spec.buckets[bucket].bucket_uuid,
            self_addr=me,
            partners=[a for a in spec.replica_addresses(bucket) if a != me],
            data_dir=self.home / f"bucket-{bucket}",
            password=self.secrets.raft_password,
            tuning=self.tuning,
            on_applied=self._on_applied_hook(bucket, notifier_slot),
            archived_through=functools.partial(self.archive.archived_through, bucket),
            publish_archive=self.archive.flush,
            loop=self.raft_loop,
        )
        faults = self._faults
        notifier = BucketNotifier(
            replica,
            self._settings,
            metrics=self.metrics,
            before_send=(lambda: faults.fire(KILL_BEFORE_SEND)) if faults.enabled else None,
        )
        notifier_slot.append(notifier)
        replica.after_applies = notifier.after_applies
        self.replicas = {**self.replicas, bucket: replica}
        self.notifiers = {**self.notifiers, bucket: notifier}
        if self._started:
            notifier.start()
        log.info("bucket %d: replica %s started", bucket, me)

    def _stop_replica(self, bucket: int, *, delete: bool) -> None:
        replica, notifier = self.replicas[bucket], self.notifiers[bucket]
        self.replicas = {b: r for b, r in self.replicas.items() if b != bucket}
        self.notifiers = {b: n for b, n in self.notifiers.items() if b != bucket}
        notifier.stop()
        replica.close()
        if delete:
            shutil.rmtree(self.home / f"bucket-{bucket}", ignore_errors=True)
        log.info(
            "bucket %d: replica %s stopped%s",
            bucket,
            replica.self_addr,
            " and its data deleted (no longer placed here)" if delete else "",
        )

    def _delete_stray_data(self, wanted: set[int]) -> None:
        """Data of a replica this node no longer hosts (it stopped before it could
        delete it: a crash right after a migration removed it)."""
        for path in self.home.glob("bucket-*"):
            suffix = path.name.removeprefix("bucket-")
            if suffix.isdigit() and int(suffix) not in wanted:
                log.warning("deleting %s: bucket %s is no longer placed on this node", path, suffix)
                shutil.rmtree(path, ignore_errors=True)

    def _reload_logged(self) -> None:
        try:
            self.reload()
        except Exception:
            log.exception(
                "converging on metadata version %d failed; the running replicas are unchanged",
                self.view.state.version,
            )

    def _on_applied_hook(
        self, bucket: int, notifier: list[BucketNotifier]
    ) -> Callable[[Applied], None]:
        metrics, archive = self.metrics, self.archive

        def hook(applied: Applied) -> None:
            metrics.applied(bucket)
            archive.on_applied(bucket, applied)
            if notifier:
                notifier[0].on_applied(applied)

        return hook

    def start_background(self) -> None:
        self._started = True
        for notifier in self.notifiers.values():
            notifier.start()
        if self.meta is None:
            self._follower = self._new_follower()
            self._follower.start()
        if self.tuning.leader_balance_s > 0:
            balancer = threading.Thread(target=self._balance_leaders, name="balance", daemon=True)
            balancer.start()
        if self.me.metrics_port:
            self.http = HealthServer(
                self.metrics, self.not_ready, self.config.node.listen_host, self.me.metrics_port
            )

    def _balance_leaders(self) -> None:
        """Hand each bucket this node leads to its preferred replica when that one is
        connected (pysyncobj refuses unless it holds the whole log; retried), paced by
        `HandoverPacer`. Not while the bucket migrates: the migration moves
        leadership itself."""
        tuning = self.tuning
        pacer = HandoverPacer(tuning.leader_balance_s, tuning.leader_balance_backoff_max_s)
        while not self._stopping.wait(tuning.leader_balance_s):
            spec = self.spec
            preferred = spec.preferred_leaders()
            for bucket, replica in self.replicas.items():
                if spec.migration(bucket) is not None:
                    continue
                target = spec.node(preferred[bucket]).raft_address(bucket)
                if target == replica.self_addr or not replica.is_leader:
                    continue
                now = time.monotonic()
                if target in replica.connectivity().connected and pacer.due(bucket, now):
                    wait_s = pacer.handed_over(bucket, now)
                    log.info(
                        "bucket %d: handing leadership to %s (the next hand-over of this "
                        "bucket from here waits %.0f s)",
                        bucket,
                        target,
                        wait_s,
                    )
                    replica.transfer_leadership(target)

    def stop_replicas(self) -> None:
        self._stopping.set()
        with self._reload_lock:
            for bucket in sorted(self.replicas):
                self._stop_replica(bucket, delete=False)
        if self._follower is not None:
            self._follower.stop()
        if self.meta is not None:
            self.meta.close()
        self.raft_loop.close()
        self.archive.close()  # publishes what is buffered
        if self.http is not None:
            self.http.close()

    # ---- health and drain ------------------------------------------------------------

    def serving(self) -> bool:
        """What `grpc.health.v1` says: SERVING once every local replica knows a leader
        and serves (not quarantined, repairing or lost), and not while draining."""
        if self.draining:
            return False
        return all(r.leader and not r.quarantined for r in self.replicas.values())

    async def _report_health(self, health: health_aio.HealthServicer) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while True:
            status = serving if self.serving() else not_serving
            for service in HEALTH_SERVICES:
                await health.set(service, status)
            await asyncio.sleep(HEALTH_EVERY_S)

    def _all_replicas(self) -> list[tuple[int, BucketReplica]]:
        """Every replica of this node, by bucket (the metadata group's as bucket -1)."""
        replicas = list(self.replicas.items())
        if self.meta is not None:
            replicas.append((self.meta.replica.bucket, self.meta.replica))
        return replicas

    def _led_here(self) -> list[tuple[int, BucketReplica]]:
        """The replicas of this node that lead their group or whose bucket's notifier
        lease names them (the metadata group's as bucket -1)."""
        found = []
        for bucket, replica in self._all_replicas():
            notifier = self.notifiers.get(bucket)
            holds = notifier is not None and notifier.holder() == replica.self_addr
            if replica.is_leader or holds:
                found.append((bucket, replica))
        return found

    def drain(self, timeout_s: float) -> bool:
        """Hand every leadership and notifier lease of this node to another replica
        (the lease follows leadership), for up to `timeout_s`: the node can then exit
        without its buckets waiting out an election. Whether everything moved."""
        deadline = time.monotonic() + timeout_s
        asked: dict[int, float] = {}
        while True:
            left = self._led_here()
            if not left:
                log.info("drain: this node leads no bucket and holds no lease")
                return True
            now = time.monotonic()
            if now > deadline:
                log.warning(
                    "drain: after %.1f s this node still leads or holds the lease of "
                    "buckets %s; exiting anyway",
                    timeout_s,
                    [b for b, _ in left],
                )
                return False
            if not any(r.connectivity().connected for _, r in left):
                log.warning(
                    "drain: no other replica of buckets %s is reachable; exiting",
                    [b for b, _ in left],
                )
                return False
            for bucket, replica in left:
                if not replica.is_leader or now < asked.get(bucket, 0.0):
                    continue  # a lease still moving, or a transfer asked a moment ago
                targets = replica.connectivity().connected
                if not targets:
                    continue
                target = targets[int(now) % len(targets)]
                log.info("drain: bucket %d: handing leadership to %s", bucket, target)
                replica.transfer_leadership(target, timeout_s=1.0)
                asked[bucket] = now + 1.0
            time.sleep(0.05)

    async def serve(self, stop: StopRequest) -> int:
        server = aio.server(
            options=[
                ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
                ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", 100_000),
                *self.config.server.grpc_options(),
            ]
        )
        self.service.serve_on(server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        for service in HEALTH_SERVICES:
            await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        listen = f"{self.config.node.listen_host}:{self.me.grpc_port}"
        if self._bind(server, listen) == 0:
            log.critical("cannot bind gRPC on %s", listen)
            return 1
        await server.start()
        self.start_background()
        # What start-up built (modules, gRPC, the replicas' restored state) lives as
        # long as the process: keep it out of every later full collection, which
        # the tick threads pay for (CPython's gc.freeze; a leaked cycle among these
        # objects is never freed, which they do not make).
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        reporter = asyncio.create_task(self._report_health(health))
        log.info(
            "node %s serving gRPC on %s (%s), metrics on %s, with %d replicas",
            self.node_id,
            self.me.grpc_address,
            self._transport(),
            f"http://{self.me.host}:{self.me.metrics_port}/metrics"
            if self.me.metrics_port
            else "(off)",
            len(self.replicas),
        )
        await asyncio.get_running_loop().run_in_executor(None, stop.event.wait)
        self.draining = True  # new writes and streams are refused, with another node's address
        reporter.cancel()
        await health.enter_graceful_shutdown()
        if stop.drain:
            drain_s = self.config.node.drain_s
            log.info("node %s stopping: draining (for up to %.1f s)", self.node_id, drain_s)
            started = time.monotonic()
            moved = await asyncio.get_running_loop().run_in_executor(None, self.drain, drain_s)
            log.info(
                "node %s drained in %.2f s (%s); closing the client port",
                self.node_id,
                time.monotonic() - started,
                "every leadership and lease handed over" if moved else "not everything moved",
            )
            for _, replica in self._all_replicas():
                replica.retire()  # no leadership comes back while the port closes
        else:
            log.info("node %s stopping without a drain (SIGINT)", self.node_id)
        await server.stop(STOP_GRACE_S)
        await self.service.close()
        return 0

    def _bind(self, server: aio.Server, listen: str) -> int:
        settings, tls = self.config.node, self.tls
        if tls is None:
            return server.add_insecure_port(listen)
        credentials = grpc.ssl_server_credentials(
            [(tls.key_pem, tls.cert_pem)],
            root_certificates=tls.ca_pem if settings.client_certs else None,
            require_client_auth=settings.client_certs,
        )
        return server.add_secure_port(listen, credentials)

    def _transport(self) -> str:
        if self.tls is None:
            return "PLAINTEXT: insecure = true"
        if self.config.node.client_certs:
            return "TLS, client certificates required"
        return "TLS"


class StopRequest:
    """How the process was asked to stop: SIGTERM drains first (`Node.drain`), SIGINT
    (Ctrl-C; `sevendb cluster down`, which stops every node at once) does not."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.drain = False

    def on_signal(self, signum: int, _frame: object = None) -> None:
        self.drain = self.drain or signum == signal.SIGTERM
        self.event.set()


def memory_dumps(config: NodeConfig, stop: threading.Event) -> MemoryDumps:
    """Dumps on SIGUSR2 (in a thread of their own: a traced snapshot takes seconds),
    and every ``memory_dump_s`` until `stop` is set (`sevendb.cluster.server.memory`)."""
    settings = config.node
    dumps = MemoryDumps(settings.data_dir / "memory", settings.tracemalloc_frames)

    def dump_in_thread(_signum: int = 0, _frame: object = None) -> None:
        threading.Thread(target=dumps.dump, name="memory-dump", daemon=True).start()

    signal.signal(signal.SIGUSR2, dump_in_thread)
    if settings.memory_dump_s > 0:

        def every() -> None:
            while not stop.wait(settings.memory_dump_s):
                dumps.dump()

        threading.Thread(target=every, name="memory-dump", daemon=True).start()
    return dumps


def serve(config: NodeConfig, stop: StopRequest) -> int:
    memory_dumps(config, stop.event)  # first: tracing must see what the node builds
    node = Node(config)
    try:
        return asyncio.run(node.serve(stop))
    finally:
        node.stop_replicas()
        log.info("node %s stopped", node.node_id)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sevendb node run",
        description="Run a sevendb node in the foreground from its configuration. Every "
        "setting is a TOML key, a SEVENDB_<SECTION>_<KEY> variable or a flag; a flag "
        "beats a variable, which beats the file, which beats the default.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=os.environ.get("SEVENDB_CONFIG"),
        help="the node's TOML file (default $SEVENDB_CONFIG)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print every effective setting and where it came from, then exit",
    )
    for flag, text in section_flags(SECTIONS):
        parser.add_argument(flag, help=text, metavar="VALUE")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    early_logging()
    try:
        config = load_node_config(args.config, os.environ, flags_from_args(SECTIONS, vars(args)))
        if args.print_config:
            print(config.settings.explain(), end="")
            return 0
        configure_logging(config.log, config.node.id)
        stop = StopRequest()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop.on_signal)
        return serve(config, stop)
    except ConfigError as exc:
        log.critical("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
