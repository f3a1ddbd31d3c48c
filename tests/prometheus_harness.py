"""A real Prometheus (Debian's `prometheus` package: deploy/system-deps.sh) scraping a
local cluster with deploy/prometheus/alerts.yml loaded, for tests/test_prometheus.py
and tests/bench/dashboard_png.py.

The rules are loaded as a test copy whose ``for:`` durations are all `for_s`
seconds, and Prometheus scrapes and evaluates every second: an alert whose real
rule waits a minute fires within seconds here (docs/operations.md, "Alerts")."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster_harness import LocalCluster, wait_for

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"


def shortened_rules(text: str, for_s: int) -> str:
    """The rules with every ``for:`` set to `for_s` seconds."""
    return re.sub(r"(?m)^(\s+for:\s*)\S+$", rf"\g<1>{for_s}s", text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as answer:
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/v1/query", query=expr)["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[Any]:
        data = self.get(
            "/api/v1/query_range", query=expr, start=str(start), end=str(end), step=str(step_s)
        )
        result: list[Any] = data["result"]
        return result

    def alerts(self, state: str = "firing") -> dict[str, list[dict[str, str]]]:
        """Alerts in `state` (firing, pending), by name, with their labels."""
        out: dict[str, list[dict[str, str]]] = {}
        for alert in self.get("/api/v1/alerts")["alerts"]:
            if alert["state"] == state:
                out.setdefault(alert["labels"]["alertname"], []).append(alert["labels"])
        return out


@contextlib.contextmanager
def prometheus(cluster: LocalCluster, workdir: Path, for_s: int = 3) -> Iterator[Prometheus]:
    """Prometheus scraping every node of `cluster` (job ``sevendb``) every second,
    with the alert rules' test copy; stopped (and waited for) on exit."""
    binary = shutil.which("prometheus")
    assert binary is not None, (
        "Debian's prometheus package is not installed (deploy/system-deps.sh)"
    )
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "alerts.yml").write_text(shortened_rules(ALERTS.read_text(), for_s))
    targets = [f"{n.host}:{n.metrics_port}" for n in cluster.spec.nodes]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [{"job_name": "sevendb", "static_configs": [{"targets": targets}]}],
    }
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = _free_port()
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    server = Prometheus(f"http://127.0.0.1:{port}", process)
    try:

        def ready() -> bool:
            assert process.poll() is None, (workdir / "prometheus.log").read_text()[-2000:]
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as answer,
            ):
                return answer.status == 200
            return False

        wait_for(ready, 60, "Prometheus to be ready", 0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
