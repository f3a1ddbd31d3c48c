"""The node's HTTP port (its metrics port): ``/metrics`` for Prometheus, ``/healthz``
and ``/readyz`` for probes, 404 for anything else.

* ``/healthz``: 200 while the process serves HTTP (alive; a liveness probe restarts
  a node that stops answering).
* ``/readyz``: 200 when every local replica (the metadata group's member
  included) has a leader, serves (not quarantined, repairing or in DATA_LOSS) and
  has applied all but at most ``[node] ready_lag_max`` entries of what its leader
  committed; otherwise 503 with one line per replica that is not ready.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from sevendb.cluster.raft.replica import BucketReplica
from sevendb.cluster.server.metrics import NodeMetrics, ReplicaSource

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def not_ready(label: str, replica: BucketReplica, lag_max: int) -> str | None:
    """Why one replica is not ready, or None."""
    name = "the metadata group" if label == "meta" else f"bucket {label}"
    reason = replica.quarantined
    if reason is not None:
        return f"{name}: not serving: {reason}"
    status = replica.status()
    if not status.get("has_leader"):
        return f"{name}: no leader"
    committed, applied = status.get("leader_commit_index"), status.get("applied_index")
    if isinstance(committed, int) and isinstance(applied, int) and committed - applied > lag_max:
        return f"{name}: {committed - applied} entries behind its leader (at most {lag_max})"
    return None


def readiness(replicas: ReplicaSource, lag_max: int) -> list[str]:
    """The reasons this node is not ready (empty: ready)."""
    return [
        reason
        for label, replica in replicas()
        if (reason := not_ready(label, replica, lag_max)) is not None
    ]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes and scrapes are not logged."""


class _Server(ThreadingWSGIServer):
    address_family = socket.AF_INET


class _Server6(ThreadingWSGIServer):
    address_family = socket.AF_INET6


class HealthServer:
    """The HTTP endpoints of one node (module docstring), in daemon threads."""

    def __init__(
        self, metrics: NodeMetrics, ready: Callable[[], list[str]], host: str, port: int
    ) -> None:
        self._metrics_app = make_wsgi_app(metrics.registry)
        self._ready = ready
        server_class = _Server6 if ":" in host else _Server
        self._server = make_server(
            host, port, self._app, server_class=server_class, handler_class=_QuietHandler
        )
        self.port = self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="sevendb-http", daemon=True
        )
        self._thread.start()

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            body: Iterable[bytes] = self._metrics_app(environ, start_response)
            return body
        if path == "/healthz":
            return _text(start_response, "200 OK", ["ok"])
        if path == "/readyz":
            reasons = self._ready()
            if reasons:
                return _text(start_response, "503 Service Unavailable", reasons)
            return _text(start_response, "200 OK", ["ready"])
        return _text(
            start_response, "404 Not Found", [f"{path}: not found; try /metrics, /healthz, /readyz"]
        )

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _text(start_response: StartResponse, status: str, lines: list[str]) -> Iterator[bytes]:
    body = "".join(f"{line}\n" for line in lines).encode()
    start_response(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
    )
    yield body


__all__ = ["HealthServer", "not_ready", "readiness"]
