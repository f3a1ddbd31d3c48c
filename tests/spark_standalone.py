"""A real Spark standalone cluster for tests: one master and N workers started from
the installed pyspark package (`bin/spark-class`), bound to 127.0.0.1, with small
memory; `stop()` ends every process it started (and the executors the workers
started, which share their process groups)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyspark
from cluster_harness import wait_for

SPARK_HOME = Path(pyspark.__file__).resolve().parent
SPARK_CLASS = SPARK_HOME / "bin" / "spark-class"
MASTER = "org.apache.spark.deploy.master.Master"
WORKER = "org.apache.spark.deploy.worker.Worker"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spark_env(work: Path) -> dict[str, str]:
    """The environment of the daemons and of a driver talking to them."""
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_DAEMON_MEMORY": "256m",
        "SPARK_LOG_DIR": str(work / "logs"),
        "PYSPARK_PYTHON": sys.executable,
    }


@dataclass
class StandaloneCluster:
    work: Path
    url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def start(cls, work: Path, workers: int = 2, memory: str = "768m") -> StandaloneCluster:
        work.mkdir(parents=True, exist_ok=True)
        port = free_port()
        cluster = cls(work, f"spark://127.0.0.1:{port}")
        try:
            cluster._spawn(
                "master",
                [MASTER, "--host", "127.0.0.1", "--port", str(port), "--webui-port", "0"],
            )
            wait_for(
                lambda: f"Starting Spark master at {cluster.url}" in cluster.log("master"),
                120,
                "the Spark master to start",
                interval_s=0.2,
            )
            for i in range(workers):
                cluster._spawn(
                    f"worker{i}",
                    [
                        WORKER,
                        cluster.url,
                        "--host",
                        "127.0.0.1",
                        "--cores",
                        "1",
                        "--memory",
                        memory,
                        "--webui-port",
                        "0",
                        "--work-dir",
                        str(work / f"worker{i}"),
                    ],
                )
            wait_for(
                lambda: all(
                    "Successfully registered with master" in cluster.log(f"worker{i}")
                    for i in range(workers)
                ),
                120,
                "every Spark worker to register with the master",
                interval_s=0.2,
            )
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _spawn(self, name: str, args: list[str]) -> None:
        with (self.work / f"{name}.log").open("wb") as out:
            self.procs.append(
                subprocess.Popen(
                    [str(SPARK_CLASS), *args],
                    env=spark_env(self.work),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: executors included
                )
            )

    def log(self, name: str) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def executor_logs(self) -> dict[str, str]:
        """Each worker's executor stderr (all applications), by worker."""
        return {
            d.name: "".join(p.read_text(errors="replace") for p in d.glob("app-*/*/stderr"))
            for d in sorted(self.work.glob("worker*"))
            if d.is_dir()
        }

    def stop(self) -> None:
        """SIGTERM each daemon's process group (workers take their executors down),
        SIGKILL what is left after 30 s, and wait until no process of any group is left."""
        groups = [p.pid for p in self.procs]
        for pid in groups:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
                p.wait(30)
        for pgid in groups:
            if not _group_gone(pgid, 30):
                _signal_group(pgid, signal.SIGKILL)
                assert _group_gone(pgid, 30), f"process group {pgid} outlived SIGKILL"
        self.procs.clear()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until no process of group `pgid` is left; False at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
