"""Where a node keeps its files under a cluster's data dir."""

from __future__ import annotations

from pathlib import Path

__all__ = ["node_dir"]


def node_dir(data_dir: Path, node_id: str) -> Path:
    """The directory of node `node_id`: its replicas' journals and snapshots, its log
    and pid file."""
    return data_dir / "nodes" / node_id
