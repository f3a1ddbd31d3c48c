"""The dashboard's main series, queried from a real Prometheus, as a PNG: what
docs/operations.md shows in place of a Grafana screenshot (Grafana is not packaged
for these machines).

    python tests/bench/dashboard_png.py [--out docs/dashboard.png] [--seconds 60]

Starts a three-node local cluster (2 buckets) and Prometheus with the alert rules'
test copy (tests/prometheus_harness.py), drives writes and a subscriber for
`--seconds`, kills two nodes for 20 s (buckets lose their leader, the alerts fire),
starts them again, drives the load once more, then queries the dashboard's
expressions (deploy/grafana/sevendb.json) over the run and plots them (matplotlib,
the `bench` extra). Not a test: it prints what it did and where the PNG went.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster_harness import LocalCluster
from prometheus_harness import Prometheus, prometheus

from sevendb.sdk import RetryPolicy, SubscribeOptions

ROOT = Path(__file__).resolve().parents[2]
PANELS = (
    "Entries committed per second",
    "Events sent per second",
    "Commit to send latency",
    "Leader per bucket",
    "Calls per second by status",
    "Journal fsync p99",
    "Open streams",
    "Memory (RSS)",
)
ALERTS_EXPR = 'count by (alertname) (ALERTS{alertstate="firing"})'


def _load(cluster: LocalCluster, seconds: float) -> int:
    """Writes (about 200/s) and one subscriber for `seconds`; returns the writes."""
    stop = threading.Event()
    done = [0]
    retry = RetryPolicy(deadline_s=30)

    def subscriber() -> None:
        with (
            cluster.client(retry) as client,
            client.subscribe("prefix:d/", options=SubscribeOptions(ack_every_events=10)) as sub,
        ):
            while not stop.is_set():
                sub.poll(0.5)

    thread = threading.Thread(target=subscriber, daemon=True)
    thread.start()
    deadline = time.monotonic() + seconds
    with cluster.client(retry) as client:
        while time.monotonic() < deadline:
            client.put(f"d/{done[0] % 500}", b"x" * 100)
            done[0] += 1
            time.sleep(0.005)
    stop.set()
    thread.join(10)
    return done[0]


def _plot(prom: Prometheus, start: float, end: float, out: Path, events: list[Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads((ROOT / "deploy" / "grafana" / "sevendb.json").read_text())
    panels = {p["title"]: p for p in dashboard["panels"] if p["type"] != "row"}
    figure, axes = plt.subplots(3, 3, figsize=(16, 11), sharex=True)
    chosen = [(title, panels[title]["targets"]) for title in PANELS]
    chosen.append(("Alerts firing", [{"expr": ALERTS_EXPR, "legendFormat": "{{alertname}}"}]))
    for ax, (title, targets) in zip(axes.flat, chosen, strict=True):
        for target in targets:
            for series in prom.query_range(target["expr"], start, end, 2):
                label = target.get("legendFormat", "")
                for key, value in series["metric"].items():
                    label = label.replace("{{" + key + "}}", value)
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, label=label or None, linewidth=1.2)
        for at, what in events:
            ax.axvline(at - start, color="grey", linestyle=":", linewidth=1)
            if title == PANELS[0]:
                ax.annotate(what, (at - start, 0), rotation=90, fontsize=7, va="bottom")
        ax.set_title(title, fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("seconds")
    figure.suptitle(
        "sevendb dashboard (deploy/grafana/sevendb.json) from a real Prometheus: "
        "3 nodes, 2 of them killed for 20 s",
        fontsize=12,
    )
    figure.tight_layout()
    figure.savefig(out, dpi=80)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--seconds", type=float, default=60.0, help="load before and after")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sevendb-dashboard-") as tmp:
        cluster = LocalCluster.start(Path(tmp) / "data", buckets=2)
        try:
            cluster.wait_settled()
            with prometheus(cluster, Path(tmp) / "prometheus") as prom:
                start = time.time()
                events: list[Any] = []
                writes = _load(cluster, args.seconds)
                events.append((time.time(), "2 nodes killed"))
                for node in cluster.spec.node_ids[1:]:
                    cluster.kill9(node)
                time.sleep(20)
                firing = sorted(prom.alerts("firing"))
                events.append((time.time(), "restarted"))
                cluster.restart()
                writes += _load(cluster, args.seconds)
                time.sleep(5)
                end = time.time()
                _plot(prom, start, end, args.out, events)
        finally:
            cluster.stop()
    print(f"{writes} writes; alerts firing with 2 nodes down: {', '.join(firing)}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
