"""deploy/k8s (kustomize), rendered and checked without a cluster.

No kubectl here, so `render` below builds what `kubectl kustomize` would for the subset of
kustomize these files use (resources, components, ConfigMap/Secret generators from env files
with a content hash in the name, images) and refuses anything else, so a new feature in a
kustomization cannot be silently skipped. The checks then hold the manifests to the Dockerfile
(user, port, entry point), to kvgate's Settings (every KVGATE_* key is a real setting and the
whole ConfigMap loads) and to the app's real routes (probe and metrics paths), kvgate's
backends to the headless Service that publishes the vLLM replicas, and its Redis URL to the
Redis the replicas share their budget through.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_files import DOCKERFILE, K8S, REPO, load_yaml
from fastapi.routing import APIRoute

from gateway.app import create_app
from gateway.settings import ENV_PREFIX, Settings, load_settings

KUSTOMIZATION_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "configMapGenerator",
    "secretGenerator",
    "images",
}
GENERATED_KINDS = {"configMapGenerator": "ConfigMap", "secretGenerator": "Secret"}
NAME_LABEL = "app.kubernetes.io/name"


# -- a small kustomize ---------------------------------------------------------------------


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` prints, for the features used here."""
    kustomization = load_yaml(directory / "kustomization.yaml")
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: kustomization uses {unknown}, which this renderer does not implement"
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for entry in kustomization.get("components", []):
        component = load_yaml(directory / entry / "kustomization.yaml")
        assert component["kind"] == "Component", f"{entry} is not a kustomize Component"
        objects += render(directory / entry)
    renames: dict[tuple[str, str], str] = {}
    for key, kind in GENERATED_KINDS.items():
        for generator in kustomization.get(key, []):
            data = _generator_data(directory, generator)
            digest = hashlib.sha256(repr(sorted(data.items())).encode()).hexdigest()[:10]
            name = f"{generator['name']}-{digest}"
            renames[(kind, generator["name"])] = name
            objects.append({"apiVersion": "v1", "kind": kind, "metadata": {"name": name}, "data": data})
    for obj in objects:
        for container in _containers(obj):
            _rename_references(container, renames)
            _set_image(container, kustomization.get("images", []))
    return objects


def _generator_data(directory: Path, generator: dict[str, Any]) -> dict[str, str]:
    assert set(generator) <= {"name", "envs", "literals"}, f"unsupported generator fields in {generator}"
    data: dict[str, str] = {}
    for env_file in generator.get("envs", []):
        data.update(read_env_file(directory / env_file))
    for literal in generator.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    return data


def read_env_file(path: Path) -> dict[str, str]:
    """kustomize's env-file format: KEY=VALUE lines; blank lines and # comments ignored."""
    data: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {line!r}"
        data[key.strip()] = value
    return data


def _containers(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])


def _rename_references(container: dict[str, Any], renames: dict[tuple[str, str], str]) -> None:
    for source in container.get("envFrom", []):
        for field, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
            if field in source:
                ref = source[field]
                ref["name"] = renames.get((kind, ref["name"]), ref["name"])
    for variable in container.get("env", []):
        source = variable.get("valueFrom", {})
        for field, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
            if field in source:
                ref = source[field]
                ref["name"] = renames.get((kind, ref["name"]), ref["name"])


