"""Executes a run's fault plan (`SimConfig.scripted`): crashes, storage faults,
pauses, partitions and heals, client crashes and stalls, epoch bumps and mallory's
moves, each at its time and only during the fault phase.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from .client import Client
from .config import STORAGE_ACTIONS, Scripted
from .raft import Damage, Role

if TYPE_CHECKING:
    from .world import Simulation

REPLICA_ACTIONS: Final = (
    "crash_replica",
    "crash_follower",
    "crash_leader",
    *STORAGE_ACTIONS,
    "crash_holder",
    "crash_holder_after_outbox",
    "pause_replica",
    "pause_leader",
)


class FaultPlan:
    """The timed fault events of one run, and the partitions they left to heal."""

    def __init__(self, sim: Simulation, plan: tuple[Scripted, ...]) -> None:
        self.sim = sim
        self._plan = sorted(plan)
        self.heal_at = -1
        """When the current partition heals (-1: none)."""

    def heal(self) -> None:
        self.sim.net.heal()
        self.heal_at = -1

    def crash_client(self, client: Client, down_ms: int, kind: str) -> None:
        if not client.alive:
            return
        client.crash(self.sim.now_ms + down_ms)
        self.sim.schedule_restart(self.sim.now_ms + down_ms, client.name)
        self.sim.faults[kind] += 1
        self.sim.trace("client-crash", client.name, down_ms)

    def step(self) -> None:
        """Execute the fault plan's events that are due (only during the fault phase)."""
        sim = self.sim
        while self._plan and self._plan[0].at_ms <= sim.now_ms:
            event = self._plan.pop(0)
            if sim.in_fault_phase:
                self._execute(event)
        if self.heal_at >= 0 and sim.now_ms >= self.heal_at:
            self.heal()
            sim.trace("heal")

    def _execute(self, event: Scripted) -> None:
        self.sim.trace("fault", str(event))
        if not self._execute_replica(event) and not self._execute_network(event):
            self._execute_client(event)

    def _execute_replica(self, event: Scripted) -> bool:
        """Crashes, storage faults and pauses; False if `event` is none of them."""
        action, arg, pick = event.action, event.arg, event.pick
        members = (self.sim.raft.members[n] for n in self.sim.replica_names)
        usable = [r for r in members if r.usable]
        followers = [r for r in usable if r.role is not Role.LEADER]
        holder = self.sim.holder()
        if action == "crash_replica" and usable:
            self.sim.crash_replica(usable[pick % len(usable)], down_ms=arg)
        elif action == "crash_follower" and followers:
            self.sim.crash_replica(followers[pick % len(followers)], down_ms=arg)
        elif action == "crash_leader":
            for r in self.sim.raft.leaders():
                self.sim.crash_replica(r, kind="leader_crash", down_ms=arg or 600)
        elif action in STORAGE_ACTIONS and usable:
            target = usable[pick % len(usable)]
            self.sim.crash_replica(target, kind=action, down_ms=arg, damage=Damage(action))
        elif action == "crash_holder" and holder is not None:
            self.sim.crash_replica(holder, kind="holder_crash", down_ms=arg or 400)
        elif action == "crash_holder_after_outbox" and holder is not None:
            self.sim.nodes[holder.name].crash_after_outbox = True
        elif action == "pause_replica" and usable:
            usable[pick % len(usable)].paused_until_ms = self.sim.now_ms + arg
            self.sim.faults["pause"] += 1
        elif action == "pause_leader":
            for r in self.sim.raft.leaders():
                r.paused_until_ms = self.sim.now_ms + (arg or 600)
                self.sim.faults["pause"] += 1
        else:
            return action in REPLICA_ACTIONS  # no target right now
        return True

    def _execute_network(self, event: Scripted) -> bool:
        """Partitions and heals; False if `event` is none of them."""
        action, arg, pick = event.action, event.arg, event.pick
        now = self.sim.now_ms
        holder = self.sim.holder()
        if action in ("partition", "partition_replicas"):
            replicas_only = action == "partition_replicas"
            names = [*self.sim.replica_names, *([] if replicas_only else self.sim.clients)]
            sides = {n: (pick >> i) & 1 for i, n in enumerate(names)}
            self.sim.net.partition(sides, replicas_only=replicas_only)
            self.heal_at = max(self.heal_at, now + arg)
            self.sim.faults["partition"] += 1
        elif action == "partition_holder" and holder is not None:
            self.sim.net.partition({holder.name: 1})
            self.heal_at = max(self.heal_at, now + (arg or 800))
            self.sim.faults["partition"] += 1
        elif action == "isolate_holder_raft" and holder is not None:
            self.sim.net.partition({holder.name: 1}, replicas_only=True)
            self.heal_at = max(self.heal_at, now + (arg or 1_500))
            self.sim.faults["partition"] += 1
        elif action == "heal":
            self.heal()
        else:
            return action in ("partition_holder", "isolate_holder_raft")
        return True

    def _execute_client(self, event: Scripted) -> None:
        """Client crashes and stalls, epoch bumps, mallory."""
        action, arg, pick = event.action, event.arg, event.pick
        clients = list(self.sim.clients.values())
        if action == "crash_client" and clients:
            kind = "client_stall" if arg > self.sim.config.stall_window_ms else "client_crash"
            self.crash_client(clients[pick % len(clients)], arg, kind)
        elif action in ("crash_clients", "stall_clients"):
            down = (
                self.sim.config.stall_window_ms + 1_000 if action == "stall_clients" else arg or 200
            )
            for client in clients:
                self.crash_client(client, down, action)
        elif action == "epoch_bump":
            self.sim.workload.epoch_bump()
        elif action == "mallory" and self.sim.mallory is not None:
            self.sim.workload.mallory_step()
