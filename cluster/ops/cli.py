"""The `sevendb` command line.

Client and admin commands find the cluster through a client bundle (`--config
FILE` or $SEVENDB_CONFIG: endpoints, a token and TLS files, written by `sevendb
cluster init`), or a local cluster's data dir (`--data DIR`, $SEVENDB_DATA, default
./.sevendb), or `--endpoints host:port,...` ($SEVENDB_ENDPOINTS) with `--token`
($SEVENDB_TOKEN) and `--ca FILE` (TLS; `--insecure` for a plaintext cluster).
They give up after --timeout seconds (default 5) when no node answers.

Exit codes: 0 done; 1 refused by the cluster (a failed precondition, not found,
...); 2 bad input (a usage error, an invalid argument, an unreadable cursor
file), nothing sent or changed; 3 the cluster could not be reached in time;
130 interrupted. Errors are one line on stderr (docs/errors.md).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from collections.abc import Iterator

    from sevendb.cluster.common.bundle import ClientConfig
    from sevendb.cluster.common.topology import MigrationSpec
    from sevendb.cluster.ops.admin import ClusterAdmin
    from sevendb.sdk import TLS, Client, Event, Record, SubscribeOptions

DEFAULT_DATA = ".sevendb"
DEFAULT_PRINCIPAL = "default"
DEMO_DATA = ".sevendb-demo"
DEFAULT_TIMEOUT_S = 5.0
"""How long a client command waits for the cluster (a dead endpoint fails in this)."""
EXIT_REFUSED = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a timeout is a number of seconds > 0, not {text!r}")
    return value


def _data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data or os.environ.get("SEVENDB_DATA") or DEFAULT_DATA)


def _client_config(args: argparse.Namespace) -> ClientConfig | None:
    """The client bundle named by --config / $SEVENDB_CONFIG, else the local data
    dir's client.toml if there is one."""
    from sevendb.cluster.common.bundle import CLIENT_FILE, ClientConfig

    named = getattr(args, "config", None) or os.environ.get("SEVENDB_CONFIG")
    if named:
        return ClientConfig.load(Path(named))
    local = _data_dir(args) / CLIENT_FILE
    return ClientConfig.load(local) if local.exists() else None


def _endpoints(args: argparse.Namespace) -> list[str]:
    from sevendb.cluster.common.topology import ConfigError

    raw = args.endpoints or os.environ.get("SEVENDB_ENDPOINTS")
    if raw:
        return [e.strip() for e in raw.split(",") if e.strip()]
    config = _client_config(args)
    if config is None:
        raise ConfigError(
            f"no cluster found: give --config FILE (a client bundle), --endpoints "
            f"HOST:PORT,..., or --data DIR of a local cluster (none in {_data_dir(args)})"
        )
    return list(config.endpoints)


def _token(args: argparse.Namespace) -> str | None:
    """--token, else $SEVENDB_TOKEN, else the client bundle's token when --config
    names one, else one minted for --principal from a local cluster's secret, else
    none."""
    token = getattr(args, "token", None) or os.environ.get("SEVENDB_TOKEN")
    if token:
        return str(token)
    from sevendb.cluster.common.topology import ConfigError
    from sevendb.cluster.ops.local import local_token

    if getattr(args, "config", None) or os.environ.get("SEVENDB_CONFIG"):
        config = _client_config(args)
        return None if config is None else config.token
    try:
        return local_token(_data_dir(args), args.principal or DEFAULT_PRINCIPAL)
    except ConfigError:
        return None


def _tls(args: argparse.Namespace) -> TLS | None:
    """--insecure: plaintext; --ca FILE (with --cert/--key): TLS with those files;
    else the client bundle's (or the local cluster's) TLS files; else TLS trusting
    the system's CAs."""
    from sevendb.cluster.ops.admin import client_tls
    from sevendb.sdk.tls import SYSTEM_ROOTS, TLS

    if getattr(args, "insecure", False):
        return None
    if getattr(args, "tls_ca", None) or getattr(args, "tls_cert", None):
        return TLS.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    config = _client_config(args)
    return SYSTEM_ROOTS if config is None else client_tls(config)


def _admin(args: argparse.Namespace) -> ClusterAdmin:
    """An admin connection: the bundle's (or the local cluster's) admin token and
    TLS files unless --token / $SEVENDB_TOKEN / --ca say otherwise."""
    from sevendb.cluster.ops.admin import ClusterAdmin

    token = getattr(args, "token", None) or os.environ.get("SEVENDB_TOKEN")
    config = _client_config(args)
    if not token and config is not None:
        token = config.token
    return ClusterAdmin(_endpoints(args), token, tls=_tls(args), progress=_progress)


@contextlib.contextmanager
def _refusal() -> Iterator[None]:
    """A gRPC error of an admin call as a one-line ConfigError."""
    import grpc

    from sevendb.cluster.common.topology import ConfigError

    try:
        yield
    except grpc.RpcError as exc:
        raise ConfigError(f"the cluster refused: {exc.code().name}: {exc.details()}") from None


