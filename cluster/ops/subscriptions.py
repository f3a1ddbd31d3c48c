"""`sevendb subscriptions list|show|delete`: what each bucket holds for its
subscribers, and deleting one (an UNSUBSCRIBE on its owner's behalf).

The commands act as the "admin" principal unless told otherwise (`--principal`,
`--token`): admin sees every subscription, any other principal only its own. They
ask any node; a node forwards to the bucket's leader.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Final, TypeVar

if TYPE_CHECKING:
    from sevendb.proto import sevendb_pb2 as pb
    from sevendb.proto import sevendb_pb2_grpc as pb_grpc

CALL_TIMEOUT_S: Final = 10.0
PAGE: Final = 1000
T = TypeVar("T")

Endpoints = Callable[[argparse.Namespace], list[str]]
Token = Callable[[argparse.Namespace], "str | None"]


class _Nodes:
    """Calls to whichever node answers first (UNAVAILABLE: the next one)."""

    def __init__(self, endpoints: list[str], token: str | None, tls: Any) -> None:
        from sevendb.cluster.common.auth import auth_metadata
        from sevendb.sdk.tls import sync_channel

        self._endpoints = endpoints
        self._channels = [sync_channel(e, tls) for e in endpoints]
        self.metadata = auth_metadata(token) if token else ()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def call(self, fn: Callable[[pb_grpc.SevenDBStub], T]) -> T:
        import grpc

        from sevendb.proto import sevendb_pb2_grpc as pb_grpc

        last: grpc.RpcError | None = None
        for channel in self._channels:
            try:
                return fn(pb_grpc.SevenDBStub(channel))
            except grpc.RpcError as exc:
                if exc.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                last = exc
        assert last is not None, "no endpoints"
        raise last

    def buckets(self) -> list[int]:
        from sevendb.proto import sevendb_pb2 as pb

        info = self.call(lambda s: s.ClusterInfo(pb.ClusterInfoRequest(), timeout=CALL_TIMEOUT_S))
        return [b.bucket for b in info.buckets]

    def pages(self, bucket: int, owner: str) -> Iterator[pb.SubscriptionInfo]:
        from sevendb.proto import sevendb_pb2 as pb

        after = ""
        while True:
            request = pb.ListSubscriptionsRequest(
                bucket=bucket, owner=owner, after_sub_id=after, limit=PAGE
            )
            page = self.call(
                lambda s, r=request: s.ListSubscriptions(  # type: ignore[misc]
                    r, metadata=self.metadata, timeout=CALL_TIMEOUT_S
                )
            )
            yield from page.subscriptions
            if not page.has_more or not page.subscriptions:
                return
            after = page.subscriptions[-1].sub_id


def _seq(seq: pb.EmitSeq) -> str:
    return f"{seq.epoch_id.epoch_counter}:{seq.commit_index}"


def _as_dict(info: pb.SubscriptionInfo, now_ms: int) -> dict[str, Any]:
    from sevendb.proto import codec

    return {
        "sub_id": info.sub_id,
        "bucket": info.bucket,
        "owner": info.owner,
        "query": str(codec.query_from_pb(info.query)),
        "start": _seq(info.start),
        "head": _seq(info.head),
        "acked": _seq(info.acked),
        "lag": info.lag,
        "last_active_ms": info.last_active_ms,
        "idle_s": round(max(0, now_ms - info.last_active_ms) / 1000, 1),
        "rows": info.rows,
        "row_bytes": info.row_bytes,
        "pending_rows": info.pending_rows,
        "attached": info.attached if info.attached_known else None,
    }


_COLUMNS: Final = (
    ("bucket", ">6"),
    ("sub_id", "<34"),
    ("owner", "<12"),
    ("query", "<20"),
    ("acked", ">12"),
    ("lag", ">8"),
    ("idle_s", ">9"),
    ("rows", ">7"),
    ("row_bytes", ">10"),
    ("attached", ">8"),
)
"""The table's columns: `acked` is the last acknowledged position (epoch:index),
`idle_s` the time since its last ack, subscribe or keep-alive (it expires past the
stall window)."""


def _line(row: dict[str, Any]) -> str:
    shown = {**row, "attached": {True: "yes", False: "no", None: "?"}[row["attached"]]}
    return " ".join(f"{shown[name]:{spec}}" for name, spec in _COLUMNS)


HEADER: Final = " ".join(f"{name:{spec}}" for name, spec in _COLUMNS)


def _run(
    args: argparse.Namespace, endpoints: Endpoints, token: Token, fn: Callable[[_Nodes], int]
) -> int:
    import grpc

    nodes = _Nodes(endpoints(args), token(args), args.tls_of(args))
    try:
        return fn(nodes)
    except grpc.RpcError as exc:
        print(f"sevendb subscriptions: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        nodes.close()


def cmd_list(args: argparse.Namespace, endpoints: Endpoints, token: Token) -> int:
    def run(nodes: _Nodes) -> int:
        buckets = [args.bucket] if args.bucket is not None else nodes.buckets()
        now = time.time_ns() // 1_000_000
        rows = [_as_dict(i, now) for b in buckets for i in nodes.pages(b, args.owner or "")]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(HEADER)
        for row in rows:
            print(_line(row))
        print(f"{len(rows)} subscription(s)", file=sys.stderr)
        return 0

    return _run(args, endpoints, token, run)


def _find(nodes: _Nodes, args: argparse.Namespace) -> pb.SubscriptionInfo | None:
    """The subscription in `--bucket`, or in whichever bucket holds it."""
    import grpc

    from sevendb.proto import sevendb_pb2 as pb

    buckets = [args.bucket] if args.bucket is not None else nodes.buckets()
    for bucket in buckets:
        request = pb.SubscriptionRequest(bucket=bucket, sub_id=args.sub_id)
        try:
            return nodes.call(
                lambda s, r=request: s.ShowSubscription(  # type: ignore[misc]
                    r, metadata=nodes.metadata, timeout=CALL_TIMEOUT_S
                )
            )
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                raise
    print(f"sevendb subscriptions: no subscription {args.sub_id}", file=sys.stderr)
    return None


def cmd_show(args: argparse.Namespace, endpoints: Endpoints, token: Token) -> int:
    def run(nodes: _Nodes) -> int:
        info = _find(nodes, args)
        if info is None:
            return 1
        row = _as_dict(info, time.time_ns() // 1_000_000)
        if args.json:
            print(json.dumps(row, indent=2))
        else:
            for key, value in row.items():
                print(f"{key:>14}: {'?' if value is None else value}")
        return 0

    return _run(args, endpoints, token, run)


def cmd_delete(args: argparse.Namespace, endpoints: Endpoints, token: Token) -> int:
    from sevendb.proto import sevendb_pb2 as pb

    def run(nodes: _Nodes) -> int:
        info = _find(nodes, args)
        if info is None:
            return 1
        request = pb.SubscriptionRequest(bucket=info.bucket, sub_id=info.sub_id)
        done = nodes.call(
            lambda s: s.DeleteSubscription(request, metadata=nodes.metadata, timeout=CALL_TIMEOUT_S)
        )
        print(
            f"deleted {info.sub_id} of {info.owner} in bucket {info.bucket} "
            f"({done.rows_dropped} unacknowledged row(s) dropped)"
        )
        return 0

    return _run(args, endpoints, token, run)


def _as_admin(args: argparse.Namespace) -> argparse.Namespace:
    """These commands act as the admin unless --principal says otherwise. (Set as a
    parser default, "admin" leaked into every command sharing the --principal
    option.)"""
    if not getattr(args, "principal", None):
        args.principal = "admin"
    return args


def add_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
    endpoints: Endpoints,
    token: Token,
    tls: Callable[[argparse.Namespace], Any],
) -> None:
    """Add `subscriptions list|show|delete` to the `sevendb` parser (cluster/ops/cli.py);
    `tls` gives a command's TLS settings (`sevendb.sdk.TLS`, None: plaintext)."""
    group = sub.add_parser(
        "subscriptions", help="list, show or delete subscriptions (as admin by default)"
    ).add_subparsers(dest="action", required=True)

    def command(name: str, help_: str, fn: Callable[..., int]) -> argparse.ArgumentParser:
        parser = group.add_parser(name, parents=[common], help=help_)
        parser.add_argument("--bucket", type=int, help="only this bucket (default: every one)")
        parser.set_defaults(fn=lambda args: fn(_as_admin(args), endpoints, token), tls_of=tls)
        return parser

    listing = command(
        "list", "owner, query, lag, idle time, rows held, attached: one line each", cmd_list
    )
    listing.add_argument("--owner", help="only this principal's (admin only)")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    show = command("show", "everything about SUB_ID", cmd_show)
    show.add_argument("sub_id", help="the subscription's id")
    show.add_argument("--json", action="store_true", help="as a JSON object")
    delete = command("delete", "delete SUB_ID: its rows are dropped, its slot freed", cmd_delete)
    delete.add_argument("sub_id", help="the subscription's id")


__all__ = ["add_commands"]
