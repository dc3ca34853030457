"""What the deploy tests share: where the files are, what their PromQL names, and which
metrics exist.

PromQL is read with a small lexer that is enough for our own files: it finds every vector
selector (metric name plus its `{...}` matchers) and the functions around it, skipping
strings, label lists of `by (...)`/`on (...)` clauses and range brackets. The metric catalogs
come from the gateway's real registry (`gateway.metrics.GatewayMetrics`) and from the recorded
vLLM 0.32 exposition, so a renamed metric on either side fails these tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics, GaugeReadings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERT_RULES = DEPLOY / "prometheus" / "kvgate-alerts.yml"
GRAFANA = DEPLOY / "grafana"
DATASOURCES = GRAFANA / "provisioning" / "datasources"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards"
DASHBOARDS = GRAFANA / "dashboards"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
VLLM_GOLDEN_METRICS = REPO / "tests" / "fixtures" / "vllm" / "metrics_0.32.0.txt"

# What Grafana substitutes before a query reaches Prometheus. `$backend` is a multi-value
# variable whose "All" value is the regex `.*`; $__rate_interval is max(4 x scrape interval,
# step + scrape interval): 15 s spans many 1 s scrapes in the live test.
GRAFANA_BUILTINS = {"__rate_interval": "15s", "__interval": "5s", "__range": "5m"}
ALL_VALUE = ".*"


# -- tools --------------------------------------------------------------------------------


def require_tool(name: str) -> str:
    """Path of a command-line tool. Missing: a failure under CI (`.ci/run` installs it), a
    skip on a developer's machine that has not installed it."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if found:
        return found
    message = f"{name} is not installed (Debian package: {_DEBIAN_PACKAGES.get(name, name)})"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


_DEBIAN_PACKAGES = {"promtool": "prometheus", "prometheus": "prometheus", "docker-compose": "docker-compose"}


# -- files --------------------------------------------------------------------------------