def _client(args: argparse.Namespace) -> Client:
    from sevendb.sdk import Client, RetryPolicy

    timeout: float = getattr(args, "timeout", DEFAULT_TIMEOUT_S)
    retry = RetryPolicy(deadline_s=timeout, call_timeout_s=min(timeout, 10.0))
    return Client(_endpoints(args), token=_token(args), tls=_tls(args), retry=retry)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    from sevendb.cluster.ops.local import cluster_up

    result = cluster_up(
        _data_dir(args),
        nodes=args.nodes,
        buckets=args.buckets,
        replicas=args.replicas,
        insecure=args.insecure,
        progress=_progress,
    )
    spec = result.spec
    print(
        f"cluster {spec.cluster_id} is up: {len(spec.nodes)} nodes, {len(spec.buckets)} "
        f"buckets x {spec.replicas} replicas"
    )
    print("client endpoints: " + ",".join(n.grpc_address for n in spec.nodes))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from sevendb.cluster.ops.local import cluster_down

    stopped = cluster_down(_data_dir(args), progress=_progress)
    print(f"stopped {len(stopped)} node(s): {', '.join(stopped) or 'none were running'}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from sevendb.cluster.ops.local import node_status
    from sevendb.proto import sevendb_pb2 as pb

    rows: dict[int, list[tuple[str, pb.ReplicaStatus]]] = {}
    down = []
    tls = _tls(args)
    for endpoint in _all_nodes(args):
        status = node_status(endpoint, tls, digests=args.json)
        if status is None:
            down.append(endpoint)
            continue
        for r in status.replicas:
            rows.setdefault(r.bucket, []).append((status.node_id, r))
    if args.json:
        out = {
            str(b): [
                {
                    "node": n,
                    "leader": r.leader,
                    "is_leader": r.is_leader,
                    "commit_index": r.commit_index,
                    "applied_index": r.applied_index,
                    "epoch": r.epoch_counter,
                    "term": r.term,
                    "digest": r.digest,
                    "quarantined": r.quarantined,
                    "state": _replica_state(r.quarantined),
                    "members": list(r.members),
                    "lease_holder": r.lease_holder,
                    "emitting": r.emitting,
                    "subscriptions": r.subscriptions,
                    "outbox_rows": r.outbox_rows,
                }
                for n, r in reps
            ]
            for b, reps in sorted(rows.items())
        }
        migrations = [
            {
                "bucket": m.bucket,
                "from": list(m.from_nodes),
                "to": list(m.to_nodes),
                "hold_point": m.hold_point,
                "epoch_target": m.epoch_target,
                "started_ms": m.started_ms,
            }
            for m in _migrations(args)
        ]
        print(json.dumps({"buckets": out, "migrations": migrations, "unreachable": down}, indent=2))
        return 0 if not down else 1
    print(f"{'bucket':>6} {'leader':<8} {'epoch':>5} {'commit':>8}  replicas (node:applied lag)")
    for bucket, reps in sorted(rows.items()):
        leader_node = next((n for n, r in reps if r.is_leader), "-")
        commit = max(r.commit_index for _, r in reps)
        epoch = max(r.epoch_counter for _, r in reps)
        parts = []
        for node, r in sorted(reps, key=lambda x: x[0]):
            state = _replica_state(r.quarantined)
            flag = "" if state == "serving" else " " + state.upper()
            parts.append(f"{node}:{r.applied_index} lag {commit - r.applied_index}{flag}")
        print(f"{bucket:>6} {leader_node:<8} {epoch:>5} {commit:>8}  " + ", ".join(parts))
    for bucket, reps in sorted(rows.items()):
        for node, r in sorted(reps, key=lambda x: x[0]):
            if r.quarantined:
                print(f"bucket {bucket} on {node}: {r.quarantined}")
    for endpoint in down:
        print(f"node at {endpoint} is not answering")
    for m in _migrations(args):
        age = max(0.0, time.time() - m.started_ms / 1000)
        print(
            f"bucket {m.bucket}: UNFINISHED MIGRATION {','.join(m.from_nodes)} -> "
            f"{','.join(m.to_nodes)} (started {age:.0f} s ago; log held from index "
            f"{m.hold_point}; epoch {m.epoch_target} next): run `sevendb bucket migrate "
            f"{m.bucket}` to finish it or add --rollback to undo it"
        )
    return 0 if not down else 1


def _all_nodes(args: argparse.Namespace) -> list[str]:
    """Every node's client address, as the cluster's metadata has them (the
    endpoints given, if no node answers)."""
    from sevendb.cluster.common.topology import ConfigError

    endpoints = _endpoints(args)
    try:
        with _admin(args) as admin:
            return [n.grpc_address for n in admin.read(linearizable=False).spec.nodes]
    except ConfigError:
        return endpoints


def _replica_state(reason: str) -> str:
    """serving, repairing, data_loss or quarantined, from a replica's status reason
    (docs/raft.md, "Disk faults")."""
    if not reason:
        return "serving"
    if reason.startswith("repairing"):
        return "repairing"
    if reason.startswith("DATA_LOSS"):
        return "data_loss"
    return "quarantined"


def cmd_recover(args: argparse.Namespace) -> int:
    """Show BUCKET's replicas after disk damage and, with --accept-loss, tell each of
    them that the entries no reachable replica holds are lost for good (docs/raft.md,
    "Disk faults")."""
    import grpc

    from sevendb.proto import sevendb_pb2 as pb

    with _admin(args) as admin:
        spec = admin.read().spec
        if args.bucket >= len(spec.buckets):
            raise SystemExit(f"sevendb: bucket {args.bucket} does not exist")
        placed = spec.buckets[args.bucket].nodes

        def ask(node_id: str, accept: bool) -> str:
            request = pb.RecoverRequest(bucket=args.bucket, accept_loss=accept)
            try:
                answer = admin.stub(spec.node(node_id).grpc_address).RecoverBucket(
                    request, metadata=admin.metadata, timeout=10
                )
            except grpc.RpcError as exc:
                return f"not answering ({exc.code().name})"
            return answer.state or "serving" if answer.has_replica else "no replica"

        states = {node_id: ask(node_id, False) for node_id in placed}
        for node_id, state in states.items():
            print(f"bucket {args.bucket} on {node_id}: {state}")
        lost = any(_replica_state(s) == "data_loss" for s in states.values())
        if not args.accept_loss:
            print(
                "choices: start the replicas that are not answering (they may hold the "
                f"entries), or `sevendb bucket recover {args.bucket} --accept-loss` to go "
                "on without what no reachable replica holds"
            )
            return 1 if lost else 0
        for node_id in placed:
            print(
                f"bucket {args.bucket} on {node_id}: told to accept the loss: {ask(node_id, True)}"
            )
    return 0


def _add_recover(bucket: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    recover = bucket.add_parser(
        "recover",
        parents=[common],
        help="after disk damage: show BUCKET's replicas; --accept-loss to go on without "
        "the entries no reachable replica holds (docs/raft.md)",
    )
    recover.add_argument("bucket", type=_bucket_number, help="the bucket's number")
    recover.add_argument(
        "--accept-loss",
        action="store_true",
        help="the replicas that lost acknowledged entries stop waiting for them",
    )
    recover.set_defaults(fn=cmd_recover)


def _migrations(args: argparse.Namespace) -> list[MigrationSpec]:
    from sevendb.cluster.common.topology import ConfigError

    try:
        with _admin(args) as admin:
            return list(admin.read(linearizable=False).spec.migrations)
    except ConfigError:
        return []  # no node answers: the buckets' lines say so


def _bucket_number(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a bucket is a number, not {text!r}")
    return int(text)


def cmd_migrate(args: argparse.Namespace) -> int:
    from sevendb.cluster.ops.migrate import migrate_bucket

    to = tuple(n.strip() for n in args.to.split(",") if n.strip()) if args.to else None
    with _admin(args) as admin:
        migrate_bucket(admin, args.bucket, to, rollback=args.rollback, progress=_progress)
    return 0


def cmd_rebalance(args: argparse.Namespace) -> int:
    from sevendb.cluster.ops.local import retire_node
    from sevendb.cluster.ops.migrate import rebalance

    data = _data_dir(args).resolve()
    local = (data / "nodes").is_dir() and not (args.config or os.environ.get("SEVENDB_CONFIG"))
    with _admin(args) as admin:
        done = rebalance(
            admin,
            dry_run=args.dry_run,
            progress=_progress,
            # A local cluster's drained nodes are stopped here; elsewhere the operator
            # stops the process on its machine.
            stop_node=(lambda n: retire_node(data, n, _progress)) if local else None,
        )
    if not args.dry_run:
        print(f"rebalanced: {len(done)} bucket(s) moved")
    return 0


def cmd_node_add(args: argparse.Namespace) -> int:
    from sevendb.cluster.ops.local import add_node

    node = add_node(_data_dir(args), progress=_progress)
    print(
        f"node {node.node_id} added (gRPC {node.grpc_address}); it holds no bucket yet: "
        "run `sevendb rebalance --dry-run` to see what would move to it"
    )
    return 0


def cmd_node_remove(args: argparse.Namespace) -> int:
    from sevendb.cluster.ops.migrate import mark_draining

    with _admin(args) as admin:
        node = mark_draining(admin, args.node)
    print(
        f"node {node.node_id} is draining: placement skips it; `sevendb rebalance` moves its "
        "buckets away and then stops it"
    )
    return 0


def cmd_write(args: argparse.Namespace) -> int:
    value = read_value(args.value)
    with _client(args) as client:
        result = client.put(
            args.key,
            value,
            expected_version=args.expect_version,
            must_not_exist=args.if_absent,
        )
    print(
        json.dumps(
            {
                "key": args.key,
                "version": result.versions.get(args.key),
                "bucket": result.bucket,
                "committed": str(result.committed),
            }
        )
    )
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with _client(args) as client:
        record = client.get(args.key)
    if record is None:
        print(f"{args.key}: not found", file=sys.stderr)
        return 1
    print(_record_json(record))
    return 0


def _record_json(record: Record) -> str:
    return json.dumps(
        {
            "key": record.key,
            "value": record.value.decode(errors="replace"),
            "version": record.version,
            "mod_commit_index": record.mod_commit_index,
        }
    )


def cmd_delete(args: argparse.Namespace) -> int:
    """Delete KEY (a no-op if it is absent, unless --expect-version says otherwise)."""
    with _client(args) as client:
        result = client.delete(args.key, expected_version=args.expect_version)
    print(json.dumps({"key": args.key, "deleted": True, "committed": str(result.committed)}))
    return 0


def cmd_range(args: argparse.Namespace) -> int:
    """The keys under --prefix or in [--start, --end), one JSON line each, in key
    order, page by page (--limit per page), up to --max lines."""
    from sevendb.outbox.errors import InvalidArgument

    if args.prefix and (args.start or args.end):
        raise InvalidArgument("range: --prefix or --start/--end, not both")
    if args.limit < 0 or (args.max is not None and args.max < 1):
        raise InvalidArgument("range: --limit must be >= 0 and --max >= 1")
    printed, token = 0, ""
    with _client(args) as client:
        while True:
            page = client.range(
                prefix=args.prefix,
                start=args.start,
                end=args.end,
                limit=args.limit,
                page_token=token,
                serializable=args.serializable,
            )
            for record in page.records:
                if args.max is not None and printed >= args.max:
                    return 0
                print(_record_json(record))
                printed += 1
            token = page.next_page_token
            if not token:
                return 0


def cmd_token(args: argparse.Namespace) -> int:
    """A token for NAME valid for --ttl: minted by the cluster (an admin call, so an
    admin machine needs no secrets file), or offline from --secrets FILE."""
    from sevendb.cluster.common.auth import check_principal, parse_duration

    check_principal(args.name)  # before reading anything: bad input is refused first
    ttl_s = parse_duration(args.ttl)
    if args.secrets:
        from sevendb.cluster.common.bundle import ClusterSecrets

        keyring = ClusterSecrets.load(Path(args.secrets)).keyring()
        print(keyring.mint(args.name, now_ms=time.time_ns() // 1_000_000, ttl_s=ttl_s))
        return 0
    with _admin(args) as admin, _refusal():
        minted = admin.mint_token(args.name, ttl_s)
    expires = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(minted.expires_ms / 1000))
    _progress(f"token for {args.name}, key {minted.key_id}, expires {expires}")
    print(minted.token)
    return 0


def cmd_auth(args: argparse.Namespace) -> int:
    """`sevendb auth keys|rotate-key|retire-key KID|revoke NAME` (docs/security.md)."""
    from sevendb.cluster.common.auth import check_principal

    if args.action == "revoke":
        check_principal(args.name)
    with _admin(args) as admin, _refusal():
        if args.action == "keys":
            print(f"{admin.signing_key()} signs new tokens")
            for kid, state in sorted(admin.token_keys().items()):
                print(f"{kid} {state}")
        elif args.action == "rotate-key":
            previous, new = admin.rotate_token_key()
            print(
                f"{new} signs new tokens from now on; {previous} is still accepted: once "
                f"its tokens are re-minted or expired, `sevendb auth retire-key {previous}`"
            )
        elif args.action == "retire-key":
            admin.retire_token_key(args.kid)
            print(f"{args.kid} is retired: every node refuses the tokens it signed")
        else:
            at = admin.revoke(args.name)
            print(
                f"the tokens and certificates of {args.name} issued before {at} ms are "
                "refused by every node; new ones work"
            )
    return 0


def cmd_acl(args: argparse.Namespace) -> int:
    """`sevendb acl grant|revoke PRINCIPAL PERMISSION [--prefix P]` and `acl list
    [PRINCIPAL]` (admin; docs/security.md, "Access control")."""
    from sevendb.cluster.common.acl import AclError, Grant, permission_of
    from sevendb.outbox.errors import InvalidArgument

    grant = None
    try:
        if args.action != "list":
            grant = Grant(args.principal, permission_of(args.permission), args.prefix)
        elif args.principal is not None:
            Grant(args.principal, permission_of("read"))  # checks the name
    except AclError as exc:
        raise InvalidArgument(str(exc)) from None
    with _admin(args) as admin, _refusal():
        if grant is None:
            grants = admin.acl().of_principal(args.principal)
            for g in grants:
                print(g.describe())
            if not grants:
                print("no grants" + (f" for {args.principal}" if args.principal else ""))
        elif args.action == "grant":
            done = admin.grant(grant)
            print(f"granted: {grant.describe()}" if done else f"already: {grant.describe()}")
        else:
            done = admin.revoke_grant(grant)
            print(f"revoked: {grant.describe()}" if done else f"no such grant: {grant.describe()}")
    return 0


def _bundle_dir(args: argparse.Namespace) -> Path:
    """Where the CA's files are by default: beside client.toml (or in the data dir)."""
    config = args.config or os.environ.get("SEVENDB_CONFIG")
    return Path(config).parent if config else _data_dir(args)


def cmd_cert(args: argparse.Namespace) -> int:
    """A client certificate naming principal NAME, from the cluster's CA (mTLS)."""
    from sevendb.cluster.common.auth import check_principal
    from sevendb.cluster.common.bundle import CA_FILE, CA_KEY_FILE, write_file
    from sevendb.cluster.common.tls import issue
    from sevendb.cluster.ops.deploy import load_ca_files

    check_principal(args.name)
    base = _bundle_dir(args)
    ca = load_ca_files(args.ca_cert or base / CA_FILE, args.ca_key or base / CA_KEY_FILE)
    issued = issue(ca, args.name, server=False)
    out = Path(args.out)
    cert = write_file(out / f"{args.name}.pem", issued.cert_pem)
    key = write_file(out / f"{args.name}-key.pem", issued.key_pem, secret=True)
    print(f"wrote {cert} and {key} (mode 0600): TLS.from_files(ca=..., cert=..., key=...)")
    return 0


def event_lines(event: Event) -> list[str]:
    """`sevendb subscribe` output: one JSON line per change of a delivered event."""
    return [
        json.dumps(
            {
                "emit_seq": event.emit_seq.pack(),
                "prev_emit_seq": event.prev_emit_seq.pack(),
                "bucket": event.bucket,
                "key": change.key,
                "op": change.op.name,
                "value": change.value.decode(errors="replace"),
                "version": change.version,
                "commit_time_ms": event.commit_time_ms,
            }
        )
        for change in event.changes
    ]


def _start_at(text: str) -> str | datetime:
    """`--start`: latest, earliest or an ISO 8601 time (UTC unless it says)."""
    if text in ("latest", "earliest"):
        return text
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--start takes latest, earliest or an ISO 8601 time, not {text!r}"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def cmd_history(args: argparse.Namespace) -> int:
    count = 0
    with _client(args) as client:
        for event in client.history(args.query, page_size=args.page_size):
            print("\n".join(event_lines(event)), flush=True)
            count += 1
    _progress(f"{count} event(s) retained")
    return 0


def cmd_subscribe(args: argparse.Namespace) -> int:
    from sevendb.sdk import Recovery, StreamReset, SubscribeOptions

    def on_reset(reset: StreamReset) -> None:
        _progress(
            f"bucket {reset.bucket}: {reset.reason}: subscription {reset.old_sub_id} could "
            "not be resumed; continuing with a new one from the current end of the log"
        )

    options = SubscribeOptions(on_reset=on_reset, on_stale=Recovery(args.on_stale))
    # Leaving the block closes the subscription: with --cursor or --durable it stays on
    # the server for the next run to resume, without either it is ended. An event is
    # processed (acked) once printed: interrupted while printing, it comes again.
    if args.group is not None:
        return _subscribe_group(args, options)
    with (
        _client(args) as client,
        client.subscribe(
            args.query,
            cursor=args.cursor,
            options=options,
            durable=args.durable,
            start=_start_at(args.start),
        ) as sub,
    ):
        _progress(f"subscribed to {args.query} in {sub.stats().buckets} bucket(s)")
        delivered = _print_events(sub, args)
    _progress(f"delivered {delivered} event(s)")
    return 0


class _Polled(Protocol):
    def poll(self, timeout_s: float = 0.0) -> Event | None: ...


def _print_events(sub: _Polled, args: argparse.Namespace) -> int:
    """Print `sub`'s events (`--count`, `--idle-exit`) until interrupted: how many."""
    delivered = 0
    try:
        while args.count is None or delivered < args.count:
            event = sub.poll(args.idle_exit if args.idle_exit else 3600.0)
            if event is None:
                if args.idle_exit:
                    break
                continue
            print("\n".join(event_lines(event)), flush=True)
            delivered += 1
    except KeyboardInterrupt:
        _progress("interrupted")
    return delivered


def _subscribe_group(args: argparse.Namespace, options: SubscribeOptions) -> int:
    """`sevendb subscribe QUERY --group NAME`: a member of the principal's consumer
    group; prints the events of the buckets it owns (docs/sdk.md, "Consumer groups")."""
    from sevendb.outbox.errors import InvalidArgument

    if args.cursor is not None or args.durable is not None or args.start != "latest":
        raise InvalidArgument("--group takes no --cursor, --durable or --start")
    with (
        _client(args) as client,
        client.subscribe(
            args.query, options=options, group=args.group, session_timeout_s=args.session_timeout
        ) as sub,
    ):
        _progress(
            f"joined group {args.group} as {sub.member}: buckets {sorted(sub.stats.owned)} "
            f"of {args.query}"
        )
        delivered = _print_events(sub, args)
    _progress(f"delivered {delivered} event(s)")
    return 0


def cmd_cluster_init(args: argparse.Namespace) -> int:
    from sevendb.cluster.common.topology import ConfigError
    from sevendb.cluster.ops.deploy import cluster_init, load_ca_files, port_plan

    if (args.ca_cert is None) != (args.ca_key is None):
        raise ConfigError("--ca-cert and --ca-key go together (your own CA)")
    spec = cluster_init(
        Path(args.out),
        args.node,
        buckets=args.buckets,
        replicas=args.replicas,
        meta_voters=args.meta_voters,
        ports=port_plan(args),
        listen_host=args.listen_host,
        insecure=args.insecure,
        ca=None if args.ca_cert is None else load_ca_files(args.ca_cert, args.ca_key),
        sans=args.san,
        progress=_progress,
    )
    if args.insecure:
        _progress("INSECURE: plaintext gRPC, no certificates (--insecure)")
    print(
        f"cluster {spec.cluster_id}: {len(spec.nodes)} node bundles and client.toml in "
        f"{args.out}; copy each node's directory to its machine and run "
        "`sevendb node run --config DIR/node.toml` there (docs/deploy.md)"
    )
    return 0


def cmd_backup_create(args: argparse.Namespace) -> int:
    from sevendb.cluster.ops.backup import create_backup

    with _admin(args) as admin:
        manifest = create_backup(admin, Path(args.out), _progress)
    size = sum(b.size for b in manifest.buckets)
    print(
        f"backup of cluster {manifest.cluster_id} in {args.out}: {len(manifest.buckets)} "
        f"buckets, {size} bytes"
    )
    return 0


def cmd_backup_restore(args: argparse.Namespace) -> int:
    from sevendb.cluster.common.topology import ConfigError
    from sevendb.cluster.ops.backup import restore_bundles, restore_local
    from sevendb.cluster.ops.deploy import port_plan

    if (args.out is None) == (args.local is None):
        raise ConfigError("give --out BUNDLES (with --node ...) or --local DIR")
    if args.local is not None:
        spec = restore_local(
            Path(args.backup),
            Path(args.local),
            nodes=args.nodes,
            replicas=args.replicas,
            progress=_progress,
        )
        start = f"`sevendb --data {args.local} cluster up` starts it"
    else:
        spec = restore_bundles(
            Path(args.backup),
            Path(args.out),
            args.node,
            replicas=args.replicas,
            meta_voters=args.meta_voters,
            ports=port_plan(args),
            listen_host=args.listen_host,
            progress=_progress,
        )
        start = "copy each node's directory to its machine and run `sevendb node run` there"
    print(f"cluster {spec.cluster_id} restored from {args.backup}: {start}")
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    print(shtab.complete(build_parser(), shell=args.shell), end="")
    return 0


def _backup_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    from sevendb.cluster.ops.deploy import add_port_arguments

    backup = sub.add_parser(
        "backup", help="back a cluster up, or build a new cluster from a backup"
    ).add_subparsers(dest="action", required=True)
    create = backup.add_parser(
        "create",
        parents=[common],
        help="a consistent snapshot of every bucket and the metadata, while writes go on",
    )
    create.add_argument("--out", required=True, help="a new directory for the backup")
    create.set_defaults(fn=cmd_backup_create)
    restore = backup.add_parser(
        "restore",
        help="a NEW cluster (new id and secrets, epochs advanced) from a backup: bundles "
        "for machines (--out, --node) or a local cluster (--local)",
    )
    restore.add_argument("backup", help="the backup's directory (`backup create --out`)")
    restore.add_argument("--out", help="a new directory for the bundles (as `cluster init`)")
    restore.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="ID=HOST[:PORT]",
        help="with --out: a node of the new cluster (repeat)",
    )
    restore.add_argument(
        "--local", help="a new data dir for a local cluster on 127.0.0.1 (instead of --out)"
    )
    restore.add_argument(
        "--nodes", type=int, default=3, help="with --local: nodes (default %(default)s)"
    )
    restore.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="replicas per bucket (default: the backed-up cluster's)",
    )
    restore.add_argument(
        "--meta-voters", type=int, default=3, help="with --out: 1, 3 or 5 (default %(default)s)"
    )
    add_port_arguments(restore)
    restore.set_defaults(fn=cmd_backup_restore)


def _init_parser(cluster: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from sevendb.cluster.ops.deploy import add_port_arguments

    init = cluster.add_parser(
        "init", help="create a cluster across machines: one bundle per node and a client bundle"
    )
    init.add_argument("--out", required=True, help="a new directory for the bundles")
    init.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="ID=HOST[:PORT]",
        help="a node and the address others reach it at (repeat; the first 3 or 5 are "
        "metadata voters)",
    )
    init.add_argument("--buckets", type=int, default=8, help="buckets (fixed; default %(default)s)")
    init.add_argument(
        "--replicas", type=int, default=3, help="replicas per bucket (default %(default)s)"
    )
    init.add_argument("--meta-voters", type=int, default=3, help="1, 3 or 5 (default %(default)s)")
    init.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext gRPC and no certificates (TLS is the default)",
    )
    add_port_arguments(init)
    init.set_defaults(fn=cmd_cluster_init)


def cmd_node_init(args: argparse.Namespace) -> int:
    from sevendb.cluster.common.bundle import CA_FILE, CA_KEY_FILE
    from sevendb.cluster.ops.deploy import load_ca_files, node_init, port_plan

    with _admin(args) as admin:
        ca = None
        if admin.tls is not None:
            base = _bundle_dir(args)
            ca = load_ca_files(args.ca_cert or base / CA_FILE, args.ca_key or base / CA_KEY_FILE)
        node = node_init(
            admin,
            Path(args.out),
            args.node,
            ports=port_plan(args),
            listen_host=args.listen_host,
            ca=ca,
            sans=args.san,
            progress=_progress,
        )
    print(
        f"node {node.node_id} is registered; run `sevendb node run --config "
        f"{Path(args.out) / node.node_id / 'node.toml'}` on its machine, then "
        "`sevendb rebalance` to move buckets to it"
    )
    return 0


def _node_init_parser(
    node: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    from sevendb.cluster.ops.deploy import add_port_arguments

    init = node.add_parser(
        "init", parents=[common], help="register a new machine's node and write its bundle"
    )
    init.add_argument(
        "--node", required=True, metavar="ID=HOST[:PORT]", help="the new node's id and address"
    )
    init.add_argument("--out", required=True, help="where to write the bundle (OUT/ID/)")
    add_port_arguments(init)
    init.set_defaults(fn=cmd_node_init)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every argument's help ends with its default, unless it names one already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == []:
            return text
        if default == argparse.SUPPRESS or isinstance(default, bool):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults (subcommands inherit the class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sevendb")
    except PackageNotFoundError:
        return "0+unknown"


GLOBAL_OPTIONS = (
    "--data",
    "--config",
    "--endpoints",
    "--token",
    "--principal",
    "--timeout",
    "--ca",
    "--cert",
    "--key",
    "--insecure",
)
"""Options that may come before the command (`sevendb --data DIR status`) or after it."""
GLOBAL_FLAGS = ("--insecure",)
"""Those of GLOBAL_OPTIONS that take no value."""


def _add_common(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """How a command finds the cluster (GLOBAL_OPTIONS). On the top parser they hold
    the defaults; on each command's (`suppress`) they only override what was given
    before the command."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--data",
        default=default(None),
        help=f"a local cluster's data dir (default ${{SEVENDB_DATA}} or ./{DEFAULT_DATA})",
    )
    parser.add_argument(
        "--config",
        default=default(None),
        help="a client bundle: client.toml from `sevendb cluster init` (default $SEVENDB_CONFIG)",
    )
    parser.add_argument(
        "--endpoints",
        default=default(None),
        help="client endpoints host:port,... (default $SEVENDB_ENDPOINTS; instead of --data)",
    )
    parser.add_argument(
        "--token",
        default=default(None),
        help="bearer token (default $SEVENDB_TOKEN, the bundle's, or minted from the data dir)",
    )
    parser.add_argument(
        "--principal",
        default=default(None),
        help=f"with a local data dir and no token: act as this principal (default: "
        f"{DEFAULT_PRINCIPAL}; admin for `subscriptions`)",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=default(DEFAULT_TIMEOUT_S),
        help=f"client commands give up after this many seconds without an answer "
        f"(default {DEFAULT_TIMEOUT_S:g})",
    )
    for flag, dest, help_ in (
        ("--ca", "tls_ca", "TLS: trust this CA certificate (default: the bundle's)"),
        ("--cert", "tls_cert", "TLS: present this client certificate (mTLS)"),
        ("--key", "tls_key", "TLS: the client certificate's key (mode 0600)"),
    ):
        parser.add_argument(flag, dest=dest, default=default(None), help=help_)
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=default(False),
        help="plaintext gRPC (a cluster made with --insecure; `cluster up`: make one)",
    )


def _cluster_admin_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """bucket migrate|recover, rebalance, node add|init|run|remove."""
    bucket = sub.add_parser("bucket", help="bucket operations").add_subparsers(
        dest="action", required=True
    )
    migrate = bucket.add_parser(
        "migrate",
        parents=[common],
        help="move BUCKET's replicas to other nodes, then bump its epoch (resumable)",
    )
    migrate.add_argument("bucket", type=_bucket_number, help="the bucket's number")
    migrate.add_argument("--to", help="the target nodes, NODE[,NODE...] (R of them)")
    migrate.add_argument(
        "--rollback", action="store_true", help="undo an unfinished migration instead"
    )
    migrate.set_defaults(fn=cmd_migrate)
    _add_recover(bucket, common)
    rebalance = sub.add_parser(
        "rebalance",
        parents=[common],
        help="move the buckets whose rendezvous placement changed, one at a time",
    )
    rebalance.add_argument("--dry-run", action="store_true", help="print the plan only")
    rebalance.set_defaults(fn=cmd_rebalance)
    node = sub.add_parser("node", help="add or remove nodes").add_subparsers(
        dest="action", required=True
    )
    node.add_parser(
        "add", parents=[common], help="add and start a node (a local cluster)"
    ).set_defaults(fn=cmd_node_add)
    _node_init_parser(node, common)
    node.add_parser(
        "run",
        add_help=False,
        help="run a node in the foreground: node run --config node.toml (`node run --help`)",
    )
    remove = node.add_parser(
        "remove", parents=[common], help="drain NODE (rebalance then moves its buckets)"
    )
    remove.add_argument("node", help="the node's id")
    remove.set_defaults(fn=cmd_node_remove)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sevendb", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"sevendb {_version()}", help="print the version"
    )
    _add_common(parser, suppress=False)
    common = _Parser(add_help=False)
    _add_common(common, suppress=True)
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True),
    )
    demo = sub.add_parser("demo", help="run the demo (starts and stops a local cluster)")
    demo.add_argument(
        "--data",
        default=argparse.SUPPRESS,
        help=f"data dir of the demo cluster (default ./{DEMO_DATA})",
    )
    demo.set_defaults(fn=None)
    cluster = sub.add_parser("cluster", help="run a local cluster").add_subparsers(
        dest="action", required=True
    )
    up = cluster.add_parser("up", parents=[common], help="start (or restart) a local cluster")
    up.add_argument("--nodes", type=int, default=3, help="node processes on 127.0.0.1")
    up.add_argument("--buckets", type=int, default=8, help="buckets (fixed once created)")
    up.add_argument("--replicas", type=int, default=3, help="replicas per bucket")
    up.set_defaults(fn=cmd_up)
    cluster.add_parser("down", parents=[common], help="stop the local cluster").set_defaults(
        fn=cmd_down
    )
    _init_parser(cluster)
    status = sub.add_parser("status", parents=[common], help="per-bucket leader, commit, lag")
    status.add_argument(
        "--json", action="store_true", help="one JSON document, with each replica's digest"
    )
    status.set_defaults(fn=cmd_status)
    _add_client_commands(sub, common)
    _backup_parser(sub, common)
    completion = sub.add_parser(
        "completion",
        help="print a shell completion script: `sevendb completion bash > "
        "/etc/bash_completion.d/sevendb`, or zsh into a directory of $fpath as _sevendb",
    )
    completion.add_argument("shell", choices=("bash", "zsh", "tcsh"), help="the shell")
    completion.set_defaults(fn=cmd_completion)
    _cluster_admin_parsers(sub, common)
    sub.add_parser(
        "spark",
        add_help=False,
        help="PySpark jobs over the drained outbox: audit|stats|export|stream "
        "(`sevendb spark --help`)",
    )
    from sevendb.cluster.ops.subscriptions import add_commands

    add_commands(sub, common, _endpoints, _token, _tls)
    from sevendb.cluster.ops.txns import add_commands as add_txn_commands

    add_txn_commands(sub, common, _endpoints, _token, _tls)
    return parser


def _add_client_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """write, get, token and subscribe: the commands of the client's CLI."""
    client_common = common
    write = sub.add_parser("write", parents=[client_common], help="write KEY VALUE")
    write.add_argument("key", help="the key")
    write.add_argument(
        "value",
        help="the value; @FILE: a file's bytes; -: standard input's; @@...: a value that "
        "starts with @",
    )
    _add_expect_version(write)
    write.add_argument("--if-absent", action="store_true", help="fail if the key exists")
    write.set_defaults(fn=cmd_write)
    get = sub.add_parser("get", parents=[client_common], help="read KEY")
    get.add_argument("key", help="the key")
    get.set_defaults(fn=cmd_get)
    _add_kv_commands(sub, client_common)
    token = sub.add_parser(
        "token",
        parents=[common],
        help="print a token for principal NAME, minted by the cluster (admin) or --secrets",
    )
    token.add_argument("name", help="the principal the token names")
    token.add_argument(
        "--ttl", default="24h", help="how long it is valid: 90s, 15m, 12h, 30d (default 24h)"
    )
    token.add_argument(
        "--secrets", help="mint offline from this secrets.toml instead of through the cluster"
    )
    token.set_defaults(fn=cmd_token)
    _add_auth_commands(sub, common)
    _add_subscribe_command(sub, client_common)
    history = sub.add_parser(
        "history",
        parents=[client_common],
        help="print the retained history of QUERY (key:K, prefix:P or all): one JSON line "
        "per change, bucket by bucket",
    )
    history.add_argument("query", help="key:K, prefix:P or all")
    history.add_argument(
        "--page-size", type=int, default=0, help="change sets per request (default: the node's)"
    )
    history.set_defaults(fn=cmd_history)


def _add_subscribe_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """subscribe: tail a query."""
    subscribe = sub.add_parser(
        "subscribe",
        parents=[common],
        help="tail QUERY (key:K, prefix:P or all): one JSON line per change, acked as printed",
    )
    subscribe.add_argument("query", help="key:K, prefix:P or all")
    subscribe.add_argument(
        "--cursor",
        type=Path,
        help="cursor file: a restarted command resumes after its last event (without one, "
        "the subscription ends when the command does)",
    )
    subscribe.add_argument(
        "--durable",
        metavar="NAME",
        help="the principal's durable subscription NAME: made or resumed, its position "
        "kept by the server (any run resumes it after its last acknowledged event, with "
        "no cursor file; one consumer at a time)",
    )
    subscribe.add_argument(
        "--group",
        metavar="NAME",
        help="join the principal's consumer group NAME: the query's buckets are spread over "
        "its live members (each bucket to one member at a time) and move when one joins, "
        "leaves or stops heartbeating",
    )
    subscribe.add_argument(
        "--session-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="with --group: a member silent this long loses its buckets (default 10)",
    )
    subscribe.add_argument(
        "--start",
        default="latest",
        help="where a new subscription starts: latest (default), earliest (the oldest "
        "retained change) or an ISO 8601 time",
    )
    subscribe.add_argument("--count", type=int, help="exit after this many events (default: never)")
    subscribe.add_argument(
        "--idle-exit",
        type=float,
        default=0.0,
        help="exit after this many idle seconds (default 0: never)",
    )
    subscribe.add_argument(
        "--on-stale",
        choices=("resubscribe", "raise"),
        default="resubscribe",
        help="when a stream cannot be resumed (default: start afresh and say so on stderr)",
    )
    subscribe.set_defaults(fn=cmd_subscribe)


def _add_kv_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """delete and range."""
    delete = sub.add_parser("delete", parents=[common], help="delete KEY")
    delete.add_argument("key", help="the key")
    _add_expect_version(delete)
    delete.set_defaults(fn=cmd_delete)
    ranged = sub.add_parser(
        "range",
        parents=[common],
        help="read the keys under --prefix or in [--start, --end): one JSON line each",
    )
    ranged.add_argument("--prefix", default="", help="the keys starting with it")
    ranged.add_argument("--start", default="", help="the first key (inclusive)")
    ranged.add_argument("--end", default="", help="the end (exclusive; default: none)")
    ranged.add_argument(
        "--limit", type=int, default=0, help="keys per page (default: the node's, 100)"
    )
    ranged.add_argument("--max", type=int, default=None, help="stop after this many keys")
    ranged.add_argument(
        "--serializable",
        action="store_true",
        help="read without a read barrier (faster; may miss the latest writes)",
    )
    ranged.set_defaults(fn=cmd_range)


def _add_expect_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--expect-version",
        type=int,
        default=None,
        help="only if KEY is at this version; 0: only if KEY does not exist",
    )


def _add_acl_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """`sevendb acl grant|revoke|list`."""
    acl = sub.add_parser(
        "acl", help="who may read, write and administer what (admin; docs/security.md)"
    ).add_subparsers(dest="action", required=True)
    for action, what in (("grant", "give"), ("revoke", "take back")):
        parser = acl.add_parser(
            action, parents=[common], help=f"{what} PRINCIPAL the PERMISSION (on --prefix)"
        )
        parser.add_argument("principal", help="the principal")
        parser.add_argument(
            "permission",
            help="read or write (on the keys under --prefix), idempotent_write or admin "
            "(on the cluster)",
        )
        parser.add_argument(
            "--prefix", default="", help="read/write: the keys starting with it (default: all)"
        )
        parser.set_defaults(fn=cmd_acl)
    listing = acl.add_parser("list", parents=[common], help="the grants in force")
    listing.add_argument("principal", nargs="?", help="only this principal's")
    listing.set_defaults(fn=cmd_acl)


def _add_auth_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """`sevendb auth ...` (token keys, revocation) and `sevendb cert NAME`."""
    auth = sub.add_parser(
        "auth", help="token keys and revocation (admin; docs/security.md)"
    ).add_subparsers(dest="action", required=True)
    auth.add_parser("keys", parents=[common], help="the key that signs, and the others")
    auth.add_parser("rotate-key", parents=[common], help="add a token key that signs from now on")
    retire = auth.add_parser(
        "retire-key", parents=[common], help="refuse every token key KID signed"
    )
    retire.add_argument("kid", help="the key id (`sevendb auth keys` lists them)")
    revoke = auth.add_parser(
        "revoke", parents=[common], help="refuse NAME's tokens and certificates issued before now"
    )
    revoke.add_argument("name", help="the principal")
    _add_acl_commands(sub, common)
    auth.choices["keys"].set_defaults(fn=cmd_auth)
    for parser in (auth.choices["rotate-key"], retire, revoke):
        parser.set_defaults(fn=cmd_auth)
    cert = sub.add_parser(
        "cert",
        parents=[common],
        help="issue a client certificate for principal NAME from the cluster's CA (mTLS)",
    )
    cert.add_argument("name", help="the principal the certificate names")
    cert.add_argument("--out", default=".", help="where to write NAME.pem and NAME-key.pem")
    cert.add_argument("--ca-cert", type=Path, help="default: ca.pem beside client.toml")
    cert.add_argument("--ca-key", type=Path, help="default: ca-key.pem beside client.toml")
    cert.set_defaults(fn=cmd_cert)


def cmd_spark(argv: list[str]) -> int:
    """`sevendb spark JOB [PATH] ...`: the PySpark jobs (cluster/archive/spark_jobs.py). With no
    PATH they read `SEVENDB_ARCHIVE_ROOT`, else the archive of the local cluster found
    through the data dir."""
    from sevendb.cluster.archive import spark_jobs
    from sevendb.cluster.archive.writer import archive_root

    args = list(argv)
    data = None
    if "--data" in args:
        i = args.index("--data")
        if i + 1 >= len(args):
            print("sevendb spark: --data needs a directory", file=sys.stderr)
            return 2
        data = args[i + 1]
        del args[i : i + 2]
    parsed = spark_jobs.build_parser().parse_args(args)  # --help and usage errors exit here
    if not parsed.path:
        data_dir = Path(data or os.environ.get("SEVENDB_DATA") or DEFAULT_DATA).resolve()
        root = os.environ.get("SEVENDB_ARCHIVE_ROOT") or str(archive_root(data_dir))
        args.insert(1, root)
    return spark_jobs.main(args)


def leading_globals(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the GLOBAL_OPTIONS before the command, with their values; the rest)."""
    i = 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name not in GLOBAL_OPTIONS:
            break
        i += 1 if "=" in argv[i] or name in GLOBAL_FLAGS else 2
    return list(argv[:i]), list(argv[i:])


def read_value(text: str) -> bytes:
    """A value given on the command line: ``-`` is standard input's bytes, ``@FILE``
    a file's, ``@@...`` the text from its second ``@``; anything else its UTF-8."""
    from sevendb.outbox.errors import InvalidArgument

    if text == "-":
        return sys.stdin.buffer.read()
    if text.startswith("@@"):
        return text[1:].encode()
    if text.startswith("@"):
        try:
            return Path(text[1:]).read_bytes()
        except OSError as exc:
            raise InvalidArgument(f"{text}: cannot read the file ({exc.strerror})") from None
    return text.encode()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    before, rest = leading_globals(argv)
    if rest[:1] == ["spark"]:
        data = [a for a in before if a == "--data" or a.startswith("--data=")]
        if data and data[0] == "--data":
            data.append(before[before.index("--data") + 1])
        return cmd_spark([*rest[1:], *data])
    if rest[:2] == ["node", "run"]:
        from sevendb.cluster.ops.deploy import node_run

        return node_run([*before, *rest[2:]])
    args = parse_args(argv)
    if args.command == "demo":
        from sevendb.cluster.ops.demo import run_demo

        return run_demo(Path(getattr(args, "data", None) or DEMO_DATA))
    from sevendb.cluster.common.auth import AuthError
    from sevendb.cluster.common.topology import ConfigError
    from sevendb.cluster.ops.migrate import MigrationError
    from sevendb.outbox.errors import SevenDBError

    try:
        code: int = args.fn(args)
        return code
    except KeyboardInterrupt:
        print("sevendb: interrupted; a migration resumes when run again", file=sys.stderr)
        return 130
    except (ConfigError, SevenDBError, TimeoutError, MigrationError, AuthError) as exc:
        print(f"sevendb: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return exit_code(exc)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line parsed; a global option given before the command holds unless
    given again after it (a command's own defaults do not override it)."""
    args = _parse(build_parser(), argv)
    before, rest = leading_globals(argv)
    if before:
        top = _Parser(add_help=False)
        _add_common(top, suppress=True)
        given = vars(top.parse_args(before))
        after = {a.split("=", 1)[0] for a in rest if a.startswith("--")}
        for dest, value in given.items():
            if f"--{dest}" not in after:
                setattr(args, dest, value)
    return args


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args`, with a usage error in one line (exit 2) like every other
    error of the command, instead of argparse's usage lines."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit as exc:
        lines = err.getvalue().strip().splitlines()
        if exc.code == EXIT_BAD_INPUT and lines:
            prog = lines[-1].split(": error:", 1)[0]
            print(f"{lines[-1]} (see {prog} --help)", file=sys.stderr)
        else:
            sys.stderr.write(err.getvalue())
        raise


def exit_code(exc: BaseException) -> int:
    """The exit code of a command that failed with `exc` (the module docstring)."""
    from sevendb.cluster.common.auth import AuthError
    from sevendb.outbox.errors import InvalidArgument
    from sevendb.sdk import BrokenReason, CursorStoreError, SubscriptionBroken, Unavailable

    if isinstance(exc, Unavailable) or (
        isinstance(exc, SubscriptionBroken) and exc.reason is BrokenReason.UNAVAILABLE
    ):
        return EXIT_UNREACHABLE
    if isinstance(exc, InvalidArgument | CursorStoreError | AuthError):
        return EXIT_BAD_INPUT
    return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