def _set_image(container: dict[str, Any], images: list[dict[str, str]]) -> None:
    name, _, tag = container["image"].partition(":")
    for image in images:
        if image["name"] == name:
            name = image.get("newName", name)
            tag = image.get("newTag", tag)
    container["image"] = f"{name}:{tag}" if tag else name


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/k8s with a secrets.env made from the example, as an operator would."""
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("secrets.env"))
    example = read_env_file(copy / "base" / "secrets.env.example")
    (copy / "base" / "secrets.env").write_text("".join(f"{key}={secrets.token_hex(16)}\n" for key in example))
    return copy


@pytest.fixture(scope="module")
def base(k8s_copy: Path) -> dict[str, dict[str, Any]]:
    return _by_kind(render(k8s_copy / "base"))


@pytest.fixture(scope="module")
def base_vllm(k8s_copy: Path) -> dict[str, dict[str, Any]]:
    return _by_kind(render(k8s_copy / "base"), app="vllm")


@pytest.fixture(scope="module")
def base_redis(k8s_copy: Path) -> dict[str, dict[str, Any]]:
    return _by_kind(render(k8s_copy / "base"), app="redis")


@pytest.fixture(scope="module")
def monitored(k8s_copy: Path) -> dict[str, dict[str, Any]]:
    return _by_kind(render(k8s_copy / "overlays" / "monitored"))


@pytest.fixture(scope="module")
def monitored_vllm(k8s_copy: Path) -> dict[str, dict[str, Any]]:
    return _by_kind(render(k8s_copy / "overlays" / "monitored"), app="vllm")


def _by_kind(objects: list[dict[str, Any]], app: str = "kvgate") -> dict[str, dict[str, Any]]:
    """The objects of `app` (by their app.kubernetes.io/name label; the generated ConfigMap and
    Secret are kvgate's) by kind, one of each."""
    found: dict[str, dict[str, Any]] = {}
    for obj in objects:
        for required in (obj.get("apiVersion"), obj.get("kind"), obj.get("metadata", {}).get("name")):
            assert required, f"an object without apiVersion, kind or name: {obj}"
        owner = (obj["metadata"].get("labels") or {}).get(NAME_LABEL, "kvgate")
        assert owner in {"kvgate", "vllm", "redis"}, (
            f"{obj['kind']} {obj['metadata']['name']} belongs to {owner}"
        )
        if owner != app:
            continue
        assert obj["kind"] not in found, f"two {obj['kind']} objects of {app}"
        found[obj["kind"]] = obj
    return found


def _container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    (container,) = containers
    return container


def _settings_of(objects: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Settings:
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    for kind in ("ConfigMap", "Secret"):
        for key, value in objects[kind]["data"].items():
            monkeypatch.setenv(key, value)
    return load_settings()


# -- checks ----------------------------------------------------------------------------------


def test_the_base_renders_the_gateway_objects(
    base: dict[str, dict[str, Any]],
    base_vllm: dict[str, dict[str, Any]],
    base_redis: dict[str, dict[str, Any]],
) -> None:
    assert set(base) == {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Secret"}
    # vLLM itself is deployed on its own: the base only publishes its pods to kvgate.
    assert set(base_vllm) == {"Service"}
    # The replicas' shared ledger comes with the base.
    assert set(base_redis) == {"Deployment", "Service"}


def test_vllm_s_pods_are_published_by_a_headless_service(base_vllm: dict[str, dict[str, Any]]) -> None:
    service = base_vllm["Service"]
    spec = service["spec"]
    # Headless: the name resolves to every pod's address, not to one virtual IP that
    # balances connections at random behind kvgate's back.
    assert spec["clusterIP"] == "None"
    assert spec.get("type", "ClusterIP") == "ClusterIP"
    # Only ready pods: one still loading its model is not a backend yet.
    assert spec.get("publishNotReadyAddresses", False) is False
    assert spec["selector"] == {NAME_LABEL: "vllm"}
    (port,) = spec["ports"]
    assert (port["name"], port["port"], port["protocol"]) == ("http", 8000, "TCP")


def test_kvgate_s_backends_are_the_addresses_of_the_headless_service(
    base: dict[str, dict[str, Any]], base_vllm: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    backends = json.loads(base["ConfigMap"]["data"]["KVGATE_BACKENDS"])
    service = base_vllm["Service"]
    (port,) = service["spec"]["ports"]
    assert backends == [f"dns+http://{service['metadata']['name']}:{port['port']}"]
    # One way to name the backends: no single-backend settings beside the list.
    assert not {"KVGATE_BACKEND_URL", "KVGATE_BACKEND_NAME"} & set(base["ConfigMap"]["data"])
    (spec,) = _settings_of(base, monkeypatch).backend_specs()
    assert spec.resolve
    assert spec.url == f"http://{service['metadata']['name']}:{port['port']}"


def test_the_monitored_overlay_adds_a_service_monitor(monitored: dict[str, dict[str, Any]]) -> None:
    assert set(monitored) == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ConfigMap",
        "Secret",
        "ServiceMonitor",
    }
    monitor = monitored["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = monitored["Service"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] in _route_paths()
    # The job label comes from the Service's name: the alert rules select job="kvgate".
    assert service["metadata"]["name"] == "kvgate"


def test_the_monitored_overlay_scrapes_each_vllm_replica_as_kvgate_names_it(
    monitored_vllm: dict[str, dict[str, Any]],
) -> None:
    assert set(monitored_vllm) == {"Service", "ServiceMonitor"}
    monitor, service = monitored_vllm["ServiceMonitor"], monitored_vllm["Service"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # The dashboards and rules select job="vllm": the job comes from the Service's name label.
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "vllm"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # Each pod's series carry its address as `backend`, kvgate's name for that backend.
    assert endpoint["relabelings"] == [{"sourceLabels": ["__address__"], "targetLabel": "backend"}]


def test_two_replicas_evicted_one_at_a_time(base: dict[str, dict[str, Any]]) -> None:
    spec = base["Deployment"]["spec"]
    assert spec["replicas"] == 2
    # They share the budget, so a rollout may run old and new side by side, never fewer.
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    budget = base["PodDisruptionBudget"]["spec"]
    assert budget["minAvailable"] == 1
    assert "maxUnavailable" not in budget, "a PDB takes one of minAvailable and maxUnavailable"
    # One replica always serves, and a drain can still evict the other: below the replicas.
    assert budget["minAvailable"] < spec["replicas"]
    (spread,) = spec["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway", "two replicas must schedule on one node too"
    assert spread["labelSelector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_the_replicas_share_the_budget_through_the_redis_of_the_base(
    base: dict[str, dict[str, Any]], base_redis: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings_of(base, monkeypatch)
    assert settings.redis_url is not None
    url = urlsplit(settings.redis_url.get_secret_value())
    service = base_redis["Service"]
    (port,) = service["spec"]["ports"]
    assert (url.scheme, url.hostname, url.port) == ("redis", service["metadata"]["name"], port["port"])
    assert "KVGATE_REDIS_URL" not in base["Secret"]["data"]
    assert settings.workers == 1, "one process per pod: the replicas are the pods"
    deployment = base_redis["Deployment"]["spec"]
    # One Redis, never two at once (each would be a ledger of its own).
    assert (deployment["replicas"], deployment["strategy"]["type"]) == (1, "Recreate")
    pod_labels = deployment["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["selector"]["matchLabels"].items() <= pod_labels.items()
    # Not selected by kvgate's Service, Deployment or PodDisruptionBudget.
    assert not base["Service"]["spec"]["selector"].items() <= pod_labels.items()
    (container,) = deployment["template"]["spec"]["containers"]
    assert container["image"] == "redis:7-alpine"
    (container_port,) = container["ports"]
    assert port["targetPort"] in (container_port["name"], container_port["containerPort"])
    assert container_port["containerPort"] == 6379
    assert container["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    assert deployment["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["limits"]["memory"]


def test_selectors_match_the_pods(base: dict[str, dict[str, Any]]) -> None:
    deployment = base["Deployment"]["spec"]
    pod_labels = deployment["template"]["metadata"]["labels"]
    for selector in (
        deployment["selector"]["matchLabels"],
        base["Service"]["spec"]["selector"],
        base["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    ):
        assert selector
        assert selector.items() <= pod_labels.items()


def test_probes_and_ports_match_the_app_and_the_dockerfile(base: dict[str, dict[str, Any]]) -> None:
    container = _container(base)
    (port,) = container["ports"]
    assert port["containerPort"] == _dockerfile_port()
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    routes = _route_paths()
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        check = container[probe]["httpGet"]
        assert check["path"] in routes, f"{probe} asks for {check['path']}, which kvgate does not serve"
        assert check["port"] in (port["name"], port["containerPort"])
    (service_port,) = base["Service"]["spec"]["ports"]
    assert service_port["targetPort"] in (port["name"], port["containerPort"])


def test_the_image_and_user_are_the_dockerfile_s(base: dict[str, dict[str, Any]]) -> None:
    container = _container(base)
    name, _, tag = container["image"].partition(":")
    assert name == "kvgate"
    assert tag == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert _dockerfile_line("ENTRYPOINT") == '["kvgate"]'
    assert container["args"] == ["serve"]
    assert "command" not in container
    pod = base["Deployment"]["spec"]["template"]["spec"]
    uid = re.search(r"--uid (\d+)", DOCKERFILE.read_text())
    assert uid
    assert pod["securityContext"]["runAsUser"] == int(uid.group(1))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert "/home/kvgate/.cache/huggingface" in mounts
    assert "/tmp" in mounts


def test_resources_are_requested(base: dict[str, dict[str, Any]]) -> None:
    resources = _container(base)["resources"]
    assert resources["requests"]["cpu"]
    assert resources["requests"]["memory"]
    assert resources["limits"]["memory"]


def test_settings_come_from_the_config_map_and_the_secret(
    base: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    container = _container(base)
    sources = {next(iter(s)): next(iter(s.values()))["name"] for s in container["envFrom"]}
    assert sources == {
        "configMapRef": base["ConfigMap"]["metadata"]["name"],
        "secretRef": base["Secret"]["metadata"]["name"],
    }
    fields = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    for kind in ("ConfigMap", "Secret"):
        unknown = set(base[kind]["data"]) - fields
        assert not unknown, f"{kind} keys {unknown} are not kvgate settings"
    settings = _settings_of(base, monkeypatch)
    assert settings.port == container["ports"][0]["containerPort"]
    assert settings.host == "0.0.0.0"
    assert settings.admin_token is not None, "the Secret carries the admin token"
    secret_keys = {"KVGATE_ADMIN_TOKEN", "KVGATE_BACKEND_API_KEY"}
    assert not set(base["ConfigMap"]["data"]) & secret_keys, "keys belong in the Secret"


def test_generated_names_change_with_the_settings(k8s_copy: Path, tmp_path: Path) -> None:
    """A changed setting gives the ConfigMap a new name, so the Deployment rolls."""
    changed = tmp_path / "k8s"
    shutil.copytree(k8s_copy, changed)
    with open(changed / "base" / "settings.env", "a") as settings:
        settings.write("KVGATE_OUTPUT_QUANTILE=0.8\n")
    before = _by_kind(render(k8s_copy / "base"))["ConfigMap"]["metadata"]["name"]
    after = _by_kind(render(changed / "base"))
    assert after["ConfigMap"]["metadata"]["name"] != before
    assert _container(after)["envFrom"][0]["configMapRef"]["name"] == after["ConfigMap"]["metadata"]["name"]


def test_the_secret_file_stays_out_of_git() -> None:
    assert "secrets.env" in (K8S / "base" / ".gitignore").read_text().split()
    example = read_env_file(K8S / "base" / "secrets.env.example")
    assert set(example) == {"KVGATE_ADMIN_TOKEN"}
    assert not any(example.values()), "the example must not carry a usable token"


def _route_paths() -> set[str]:
    app = create_app(Settings(backend_url="http://127.0.0.1:9"))
    return {route.path for route in app.routes if isinstance(route, APIRoute)}


def _dockerfile_line(instruction: str) -> str:
    values: list[str] = re.findall(rf"^{instruction} (.+)$", DOCKERFILE.read_text(), re.MULTILINE)
    (value,) = values
    return value.strip()


def _dockerfile_port() -> int:
    return int(_dockerfile_line("EXPOSE"))
