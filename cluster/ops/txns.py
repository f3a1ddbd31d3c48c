"""`sevendb txn list|resolve`: the transactions not complete (open, or decided and
awaiting their markers), and an administrator's decision of an open one
(docs/transactions.md, "In-doubt transactions"). As the "admin" principal unless
`--principal` / `--token` say otherwise."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from sevendb.cluster.ops.subscriptions import (
    CALL_TIMEOUT_S,
    Endpoints,
    Token,
    _as_admin,
    _Nodes,
    _run,
)

HEADER = (
    f"{'transactional_id':<24} {'number':>6} {'epoch':>5} {'phase':<15} {'outcome':<16} "
    "buckets  age"
)


def cmd_list(args: argparse.Namespace, endpoints: Endpoints, token: Token) -> int:
    from sevendb.proto import sevendb_pb2 as pb

    def run(nodes: _Nodes) -> int:
        answer = nodes.call(
            lambda s: s.ListTransactions(
                pb.ListTransactionsRequest(), metadata=nodes.metadata, timeout=CALL_TIMEOUT_S
            )
        )
        now = time.time_ns() // 1_000_000
        rows = [
            {
                "transactional_id": t.transactional_id,
                "owner": t.owner,
                "number": t.number,
                "epoch": t.epoch,
                "phase": t.phase,
                "outcome": t.outcome,
                "buckets": list(t.buckets),
                "coordinator": t.coordinator,
                "age_s": round((now - t.started_ms) / 1000, 1),
                "timeout_s": t.timeout_ms / 1000,
            }
            for t in answer.transactions
        ]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(HEADER)
        for r in rows:
            buckets = ",".join(map(str, r["buckets"])) or "-"
            print(
                f"{r['transactional_id']:<24} {r['number']:>6} {r['epoch']:>5} {r['phase']:<15} "
                f"{r['outcome']:<16} {buckets:<8} {r['age_s']}s"
            )
        return 0

    return _run(args, endpoints, token, run)


def cmd_resolve(args: argparse.Namespace, endpoints: Endpoints, token: Token) -> int:
    from sevendb.proto import sevendb_pb2 as pb

    def run(nodes: _Nodes) -> int:
        request = pb.TxnRequest(
            action=pb.TxnRequest.RESOLVE,
            transactional_id=args.transactional_id,
            number=args.number,
            resolve_commit=args.decision == "commit",
        )
        answer = nodes.call(
            lambda s: s.Txn(request, metadata=nodes.metadata, timeout=CALL_TIMEOUT_S)
        )
        buckets = ",".join(map(str, answer.buckets)) or "none"
        print(
            f"transaction {answer.number} of {args.transactional_id}: {args.decision} decided "
            f"(participant buckets: {buckets})"
        )
        return 0

    return _run(args, endpoints, token, run)


def add_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
    endpoints: Endpoints,
    token: Token,
    tls: Callable[[argparse.Namespace], Any],
) -> None:
    """Add `txn list|resolve` to the `sevendb` parser (cluster/ops/cli.py)."""
    group = sub.add_parser(
        "txn", help="list transactions not complete, or resolve one (as admin by default)"
    ).add_subparsers(dest="action", required=True)
    listing = group.add_parser("list", parents=[common], help="open and in-doubt transactions")
    listing.add_argument("--json", action="store_true", help="as JSON")
    listing.set_defaults(fn=lambda a: cmd_list(_as_admin(a), endpoints, token), tls_of=tls)
    resolve = group.add_parser(
        "resolve", parents=[common], help="decide an open transaction: commit or abort"
    )
    resolve.add_argument("transactional_id", help="the transactional id")
    resolve.add_argument("number", type=int, help="the transaction's number (`txn list`)")
    resolve.add_argument("decision", choices=("commit", "abort"), help="the decision")
    resolve.set_defaults(fn=lambda a: cmd_resolve(_as_admin(a), endpoints, token), tls_of=tls)


__all__ = ["add_commands"]
