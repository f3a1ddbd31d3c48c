"""Per-node configuration: layers and precedence, provenance, refusals; bundles and
secret files; the metadata overlay."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from sevendb.cluster.common.bundle import (
    ClientConfig,
    ClusterSecrets,
    write_client_config,
    write_node_bundle,
)
from sevendb.cluster.common.meta import changes, overlay
from sevendb.cluster.common.settings import Layers, Settings
from sevendb.cluster.common.topology import (
    ClusterSpec,
    ConfigError,
    MigrationSpec,
    NodeSpec,
    new_cluster,
)
from sevendb.cluster.server.config import load_node_config


@dataclasses.dataclass(frozen=True)
class _Demo:
    count: int = 3
    ratio: float = 0.5
    name: str = "x"
    on: bool = False
    hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError("count must be >= 0")


def _settings(tmp_path: Path, toml: str, env: dict[str, str], flags: dict[str, str]) -> Settings:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    return Settings(Layers.read(path, env, flags), {"demo": _Demo})


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    s = _settings(
        tmp_path,
        '[demo]\ncount = 5\nratio = 1\nname = "file"\n',
        {"SEVENDB_DEMO_COUNT": "7", "SEVENDB_DEMO_NAME": "env"},
        {"demo-count": "9"},
    )
    demo = s.section("demo", _Demo)
    assert (demo.count, demo.ratio, demo.name, demo.on) == (9, 1.0, "env", False)
    origins = {k: str(v) for k, v in s.origins["demo"].items()}
    assert origins["count"] == "flag --demo-count"
    assert origins["name"] == "env SEVENDB_DEMO_NAME"
    assert origins["ratio"].startswith("file ")
    assert origins["on"] == "default"
    explained = s.explain()
    assert "count = 9  # flag --demo-count" in explained
    assert "on = false  # default" in explained


def test_lists_and_booleans_from_text(tmp_path: Path) -> None:
    s = _settings(tmp_path, "", {"SEVENDB_DEMO_HOSTS": "a:1, b:2", "SEVENDB_DEMO_ON": "yes"}, {})
    assert s.section("demo", _Demo).hosts == ("a:1", "b:2")
    assert s.section("demo", _Demo).on is True


@pytest.mark.parametrize(
    ("toml", "env", "flags", "message"),
    [
        ("[demo]\nbogus = 1\n", {}, {}, "unknown key 'bogus' in [demo]"),
        ("[other]\nx = 1\n", {}, {}, "unknown section [other]"),
        ("", {"SEVENDB_DEMO_BOGUS": "1"}, {}, "SEVENDB_DEMO_BOGUS: unknown setting"),
        ("", {}, {"demo-bogus": "1"}, "--demo-bogus: unknown setting"),
        ('[demo]\ncount = "many"\n', {}, {}, "expected int"),
        ("[demo]\ncount = true\n", {}, {}, "expected int"),
        ("", {"SEVENDB_DEMO_COUNT": "many"}, {}, "SEVENDB_DEMO_COUNT='many': expected int"),
        ("", {}, {"demo-count": "-1"}, "[demo]: count must be >= 0"),
        ("[demo\n", {}, {}, "not valid TOML"),
    ],
)
def test_bad_settings_are_refused_by_name(
    tmp_path: Path, toml: str, env: dict[str, str], flags: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _settings(tmp_path, toml, env, flags)
    assert message in str(caught.value)


def test_other_sevendb_variables_are_not_settings(tmp_path: Path) -> None:
    _settings(tmp_path, "", {"SEVENDB_DATA": "x", "SEVENDB_TOKEN": "t"}, {})


def _nodes(n: int) -> list[NodeSpec]:
    return [
        NodeSpec(f"n{i}", f"10.0.0.{i}", 7001, 7100, 9101, meta_port=7000 if i <= 3 else 0)
        for i in range(1, n + 1)
    ]


def test_a_node_config_resolves_paths_and_sections(tmp_path: Path) -> None:
    spec = new_cluster(nodes=_nodes(3), buckets=4, replicas=3)
    toml = write_node_bundle(
        tmp_path / "n1", spec, spec.node("n1"), ClusterSecrets.new(), None, listen_host="0.0.0.0"
    )
    config = load_node_config(
        toml, {"SEVENDB_RAFT_HEARTBEAT_S": "0.2"}, {"notifier-window-events": "64"}
    )
    assert config.node.id == "n1"
    assert config.node.listen_host == "0.0.0.0"
    assert config.node.seeds == ("10.0.0.2:7001", "10.0.0.3:7001")
    assert config.node.data_dir == (tmp_path / "n1" / "data").resolve()
    assert ClusterSpec.load(config.node.genesis) == spec
    assert config.raft.heartbeat_s == 0.2
    assert config.notifier.window_events == 64
    assert config.notifier.stall_window_ms == config.raft.stall_window_ms
    assert "heartbeat_s = 0.2  # env SEVENDB_RAFT_HEARTBEAT_S" in config.settings.explain()


def test_a_node_config_needs_an_id(tmp_path: Path) -> None:
    (tmp_path / "node.toml").write_text("[node]\n")
    with pytest.raises(ConfigError, match="id is required"):
        load_node_config(tmp_path / "node.toml", {})


def test_secret_files_are_0600_and_others_are_refused(tmp_path: Path) -> None:
    spec = new_cluster(nodes=_nodes(3), buckets=2, replicas=3)
    secrets = ClusterSecrets.new()
    write_node_bundle(tmp_path / "n2", spec, spec.node("n2"), secrets, None)
    client = write_client_config(tmp_path / "client.toml", spec, secrets, now_ms=0, ca_pem=None)
    for path in (tmp_path / "n2" / "secrets.toml", client):
        assert os.stat(path).st_mode & 0o777 == 0o600
    assert ClusterSecrets.load(tmp_path / "n2" / "secrets.toml") == secrets
    assert ClientConfig.load(client).endpoints == tuple(n.grpc_address for n in spec.nodes)
    os.chmod(client, 0o644)
    with pytest.raises(ConfigError, match=r"readable by others \(mode 644\); run `chmod 600"):
        ClientConfig.load(client)


def test_the_metadata_overlay_round_trips_every_kind_of_change() -> None:
    genesis = new_cluster(nodes=_nodes(3), buckets=4, replicas=3)
    n4 = NodeSpec("n4", "10.0.0.4", 7001, 7100, 9101)
    grown = genesis.with_node(n4)
    moved = grown.with_bucket_nodes(2, ("n4", "n1", "n2"))
    migrating = moved.with_migration(
        MigrationSpec(1, ("n1", "n2", "n3"), ("n4", "n2", "n3"), 7, 2, 1), 1
    )
    draining = migrating.with_node(dataclasses.replace(genesis.node("n3"), draining=True))
    records: dict[str, bytes] = {}
    previous = genesis
    done = draining.with_migration(None, 1)
    back = done.with_bucket_nodes(2, genesis.buckets[2].nodes)
    for step in (grown, moved, migrating, draining, done, back, back.without_node("n4")):
        for key, value in changes(previous, step).items():
            if value is None:
                records.pop(key, None)
            else:
                records[key] = value
        assert overlay(genesis, records) == step
        previous = step
    assert json.loads(records["node/n4"]) == {"removed": True}


def test_the_overlay_refuses_a_bad_record() -> None:
    genesis = new_cluster(nodes=_nodes(3), buckets=2, replicas=3)
    with pytest.raises(ConfigError, match="'bucket/1' is not JSON"):
        overlay(genesis, {"bucket/1": b"\xff"})
    with pytest.raises(ConfigError, match="bucket 1 needs 3 distinct nodes"):
        overlay(genesis, {"bucket/1": b'{"nodes": ["n1"]}'})
