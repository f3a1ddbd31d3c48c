"""proto/threads.py: a node's threads, and a client's loop thread, carry their names to
the operating system; long CPU-bound work runs in a child process that dies with
its parent."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sevendb.proto.threads import name_os_thread, start_forked
from tests.cluster_harness import wait_for


def _os_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_thread_gets_its_python_name_or_the_given_one_cut_to_15_bytes() -> None:
    seen: dict[str, str] = {}

    def run(key: str, name: str | None) -> None:
        name_os_thread(name)
        seen[key] = _os_name(threading.get_native_id())

    threads = [
        threading.Thread(target=run, args=("own", None), name="notifier-b7"),
        threading.Thread(target=run, args=("given", "raft-b123456789012345"), name="x"),
    ]
    for t in threads:
        t.start()
        t.join()
    assert seen == {"own": "notifier-b7", "given": "raft-b123456789"}
    main = threading.main_thread().native_id
    assert main is not None and _os_name(main) != "notifier-b7"  # only the caller


def test_a_client_names_its_loop_thread() -> None:
    from sevendb.sdk.engine import Engine

    engine = Engine(["127.0.0.1:1"], None)  # no call is made: the loop thread alone
    try:
        native = engine.submit(_native_id()).result(5)
        assert _os_name(native) == "sevendb-sdk"
    finally:
        engine.close()


async def _native_id() -> int:
    return threading.get_native_id()


def test_start_forked_runs_the_function_in_a_child_process(tmp_path: Path) -> None:
    out = tmp_path / "pid"

    def note_pid() -> None:
        out.write_text(str(os.getpid()))

    start_forked(note_pid, "test-child").wait()
    assert int(out.read_text()) != os.getpid()


def test_start_forked_runs_the_function_without_the_garbage_collector(tmp_path: Path) -> None:
    """The child only runs `fn` and ends: a collection there would copy the parent's
    pages of every object it walks."""
    out = tmp_path / "gc"

    def note_gc() -> None:
        out.write_text(str(gc.isenabled()))

    start_forked(note_gc, "test-child").wait()
    assert out.read_text() == "False"
    assert gc.isenabled()


def test_start_forked_says_when_the_function_raised(tmp_path: Path) -> None:
    def fail() -> None:
        raise ValueError("packing failed")

    with pytest.raises(
        ChildProcessError, match=r"test-child: child process \d+ failed \(exit status 70\)"
    ):
        start_forked(fail, "test-child").wait()


def test_start_forked_returns_while_the_child_runs_and_kill_ends_it(tmp_path: Path) -> None:
    """The snapshot's child is started in the tick thread, which goes on at once; a
    snapshot the archive refuses kills it (`SnapshotWrite.abandon`)."""
    started = tmp_path / "started"
    release = tmp_path / "release"

    def wait_for_release() -> None:
        started.write_text(str(os.getpid()))
        while not release.exists():
            time.sleep(0.01)

    child = start_forked(wait_for_release, "test-child")
    wait_for(lambda: started.exists() and started.read_text() != "", 10, "the child")
    assert _alive(child.pid)  # running while this thread goes on
    child.kill()
    assert not _alive(child.pid)
    with pytest.raises(ChildProcessError, match="was killed by signal 9"):
        child.wait()  # the end is kept: no second waitpid on a reaped pid
    finished = start_forked(lambda: None, "test-child")
    finished.wait()
    finished.kill()  # an ended child: nothing to kill, no error


_PARENT = """
import os, sys, time
from pathlib import Path
from sevendb.proto.threads import start_forked

def child() -> None:
    Path(sys.argv[1]).write_text(str(os.getpid()))
    time.sleep(60)

start_forked(child, "test-child").wait()
"""


def test_a_forked_child_dies_with_its_parent(tmp_path: Path) -> None:
    """A node killed while its snapshot is being written leaves no child writing
    into its data directory: the child gets SIGKILL when its parent's thread ends."""
    pid_file = tmp_path / "child"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(pid_file)])
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", 10, "the child")
        child = int(pid_file.read_text())
        os.kill(child, 0)  # alive
        parent.kill()
        parent.wait(10)
        wait_for(lambda: not _alive(child), 10, "the child to end with its parent")
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, which the kernel keeps for a parent that is gone
    until init reaps it, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


_NODE_FORKS = """
import asyncio
import sevendb.cluster.server.node  # the node's environment
from grpc import aio
from sevendb.proto.threads import start_forked

async def main() -> None:
    server = aio.server()
    server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # forked from another thread than the loop's, as the Raft tick thread does
    await asyncio.to_thread(lambda: start_forked(lambda: None, "test-child").wait())
    await server.stop(None)

asyncio.run(main())
print("forked")
"""


def test_a_node_forks_without_grpcs_fork_handlers() -> None:
    """A node forks a child per snapshot while it serves gRPC. gRPC's fork handlers
    would pause its threads around the fork, or log once per snapshot that they skip
    it: a node turns them off (the child never uses gRPC)."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run(
        [sys.executable, "-c", _NODE_FORKS], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "forked"
    assert "fork" not in out.stderr, out.stderr
