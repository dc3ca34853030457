"""Prometheus's own tool on our Prometheus files: the configuration and the rules parse, and
each alert fires on the situation it is about and stays quiet on the look-alike it must not
page for (`promtool test rules`, on synthetic series with 15 s resolution).

promtool comes from the Debian package `prometheus`, which `.ci/run` installs: missing under CI
is a failure, missing on a developer's machine a skip.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import ALERT_RULES, PROMETHEUS_CONFIG, alert_rules, load_yaml, require_tool


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def test_promtool_accepts_the_scrape_configuration_and_its_rule_files() -> None:
    result = _promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    # check config also checks every rule file it names: make sure it named ours.
    assert (
        f"{len(load_yaml(PROMETHEUS_CONFIG)['rule_files'])} rule files found" in result.stdout + result.stderr
    )


def test_promtool_accepts_the_alert_rules() -> None:
    result = _promtool("check", "rules", str(ALERT_RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout + result.stderr


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    """The checks above can fail: a rule with a PromQL syntax error does not pass."""
    broken = load_yaml(ALERT_RULES)
    broken["groups"][0]["rules"][0]["expr"] = "sum by (backend) (kvgate_queue_depth"
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump(broken))
    assert _promtool("check", "rules", str(path)).returncode != 0


# Each case: the series, when to look, and which alerts (with their labels) must be firing
# then. Annotations are left out of the comparison (the copy of the rules tested here has
# none); labels are compared exactly.
VLLM = {"backend": "vllm"}
CASES: list[dict[str, Any]] = [
    {
        "name": "a queue that keeps growing pages after its 5 minutes",
        "series": {'kvgate_queue_depth{backend="vllm", priority="normal"}': "0+1x60"},
        "expect": {"4m": {}, "8m": {"KvgateQueueGrowing": [{**VLLM, "severity": "warning"}]}},
    },
    {
        "name": "a queue that filled in one burst and stays put does not",
        "series": {'kvgate_queue_depth{backend="vllm", priority="normal"}': "0 0 0 0 50x56"},
        "expect": {"10m": {}},
    },
    {
        "name": "10% shed for ten minutes pages",
        "series": {
            'kvgate_requests_total{backend="vllm", outcome="completed"}': "0+90x80",
            'kvgate_requests_total{backend="vllm", outcome="shed_deadline"}': "0+10x80",
        },
        "expect": {"8m": {}, "16m": {"KvgateSheddingHigh": [{**VLLM, "severity": "warning"}]}},
    },
    {
        "name": "1% shed does not, nor does one burst of sheds",
        "series": {
            'kvgate_requests_total{backend="vllm", outcome="completed"}': "0+99x80",
            'kvgate_requests_total{backend="vllm", outcome="shed_queue_full"}': "0+1x80",
            'kvgate_requests_total{backend="b2", outcome="completed"}': "0+100x80",
            'kvgate_requests_total{backend="b2", outcome="shed_queue_full"}': "0x4 300x75",
        },
        "expect": {"12m": {}, "18m": {}},
    },
    {
        "name": "four preemptions a minute for five minutes pages",
        "series": {'kvgate_backend_preemptions_total{backend="vllm"}': "0+1x80"},
        "expect": {"3m": {}, "8m": {"KvgatePreemptionsDespiteGateway": [{**VLLM, "severity": "warning"}]}},
    },
    {
        "name": "one burst of preemptions, or one a minute, does not",
        "series": {
            'kvgate_backend_preemptions_total{backend="vllm"}': "0x4 20x75",
            'kvgate_backend_preemptions_total{backend="b2"}': "0+0.25x80",
        },
        "expect": {"4m": {}, "10m": {}, "18m": {}},
    },
    {
        "name": "an unreachable backend pages after a minute, stale metrics after two",
        "series": {
            'kvgate_budget_state{backend="vllm", state="down"}': "0x4 1x20",
            'kvgate_budget_state{backend="vllm", state="fresh"}': "1x4 0x20",
            'kvgate_backend_metrics_stale{backend="vllm"}': "0x4 1x20",
        },
        "expect": {
            "1m30s": {},
            "2m30s": {"KvgateBackendDown": [{**VLLM, "severity": "critical"}]},
            "3m30s": {
                "KvgateBackendDown": [{**VLLM, "severity": "critical"}],
                "KvgateBackendMetricsStale": [{**VLLM, "severity": "critical"}],
            },
        },
    },
    {
        "name": "a scrape target that is down pages, the replica beside it does not; other jobs do not",
        "series": {
            'up{job="kvgate", instance="kvgate-a:8080"}': "1x4 0x20",
            'up{job="kvgate", instance="kvgate-b:8080"}': "1x24",
            'up{job="node", instance="node:9100"}': "0x24",
        },
        "expect": {
            "1m30s": {},
            "2m30s": {
                "KvgateScrapeTargetDown": [
                    {"job": "kvgate", "instance": "kvgate-a:8080", "severity": "critical"}
                ]
            },
        },
    },
]


def _unit_tests(rules_file: str) -> dict[str, Any]:
    alert_names = [rule["alert"] for rule in alert_rules()]
    tests = []
    for case in CASES:
        checks = []
        for at, firing in case["expect"].items():
            unknown = set(firing) - set(alert_names)
            assert not unknown, f"case {case['name']!r} names unknown alerts {unknown}"
            for name in alert_names:
                checks.append(
                    {
                        "eval_time": at,
                        "alertname": name,
                        "exp_alerts": [{"exp_labels": labels} for labels in firing.get(name, [])],
                    }
                )
        tests.append(
            {
                "name": case["name"],
                "interval": "15s",
                "input_series": [{"series": s, "values": v} for s, v in case["series"].items()],
                "alert_rule_test": checks,
            }
        )
    return {"rule_files": [rules_file], "evaluation_interval": "15s", "tests": tests}


def test_each_alert_fires_on_its_situation_and_not_on_look_alikes(tmp_path: Path) -> None:
    rules = load_yaml(ALERT_RULES)
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(_unit_tests("rules.yml"), sort_keys=False))
    result = _promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@pytest.mark.parametrize("alert", [rule["alert"] for rule in alert_rules()])
def test_every_alert_has_a_case_that_fires_it(alert: str) -> None:
    fired = {name for case in CASES for firing in case["expect"].values() for name in firing}
    assert alert in fired
