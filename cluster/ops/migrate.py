"""Moving buckets between nodes (docs/contract.md §7): the operator's side of a
migration, run from any machine with an admin credential.

`migrate_bucket` moves one bucket's replicas to a target set of nodes, one Raft
membership change at a time, then commits EPOCH_CREATE:

1. record the migration in the cluster's metadata (from, to, the compaction hold
   point, the epoch to create) - from now on it is visible in `sevendb status`, and
   nodes keep their logs from the hold point on;
2. repeat, reading the group's *actual* membership from its leader each time:
   make the placement in the metadata equal that membership (nodes start the
   replica of a member just added, and stop and delete the replica of a member
   just removed), wait until every member has caught up, then either add one
   target node (while the group has R members: never fewer than R live replicas),
   or remove one node that is not a target (first moving leadership off it);
3. once the membership is the target, commit EPOCH_CREATE and clear the record.

Every step is idempotent and derived from the cluster's state, never from where a
previous run stopped, so an interrupted migration (Ctrl-C, `kill -9` of the
command, of the leader, of the joining or leaving replica, of a metadata voter) is
resumed by running the command again, from any machine, or rolled back with
`--rollback` (the same procedure towards the original nodes). Every metadata write
is a compare-and-set (`ClusterAdmin.save`): two operators cannot both change it.
pysyncobj changes membership one server at a time and the replica refuses a change
while another is uncommitted: never two in flight.

`rebalance` recomputes rendezvous placement over the active nodes (after `sevendb
node add`, or `node remove`, which marks a node as draining) and migrates only the
buckets whose placement changed, one at a time; draining nodes left with no
bucket are stopped and dropped from the cluster.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeVar

import grpc

from sevendb.cluster.common.topology import ClusterSpec, ConfigError, MigrationSpec, NodeSpec
from sevendb.cluster.ops.admin import ClusterAdmin
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc

T = TypeVar("T")
STEP_TIMEOUT_S: Final = 120.0
CAUGHT_UP_LAG_MAX: Final = 0
"""A member counts as caught up once it applied what the leader had committed."""
CLOSE_BEHIND_LAG_MAX: Final = 32
CLOSE_BEHIND_WAIT_S: Final = 30.0
_RETRYABLE: Final = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


class MigrationError(Exception):
    """A migration cannot proceed; the message says why and what to do."""


@dataclass
class MigrationSummary:
    bucket: int
    from_nodes: tuple[str, ...]
    to_nodes: tuple[str, ...]
    steps: list[str] = field(default_factory=list)
    seconds: float = 0.0
    epoch: int = 0
    resumed: bool = False
    rolled_back: bool = False

    def describe(self) -> str:
        verb = "rolled back to" if self.rolled_back else "moved to"
        how = "resumed and " if self.resumed else ""
        return (
            f"bucket {self.bucket} {how}{verb} {','.join(self.to_nodes)} "
            f"(from {','.join(self.from_nodes)}) in {self.seconds:.1f} s, "
            f"{len(self.steps)} membership step(s), now in epoch {self.epoch}"
        )


class _Admin:
    """A migration's view of the cluster: its metadata (saved by compare-and-set) and
    synchronous admin calls to its nodes, following leader hints."""

    def __init__(self, admin: ClusterAdmin, progress: Callable[[str], None]) -> None:
        self.admin = admin
        self.progress = progress
        self.meta = admin.read()
        self.metadata = admin.metadata

    @property
    def spec(self) -> ClusterSpec:
        return self.meta.spec

    def stub(self, address: str) -> pb_grpc.SevenDBStub:
        return self.admin.stub(address)

    def save(self, spec: ClusterSpec) -> None:
        """Write `spec` to the metadata; the nodes converge on it before this returns
        (those that answer)."""
        self.meta = self.admin.save(self.meta, spec)

    def replica(self, node_id: str, bucket: int) -> pb.ReplicaStatus | None:
        address = self.spec.node(node_id).grpc_address
        try:
            status = self.stub(address).Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError:
            return None
        return next((r for r in status.replicas if r.bucket == bucket), None)

    def leader(
        self, bucket: int, timeout_s: float = STEP_TIMEOUT_S
    ) -> tuple[str, pb.ReplicaStatus]:
        """The node leading `bucket` and its replica's status (waits for one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for node in self.spec.nodes:
                r = self.replica(node.node_id, bucket)
                if r is not None and r.is_leader and not r.quarantined:
                    return node.node_id, r
            if time.monotonic() > deadline:
                raise MigrationError(
                    f"bucket {bucket} has no leader after {timeout_s:.0f} s: is a majority "
                    "of its replicas running? (`sevendb status`; `sevendb cluster up`)"
                )
            time.sleep(0.2)

    def on_leader(self, bucket: int, call: Callable[[pb_grpc.SevenDBStub], T]) -> T:
        """`call` on the bucket's leader, retried (with hints) through leader changes."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        backoff = 0.1
        while True:
            node_id, _ = self.leader(bucket)
            try:
                return call(self.stub(self.spec.node(node_id).grpc_address))
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE or time.monotonic() > deadline:
                    raise
                self.progress(f"  (retrying: {exc.code().name}: {exc.details()})")
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def node_of_member(self, bucket: int, address: str) -> str:
        node = self.spec.node_of_raft_address(bucket, address)
        if node is None:
            raise MigrationError(
                f"bucket {bucket} has a member {address} that no node of the cluster "
                "listens on; remove that member"
            )
        return node.node_id


def _ordered(members: set[str], target: tuple[str, ...]) -> tuple[str, ...]:
    return tuple([n for n in target if n in members] + sorted(members - set(target)))


def migrate_bucket(
    cluster: ClusterAdmin,
    bucket: int,
    to_nodes: tuple[str, ...] | None,
    *,
    rollback: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> MigrationSummary:
    """Move `bucket` to `to_nodes` (or resume / roll back its unfinished migration)."""
    started = time.monotonic()
    summary = _migrate(_Admin(cluster, progress), bucket, to_nodes, rollback)
    summary.seconds = time.monotonic() - started
    progress(summary.describe())
    return summary


def _migrate(
    admin: _Admin, bucket: int, to_nodes: tuple[str, ...] | None, rollback: bool
) -> MigrationSummary:
    spec = admin.spec
    if not 0 <= bucket < len(spec.buckets):
        raise MigrationError(f"bucket {bucket} does not exist (0..{len(spec.buckets) - 1})")
    record = spec.migration(bucket)
    if record is None:
        if rollback:
            raise MigrationError(f"bucket {bucket} has no unfinished migration to roll back")
        if to_nodes is None:
            raise MigrationError("say where to: --to NODE[,NODE...]")
        _check_target(spec, to_nodes)
        current = spec.buckets[bucket].nodes
        _, leader = admin.leader(bucket)
        if set(current) == set(to_nodes):
            admin.progress(f"bucket {bucket} is already on {','.join(current)}: nothing to do")
            return MigrationSummary(bucket, current, current, epoch=leader.epoch_counter)
        record = MigrationSpec(
            bucket,
            current,
            to_nodes,
            hold_point=leader.commit_index,
            epoch_target=leader.epoch_counter + 1,
            started_ms=time.time_ns() // 1_000_000,
        )
        admin.save(spec.with_migration(record, bucket))
        admin.progress(
            f"migrating bucket {bucket}: {','.join(current)} -> {','.join(to_nodes)} "
            f"(log held from index {record.hold_point}; epoch {record.epoch_target} next)"
        )
        resumed = False
    else:
        resumed = True
        if to_nodes is not None and not rollback and set(to_nodes) != set(record.to_nodes):
            raise MigrationError(
                f"bucket {bucket} has an unfinished migration to {','.join(record.to_nodes)} "
                f"(from {','.join(record.from_nodes)}): run the same command again to finish "
                "it, or --rollback to undo it, before starting another"
            )
        admin.progress(
            f"{'rolling back' if rollback else 'resuming'} the migration of bucket {bucket}: "
            f"{','.join(record.from_nodes)} -> {','.join(record.to_nodes)}"
        )
    target = record.from_nodes if rollback else record.to_nodes
    summary = MigrationSummary(
        bucket, record.from_nodes, target, resumed=resumed, rolled_back=rollback
    )
    _move(admin, bucket, target, summary)
    epoch = _create_epoch(admin, bucket, record.epoch_target)
    summary.epoch = epoch
    admin.save(admin.spec.with_bucket_nodes(bucket, target).with_migration(None, bucket))
    return summary


def _check_target(spec: ClusterSpec, to_nodes: tuple[str, ...]) -> None:
    if len(set(to_nodes)) != len(to_nodes):
        raise MigrationError(f"--to names a node twice: {','.join(to_nodes)}")
    if len(to_nodes) != spec.replicas:
        raise MigrationError(
            f"--to needs {spec.replicas} nodes (the cluster's replica count), got {len(to_nodes)}"
        )
    for node_id in to_nodes:
        try:
            node = spec.node(node_id)
        except ConfigError as exc:
            raise MigrationError(str(exc)) from None
        if node.draining:
            raise MigrationError(f"node {node_id} is being removed; choose another")


def _move(admin: _Admin, bucket: int, target: tuple[str, ...], summary: MigrationSummary) -> None:
    replicas = admin.spec.replicas
    step = 0
    while True:
        _, leader = admin.leader(bucket)
        members = {admin.node_of_member(bucket, a) for a in leader.members}
        placed = _ordered(members, target)
        if set(admin.spec.buckets[bucket].nodes) != members:
            # Nodes start the replica of a member just added, stop and delete the
            # replica of a member just removed.
            admin.save(admin.spec.with_bucket_nodes(bucket, placed))
        _wait_caught_up(admin, bucket, placed)
        if members == set(target):
            return
        adds = [n for n in target if n not in members]
        removes = sorted(members - set(target))
        step += 1
        if adds and len(members) <= replicas:
            node_id = adds[0]
            address = admin.spec.node(node_id).raft_address(bucket)
            admin.progress(
                f"step {step}: add a replica of bucket {bucket} on {node_id} ({address})"
            )
            _change(admin, bucket, "AddMember", address)
            summary.steps.append(f"added {node_id}")
        else:
            node_id = removes[0]
            address = admin.spec.node(node_id).raft_address(bucket)
            leader_node, _ = admin.leader(bucket)
            if leader_node == node_id:
                _move_leadership(admin, bucket, node_id, target)
            admin.progress(
                f"step {step}: remove the replica of bucket {bucket} on {node_id} ({address})"
            )
            _change(admin, bucket, "RemoveMember", address)
            summary.steps.append(f"removed {node_id}")


def _change(admin: _Admin, bucket: int, method: str, address: str) -> None:
    request = pb.MemberRequest(bucket=bucket, address=address)
    try:
        admin.on_leader(
            bucket,
            lambda s: getattr(s, method)(request, metadata=admin.metadata, timeout=30),
        )
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND):
            return  # an earlier run got this far: nothing to change
        raise MigrationError(f"{method} {address}: {exc.code().name}: {exc.details()}") from None


def _move_leadership(admin: _Admin, bucket: int, leaving: str, target: tuple[str, ...]) -> None:
    for node_id in target:
        if node_id == leaving:
            continue
        r = admin.replica(node_id, bucket)
        if r is None:
            continue
        _wait_close_behind(admin, bucket, node_id)
        admin.progress(f"  moving bucket {bucket}'s leadership from {leaving} to {node_id}")
        request = pb.MemberRequest(bucket=bucket, address=r.address)
        with contextlib.suppress(grpc.RpcError):
            admin.on_leader(
                bucket,
                lambda s, r=request: s.TransferLeader(r, metadata=admin.metadata, timeout=30),  # type: ignore[misc]
            )
            return
    raise MigrationError(
        f"could not move bucket {bucket}'s leadership off {leaving}: no caught-up target "
        "replica answered; re-run the command"
    )


def _wait_close_behind(admin: _Admin, bucket: int, node_id: str) -> None:
    """Before leadership moves to `node_id`: wait (at most `CLOSE_BEHIND_WAIT_S`) until
    it applied all but `CLOSE_BEHIND_LAG_MAX` entries of what the leader has committed
    now, not at the start of the step, and its transport reaches every other member.
    A new leader serves writes only once it applied its backlog, and it needs the
    votes of members it is connected to (a vote request to one it is not is dropped,
    costing an election timeout); the old leader holds writes back meanwhile."""
    deadline = time.monotonic() + CLOSE_BEHIND_WAIT_S
    while time.monotonic() < deadline:
        _, leader = admin.leader(bucket)
        r = admin.replica(node_id, bucket)
        if (
            r is not None
            and leader.commit_index - r.applied_index <= CLOSE_BEHIND_LAG_MAX
            and set(r.members) - {r.address} <= set(r.connected)
        ):
            return
        time.sleep(0.05)
    admin.progress(
        f"  {node_id} still trails the leader after {CLOSE_BEHIND_WAIT_S:.0f} s; "
        "moving leadership anyway (writes pause while it catches up)"
    )


def _wait_caught_up(admin: _Admin, bucket: int, nodes: tuple[str, ...]) -> None:
    _, leader = admin.leader(bucket)
    goal = leader.commit_index
    deadline = time.monotonic() + STEP_TIMEOUT_S
    last_report = 0.0
    while True:
        lags: dict[str, int | None] = {}
        for node_id in nodes:
            r = admin.replica(node_id, bucket)
            lags[node_id] = None if r is None else max(0, goal - r.applied_index)
        if all(lag is not None and lag <= CAUGHT_UP_LAG_MAX for lag in lags.values()):
            return
        now = time.monotonic()
        if now - last_report >= 1.0:
            last_report = now
            shown = ", ".join(
                f"{n}: {'not answering' if lag is None else f'{lag} entries behind'}"
                for n, lag in lags.items()
            )
            admin.progress(f"  waiting for replicas to catch up to index {goal}: {shown}")
        if now > deadline:
            raise MigrationError(
                f"bucket {bucket}: replicas did not catch up within {STEP_TIMEOUT_S:.0f} s "
                f"({lags}); is every node running (`sevendb cluster up`)? Re-run to resume."
            )
        time.sleep(0.2)


def _create_epoch(admin: _Admin, bucket: int, epoch_target: int) -> int:
    request = pb.EpochRequest(bucket=bucket, epoch_counter=epoch_target)
    try:
        response: pb.EpochResponse = admin.on_leader(
            bucket, lambda s: s.CreateEpoch(request, metadata=admin.metadata, timeout=30)
        )
    except grpc.RpcError as exc:
        _, leader = admin.leader(bucket)
        if leader.epoch_counter >= epoch_target:
            return leader.epoch_counter  # an earlier run (or a concurrent retry) did it
        raise MigrationError(f"EPOCH_CREATE {epoch_target}: {exc.details()}") from None
    admin.progress(f"EPOCH_CREATE committed: bucket {bucket} is in epoch {epoch_target}")
    return int(response.epoch_id.epoch_counter)


# ---- rebalancing ---------------------------------------------------------------------


@dataclass(frozen=True)
class Move:
    bucket: int
    current: tuple[str, ...]
    desired: tuple[str, ...]


def plan_rebalance(spec: ClusterSpec) -> list[Move]:
    """The buckets whose rendezvous placement over the active nodes changed."""
    moves = []
    for b in spec.buckets:
        desired = tuple(spec.placement(b.bucket_uuid))
        if set(desired) != set(b.nodes):
            moves.append(Move(b.bucket, b.nodes, desired))
    return moves


def rebalance(
    cluster: ClusterAdmin,
    *,
    dry_run: bool = False,
    progress: Callable[[str], None] = lambda _: None,
    stop_node: Callable[[str], Any] | None = None,
) -> list[MigrationSummary]:
    """Migrate, one at a time, every bucket whose placement changed; then drop
    draining nodes that hold no bucket (stopping them with `stop_node`)."""
    spec = cluster.read().spec
    unfinished = [m.bucket for m in spec.migrations]
    if unfinished:
        raise MigrationError(
            f"bucket(s) {unfinished} have an unfinished migration: finish or roll it back "
            "first (`sevendb bucket migrate BUCKET` / `--rollback`)"
        )
    moves = plan_rebalance(spec)
    if not moves:
        progress("placement matches rendezvous hashing: nothing to move")
    for move in moves:
        progress(
            f"{'would move' if dry_run else 'moving'} bucket {move.bucket}: "
            f"{','.join(move.current)} -> {','.join(move.desired)}"
        )
    if dry_run:
        return []
    done = [migrate_bucket(cluster, move.bucket, move.desired, progress=progress) for move in moves]
    meta = cluster.read()
    spec = meta.spec
    for node in meta.spec.nodes:
        if node.draining and not any(node.node_id in b.nodes for b in spec.buckets):
            progress(f"node {node.node_id} holds no bucket any more: dropping it")
            if stop_node is not None:
                stop_node(node.node_id)
            spec = spec.without_node(node.node_id)
    cluster.save(meta, spec)
    return done


def mark_draining(cluster: ClusterAdmin, node_id: str) -> NodeSpec:
    meta = cluster.read()
    spec = meta.spec
    node = spec.node(node_id)
    active = [n for n in spec.nodes if not n.draining and n.node_id != node_id]
    if len(active) < spec.replicas:
        raise MigrationError(
            f"removing {node_id} would leave {len(active)} active nodes for "
            f"{spec.replicas} replicas per bucket; add a node first"
        )
    if node.meta_port:
        raise MigrationError(
            f"{node_id} is a metadata voter; voters cannot be removed yet (docs/deploy.md)"
        )
    node = replace(node, draining=True)
    cluster.save(meta, spec.with_node(node))
    return node


__all__ = [
    "MigrationError",
    "MigrationSummary",
    "Move",
    "mark_draining",
    "migrate_bucket",
    "plan_rebalance",
    "rebalance",
]
