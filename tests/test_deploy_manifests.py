"""The packaging in deploy/ without running it (tests/test_image.py runs the image and
the compose file): the Kubernetes manifests validate offline against the Kubernetes
schemas, and agree with each other and with the node; the init container assembles
each pod's bundle from a real `sevendb cluster init`; the systemd unit passes
`systemd-analyze verify`; the image, compose file, manifests and unit run the same
entry point on the same paths, which `sevendb node run --print-config` accepts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sevendb.cluster.common.bundle import ClusterSecrets
from sevendb.cluster.common.topology import ClusterSpec
from sevendb.cluster.ops.deploy import PortPlan, cluster_init
from sevendb.cluster.server.config import load_node_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "sevendb-node@.service"
PODS = ("sevendb-0", "sevendb-1", "sevendb-2")
# The oldest and the newest Kubernetes that kubernetes-validate has schemas for.
K8S_VERSIONS = ("1.25", kubernetes_validate.latest_version())


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _manifests() -> dict[str, dict[str, Any]]:
    """Every object under deploy/k8s by kind (one of each kind)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in _docs(path):
            assert doc["kind"] not in found, f"two {doc['kind']}s"
            found[doc["kind"]] = doc
    return found


def _dockerfile() -> tuple[list[str], dict[str, str], str, str]:
    """The runtime stage's ENTRYPOINT, ENV, VOLUME and UID."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")

    def rest(start: str) -> str:
        found = re.search(rf"^{start}(.*)$", text, re.M)
        assert found is not None, f"the Dockerfile has no {start!r} line"
        return found.group(1).strip()

    entry = json.loads(rest("ENTRYPOINT "))
    env = dict(pair.split("=", 1) for pair in rest("ENV ").split())
    (volume,) = json.loads(rest("VOLUME "))
    return entry, env, volume, rest("ARG UID=")


def _unit() -> dict[str, list[str]]:
    """The unit's keys (a key may repeat), from every section."""
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            keys.setdefault(key, []).append(value)
    return keys


