"""Settings: sources in order of strength (flags, environment, file, defaults), validated at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.admission import Priority
from gateway.settings import (
    DEFAULT_METRICS_POLL_INTERVAL_S,
    ConfigFileError,
    Settings,
    load_settings,
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVGATE_"):
            monkeypatch.delenv(name)


def test_defaults_need_only_a_backend() -> None:
    settings = load_settings({"backend_url": "http://127.0.0.1:8000/"})
    assert settings.backend_url == "http://127.0.0.1:8000"
    assert settings.metrics_poll_interval_s == DEFAULT_METRICS_POLL_INTERVAL_S
    assert settings.queue_max()[Priority.LOW] == settings.priority_classes[Priority.LOW].queue_max


def test_flags_beat_environment_beats_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text(
        'backend_url = "http://file:1"\nport = 1111\nhol_deadline_share = 0.3\noutput_quantile = 0.5\n'
    )
    monkeypatch.setenv("KVGATE_PORT", "2222")
    monkeypatch.setenv("KVGATE_HOL_DEADLINE_SHARE", "0.4")
    settings = load_settings({"hol_deadline_share": 0.2, "model": None}, config_file=config)
    assert settings.backend_url == "http://file:1"  # file only
    assert settings.output_quantile == 0.5  # file only
    assert settings.port == 2222  # environment over file
    assert settings.hol_deadline_share == 0.2  # flag over environment
    assert settings.model is None  # an absent flag (None) overrides nothing


def test_json_file_and_serve_table(tmp_path: Path) -> None:
    as_json = tmp_path / "kvgate.json"
    as_json.write_text(json.dumps({"backend_url": "http://json:1", "output_backend_prior": False}))
    assert load_settings(config_file=as_json).output_backend_prior is False
    as_toml = tmp_path / "nested.toml"
    as_toml.write_text('[serve]\nbackend_url = "http://toml:1"\n')
    assert load_settings(config_file=as_toml).backend_url == "http://toml:1"


@pytest.mark.parametrize(
    ("content", "suffix", "message"),
    [("[1, 2]", ".json", "table"), ("not = [toml", ".toml", "not valid"), ("{", ".json", "not valid")],
)
def test_bad_config_files(tmp_path: Path, content: str, suffix: str, message: str) -> None:
    path = tmp_path / f"config{suffix}"
    path.write_text(content)
    with pytest.raises(ConfigFileError, match=message):
        load_settings(config_file=path)
    with pytest.raises(ConfigFileError, match="cannot read"):
        load_settings(config_file=tmp_path / "missing.toml")


def test_every_field_error_is_reported_at_once() -> None:
    with pytest.raises(ValidationError) as error:
        load_settings(
            {
                "backend_url": "ftp://x",
                "port": 70000,
                "metrics_poll_interval_s": 0,
                "output_quantile": 2.0,
                "unknown_budget": "maybe",
                "no_such_setting": 1,
            }
        )
    fields = {str(item["loc"][0]) for item in error.value.errors()}
    assert fields == {
        "backend_url",
        "port",
        "metrics_poll_interval_s",
        "output_quantile",
        "unknown_budget",
        "no_such_setting",
    }


def test_cross_field_problems_are_reported_together() -> None:
    with pytest.raises(ValidationError) as error:
        Settings(
            backend_url="http://x:1",
            workers=2,
            metrics_poll_interval_s=2.0,
            metrics_stale_after_s=1.0,
        )
    message = str(error.value)
    assert "redis_url" in message
    assert "metrics_stale_after_s" in message


@pytest.mark.parametrize(
    ("source", "value"),
    [
        ("flag", '{"low": {"queue_max": 3}}'),
        ("env", '{"low": {"queue_max": 3}}'),
        ("file", None),
    ],
)
def test_a_partial_class_table_keeps_the_other_classes_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, value: str | None
) -> None:
    overrides: dict[str, object] = {"backend_url": "http://x:1"}
    config = None
    if source == "flag":
        overrides["priority_classes"] = value
    elif source == "env":
        monkeypatch.setenv("KVGATE_PRIORITY_CLASSES", str(value))
    else:
        config = tmp_path / "kvgate.toml"
        config.write_text("[priority_classes.low]\nqueue_max = 3\n")
    settings = load_settings(overrides, config_file=config)
    assert settings.queue_max() == {Priority.HIGH: 256, Priority.NORMAL: 256, Priority.LOW: 3}
    assert settings.queue_timeout_s()[Priority.LOW] == 30.0


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ('{"urgent": {"queue_max": 3}}', "priority_classes.urgent"),
        ('{"low": {"queue_max": -1}}', "priority_classes.low.queue_max"),
        ('{"low": {"queue_size": 3}}', "priority_classes.low.queue_size"),
        ("[1, 2]", "table of classes"),
        ("{not json", "JSON"),
    ],
)
def test_a_bad_class_table_is_refused_with_its_place(value: str, problem: str) -> None:
    with pytest.raises(ValidationError) as error:
        load_settings({"backend_url": "http://x:1", "priority_classes": value})
    assert problem in str(error.value)


def test_secrets_are_masked_in_the_public_view() -> None:
    settings = Settings(backend_url="http://x:1", admin_token="s3cret", backend_api_key="k3y")
    view = settings.public_view()
    assert view["admin_token"] == "***"
    assert view["backend_api_key"] == "***"
    assert "s3cret" not in repr(settings)
    assert "s3cret" not in json.dumps(view)
