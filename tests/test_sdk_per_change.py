"""Per-change delivery against a real cluster (docs/emission.md, "Event granularity"):
an entry of several changes arrives as one event per change, each at its position
``(emit_seq, i)``; the entry is acknowledged to the node only once all its changes
were processed, and a process that stops mid-entry - detached, or killed -9 - gets
the entry again and skips the changes it had processed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import LocalCluster
from sdk_facade import KINDS

from sevendb.sdk import Client, Event, SubscribeOptions, Subscription, set_op

pytestmark = pytest.mark.slow

PER_CHANGE = SubscribeOptions(per_change=True, ack_every_events=1)


@pytest.fixture(params=KINDS)
def client(shared_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[Client]:
    """A `Client`, and an `AsyncClient` behind the same calls (tests/sdk_facade.py)."""
    with shared_cluster.client(kind=request.param) as c:
        yield c


def same_bucket(client: Client, prefix: str, count: int) -> list[str]:
    layout = client.layout()
    keys = (f"{prefix}{i}" for i in range(10_000))
    return [k for k in keys if layout.bucket_of(k) == 0][:count]


def take(sub: Subscription, count: int) -> list[Event]:
    events: list[Event] = []
    for _ in range(count):
        event = sub.poll(30)
        assert event is not None, f"only {len(events)} of {count} events"
        events.append(event)
    return events


def test_each_change_arrives_alone_at_its_position(client: Client) -> None:
    keys = same_bucket(client, "pc/one/", 3)
    with client.subscribe("prefix:pc/one/", options=PER_CHANGE) as sub:
        entry = client.write([set_op(k, k.encode()) for k in keys])
        single = client.put(keys[0], b"again")
        events = take(sub, 4)
    assert [e.position for e in events] == [
        (entry.committed, 0),
        (entry.committed, 1),
        (entry.committed, 2),
        (single.committed, 0),
    ]
    assert [[c.key for c in e.changes] for e in events] == [[k] for k in [*keys, keys[0]]]
    assert [e.entry_changes for e in events] == [3, 3, 3, 1]
    assert [e.last_of_entry for e in events] == [False, False, True, True]


def test_an_entry_left_mid_way_comes_again_without_its_processed_changes(
    client: Client, tmp_path: Path
) -> None:
    """Detached after two of three changes: the node was not acked for the entry (it
    delivers it again), and the resumed subscription skips the two."""
    keys = same_bucket(client, "pc/mid/", 3)
    cursor = tmp_path / "c.cursor"
    sub = client.subscribe("prefix:pc/mid/", cursor=cursor, options=PER_CHANGE)
    entry = client.write([set_op(k, b"v") for k in keys])
    first, second = take(sub, 2)
    assert (first.change_index, second.change_index) == (0, 1)
    sub.detach()  # `second` was in hand: processed
    saved = json.loads(cursor.read_text())["cursors"]
    partials = [c["partial"] for c in saved if "partial" in c]
    assert partials == [[list(entry.committed), 2]]
    later = client.put(keys[0], b"later")
    with client.subscribe("prefix:pc/mid/", cursor=cursor, options=PER_CHANGE) as again:
        rest = take(again, 2)
        assert again.poll(0.5) is None
    assert [e.position for e in rest] == [(entry.committed, 2), (later.committed, 0)]


CONSUMER = """
import json, os, signal, sys
from pathlib import Path
from sevendb.cluster.ops.local import local_tls, local_token

from sevendb.sdk import Client, SubscribeOptions

data, cursor, endpoints, crash_at = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
options = SubscribeOptions(per_change=True, ack_every_events=1)
token, tls = local_token(data, "default"), local_tls(data)
with Client(endpoints.split(","), token=token, tls=tls) as client:
    sub = client.subscribe("prefix:pc/kill/", cursor=cursor, options=options)
    print("ready", flush=True)
    for number, event in enumerate(sub, 1):
        if number == int(crash_at):
            os.kill(os.getpid(), signal.SIGKILL)  # a crash before processing it
        print(json.dumps([event.emit_seq.commit_index, event.change_index]), flush=True)
"""


def test_a_process_killed_mid_entry_resumes_with_the_entry_s_next_change(
    shared_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Killed -9 while holding change 2 of an entry of 4 (0 and 1 processed and
    persisted): the next process gets changes 2 and 3 only, then later entries."""
    cluster = shared_cluster
    cursor = tmp_path / "c.cursor"
    endpoints = ",".join(n.grpc_address for n in cluster.spec.nodes)

    def consumer(crash_at: int) -> subprocess.Popen[str]:
        args = [str(cluster.data_dir), str(cursor), endpoints, str(crash_at)]
        process = subprocess.Popen(
            [sys.executable, "-c", CONSUMER, *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        return process

    def lines(process: subprocess.Popen[str], count: int) -> list[list[int]]:
        assert process.stdout is not None
        return [json.loads(process.stdout.readline()) for _ in range(count)]

    with cluster.client() as client:
        keys = same_bucket(client, "pc/kill/", 4)
        first = consumer(crash_at=3)
        entry = client.write([set_op(k, b"v") for k in keys]).committed.commit_index
        assert lines(first, 2) == [[entry, 0], [entry, 1]]
        assert first.wait(60) == -9  # killed holding change 2
        second = consumer(crash_at=0)
        try:
            assert lines(second, 2) == [[entry, 2], [entry, 3]]
            later = client.put(keys[0], b"later").committed.commit_index
            assert lines(second, 1) == [[later, 0]]
        finally:
            second.kill()
            second.wait(30)
