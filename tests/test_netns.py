"""A cluster across real network boundaries: three node hosts and a client host, each
a Linux network namespace with its own address (tests/netns.py), the nodes made by
`sevendb cluster init` and run with `sevendb node run`, the client using nothing but
its client bundle. Faults are real: `kill -9`, packets dropped inside a namespace
(both ways, or only what it sends), delay and loss.

One cluster serves the whole module, the tests in order; each ends with every host
healed and every node running.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import wait_for
from netns import Host, NetLab

from sevendb.cluster.common.auth import Token
from sevendb.cluster.common.bundle import ClientConfig
from sevendb.cluster.ops.admin import ClusterAdmin
from sevendb.proto import sevendb_pb2 as pb

pytestmark = pytest.mark.slow

CLIENT = str(Path(__file__).with_name("netns_client.py"))
NODES = ("n1", "n2", "n3")
BUCKETS = 2


@dataclass
class Deployment:
    lab: NetLab
    root: Path
    bundles: Path
    client_host: Host
    node_hosts: dict[str, Host]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    not_converged: str = ""

    @property
    def client_toml(self) -> Path:
        return self.bundles / "client.toml"

    def admin(self) -> ClusterAdmin:
        return ClusterAdmin.from_config(ClientConfig.load(self.client_toml))

    def sevendb(self, *args: str, host: Host | None = None, timeout: float = 120) -> str:
        """`sevendb ARGS` on the client host (or `host`), from the client bundle."""
        argv = [sys.executable, "-m", "sevendb.cluster.ops.cli", *args]
        if "--endpoints" not in args:
            argv += ["--config", str(self.client_toml)]
        out = (host or self.client_host).run(argv, timeout=timeout)
        assert out.returncode == 0, f"sevendb {' '.join(args)}: {out.stderr}"
        return out.stdout

    def start(self, node_id: str) -> None:
        host = self.node_hosts[node_id]
        log = (self.root / f"{node_id}.log").open("ab")
        self.procs[node_id] = host.popen(
            [
                sys.executable,
                "-m",
                "sevendb.cluster.ops.cli",
                "node",
                "run",
                "--config",
                str(self.bundles / node_id / "node.toml"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def kill9(self, node_id: str) -> None:
        self.node_hosts[node_id].kill9(self.procs.pop(node_id))

    def status(self, node_id: str) -> pb.StatusResponse | None:
        with self.admin() as admin:
            return admin.status(f"{self.node_hosts[node_id].address}:7001", timeout_s=2)

    def wait_leaders(self, timeout_s: float = 60) -> None:
        def ready() -> bool:
            for node_id in self.node_hosts:
                status = self.status(node_id)
                if status is None or any(not r.leader for r in status.replicas):
                    return False
            return True

        wait_for(ready, timeout_s, "every bucket to have a leader on every node", 0.2)

    def converged(self) -> bool:
        """Every replica of every bucket applied the same log to the same digest (what
        is not yet is kept in `self.not_converged`, for the failure message)."""
        per_bucket: dict[int, dict[str, tuple[int, str]]] = {}
        raft: dict[int, dict[str, str]] = {}
        problems = []
        with self.admin() as admin:
            spec = admin.read().spec
            for node in spec.nodes:
                status = admin.status(node.grpc_address, digests=True, timeout_s=5)
                if status is None:
                    problems.append(f"{node.node_id} does not answer")
                    continue
                for r in status.replicas:
                    if r.quarantined:
                        problems.append(f"{node.node_id} bucket {r.bucket}: {r.quarantined}")
                    per_bucket.setdefault(r.bucket, {})[node.node_id] = (
                        r.applied_index,
                        r.digest[:8],
                    )
                    raft.setdefault(r.bucket, {})[node.node_id] = (
                        f"term {r.term} leader {r.leader or '-'} commit {r.commit_index} "
                        f"log {r.log_len} connected {sorted(r.connected)}"
                    )
        for bucket, seen in sorted(per_bucket.items()):
            placed = set(spec.buckets[bucket].nodes)
            if len(set(seen.values())) != 1 or set(seen) != placed:
                problems.append(
                    f"bucket {bucket} (placed on {sorted(placed)}): {seen} (Raft: {raft[bucket]})"
                )
        self.not_converged = "; ".join(problems)
        return not problems and len(per_bucket) == BUCKETS

    def wait_converged(self, what: str, timeout_s: float = 90) -> None:
        try:
            wait_for(self.converged, timeout_s, what, 0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.not_converged}{self.warnings()}") from None

    def warnings(self, last: int = 6) -> str:
        """The last WARNING-or-worse lines of each node's log (a failure's context: CI
        shows the assertion, not the logs)."""
        found = []
        for log in sorted(self.root.glob("n*.log")):
            lines = [
                line
                for line in log.read_text(errors="replace").splitlines()
                if any(f'"level": "{level}"' in line for level in ("WARNING", "ERROR", "CRITICAL"))
            ]
            found += [f"{log.stem}: {_message(line)}" for line in lines[-last:]]
        return "".join(f"\n  {line}" for line in found)

    def leader_of(self, bucket: int) -> str:
        def find() -> str | None:
            for node_id in self.node_hosts:
                status = self.status(node_id)
                if status and any(r.bucket == bucket and r.is_leader for r in status.replicas):
                    return node_id
            return None

        found = wait_for(find, 60, f"a leader of bucket {bucket}", 0.2)
        assert found is not None
        return found


def _message(line: str) -> str:
    try:
        return str(json.loads(line)["message"])
    except (ValueError, KeyError):
        return line  # a line still being written


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("netns")
    with NetLab() as lab:
        hosts = {n: lab.add_host(n) for n in NODES}
        client = lab.add_host("client")
        bundles = root / "bundles"
        init = [
            sys.executable,
            "-m",
            "sevendb.cluster.ops.cli",
            "cluster",
            "init",
            "--out",
            str(bundles),
            "--buckets",
            str(BUCKETS),
        ]
        for node_id, host in hosts.items():
            init += ["--node", f"{node_id}={host.address}"]
        subprocess.run(init, check=True, capture_output=True)
        for node_id, host in hosts.items():
            # Each node's data dir is its bundle's: give it a data dir of its own host.
            assert (bundles / node_id / "node.toml").read_text().count(host.address) >= 1
        deployment = Deployment(lab, root, bundles, client, hosts)
        try:
            for node_id in NODES:
                deployment.start(node_id)
            deployment.wait_leaders()
            yield deployment
        finally:
            for node_id in list(deployment.procs):
                deployment.kill9(node_id)
            for log in sorted(root.glob("*.log")):
                print(
                    f"---- {log.name} (tail)\n"
                    + "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                )


@contextlib.contextmanager
def tailing(d: Deployment, name: str, query: str = "prefix:") -> Iterator[Path]:
    """A subscriber on the client host for the block; yields its output file."""
    out = d.root / f"{name}.events"
    proc = d.client_host.popen(
        [
            sys.executable,
            CLIENT,
            "tail",
            str(d.client_toml),
            str(out),
            str(d.root / f"{name}.cursor"),
            query,
        ],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"subscribed"
    try:
        yield out
    finally:
        d.client_host.kill9(proc)


def load(d: Deployment, name: str, seconds: float) -> subprocess.Popen[bytes]:
    return d.client_host.popen(
        [
            sys.executable,
            CLIENT,
            "load",
            str(d.client_toml),
            str(d.root / f"{name}.acked"),
            f"{name}/",
            str(seconds),
        ]
    )


def acked(d: Deployment, name: str) -> list[str]:
    path = d.root / f"{name}.acked"
    return path.read_text().split() if path.exists() else []


def events(out: Path) -> list[dict[str, Any]]:
    """The events the subscriber has printed so far: whole lines only (it may be in
    the middle of writing the last one)."""
    lines = out.read_text().split("\n")[:-1] if out.exists() else []
    return [json.loads(line) for line in lines if line]


def check_delivery(d: Deployment, out: Path, name: str) -> None:
    """Every acknowledged key is in the cluster and was delivered; no event twice; each
    bucket's positions strictly increase."""
    keys = set(acked(d, name))
    assert keys, f"no write of {name} was acknowledged"
    wait_for(
        lambda: keys <= {e["key"] for e in events(out)}, 90, f"{name}'s writes to be delivered"
    )
    seen = events(out)
    positions = [(e["bucket"], tuple(e["seq"]), e["key"]) for e in seen]
    assert len(set(positions)) == len(positions), "an event was delivered twice"
    for bucket in range(BUCKETS):
        seqs = [e["seq"] for e in seen if e["bucket"] == bucket]
        assert seqs == sorted(seqs)
    for key in sorted(keys)[:: max(1, len(keys) // 4)]:
        assert json.loads(d.sevendb("get", key))["key"] == key


def test_write_read_and_subscribe_across_hosts_from_the_client_bundle(d: Deployment) -> None:
    with tailing(d, "basic") as out:
        written = json.loads(d.sevendb("write", "basic/a", "1"))
        assert written["version"] == 1
        assert json.loads(d.sevendb("get", "basic/a"))["value"] == "1"
        wait_for(lambda: any(e["key"] == "basic/a" for e in events(out)), 30, "the event")
    # The cursor resumes: nothing is delivered twice, and what was written meanwhile arrives.
    d.sevendb("write", "basic/b", "2")
    with tailing(d, "basic") as out:
        wait_for(lambda: any(e["key"] == "basic/b" for e in events(out)), 30, "the later event")
        assert [e["key"] for e in events(out)].count("basic/a") == 1


def test_kill9_of_the_lease_holders_host_loses_nothing(d: Deployment) -> None:
    with tailing(d, "kill") as out:
        writer = load(d, "kill", 600)
        wait_for(lambda: len(acked(d, "kill")) > 50, 30, "writes before the kill")
        victim = d.leader_of(0)
        d.kill9(victim)
        wait_for(lambda: len(acked(d, "kill")) > 150, 60, "writes after the kill")
        d.start(victim)
        d.wait_leaders()
        restarted = len(acked(d, "kill"))
        wait_for(lambda: len(acked(d, "kill")) > restarted + 50, 60, "writes after the restart")
        d.client_host.kill9(writer)
        d.wait_leaders()
        check_delivery(d, out, "kill")
    d.wait_converged("replicas to converge")


def _minority_refuses(d: Deployment, host: Host) -> float:
    """How long a write through `host`'s own node, from inside `host`, takes to fail."""
    started = time.monotonic()
    out = host.run(
        [
            sys.executable,
            "-m",
            "sevendb.cluster.ops.cli",
            "write",
            "minority/x",
            "1",
            "--endpoints",
            f"{host.address}:7001",
            "--token",
            ClientConfig.load(d.client_toml).token or "",
            "--ca",
            str(d.bundles / "ca.pem"),
        ],
        timeout=120,
    )
    took = time.monotonic() - started
    assert out.returncode != 0, "a write on the minority side was acknowledged"
    assert "UNAVAILABLE" in out.stderr or "Unavailable" in out.stderr, out.stderr
    return took


@pytest.mark.parametrize("fault", ["partition", "outbound", "delay_and_loss"])
def test_a_faulty_host_under_load_loses_nothing(d: Deployment, fault: str) -> None:
    name = f"fault-{fault}"
    victim = d.node_hosts[d.leader_of(0)]
    with tailing(d, name) as out:
        writer = load(d, name, 600)
        wait_for(lambda: len(acked(d, name)) > 30, 30, "writes before the fault")
        if fault == "partition":
            d.lab.partition(victim)
            took = _minority_refuses(d, victim)
            print(f"the minority refused a write after {took:.1f} s")
            assert took < 60, f"the minority took {took:.0f} s to refuse"
        elif fault == "outbound":
            d.lab.partition_outbound(victim)
        else:
            d.lab.netem(victim, delay_ms=30, jitter_ms=20, loss_pct=5)
        before = len(acked(d, name))
        wait_for(lambda: len(acked(d, name)) > before + 50, 60, "writes during the fault")
        d.lab.heal(victim)
        healed = len(acked(d, name))
        wait_for(lambda: len(acked(d, name)) > healed + 50, 60, "writes after healing")
        d.client_host.kill9(writer)
        check_delivery(d, out, name)
    d.wait_leaders()
    d.wait_converged("replicas to converge after healing")


def test_data_buckets_serve_while_the_metadata_group_has_no_majority(d: Deployment) -> None:
    """Cut the metadata port on two of the three voters: the metadata group has no
    majority, yet writes and subscriptions go on, a metadata change is refused with
    UNAVAILABLE, and a node restarted meanwhile starts from its cache."""
    cut = [d.node_hosts["n2"], d.node_hosts["n3"]]
    with tailing(d, "nometa") as out:
        for host in cut:
            d.lab.block_port(host, 7000)
        try:
            writer = load(d, "nometa", 600)

            def no_metadata_leader() -> bool:
                statuses = [d.status(n) for n in NODES]
                return all(s is not None and not s.meta.leader for s in statuses)

            wait_for(no_metadata_leader, 60, "every metadata voter to know no leader")
            wait_for(lambda: len(acked(d, "nometa")) > 50, 60, "writes without a metadata majority")
            refused = d.client_host.run(
                [
                    sys.executable,
                    "-m",
                    "sevendb.cluster.ops.cli",
                    "node",
                    "init",
                    "--node",
                    "n9=10.0.0.99",
                    "--out",
                    str(d.root / "refused"),
                    "--config",
                    str(d.client_toml),
                ],
                timeout=120,
            )
            assert refused.returncode != 0 and "UNAVAILABLE" in refused.stderr, refused.stderr
            assert "nothing was changed" in refused.stderr, refused.stderr
            d.kill9("n3")
            d.start("n3")  # its metadata comes from its cache
            wait_for(lambda: d.status("n3") is not None, 60, "n3 to restart from its cache")
            before = len(acked(d, "nometa"))
            wait_for(lambda: len(acked(d, "nometa")) > before + 50, 60, "writes after the restart")
        finally:
            for host in cut:
                d.lab.heal(host)
        d.client_host.kill9(writer)
        check_delivery(d, out, "nometa")
    with d.admin() as admin:
        assert "n9" not in admin.read().spec.node_ids  # the refused change did not happen
    d.wait_leaders()
    d.wait_converged("replicas to converge")


def test_a_voter_cut_off_from_the_metadata_group_is_not_what_a_change_is_based_on(
    d: Deployment,
) -> None:
    """n1's metadata port is blocked: it still answers clients, from a view that no
    longer moves. A change made meanwhile through the others is in the admin's next
    read even with n1 asked first (the read is a round through the group, which n1
    refuses), so a compare-and-set based on it is not refused as a conflict. (The
    CI's failure: a migration resumed after a voter's partition read the voter's
    stale view and was refused with MetadataConflict.)"""
    from sevendb.cluster.common.acl import Grant, Permission

    n1 = d.node_hosts["n1"]
    grant = Grant("stale-reader", Permission.READ, "stale/")
    d.lab.block_port(n1, 7000)
    try:

        def n1_knows_no_leader() -> bool:
            status = d.status("n1")
            return status is not None and not status.meta.leader

        wait_for(n1_knows_no_leader, 60, "n1 to know no metadata leader")
        with d.admin() as others, d.admin() as admin:
            others.endpoints[:] = [e for e in others.endpoints if not e.startswith(n1.address)]
            admin.endpoints.sort(key=lambda e: not e.startswith(n1.address))
            assert others.grant(grant, wait=False)
            fresh = admin.read()
            assert grant in admin.acl().grants
            assert admin.read(linearizable=False).version < fresh.version  # n1's view
            assert admin.revoke_grant(grant, wait=False)  # read, then compare-and-set
            assert grant not in admin.acl().grants
    finally:
        d.lab.heal(n1)
    with d.admin() as admin:
        admin.endpoints.sort(key=lambda e: not e.startswith(n1.address))
        version = admin.read().version
        wait_for(
            lambda: admin.read(linearizable=False).version >= version,
            60,
            "n1's view to catch up",
        )


def test_a_fourth_host_joins_and_a_migration_survives_a_partitioned_metadata_voter(
    d: Deployment,
) -> None:
    n4 = d.lab.add_host("n4")
    d.node_hosts["n4"] = n4
    d.sevendb("node", "init", "--node", f"n4={n4.address}", "--out", str(d.bundles))
    d.start("n4")
    wait_for(lambda: d.status("n4") is not None, 60, "n4 to answer")
    with d.admin() as admin:
        spec = admin.read().spec
    bucket = 1
    keep = list(spec.buckets[bucket].nodes[:2])
    target = ",".join(["n4", *keep])
    voter = next(n for n in NODES if n not in keep)  # a metadata voter, and the replica leaving
    with tailing(d, "mig") as out:
        writer = load(d, "mig", 600)
        wait_for(lambda: len(acked(d, "mig")) > 30, 30, "writes before the migration")
        migrate = d.client_host.popen(
            [
                sys.executable,
                "-m",
                "sevendb.cluster.ops.cli",
                "bucket",
                "migrate",
                str(bucket),
                "--to",
                target,
                "--config",
                str(d.client_toml),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        d.lab.partition(d.node_hosts[voter])
        try:
            code = migrate.wait(180)
        finally:
            d.lab.heal(d.node_hosts[voter])
        if code != 0:  # interrupted by the partition: it resumes from the cluster's state
            d.sevendb("bucket", "migrate", str(bucket), "--to", target, timeout=180)
        d.client_host.kill9(writer)
        check_delivery(d, out, "mig")
    with d.admin() as admin:
        after = admin.read().spec
    assert set(after.buckets[bucket].nodes) == {"n4", *keep} and not after.migrations
    d.wait_leaders()
    d.wait_converged("replicas to converge after the migration")


@pytest.fixture
def d(deployment: Deployment) -> Deployment:
    return deployment


# ---- refusals across hosts (issue 32 item 5; docs/security.md) --------------------------


def _cli(d: Deployment, *args: str, host: Host | None = None) -> subprocess.CompletedProcess[str]:
    """`sevendb ARGS` on the client host (or `host`), whatever its exit code."""
    argv = [sys.executable, "-m", "sevendb.cluster.ops.cli", *args, "--timeout", "5"]
    return (host or d.client_host).run(argv, timeout=120)


def _get_on(d: Deployment, node_id: str, *tls: str, token: str) -> subprocess.CompletedProcess[str]:
    """`sevendb get` through `node_id` alone, with these TLS flags and `token`."""
    endpoint = f"{d.node_hosts[node_id].address}:7001"
    return _cli(d, "get", "refusal/x", "--endpoints", endpoint, "--token", token, *tls)


def _keyring_now(d: Deployment) -> tuple[Any, int]:
    from sevendb.cluster.common.bundle import ClusterSecrets

    keyring = ClusterSecrets.load(d.bundles / "n1" / "secrets.toml").keyring()
    return keyring, time.time_ns() // 1_000_000


def test_refusals_across_hosts_change_nothing(d: Deployment) -> None:
    """From the client host, through each node: a plaintext client, a client
    trusting another CA, an expired token, a token of a retired key and a revoked
    principal's token are each refused with a status that says why; nothing is
    written."""
    ca = str(d.bundles / "ca.pem")
    admin_token = ClientConfig.load(d.client_toml).token
    assert admin_token is not None
    d.sevendb("write", "refusal/x", "before")
    for principal in ("alice", "mallory"):  # a `cluster init` cluster grants nobody
        d.sevendb("acl", "grant", principal, "read", "--prefix", "refusal/")
    other_ca = d.root / "other-ca.pem"
    from sevendb.cluster.common.tls import new_ca

    other_ca.write_bytes(new_ca("not-this-cluster").cert_pem)
    keyring, now = _keyring_now(d)
    # (An admin token: the admin key is not retired below, so expiry is its only fault.)
    expired = keyring.mint("admin", now_ms=now - 7_200_000, ttl_s=3600)
    old_key = keyring.mint("alice", now_ms=now, ttl_s=3600)
    d.sevendb("auth", "rotate-key")
    mallory = d.sevendb("token", "mallory", "--ttl", "1h").strip()  # by the new key
    # Both work through every node, the old key's token too, until the changes below.
    for node_id in NODES:
        for token in (old_key, mallory):
            assert _get_on(d, node_id, "--ca", ca, token=token).returncode == 0
    previous = Token.parse(old_key).kid
    assert Token.parse(mallory).kid != previous
    d.sevendb("auth", "retire-key", previous)
    d.sevendb("auth", "revoke", "mallory")
    cases = [
        (("--insecure",), admin_token, 3, "UNAVAILABLE"),
        (("--ca", str(other_ca)), admin_token, 3, "CERTIFICATE_VERIFY_FAILED"),
        (("--ca", ca), expired, 1, "Unauthenticated: token for 'admin' expired"),
        (("--ca", ca), old_key, 1, f"signed by key {previous}, which was retired"),
        (("--ca", ca), mallory, 1, "tokens of 'mallory' minted before"),
    ]
    for node_id in NODES:
        for tls, token, code, why in cases:
            run = _get_on(d, node_id, *tls, token=token)
            assert run.returncode == code and why in run.stderr, (node_id, tls, run.stderr)
            write = _cli(
                d,
                "write",
                "refusal/x",
                "after",
                "--endpoints",
                f"{d.node_hosts[node_id].address}:7001",
                "--token",
                token,
                *tls,
            )
            assert write.returncode == code, write.stderr
    assert json.loads(d.sevendb("get", "refusal/x"))["value"] == "before"
    fresh = d.sevendb("token", "mallory", "--ttl", "1h").strip()
    assert _get_on(d, "n1", "--ca", ca, token=fresh).returncode == 0


def test_a_node_whose_certificate_the_others_do_not_trust_is_refused(d: Deployment) -> None:
    """n3 restarted with its own data and secrets but a certificate from another CA
    (and that CA in its ca.pem, so that it starts): clients and the other nodes,
    connecting with the cluster's CA, refuse it at the handshake; a write through it
    is refused and nothing changes. (It still holds the Raft key, so it stays a
    replica: a bucket it leads is unavailable to clients meanwhile, as forwarding to
    it is refused too.) Then the real n3 comes back."""
    import shutil

    from sevendb.cluster.common.tls import issue, new_ca

    host = d.node_hosts["n3"]
    impostor = d.root / "impostor-n3"
    shutil.copytree(d.bundles / "n3", impostor, ignore=shutil.ignore_patterns("data"))
    foreign = new_ca("impostor")
    cert = issue(foreign, "n3", hosts=[host.address])
    (impostor / "ca.pem").write_bytes(foreign.cert_pem)
    (impostor / "node.pem").write_bytes(cert.cert_pem)
    (impostor / "node-key.pem").write_bytes(cert.key_pem)
    d.kill9("n3")
    log = (d.root / "impostor.log").open("ab")
    proc = host.popen(
        [
            sys.executable,
            "-m",
            "sevendb.cluster.ops.cli",
            "node",
            "run",
            "--config",
            str(impostor / "node.toml"),
            "--node-data-dir",
            str(d.bundles / "n3" / "data"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: b"serving gRPC" in (d.root / "impostor.log").read_bytes(),
            60,
            "the impostor to serve",
        )
        ca = str(d.bundles / "ca.pem")
        token = ClientConfig.load(d.client_toml).token or ""
        run = _get_on(d, "n3", "--ca", ca, token=token)
        assert run.returncode == 3 and "CERTIFICATE_VERIFY_FAILED" in run.stderr, run.stderr
        write = _cli(
            d,
            "write",
            "refusal/x",
            "impostor",
            "--endpoints",
            f"{host.address}:7001",
            "--token",
            token,
            "--ca",
            ca,
        )
        assert write.returncode == 3, write.stderr
        # A node reaches another with its own certificate and the cluster's CA.
        n1 = d.bundles / "n1"
        probe = (
            "import grpc, sys\n"
            "from pathlib import Path\n"
            "from sevendb.proto import sevendb_pb2 as pb, sevendb_pb2_grpc as g\n"
            f"b = Path({str(n1)!r})\n"
            "creds = grpc.ssl_channel_credentials((b / 'ca.pem').read_bytes(), "
            "(b / 'node-key.pem').read_bytes(), (b / 'node.pem').read_bytes())\n"
            f"ch = grpc.secure_channel('{host.address}:7001', creds)\n"
            "try:\n"
            "    g.SevenDBStub(ch).Status(pb.StatusRequest(), timeout=5)\n"
            "except grpc.RpcError as e:\n"
            "    print(e.code().name, e.details()); sys.exit(0)\n"
            "sys.exit('the impostor was trusted')\n"
        )
        out = d.node_hosts["n1"].run([sys.executable, "-c", probe], timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("UNAVAILABLE") and "CERTIFICATE_VERIFY_FAILED" in out.stdout
    finally:
        host.kill9(proc)
    d.start("n3")
    d.wait_leaders()
    wait_for(d.converged, 90, "replicas to converge after the impostor")
    assert json.loads(d.sevendb("get", "refusal/x"))["value"] == "before"
