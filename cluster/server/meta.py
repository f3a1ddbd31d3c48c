"""How a node knows the cluster: its genesis, overlaid by the metadata Raft group.

* `ClusterView` - the node's current `ClusterSpec` and the metadata records it came
  from, at a version (the metadata group's applied index; 0 is the genesis alone).
  Every newer version is validated, written to a cache file in the node's data dir
  and handed to the listeners (the node converges its replicas on it). A node that
  restarts while the metadata group has no majority starts from its cache, so its
  buckets keep serving.
* `MetaMember` - on the 3 or 5 metadata voters: this node's replica of the metadata
  group (the same hardened replica and state machine as a bucket's; its keys are the
  records of `sevendb.cluster.common.meta`). Each apply refreshes the view.
* `MetaFollower` - on every other node: a thread that long-polls the voters'
  `MetaRead` for versions newer than the view's.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
import xxhash

from sevendb.cluster.common.files import fsync_dir, write_synced
from sevendb.cluster.common.meta import overlay
from sevendb.cluster.common.topology import ClusterSpec, ConfigError
from sevendb.cluster.raft.replica import BucketReplica, RaftLoop, RaftTuning
from sevendb.outbox.entries import (
    Entry,
    Expected,
    ExpectKind,
    Op,
    OpKind,
    OutboxPurge,
    Write,
    encode_entry,
)
from sevendb.outbox.model import Applied, WriteResult
from sevendb.outbox.replica import ReplicaUnavailable
from sevendb.outbox.state import BucketStateMachine
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc

__all__ = ["META_BUCKET", "ClusterView", "MetaMember", "MetaFollower", "MetaState"]

log = logging.getLogger("sevendb.meta")

META_BUCKET: Final = -1
"""The bucket number the metadata group's replica goes by (in logs and status)."""
CACHE_FILE: Final = "cluster-cache.json"
POLL_WAIT_MS: Final = 10_000
"""A follower's MetaRead waits this long for a newer version before asking again."""
RETRY_S: Final = 1.0


@dataclass(frozen=True)
class MetaState:
    version: int
    records: Mapping[str, tuple[bytes, int]]
    """key -> (value, the key's version in the metadata group)."""
    spec: ClusterSpec