def load_script(name: str) -> ModuleType:
    """A script of deploy/ (not a package) loaded as a module, `name` without `.py`."""
    spec = importlib.util.spec_from_file_location(name, DEPLOY / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dashboards() -> dict[Path, dict[str, Any]]:
    found = {path: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}
    assert found, f"no dashboard JSON under {DASHBOARDS}"
    return found


def provisioned_datasource_uid() -> str:
    files = sorted(DATASOURCES.glob("*.yml")) + sorted(DATASOURCES.glob("*.yaml"))
    sources = [source for path in files for source in load_yaml(path)["datasources"]]
    assert len(sources) == 1, f"expected one provisioned datasource, found {sources}"
    uid: str = sources[0]["uid"]
    return uid


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Grafana's variable substitution: $name, ${name} and [[name]]."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in variables:
            raise KeyError(f"unknown variable ${name} in {expr!r}")
        return variables[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", value, expr)


def dashboard_variables(dashboard: dict[str, Any]) -> dict[str, str]:
    """The values to query with: every template variable at its "All" value, and the builtins."""
    variables = dict(GRAFANA_BUILTINS)
    for variable in dashboard.get("templating", {}).get("list", []):
        variables[variable["name"]] = variable.get("allValue") or ALL_VALUE
    return variables


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL expression as Prometheus would receive it, and where it comes from."""

    origin: str
    expr: str


def dashboard_queries() -> list[Query]:
    queries: list[Query] = []
    for path, dashboard in dashboards().items():
        variables = dashboard_variables(dashboard)
        for panel in all_panels(dashboard):
            for target in panel.get("targets", []):
                origin = (
                    f"{path.name} panel {panel['id']} {panel.get('title')!r} target {target.get('refId')}"
                )
                queries.append(Query(origin, substitute(target["expr"], variables)))
    return queries


def variable_queries() -> list[Query]:
    """Template-variable queries, as the PromQL that returns the same label values."""
    queries: list[Query] = []
    for path, dashboard in dashboards().items():
        for variable in dashboard.get("templating", {}).get("list", []):
            if variable.get("type") != "query":
                continue
            definition = variable["definition"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition.strip())
            assert match, f"{path.name} variable {variable['name']}: unsupported query {definition!r}"
            selector, label = match.groups()
            queries.append(
                Query(f"{path.name} variable {variable['name']}", f"group by ({label}) ({selector})")
            )
    return queries


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(ALERT_RULES)["groups"] for rule in group["rules"]]


def rule_queries() -> list[Query]:
    return [Query(f"rule {rule.get('alert') or rule.get('record')}", rule["expr"]) for rule in alert_rules()]


# -- PromQL -------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<number>\d[\w.]*(?:[eE][-+]?\d+)?)
    | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<punct>[(){}\[\],]|[^\s\w"'`(){}\[\],]+)
    """,
    re.VERBOSE,
)
# Keywords followed by a parenthesised list of label names, not of expressions.
_LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Selector:
    """A vector selector: its metric name, its matcher block (with braces) and the functions
    it sits in, innermost last."""

    metric: str
    matchers: str
    functions: tuple[str, ...]

    @property
    def text(self) -> str:
        return self.metric + self.matchers

    def label_names(self) -> set[str]:
        body = self.matchers[1:-1]
        body = re.sub(r'"(?:[^"\\]|\\.)*"', '""', body)
        return set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", body))

    def matcher(self, label: str) -> str | None:
        """The raw `op"value"` of the matcher on `label`, if any."""
        match = re.search(rf'\b{label}\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")', self.matchers)
        return match.group(1) + match.group(2) if match else None


def _tokens(expr: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None:
            raise ValueError(f"cannot read PromQL at {expr[position:]!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            tokens.append((kind, match.group()))
        position = match.end()
    return tokens


def _skip_group(tokens: list[tuple[str, str]], start: int, opening: str, closing: str) -> int:
    """Index just past the group that opens at tokens[start]."""
    depth = 0
    for index in range(start, len(tokens)):
        value = tokens[index][1]
        if value == opening:
            depth += 1
        elif value == closing:
            depth -= 1
            if depth == 0:
                return index + 1
    raise ValueError(f"unbalanced {opening}{closing}")


def selectors(expr: str) -> list[Selector]:
    """Every vector selector in `expr`, in order. Raises ValueError on a selector without a
    metric name (these tests check every metric a query names, so there must be one)."""
    tokens = _tokens(expr)
    found: list[Selector] = []
    stack: list[str | None] = []  # one entry per open parenthesis: its function, if any
    index = 0
    while index < len(tokens):
        kind, value = tokens[index]
        following = tokens[index + 1][1] if index + 1 < len(tokens) else ""
        if kind == "name" and value in _LABEL_LIST_KEYWORDS:
            index = _skip_group(tokens, index + 1, "(", ")") if following == "(" else index + 1
            continue
        if kind == "name" and (value in _KEYWORDS or value in _AGGREGATIONS):
            if value in _AGGREGATIONS:
                stack.append(value)
                # The aggregation's own parenthesis comes after an optional by/without clause.
                index += 1
                while index < len(tokens) and tokens[index][1] in _LABEL_LIST_KEYWORDS:
                    index = _skip_group(tokens, index + 1, "(", ")")
                if index < len(tokens) and tokens[index][1] == "(":
                    index += 1
                continue
            index += 1
            continue
        if kind == "name" and following == "(":
            stack.append(value)
            index += 2
            continue
        if kind == "name":
            matchers = ""
            end = index + 1
            if following == "{":
                end = _skip_group(tokens, index + 1, "{", "}")
                matchers = "".join(v for _, v in tokens[index + 1 : end])
            functions = tuple(f for f in stack if f is not None)
            found.append(Selector(value, matchers, functions))
            index = end
            continue
        if value == "{":
            raise ValueError(f"a selector without a metric name in {expr!r}")
        if value == "[":
            index = _skip_group(tokens, index, "[", "]")
            continue
        if value == "(":
            stack.append(None)
        elif value == ")":
            if not stack:
                raise ValueError(f"unbalanced parentheses in {expr!r}")
            stack.pop()
        index += 1
    return found


# -- metric catalogs ----------------------------------------------------------------------

# Kinds of exposed series, as far as PromQL functions care.
COUNTER = "counter"  # monotone: counters' _total, histograms' _count and _sum
BUCKET = "bucket"  # a histogram's _bucket series (monotone, with `le`)
GAUGE = "gauge"


class _NoLevels:
    def gauge_readings(self) -> Iterable[GaugeReadings]:
        return []


def kvgate_catalog() -> dict[str, str]:
    """Series names kvgate exports -> kind, from the gateway's own metrics registry."""
    metrics = GatewayMetrics(CollectorRegistry(auto_describe=True))
    metrics.watch(_NoLevels())
    catalog: dict[str, str] = {}
    for family in metrics.registry.collect():
        catalog.update(_series_of(family.name, family.type))
    return catalog


def vllm_catalog() -> dict[str, set[str]]:
    """vLLM 0.32's series names -> label names, from the recorded /metrics text."""
    catalog: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(VLLM_GOLDEN_METRICS.read_text()):
        for sample in family.samples:
            catalog.setdefault(sample.name, set()).update(sample.labels)
    return catalog


def vllm_kinds() -> dict[str, str]:
    kinds: dict[str, str] = {}
    for family in text_string_to_metric_families(VLLM_GOLDEN_METRICS.read_text()):
        kinds.update(_series_of(family.name, family.type))
    return kinds


def _series_of(name: str, kind: str) -> dict[str, str]:
    if kind == "counter":
        return {f"{name}_total": COUNTER}
    if kind == "histogram":
        return {f"{name}_bucket": BUCKET, f"{name}_count": COUNTER, f"{name}_sum": COUNTER}
    if kind == "summary":
        return {name: GAUGE, f"{name}_count": COUNTER, f"{name}_sum": COUNTER}
    return {name: GAUGE}


# Series Prometheus itself adds to every scrape target.
PROMETHEUS_SERIES = {"up": GAUGE, "scrape_duration_seconds": GAUGE, "scrape_samples_scraped": GAUGE}
