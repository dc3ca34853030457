"""docker-compose.yml, as Compose itself reads it.

No Docker engine runs here, but `docker-compose config` (Debian's docker-compose 1.29, which
`.ci/run` installs) validates the file, interpolates the environment and prints the result.
On that result these tests check what `up` would do with each profile: which services start,
that every dependency of a started service starts too (else `up` refuses), that kvgate waits
for both healthy vLLM replicas and for Redis, that the replicas (of vLLM, of kvgate) are the
same engine and the same gateway, where the GPUs go, and that kvgate's settings and backends,
the Redis they share, the Prometheus targets and the Grafana provisioning agree with each other
and with the Dockerfile.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_files import (
    COMPOSE_FILE,
    DASHBOARD_PROVIDERS,
    DATASOURCES,
    DOCKERFILE,
    PROMETHEUS_CONFIG,
    REPO,
    load_yaml,
    require_tool,
)

from gateway.settings import Settings, load_settings

PROFILES = (None, "gpu", "cpu")
# Each profile's kvgate replicas and the vLLM replicas they front.
GATEWAYS_OF_PROFILE = {"gpu": ("kvgate-a", "kvgate-b"), "cpu": ("kvgate-cpu-a", "kvgate-cpu-b")}
VLLMS_OF_PROFILE = {"gpu": ("vllm-a", "vllm-b"), "cpu": ("vllm-cpu-a", "vllm-cpu-b")}
EXPECTED = {
    None: {"prometheus", "grafana"},
    **{
        profile: {*GATEWAYS_OF_PROFILE[profile], *VLLMS_OF_PROFILE[profile], "redis", "prometheus", "grafana"}
        for profile in GATEWAYS_OF_PROFILE
    },
}
# Each gateway's vLLM replicas.
VLLMS_OF = {
    gateway: VLLMS_OF_PROFILE[profile]
    for profile, gateways in GATEWAYS_OF_PROFILE.items()
    for gateway in gateways
}
VLLMS = tuple(name for names in VLLMS_OF_PROFILE.values() for name in names)
# The names Prometheus scrapes the gateways by (the cpu profile's carry them as aliases).
GATEWAY_HOSTNAMES = ("kvgate-a", "kvgate-b")
# What may differ between two replicas of a profile: the GPU (a deploy reservation), the cores
# their threads bind to, and the name each answers to.
REPLICA_DIFFERENCES = {"deploy", "networks"}
REPLICA_ENVIRONMENT_DIFFERENCES = {"VLLM_CPU_OMP_THREADS_BIND"}


def _compose(home: Path, *args: str, **env: str) -> str:
    # A clean environment: the file's own defaults apply unless a test sets a variable.
    environment = {"PATH": os.environ["PATH"], "HOME": str(home), **env}
    result = subprocess.run(
        [require_tool("docker-compose"), "-f", str(COMPOSE_FILE), *args],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=environment, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _config(home: Path, profile: str | None = None, **env: str) -> dict[str, Any]:
    args = ["--profile", profile] if profile else []
    config: dict[str, Any] = yaml.safe_load(_compose(home, *args, "config", **env))
    return config


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def services(home: Path) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = _config(home)["services"]
    return found


def _active(services: dict[str, dict[str, Any]], profile: str | None) -> set[str]:
    """Compose's rule: a service starts when it has no profile or one of the enabled ones."""
    return {
        name for name, service in services.items()
        if not service.get("profiles") or (profile is not None and profile in service["profiles"])
    }  # fmt: skip


def _hostnames(services: dict[str, dict[str, Any]], name: str) -> set[str]:
    aliases = {
        alias
        for network in (services[name].get("networks") or {}).values()
        for alias in ((network or {}).get("aliases") or [])
    }
    return {name} | aliases