def _checksum(body: Mapping[str, object]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh64_hexdigest(canonical)


def _records_json(records: Mapping[str, tuple[bytes, int]]) -> dict[str, list[object]]:
    return {k: [v.decode(), ver] for k, (v, ver) in sorted(records.items())}


class ClusterView:
    """See the module docstring. Thread-safe."""

    def __init__(self, genesis: ClusterSpec, data_dir: Path) -> None:
        self.genesis = genesis
        self._cache = data_dir / CACHE_FILE
        self._cond = threading.Condition()
        self._listeners: list[Callable[[MetaState], None]] = []
        self._state = MetaState(0, {}, genesis)
        cached = self._load_cache()
        if cached is not None:
            self._state = cached
        else:
            self._save_cache(self._state)  # the genesis: what this node knows so far

    @property
    def state(self) -> MetaState:
        return self._state

    @property
    def spec(self) -> ClusterSpec:
        return self._state.spec

    def listen(self, fn: Callable[[MetaState], None]) -> None:
        self._listeners.append(fn)

    def offer(self, version: int, records: Mapping[str, tuple[bytes, int]]) -> bool:
        """Take the metadata at `version` if it is newer than the view's; returns
        whether it was. Records that do not make a valid spec are refused (logged),
        and the view stays where it was."""
        with self._cond:
            if version <= self._state.version:
                return False
            try:
                spec = overlay(self.genesis, {k: v for k, (v, _) in records.items()})
            except (ConfigError, ValueError, KeyError) as exc:
                log.error("metadata version %d refused: %s", version, exc)
                return False
            state = MetaState(version, dict(records), spec)
            self._save_cache(state)
            self._state = state
            self._cond.notify_all()
        for fn in self._listeners:
            try:
                fn(state)
            except Exception:
                log.exception("a listener of metadata version %d failed", version)
        return True

    def wait_newer(self, version: int, timeout_s: float) -> MetaState:
        """The view once it is newer than `version`, or as it is at the timeout."""
        with self._cond:
            self._cond.wait_for(lambda: self._state.version > version, timeout_s)
            return self._state

    def _save_cache(self, state: MetaState) -> None:
        body: dict[str, object] = {
            "cluster_id": self.genesis.cluster_id,
            "version": state.version,
            "records": _records_json(state.records),
        }
        body["checksum"] = _checksum(body)
        tmp = self._cache.with_suffix(".tmp")
        self._cache.parent.mkdir(parents=True, exist_ok=True)
        write_synced(tmp, json.dumps(body).encode())
        os.chmod(tmp, 0o600)  # the metadata holds token keys (auth/key/...)
        tmp.replace(self._cache)
        fsync_dir(self._cache.parent)

    def _load_cache(self) -> MetaState | None:
        try:
            body = json.loads(self._cache.read_text())
            if body.pop("checksum", None) != _checksum(body):
                raise ConfigError("checksum mismatch (the file is damaged)")
            if body["cluster_id"] != self.genesis.cluster_id:
                raise ConfigError(f"it is cluster {body['cluster_id']}'s")
            records = {k: (v.encode(), int(ver)) for k, (v, ver) in body["records"].items()}
            version = int(body["version"])
            return MetaState(
                version, records, overlay(self.genesis, {k: v for k, (v, _) in records.items()})
            )
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            log.error(
                "ignoring the metadata cache %s (%s): starting from the genesis", self._cache, exc
            )
            return None


def _all_records(sm: BucketStateMachine) -> tuple[int, dict[str, tuple[bytes, int]]]:
    records: dict[str, tuple[bytes, int]] = {}
    since_index, since_key = 0, ""
    while True:
        page = sm.sync_page(since_index, since_key, 1000)
        for item in page.items:
            records[item.key] = (item.value, item.version)
        if not page.has_more:
            return sm.applied_index, records
        since_index, since_key = page.next_since_index, page.next_since_key


class MetaMember:
    """This node's replica of the metadata group (a voter)."""

    def __init__(
        self,
        view: ClusterView,
        node_id: str,
        data_dir: Path,
        password: str,
        tuning: RaftTuning,
        loop: RaftLoop,
        listen_host: str | None = None,
    ) -> None:
        spec = view.spec
        me = spec.node(node_id)
        self._view = view
        # Its journal holds the token keys (auth/key/...): for this node's user only.
        (data_dir / "meta").mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(data_dir / "meta", 0o700)
        self.replica = BucketReplica(
            bucket=META_BUCKET,
            bucket_uuid=spec.meta_uuid,
            self_addr=me.meta_address,
            partners=[n.meta_address for n in spec.meta_voters if n.node_id != node_id],
            data_dir=data_dir / "meta",
            password=password,
            tuning=tuning,
            on_applied=lambda _: self._refresh(),
            loop=loop,
        )
        self._refresh()

    def _refresh(self) -> None:
        version, records = self.replica.read(_all_records)
        if version:
            self._view.offer(version, records)

    def write(self, ops: Sequence[Op], now_ms: int) -> tuple[WriteResult, int]:
        """Replicate a compare-and-set write of metadata records (blocking): its
        result (`error` set when a precondition failed) and commit index. Raises
        ReplicaUnavailable when the group cannot commit it now: at once, proposing
        nothing, when this member knows no leader or reaches no majority (pysyncobj
        would queue the proposal until a leader appears, so a change refused for want
        of a quorum would commit once the group heals)."""
        applied, index = self._commit(Write(tuple(ops), now_ms=now_ms))
        result = applied.result
        assert isinstance(result, WriteResult)
        return result, index

    def barrier(self, now_ms: int) -> int:
        """Commit an empty entry through the group (blocking): once this returns,
        this member has applied every write committed before the call. The entry's
        index; ReplicaUnavailable as for `write`."""
        lease_index = self.replica.read(lambda sm: sm.lease_index)
        return self._commit(OutboxPurge(lease_index, now_ms=now_ms))[1]

    def _commit(self, entry: Entry) -> tuple[Applied, int]:
        connectivity = self.replica.connectivity()
        if not connectivity.quorum or not connectivity.leader:
            raise ReplicaUnavailable(
                "the metadata group has no leader this voter reaches; nothing was changed",
                reason="no_quorum",
            )
        outcome = self.replica.propose(encode_entry(entry))
        if outcome.error is not None or outcome.applied is None:
            raise ConfigError(f"metadata write refused: {outcome.error}")
        return outcome.applied, outcome.commit_index

    def close(self) -> None:
        self.replica.close()


def cas_op(key: str, value: bytes | None, expected_version: int | None) -> Op:
    """A metadata op: set `key` (or delete it, `value` None) if its version is still
    `expected_version` (0: it must not exist; None: any)."""
    if expected_version is None:
        expected = Expected(ExpectKind.ANY)
    elif expected_version == 0:
        expected = Expected(ExpectKind.NOT_EXISTS)
    else:
        expected = Expected(ExpectKind.EXACT, expected_version)
    if value is None:
        return Op(OpKind.DEL, key, b"", expected)
    return Op(OpKind.SET, key, value, expected)


class MetaFollower:
    """Keeps a non-voter's view current by long-polling the voters' `MetaRead`."""

    def __init__(
        self,
        view: ClusterView,
        metadata: Callable[[], Sequence[tuple[str, str]]],
        seeds: Sequence[str],
        credentials: grpc.ChannelCredentials | None,
    ) -> None:
        """`metadata` gives the credentials of each request (a fresh node token);
        `credentials` are the TLS channel's (None: plaintext)."""
        self._view = view
        self._metadata = metadata
        self._credentials = credentials
        self._seeds = tuple(seeds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meta-follow", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def fetch(self, until: Callable[[ClusterSpec], bool], timeout_s: float) -> None:
        """Ask the voters and seeds (each in turn, without waiting for a newer version)
        until the view satisfies `until`; ConfigError at the timeout. For a node that
        joined after the genesis: it learns its own place before it starts."""
        deadline = time.monotonic() + timeout_s
        i = 0
        while not until(self._view.spec):
            endpoints = self._endpoints()
            endpoint = endpoints[i % len(endpoints)]
            i += 1
            try:
                with self._channel(endpoint) as channel:
                    response = pb_grpc.SevenDBStub(channel).MetaRead(
                        pb.MetaReadRequest(), metadata=self._metadata(), timeout=5
                    )
                self._view.offer(
                    response.version, {r.key: (r.value, r.version) for r in response.records}
                )
            except grpc.RpcError as exc:
                log.info("metadata from %s: %s: %s", endpoint, exc.code().name, exc.details())
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"could not learn this node's place in the cluster from {endpoints} "
                    f"within {timeout_s:.0f} s (is it registered? `sevendb node init`)"
                )
            if not until(self._view.spec):
                time.sleep(0.2)

    def _channel(self, endpoint: str) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(endpoint)
        return grpc.secure_channel(endpoint, self._credentials)

    def _endpoints(self) -> list[str]:
        voters = [n.grpc_address for n in self._view.spec.meta_voters]
        return voters + [s for s in self._seeds if s not in voters]

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            endpoints = self._endpoints()
            endpoint = endpoints[i % len(endpoints)]
            try:
                self._poll(endpoint)
            except grpc.RpcError as exc:
                log.debug("metadata from %s: %s", endpoint, exc)
                if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                    log.warning("metadata from %s refused: %s", endpoint, exc.details())
                i += 1
                self._stop.wait(RETRY_S)

    def _poll(self, endpoint: str) -> None:
        with self._channel(endpoint) as channel:
            stub = pb_grpc.SevenDBStub(channel)
            while not self._stop.is_set():
                request = pb.MetaReadRequest(
                    after_version=self._view.state.version, wait_ms=POLL_WAIT_MS
                )
                response = stub.MetaRead(
                    request, metadata=self._metadata(), timeout=POLL_WAIT_MS / 1000 + 5
                )
                records = {r.key: (r.value, r.version) for r in response.records}
                self._view.offer(response.version, records)