def _print_config(argv: list[str], env: dict[str, str]) -> str:
    """`sevendb node run ... --print-config` as the packaging would run it."""
    assert argv[:3] == ["sevendb", "node", "run"], argv
    sevendb = str(Path(sys.executable).with_name("sevendb"))
    out = subprocess.run(
        [sevendb, *argv[1:], "--print-config"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def k8s_bundles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bundles for the StatefulSet's pods, as docs/deploy.md makes them."""
    out = tmp_path_factory.mktemp("k8s") / "bundles"
    nodes = [f"{pod}={pod}.sevendb" for pod in PODS]
    cluster_init(out, nodes, buckets=2, replicas=3, listen_host="0.0.0.0")
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    paths = sorted(K8S.rglob("*.yaml"))
    assert {p.relative_to(K8S).as_posix() for p in paths} >= {
        "service.yaml",
        "statefulset.yaml",
        "pdb.yaml",
        "examples/bundle.yaml",
    }
    for path in paths:
        for doc in _docs(path):
            kubernetes_validate.validate(doc, version, strict=True)


def test_a_wrong_field_is_caught_by_the_validation() -> None:
    statefulset = _manifests()["StatefulSet"]
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGet"]["paht"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, K8S_VERSIONS[-1], strict=True)


def test_the_objects_agree_with_each_other_and_the_node() -> None:
    found = _manifests()
    service, sts, pdb = found["Service"], found["StatefulSet"], found["PodDisruptionBudget"]
    spec = sts["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    # The headless Service names the pods; not-ready pods are named too (peers elect
    # leaders before anyone is ready), and all start at once for the same reason.
    assert spec["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert spec["podManagementPolicy"] == "Parallel"
    for selector in (spec["selector"]["matchLabels"], pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    assert spec["replicas"] == len(PODS)
    # Probes on the metrics port: /healthz is alive, /readyz ready.
    (node,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    plan = PortPlan()
    assert ports == {"grpc": plan.grpc, "meta": plan.meta, "metrics": plan.metrics}
    assert node["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert node["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert node["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # The image's user, and its paths.
    entry, env, volume, uid = _dockerfile()
    assert pod["securityContext"]["runAsUser"] == int(uid)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert "command" not in node and "args" not in node, "the image's entry point runs"
    mounts = {m["name"]: m["mountPath"] for m in node["volumeMounts"]}
    assert mounts["data"] == volume == env["SEVENDB_NODE_DATA_DIR"]
    assert Path(entry[entry.index("--config") + 1]).parent == Path(mounts["bundle"])
    assert [t["metadata"]["name"] for t in spec["volumeClaimTemplates"]] == ["data"]
    # The bundle volumes are the example objects.
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["bundle-config"]["configMap"]["name"] == found["ConfigMap"]["metadata"]["name"]
    assert volumes["bundle-secret"]["secret"]["secretName"] == found["Secret"]["metadata"]["name"]


def _init_script() -> tuple[str, dict[str, str]]:
    """The init container's shell script and where it reads each source."""
    (init,) = _manifests()["StatefulSet"]["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][:2] == ["sh", "-c"]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    return init["command"][2], mounts


def _as_volume(directory: Path, files: dict[str, bytes], mode: int) -> None:
    """Files laid out as the kubelet lays out a ConfigMap or Secret volume: each key
    a symlink into a timestamped directory behind ``..data``."""
    real = directory / "..2025_01_01_00_00_00.000000000"
    real.mkdir(parents=True)
    for key, body in files.items():
        (real / key).write_bytes(body)
        os.chmod(real / key, mode)
        (directory / key).symlink_to(Path("..data") / key)
    (directory / "..data").symlink_to(real.name)


def _as_objects(bundles: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The ConfigMap's and the Secret's data for these bundles, by the rule the
    manifests document: a file the same in every pod's bundle is one key, FILE; any
    other is one key per pod, POD.FILE; a file only its owner may read is in the Secret."""
    config: dict[str, bytes] = {}
    secret: dict[str, bytes] = {}
    for name in sorted(p.name for p in (bundles / PODS[0]).iterdir()):
        bodies = {pod: (bundles / pod / name).read_bytes() for pod in PODS}
        mode = stat.S_IMODE((bundles / PODS[0] / name).stat().st_mode)
        into = secret if mode & 0o077 == 0 else config
        if len(set(bodies.values())) == 1:
            into[name] = bodies[PODS[0]]
        else:
            into |= {f"{pod}.{name}": body for pod, body in bodies.items()}
    return config, secret


def _assemble(script: str, source: Path, pod: str, to: Path) -> subprocess.CompletedProcess[str]:
    to.mkdir()
    env = {"PATH": os.environ["PATH"], "POD_NAME": pod}
    env |= {"BUNDLE_FROM": str(source), "BUNDLE_TO": str(to)}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)


def test_the_init_container_assembles_each_pods_bundle(k8s_bundles: Path, tmp_path: Path) -> None:
    script, mounts = _init_script()
    assert (mounts["bundle-config"], mounts["bundle-secret"]) == (
        "/bundle/config",
        "/bundle/secret",
    )
    assert mounts["bundle"] == "/etc/sevendb"
    config, secret = _as_objects(k8s_bundles)
    # A Secret volume with fsGroup is group-readable, which the node refuses as such.
    _as_volume(tmp_path / "from" / "config", config, 0o644)
    _as_volume(tmp_path / "from" / "secret", secret, 0o440)
    for pod in PODS:
        to = tmp_path / pod
        done = _assemble(script, tmp_path / "from", pod, to)
        assert done.returncode == 0, done.stderr
        made = sorted(p.name for p in (k8s_bundles / pod).iterdir())
        assert sorted(p.name for p in to.iterdir()) == made
        for name in made:
            assert (to / name).read_bytes() == (k8s_bundles / pod / name).read_bytes(), name
            mode = stat.S_IMODE((k8s_bundles / pod / name).stat().st_mode)
            assert stat.S_IMODE((to / name).stat().st_mode) == mode, name
        ClusterSecrets.load(to / "secrets.toml")  # the node's own check of the mode
        assert load_node_config(to / "node.toml", {}).node.id == pod
    # A pod the bundles have no node for fails, saying so.
    refused = _assemble(script, tmp_path / "from", "sevendb-3", tmp_path / "sevendb-3")
    assert refused.returncode != 0 and "no sevendb-3.node.toml" in refused.stderr


def test_the_example_bundle_is_the_bundle_format(k8s_bundles: Path, tmp_path: Path) -> None:
    found = _manifests()
    data, secret = found["ConfigMap"]["data"], found["Secret"]["stringData"]
    config_keys, secret_keys = (set(o) for o in _as_objects(k8s_bundles))
    assert set(data) == config_keys
    assert set(secret) == secret_keys
    spec = ClusterSpec.from_json(data["genesis.json"], "the example genesis")
    assert sorted(spec.node_ids) == list(PODS)
    (tmp_path / "genesis.json").write_text(data["genesis.json"])
    for pod in PODS:
        path = tmp_path / f"{pod}.toml"
        path.write_text(data[f"{pod}.node.toml"])
        node = load_node_config(path, {}).node
        assert node.id == pod and node.listen_host == "0.0.0.0"
        assert spec.node(pod).host == f"{pod}.sevendb"
    path = tmp_path / "secrets.toml"
    path.write_text(secret["secrets.toml"])
    os.chmod(path, 0o600)
    ClusterSecrets.load(path)


def test_the_image_entry_point_runs_a_bundle_with_its_data_in_the_volume(
    k8s_bundles: Path,
) -> None:
    entry, env, volume, _ = _dockerfile()
    argv = [a.replace("/etc/sevendb", str(k8s_bundles / PODS[0])) for a in entry]
    shown = _print_config(argv, {"SEVENDB_NODE_DATA_DIR": env["SEVENDB_NODE_DATA_DIR"]})
    assert f'data_dir = "{volume}"  # env SEVENDB_NODE_DATA_DIR' in shown


def test_the_compose_file_mounts_each_bundle_where_the_image_reads_it() -> None:
    (compose,) = _docs(DEPLOY / "compose.yaml")
    entry, _, volume, _ = _dockerfile()
    config_dir = str(Path(entry[entry.index("--config") + 1]).parent)
    nodes = {name: s for name, s in compose["services"].items() if "profiles" not in s}
    assert sorted(nodes) == ["n1", "n2", "n3"]
    for name, service in nodes.items():
        assert service["hostname"] == name, "the bundles advertise the service names"
        assert "entrypoint" not in service and "command" not in service
        assert f"/{name}:{config_dir}:ro" in service["volumes"][0]
        assert service["volumes"][1] == f"{name}-data:{volume}"
        assert service["restart"] == "unless-stopped"
    assert sorted(compose["volumes"]) == [f"{n}-data" for n in sorted(nodes)]


def test_the_systemd_unit_verifies_and_runs_the_bundle_of_its_instance(
    k8s_bundles: Path, tmp_path: Path
) -> None:
    keys = _unit()
    assert keys["Type"] == ["simple"]
    assert keys["Restart"] == ["on-failure"]
    assert keys["RestartPreventExitStatus"] == ["2"]  # sevendb node run's configuration error
    assert keys["User"] == ["sevendb"]
    (exec_start,) = keys["ExecStart"]
    argv = exec_start.split()
    assert argv[0] == "/opt/sevendb/bin/sevendb"
    # systemd-analyze wants the command to exist: the same unit, run from this venv.
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze missing (deploy/system-deps.sh installs it)"
    copy = tmp_path / UNIT.name
    sevendb = str(Path(sys.executable).with_name("sevendb"))
    copy.write_text(UNIT.read_text().replace(argv[0], sevendb))
    verified = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True)
    assert verified.returncode == 0 and not verified.stdout + verified.stderr, verified.stderr
    # The instance's command line and environment, as systemd would expand them.
    bundle = k8s_bundles / PODS[1]

    def expand(text: str) -> str:
        return text.replace("/etc/sevendb/%i", str(bundle)).replace("%i", PODS[1])

    env = dict(expand(e).split("=", 1) for e in keys["Environment"])
    shown = _print_config(["sevendb", *[expand(a) for a in argv[1:]]], env)
    assert f'id = "{PODS[1]}"' in shown
    assert f'data_dir = "/var/lib/sevendb/{PODS[1]}"  # env SEVENDB_NODE_DATA_DIR' in shown
    assert keys["StateDirectory"] == ["sevendb/%i"]