def _volumes(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (or volume name) of a service's mounts."""
    mounts: dict[str, str] = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        mounts[target] = source
    return mounts


def _settings(monkeypatch: pytest.MonkeyPatch, environment: dict[str, Any]) -> Settings:
    for key in list(os.environ):
        if key.startswith("KVGATE_"):
            monkeypatch.delenv(key)
    for key, value in environment.items():
        if key.startswith("KVGATE_") and value is not None:
            monkeypatch.setenv(key, str(value))
    return load_settings()


def _exposed_port() -> int:
    (port,) = re.findall(r"^EXPOSE (\d+)$", DOCKERFILE.read_text(), re.MULTILINE)
    return int(port)


def _command_port(service: dict[str, Any]) -> int:
    match = re.search(r"--port (\d+)", service["command"])
    assert match, f"vLLM's port is not explicit in {service['command']!r}"
    return int(match.group(1))


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_validates_the_file_for_each_profile(home: Path, profile: str | None) -> None:
    config = _config(home, profile)
    assert set(config["services"]) == set().union(*EXPECTED.values())
    assert set(config["volumes"]) == {"prometheus-data", "grafana-data"}


def test_compose_reports_the_gpu_and_cpu_profiles(home: Path) -> None:
    assert _compose(home, "config", "--profiles").split() == ["cpu", "gpu"]
    assert set(_compose(home, "config", "--services").split()) == set().union(*EXPECTED.values())


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_starts_a_complete_stack(
    services: dict[str, dict[str, Any]], profile: str | None
) -> None:
    active = _active(services, profile)
    assert active == EXPECTED[profile]
    for name in active:
        missing = set(services[name].get("depends_on", {})) - active
        assert not missing, f"with profile {profile}, {name} depends on {missing}, which would not start"
    names = [host for name in active for host in _hostnames(services, name)]
    assert len(names) == len(set(names)), f"profile {profile}: a hostname is taken twice: {sorted(names)}"
    if profile is not None:
        # Both profiles' engines answer as `vllm-a` and `vllm-b`, and their gateways as
        # `kvgate-a` and `kvgate-b`: the names Prometheus scrapes.
        targets = {t for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"] for g in job["static_configs"]
                   for t in g["targets"]}  # fmt: skip
        assert {t.split(":")[0] for t in targets} <= set(names)


def test_every_service_has_a_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        check = service.get("healthcheck")
        assert check, f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert check["interval"], name
        assert check["retries"] >= 1, name


@pytest.mark.parametrize("gateway", sorted(VLLMS_OF))
def test_kvgate_starts_once_both_its_vllms_are_healthy(
    services: dict[str, dict[str, Any]], gateway: str
) -> None:
    kvgate = services[gateway]
    assert kvgate["depends_on"] == {
        name: {"condition": "service_healthy"} for name in ("redis", *VLLMS_OF[gateway])
    }
    for name in VLLMS_OF[gateway]:
        vllm = services[name]
        assert kvgate["profiles"] == vllm["profiles"]
        # vLLM is healthy when its own /health answers, on the port it serves.
        probe = " ".join(vllm["healthcheck"]["test"])
        assert f"127.0.0.1:{_command_port(vllm)}/health'" in probe
        # A model download can take long: the health checks must not give up on it first.
        start_period = vllm["healthcheck"]["start_period"]
        assert re.fullmatch(r"\d+m", start_period)
        assert int(start_period[:-1]) >= 10
    port = kvgate["environment"]["KVGATE_PORT"]
    assert f"127.0.0.1:{port}/healthz'" in " ".join(kvgate["healthcheck"]["test"])


@pytest.mark.parametrize("gateway", sorted(VLLMS_OF))
def test_the_replicas_are_the_same_engine(services: dict[str, dict[str, Any]], gateway: str) -> None:
    """Same image, model, flags, cache and health check: kvgate routes a model's requests to
    either, so they must serve the same model the same way."""
    first, second = (services[name] for name in VLLMS_OF[gateway])

    def engine(service: dict[str, Any]) -> dict[str, Any]:
        same = {key: value for key, value in service.items() if key not in REPLICA_DIFFERENCES}
        environment = same.get("environment") or {}
        same["environment"] = {
            key: value for key, value in environment.items() if key not in REPLICA_ENVIRONMENT_DIFFERENCES
        }
        return same

    assert engine(first) == engine(second)
    assert "--model " in first["command"]


def test_each_gpu_replica_reserves_a_gpu_of_its_own(home: Path, services: dict[str, dict[str, Any]]) -> None:
    def gpus(config: dict[str, dict[str, Any]], name: str) -> list[str]:
        (device,) = config[name]["deploy"]["resources"]["reservations"]["devices"]
        assert "gpu" in device["capabilities"]
        assert "count" not in device, "a replica takes its own GPU, not all of them"
        ids: list[str] = device["device_ids"]
        return ids

    assert gpus(services, "vllm-a") == ["0"]
    assert gpus(services, "vllm-b") == ["1"]
    moved = _config(home, VLLM_A_GPU="2", VLLM_B_GPU="3")["services"]
    assert (gpus(moved, "vllm-a"), gpus(moved, "vllm-b")) == (["2"], ["3"])
    for name in VLLMS_OF_PROFILE["gpu"]:
        assert services[name]["image"].startswith("vllm/vllm-openai:")
    for name in VLLMS_OF_PROFILE["cpu"]:
        assert services[name]["image"].startswith("vllm/vllm-openai-cpu:")
    for name, service in services.items():
        if name not in VLLMS_OF_PROFILE["gpu"]:
            assert "deploy" not in service, f"{name} should not reserve devices"


def test_each_cpu_replica_binds_the_cores_it_is_given(home: Path) -> None:
    services = _config(home, VLLM_CPU_A_CORES="0-3", VLLM_CPU_B_CORES="4-7")["services"]
    assert services["vllm-cpu-a"]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert services["vllm-cpu-b"]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "4-7"


def test_model_and_hugging_face_cache_come_from_the_environment(home: Path) -> None:
    services = _config(
        home, VLLM_MODEL="org/big-model", VLLM_CPU_MODEL="org/small-model", HF_CACHE="/srv/hf"
    )["services"]
    for name in VLLMS_OF_PROFILE["gpu"]:
        assert "--model org/big-model " in services[name]["command"] + " "
    for name in VLLMS_OF_PROFILE["cpu"]:
        assert "--model org/small-model " in services[name]["command"] + " "
    home_dir = _dockerfile_home()
    for name in VLLMS:
        assert _volumes(services[name])["/root/.cache/huggingface"] == "/srv/hf"
    for name in VLLMS_OF:
        assert _volumes(services[name])[f"{home_dir}/.cache/huggingface"] == "/srv/hf"
        assert services[name]["volumes"][0].endswith(":ro"), "kvgate only reads the cache"


def _dockerfile_home() -> str:
    text = DOCKERFILE.read_text()
    assert "--create-home" in text
    (user,) = re.findall(r"useradd .* (\w+)$", text, re.MULTILINE)
    return f"/home/{user}"


@pytest.mark.parametrize("gateway", sorted(VLLMS_OF))
def test_kvgate_is_built_here_and_its_settings_load(
    services: dict[str, dict[str, Any]], gateway: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kvgate = services[gateway]
    assert Path(kvgate["build"]["context"]) == REPO
    assert DOCKERFILE.exists()
    environment = dict(kvgate["environment"])
    backends = _backends(kvgate)
    settings = _settings(monkeypatch, environment)
    assert [spec.url for spec in settings.backend_specs()] == backends
    (published,) = kvgate["ports"]
    assert settings.port == published["target"] == _exposed_port()
    assert settings.host == "0.0.0.0"
    # Secrets are passed through from the shell, never written into the file.
    assert kvgate["environment"]["KVGATE_ADMIN_TOKEN"] is None
    assert kvgate["environment"]["KVGATE_BACKEND_API_KEY"] is None


def _backends(kvgate: dict[str, Any]) -> list[str]:
    backends = json.loads(kvgate["environment"]["KVGATE_BACKENDS"])
    assert isinstance(backends, list)
    assert all(isinstance(url, str) for url in backends)
    return backends


@pytest.mark.parametrize("gateway", sorted(VLLMS_OF))
def test_kvgate_fronts_each_replica_once_and_prometheus_scrapes_them_by_its_names(
    services: dict[str, dict[str, Any]], gateway: str
) -> None:
    """KVGATE_BACKENDS names each of this profile's vLLMs once, on the port it serves; the
    vllm scrape job has exactly those host:port targets, and (see its relabel rule, run for
    real by test_deploy_prometheus_live.py) labels each with its address: the name kvgate
    gives a backend by default, which the dashboards match vLLM's series to kvgate's on."""
    urls = _backends(services[gateway])
    addresses: list[str] = []
    fronted: list[str] = []
    for url in urls:
        match = re.fullmatch(r"http://([\w.-]+):(\d+)", url)
        assert match, url
        host, port = match.groups()
        (vllm,) = [name for name in VLLMS_OF[gateway] if host in _hostnames(services, name)]
        assert int(port) == _command_port(services[vllm])
        fronted.append(vllm)
        addresses.append(f"{host}:{port}")
    assert sorted(fronted) == sorted(VLLMS_OF[gateway])
    vllm_job = next(j for j in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"] if j["job_name"] == "vllm")
    (group,) = vllm_job["static_configs"]
    assert group["targets"] == addresses
    assert "backend" not in group.get("labels", {}), "the relabel rule gives each its address"
    (rule,) = vllm_job["relabel_configs"]
    assert rule["target_label"] == "backend"
    assert rule["source_labels"] == ["backend", "__address__"]


def test_prometheus_runs_the_repository_configuration(services: dict[str, dict[str, Any]]) -> None:
    prometheus = services["prometheus"]
    mounts = _volumes(prometheus)
    (flag,) = [c for c in prometheus["command"] if c.startswith("--config.file=")]
    config_path = PurePosixPath(flag.split("=", 1)[1])
    host_dir = mounts[str(config_path.parent)]
    assert Path(host_dir) / config_path.name == PROMETHEUS_CONFIG
    for rule_file in load_yaml(PROMETHEUS_CONFIG)["rule_files"]:
        assert (Path(host_dir) / rule_file).exists(), f"{rule_file} is not mounted beside the config"
    # The scrape targets' ports are the ones the services listen on.
    targets = {t for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"] for g in job["static_configs"]
               for t in g["targets"]}  # fmt: skip
    for name in VLLMS_OF_PROFILE["gpu"]:
        assert f"{name}:{_command_port(services[name])}" in targets


@pytest.mark.parametrize("profile", sorted(GATEWAYS_OF_PROFILE))
def test_prometheus_scrapes_every_kvgate_replica(services: dict[str, dict[str, Any]], profile: str) -> None:
    (kvgate_job,) = [j for j in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"] if j["job_name"] == "kvgate"]
    (group,) = kvgate_job["static_configs"]
    assert "backend" not in group.get("labels", {}), "kvgate's series carry their own backend label"
    expected = []
    for gateway, hostname in zip(GATEWAYS_OF_PROFILE[profile], GATEWAY_HOSTNAMES, strict=True):
        assert hostname in _hostnames(services, gateway)
        expected.append(f"{hostname}:{services[gateway]['environment']['KVGATE_PORT']}")
    assert group["targets"] == expected


def test_grafana_loads_the_provisioned_datasource_and_dashboards(services: dict[str, dict[str, Any]]) -> None:
    grafana = services["grafana"]
    mounts = _volumes(grafana)
    provisioning = Path(mounts["/etc/grafana/provisioning"])
    assert provisioning / "datasources" == DATASOURCES
    assert provisioning / "dashboards" == DASHBOARD_PROVIDERS
    (provider,) = load_yaml(next(DASHBOARD_PROVIDERS.glob("*.yml")))["providers"]
    dashboards_dir = provider["options"]["path"]
    assert dashboards_dir in mounts, "the provider reads a folder compose does not mount"
    home = PurePosixPath(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert str(home.parent) == dashboards_dir
    assert (Path(mounts[dashboards_dir]) / home.name).exists()
    # The datasource reaches the prometheus service on the port it listens on.
    (source,) = load_yaml(next(DATASOURCES.glob("*.yml")))["datasources"]
    (published,) = services["prometheus"]["ports"]
    assert source["url"] == f"http://prometheus:{published['target']}"
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_healthy"}}


@pytest.mark.parametrize("profile", sorted(GATEWAYS_OF_PROFILE))
def test_the_kvgate_replicas_are_one_gateway_on_two_ports(
    services: dict[str, dict[str, Any]], profile: str
) -> None:
    """Same image, settings, cache, health check and dependencies: a client may send any
    request to either. Only the host port and the name each answers to differ."""
    first, second = (services[name] for name in GATEWAYS_OF_PROFILE[profile])

    def gateway(service: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in service.items() if key not in {"ports", "networks"}}

    assert gateway(first) == gateway(second)
    published = [
        int(port["published"])
        for name in _active(services, profile)
        for port in services[name].get("ports", [])
    ]
    assert len(published) == len(set(published)), f"profile {profile}: a host port is taken twice"
    assert [int(service["ports"][0]["published"]) for service in (first, second)] == [8080, 8081]


@pytest.mark.parametrize("gateway", sorted(VLLMS_OF))
def test_kvgate_replicas_share_their_budget_through_the_redis_service(
    services: dict[str, dict[str, Any]], gateway: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings(monkeypatch, dict(services[gateway]["environment"]))
    assert settings.redis_url is not None
    parts = urlsplit(settings.redis_url.get_secret_value())
    assert parts.scheme == "redis"
    assert parts.hostname in _hostnames(services, "redis")
    redis = services["redis"]
    # The port the image's server listens on (redis-server's default; the command keeps it).
    assert (parts.port, "--port" in redis["command"]) == (6379, False)
    assert services[gateway]["depends_on"]["redis"] == {"condition": "service_healthy"}


def test_redis_is_the_official_image_checked_by_ping_and_private(services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    assert redis["image"] == "redis:7-alpine"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert sorted(redis["profiles"]) == sorted(GATEWAYS_OF_PROFILE)
    # Only the gateways reach it; no host port, and nothing written to disk (see the file).
    assert "ports" not in redis
    assert redis["command"][0] == "redis-server"
    assert "--appendonly" in redis["command"]
