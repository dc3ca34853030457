"""docker-compose.yml, as Compose itself reads it.

No Docker engine runs here, but `docker-compose config` (Debian's docker-compose 1.29, which
`.ci/run` installs) validates the file, interpolates the environment and prints the result.
On that result these tests check what `up` would do with each profile: which services start,
that every dependency of a started service starts too (else `up` refuses), that kvgate waits
for a healthy vLLM, where the GPU goes, and that kvgate's settings, the Prometheus targets and
the Grafana provisioning agree with each other and with the Dockerfile.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

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
EXPECTED = {
    None: {"prometheus", "grafana"},
    "gpu": {"vllm", "kvgate", "prometheus", "grafana"},
    "cpu": {"vllm-cpu", "kvgate-cpu", "prometheus", "grafana"},
}
VLLM_OF = {"kvgate": "vllm", "kvgate-cpu": "vllm-cpu"}


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
        # Both engines answer as `vllm` and both gateways as `kvgate`, the names Prometheus scrapes.
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


@pytest.mark.parametrize("gateway", sorted(VLLM_OF))
def test_kvgate_starts_once_its_vllm_is_healthy(services: dict[str, dict[str, Any]], gateway: str) -> None:
    kvgate, vllm = services[gateway], services[VLLM_OF[gateway]]
    assert kvgate["depends_on"] == {VLLM_OF[gateway]: {"condition": "service_healthy"}}
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


def test_the_gpu_is_reserved_for_the_gpu_vllm_only(services: dict[str, dict[str, Any]]) -> None:
    devices = services["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    assert services["vllm"]["image"].startswith("vllm/vllm-openai:")
    assert services["vllm-cpu"]["image"].startswith("vllm/vllm-openai-cpu:")
    for name, service in services.items():
        if name != "vllm":
            assert "deploy" not in service, f"{name} should not reserve devices"


def test_model_and_hugging_face_cache_come_from_the_environment(home: Path) -> None:
    services = _config(
        home, VLLM_MODEL="org/big-model", VLLM_CPU_MODEL="org/small-model", HF_CACHE="/srv/hf"
    )["services"]
    assert "--model org/big-model " in services["vllm"]["command"] + " "
    assert "--model org/small-model " in services["vllm-cpu"]["command"] + " "
    home_dir = _dockerfile_home()
    for name in ("vllm", "vllm-cpu"):
        assert _volumes(services[name])["/root/.cache/huggingface"] == "/srv/hf"
    for name in VLLM_OF:
        assert _volumes(services[name])[f"{home_dir}/.cache/huggingface"] == "/srv/hf"
        assert services[name]["volumes"][0].endswith(":ro"), "kvgate only reads the cache"


def _dockerfile_home() -> str:
    text = DOCKERFILE.read_text()
    assert "--create-home" in text
    (user,) = re.findall(r"useradd .* (\w+)$", text, re.MULTILINE)
    return f"/home/{user}"


@pytest.mark.parametrize("gateway", sorted(VLLM_OF))
def test_kvgate_is_built_here_and_its_settings_load(
    services: dict[str, dict[str, Any]], gateway: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kvgate = services[gateway]
    assert Path(kvgate["build"]["context"]) == REPO
    assert DOCKERFILE.exists()
    settings = _settings(monkeypatch, kvgate["environment"])
    (published,) = kvgate["ports"]
    assert settings.port == published["target"] == _exposed_port()
    assert settings.host == "0.0.0.0"
    # The backend URL names this profile's vLLM, on the port it serves.
    url = re.fullmatch(r"http://([\w.-]+):(\d+)", settings.backend_url)
    assert url, settings.backend_url
    host, port = url.groups()
    vllm = VLLM_OF[gateway]
    assert host in _hostnames(services, vllm)
    assert int(port) == _command_port(services[vllm])
    # Prometheus labels vLLM's series with kvgate's backend name: the dashboards join on it.
    vllm_job = next(j for j in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"] if j["job_name"] == "vllm")
    assert vllm_job["static_configs"][0]["labels"]["backend"] == settings.backend_name
    # Secrets are passed through from the shell, never written into the file.
    assert kvgate["environment"]["KVGATE_ADMIN_TOKEN"] is None
    assert kvgate["environment"]["KVGATE_BACKEND_API_KEY"] is None


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
    assert f"kvgate:{services['kvgate']['environment']['KVGATE_PORT']}" in targets
    assert f"vllm:{_command_port(services['vllm'])}" in targets


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
