"""The Grafana dashboard and the Prometheus alert rules in deploy/ use only what a
node exports (`metrics.FAMILIES`, which tests/test_metrics.py checks against real
nodes), the rules pass `promtool check rules`, and docs/operations.md lists every
family and every alert."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from sevendb.cluster.server.metrics import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "sevendb.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
OPERATIONS = ROOT / "docs" / "operations.md"

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_PREFIXES = ("sevendb_", "process_", "python_")


def exported() -> set[str]:
    """Every sample name a node's scrape can hold, plus Prometheus's own `up`."""
    names = {"up"}
    for name, (kind, _) in FAMILIES.items():
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def metrics_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    return {t for t in _NAME.findall(expr) if t.startswith(_PREFIXES) or t == "up"}


def dashboard_exprs() -> list[str]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_the_dashboard_uses_only_exported_metrics() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    used = set().union(*(metrics_in(e) for e in exprs))
    assert not used - exported(), f"not exported by a node: {sorted(used - exported())}"
    # Its main families are all there.
    for name in (
        "sevendb_emit_latency_seconds_bucket",
        "sevendb_raft_has_leader",
        "sevendb_grpc_server_handled_total",
        "sevendb_raft_journal_fsync_duration_seconds_bucket",
        "process_resident_memory_bytes",
    ):
        assert name in used, name


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${DS_PROMETHEUS}"


def test_the_alert_rules_use_only_exported_metrics_and_pass_promtool() -> None:
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert {
        "SevendbNodeDown",
        "SevendbNoLeader",
        "SevendbReplicaQuarantined",
        "SevendbAckLagHigh",
        "SevendbSubscriptionsStalled",
        "SevendbFsyncSlow",
        "SevendbOutboxGrowing",
        "SevendbArchiveLag",
    } <= names
    used = set().union(*(metrics_in(r["expr"]) for r in rules))
    assert not used - exported(), f"not exported by a node: {sorted(used - exported())}"
    check = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules)} rules found" in check.stdout


def test_operations_doc_lists_every_family_and_alert() -> None:
    text = OPERATIONS.read_text()
    missing = [name for name in FAMILIES if f"`{name}`" not in text]
    assert not missing, f"docs/operations.md does not list {missing}"
    alerts = [r["alert"] for r in alert_rules() if f"`{r['alert']}`" not in text]
    assert not alerts, f"docs/operations.md does not describe {alerts}"
