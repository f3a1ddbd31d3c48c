"""Lifecycles and overload protection against real node processes (issue 27, items
2-4; docs/limits.md): per-principal rates answered RESOURCE_EXHAUSTED with
`sevendb-retry-after-ms`, the subscriptions a principal may hold, a slow subscriber's
stream ended SLOW_SUBSCRIBER and resumed from its position, `sevendb subscriptions
list|show|delete`, and subscriptions and producers idle past their windows deleted
by the lease holder while attached quiet ones live on."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cluster_harness import LocalCluster, RawStream, wait_for

from sevendb.cluster.ops import cli
from sevendb.outbox.keys import bucket_of
from sevendb.proto import codec
from sevendb.proto import sevendb_pb2 as pb
from sevendb.proto import sevendb_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

BUCKETS = 2
BUCKET = 0
WRITES_PER_S = 20
SUBSCRIPTIONS_MAX = 3
SLOW_STREAM_MS = 1_500
STALL_WINDOW_MS = 2_000
PRODUCER_IDLE_MS = 2_000


@contextlib.contextmanager
def _cluster(path: Path, env: dict[str, str]) -> Iterator[LocalCluster]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        cluster = LocalCluster.start(path, nodes=1, buckets=BUCKETS)
    try:
        cluster.wait_settled()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    env = {
        "SEVENDB_SERVER_PRINCIPAL_WRITES_PER_S": str(WRITES_PER_S),
        "SEVENDB_SERVER_PRINCIPAL_SUBSCRIPTIONS_MAX": str(SUBSCRIPTIONS_MAX),
        "SEVENDB_NOTIFIER_RESEND_AFTER_MS": "300",
        "SEVENDB_NOTIFIER_SLOW_STREAM_MS": str(SLOW_STREAM_MS),
    }
    with _cluster(tmp_path_factory.mktemp("limited") / "data", env) as cluster:
        cluster.grant_all("hasty", "patient", "collector", "someone-else", "slowpoke", "owner")
        yield cluster


@pytest.fixture(scope="module")
def expiring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    env = {
        "SEVENDB_RAFT_STALL_WINDOW_MS": str(STALL_WINDOW_MS),
        "SEVENDB_NOTIFIER_ATTACH_GRACE_MS": "0",
        "SEVENDB_NOTIFIER_PRODUCER_IDLE_MS": str(PRODUCER_IDLE_MS),
    }
    with _cluster(tmp_path_factory.mktemp("expiring") / "data", env) as cluster:
        cluster.grant_all("app")
        yield cluster


def _node(cluster: LocalCluster) -> str:
    return cluster.spec.nodes[0].grpc_address


def _stub(cluster: LocalCluster) -> pb_grpc.SevenDBStub:
    return cluster.stub(_node(cluster))


def _auth(cluster: LocalCluster, principal: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {cluster.token(principal)}"),)


def _keys(prefix: str, count: int) -> list[str]:
    return [k for i in range(1000) if bucket_of(k := f"{prefix}{i:03d}", BUCKETS) == BUCKET][:count]


def _write(cluster: LocalCluster, principal: str, key: str) -> pb.WriteResponse:
    request = pb.WriteRequest(ops=[pb.Op(kind=pb.Op.SET, key=key, value=b"v")])
    answer: pb.WriteResponse = _stub(cluster).Write(
        request, metadata=_auth(cluster, principal), timeout=10
    )
    return answer


def _trailers(error: grpc.RpcError) -> dict[str, str]:
    return {k: v for k, v in error.trailing_metadata() or ()}  # type: ignore[attr-defined]


def _subscribe(
    cluster: LocalCluster, principal: str, sub_id: str, prefix: str, *, keep: bool = False
) -> RawStream:
    request = pb.SubscribeRequest(
        bucket=BUCKET, sub_id=sub_id, query=pb.Query(kind=pb.Query.PREFIX, arg=prefix)
    )
    stream = RawStream(_stub(cluster).Subscribe(request, metadata=_auth(cluster, principal)))
    wait_for(lambda: stream.messages or stream.ended.is_set(), 30, f"{sub_id}'s SubAck")
    if not keep:
        stream.call.cancel()
    return stream


def _subscriptions(cluster: LocalCluster) -> int:
    status = cluster.status(cluster.spec.nodes[0].node_id)
    assert status is not None
    return next(r.subscriptions for r in status.replicas if r.bucket == BUCKET)


# ---- rates ---------------------------------------------------------------------------------


def test_a_principal_over_its_write_rate_is_told_when_to_retry(limited: LocalCluster) -> None:
    refused = None
    for key in _keys("rate/", 3 * WRITES_PER_S):
        try:
            _write(limited, "hasty", key)
        except grpc.RpcError as exc:
            refused = exc
            break
    assert refused is not None, "no write was refused"
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = _trailers(refused)
    assert trailers[codec.ERROR_CODE_KEY] == codec.RATE_LIMITED
    wait_ms = int(trailers[codec.RETRY_AFTER_KEY])
    assert 0 < wait_ms <= 1000 // WRITES_PER_S + 1
    _write(limited, "patient", _keys("rate/", 1)[0])  # another principal: its own rate
    # A WriteMany over the rate: every write of the group is refused with the wait.
    many = pb.WriteManyRequest(
        writes=[pb.WriteRequest(ops=[pb.Op(kind=pb.Op.SET, key=k)]) for k in _keys("rate/", 5)]
    )
    answer = _stub(limited).WriteMany(many, metadata=_auth(limited, "hasty"), timeout=10)
    for outcome in answer.outcomes:
        assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert outcome.error == codec.RATE_LIMITED and outcome.retry_after_ms > 0
    time.sleep(answer.outcomes[0].retry_after_ms / 1000)  # what the server advised
    assert _write(limited, "hasty", _keys("rate/", 1)[0]).committed.commit_index > 0


def test_a_principal_holds_a_bounded_number_of_subscriptions(limited: LocalCluster) -> None:
    for i in range(SUBSCRIPTIONS_MAX):
        _subscribe(limited, "collector", f"col-{i}", f"col{i}/")
    over = _subscribe(limited, "collector", "col-x", "colx/")
    assert isinstance(over.error, grpc.RpcError)
    assert over.error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _trailers(over.error)[codec.ERROR_CODE_KEY] == codec.TOO_MANY_SUBSCRIPTIONS
    again = _subscribe(limited, "collector", "col-0", "col0/")  # idempotent: let through
    assert again.messages and again.messages[0].HasField("sub_ack")
    _subscribe(limited, "someone-else", "else-0", "else/")  # others are not affected
    _stub(limited).Unsubscribe(
        pb.UnsubscribeRequest(sub_id="col-1", bucket=BUCKET),
        metadata=_auth(limited, "collector"),
        timeout=10,
    )
    taken = _subscribe(limited, "collector", "col-x", "colx/")
    assert taken.messages and taken.messages[0].HasField("sub_ack")


# ---- a slow subscriber ------------------------------------------------------------------------


def test_a_subscriber_that_stops_acknowledging_has_its_stream_ended_and_resumes(
    limited: LocalCluster,
) -> None:
    """Before, its window was resent every resend_after_ms until the stall window
    (24 h) passed: the stream never ended."""
    stream = _subscribe(limited, "slowpoke", "slow-1", "slow/", keep=True)
    keys = _keys("slow/", 6)
    for key in keys[:3]:
        _write(limited, "slowpoke", key)
    wait_for(lambda: len(stream.events()) >= 3, 30, "the first events")
    started = time.monotonic()
    assert stream.ended.wait(SLOW_STREAM_MS / 1000 + 10), "the slow stream was never ended"
    assert time.monotonic() - started >= SLOW_STREAM_MS / 1000 - 0.5
    assert stream.error is not None
    assert stream.error.code() is grpc.StatusCode.UNAVAILABLE
    assert _trailers(stream.error)[codec.ERROR_CODE_KEY] == codec.SLOW_SUBSCRIBER
    # It resumes from what it processed: the first event.
    first = stream.events()[0]
    for key in keys[3:]:
        _write(limited, "slowpoke", key)
    request = pb.ReconnectRequest(
        sub_id="slow-1", last_processed_emit_seq=first.emit_seq, bucket=BUCKET
    )
    resumed = RawStream(_stub(limited).Reconnect(request, metadata=_auth(limited, "slowpoke")))
    wait_for(lambda: len(resumed.events()) >= 5, 30, "the events after the first")
    assert resumed.messages[0].reconnect_ack.status == pb.ReconnectAck.OK
    got = [c.key for e in resumed.events() for c in e.delta.changes]
    assert got[:5] == keys[1:]
    resumed.call.cancel()


# ---- administration ----------------------------------------------------------------------------


def _cli(cluster: LocalCluster, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["subscriptions", *args, "--data", str(cluster.data_dir)])
    return code, capsys.readouterr().out


def test_subscriptions_are_listed_shown_and_deleted(
    limited: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    _subscribe(limited, "owner", "adm-1", "adm/")  # its client went away
    watched = _subscribe(limited, "owner", "adm-2", "adm2/", keep=True)
    for key in _keys("adm/", 3):
        _write(limited, "owner", key)

    def listed() -> dict[str, dict[str, Any]]:
        code, out = _cli(limited, capsys, "list", "--json", "--bucket", str(BUCKET))
        assert code == 0
        return {r["sub_id"]: r for r in json.loads(out) if r["owner"] == "owner"}

    rows = wait_for(lambda: (r := listed()) and r["adm-1"]["rows"] == 3 and r, 30, "3 rows held")
    one, two = rows["adm-1"], rows["adm-2"]
    assert (one["query"], one["attached"], two["attached"]) == ("prefix:adm/", False, True)
    assert one["lag"] > 0 and one["row_bytes"] > 0 and one["idle_s"] >= 0
    assert (two["rows"], two["lag"]) == (0, 0)
    code, out = _cli(limited, capsys, "list")  # the table, every bucket
    [line] = [line for line in out.splitlines() if "adm-1" in line]
    assert code == 0 and out.startswith("bucket") and "prefix:adm/" in line and " no" in line
    code, out = _cli(limited, capsys, "show", "adm-1")  # found without --bucket
    assert code == 0 and "prefix:adm/" in out
    # Anyone else sees only their own.
    code, out = _cli(limited, capsys, "list", "--json", "--principal", "intruder")
    assert code == 0 and json.loads(out) == []
    code, _ = _cli(limited, capsys, "delete", "adm-1", "--principal", "intruder")
    assert code == 1

    before = _subscriptions(limited)
    code, out = _cli(limited, capsys, "delete", "adm-1")
    assert code == 0 and "3 unacknowledged row(s) dropped" in out
    code, out = _cli(limited, capsys, "delete", "adm-2")
    assert code == 0
    assert _subscriptions(limited) == before - 2  # their slots are free
    assert watched.ended.wait(30) and watched.error is not None  # its stream ended
    code, _ = _cli(limited, capsys, "show", "adm-1")
    assert code == 1


# ---- expiry --------------------------------------------------------------------------------------


def test_subscriptions_idle_past_the_window_are_deleted_attached_quiet_ones_live(
    expiring: LocalCluster,
) -> None:
    """Before, an expired subscription stayed (holding its slot) and one with nothing
    to acknowledge never expired at all."""
    gone = _subscribe(expiring, "app", "gone-1", "gone/")  # the client vanishes
    start = gone.messages[0].sub_ack.start_emit_seq
    alive = _subscribe(expiring, "app", "alive-1", "alive/", keep=True)
    assert _subscriptions(expiring) == 2
    wait_for(lambda: _subscriptions(expiring) == 1, 30, "the idle subscription's deletion")
    time.sleep(2 * STALL_WINDOW_MS / 1000)  # the attached one outlives windows...
    assert _subscriptions(expiring) == 1 and not alive.ended.is_set()
    _write(expiring, "app", _keys("alive/", 1)[0])  # ...and its first row
    wait_for(lambda: alive.events(), 30, "the attached subscription's event")
    request = pb.ReconnectRequest(sub_id="gone-1", last_processed_emit_seq=start, bucket=BUCKET)
    [ack] = list(_stub(expiring).Reconnect(request, metadata=_auth(expiring, "app"), timeout=30))
    assert ack.reconnect_ack.status == pb.ReconnectAck.STALE_SEQUENCE
    alive.call.cancel()


def test_a_producer_idle_past_its_window_is_forgotten(expiring: LocalCluster) -> None:
    stub = _stub(expiring)
    auth = _auth(expiring, "app")
    init = stub.InitProducer(pb.InitProducerRequest(bucket=BUCKET), metadata=auth, timeout=10)
    key = _keys("prod/", 1)[0]

    def produce(sequence: int) -> pb.WriteResponse:
        ref = pb.ProducerRef(
            producer_id=init.producer_id, producer_epoch=init.producer_epoch, sequence=sequence
        )
        request = pb.WriteRequest(ops=[pb.Op(kind=pb.Op.SET, key=key)], producer=ref)
        answer: pb.WriteResponse = stub.Write(request, metadata=auth, timeout=10)
        return answer

    produce(0)
    assert produce(0).duplicate  # remembered

    def forgotten() -> bool:
        """Asked with a sequence that skips ahead, which is refused (and, refused,
        does not count as the producer's activity) until it is forgotten."""
        with pytest.raises(grpc.RpcError) as refused:
            produce(100)
        error = _trailers(refused.value)[codec.ERROR_CODE_KEY]
        assert error in ("OUT_OF_ORDER_SEQUENCE", "UNKNOWN_PRODUCER")
        return error == "UNKNOWN_PRODUCER"

    time.sleep(PRODUCER_IDLE_MS / 1000)
    wait_for(forgotten, 30, "the idle producer to be forgotten", interval_s=0.5)
