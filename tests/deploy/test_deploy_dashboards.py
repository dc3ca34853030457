"""The Grafana dashboards, their provisioning and the alert rules, checked as files.

Every metric a panel, a template variable or a rule names must be one kvgate exports (its
real metrics registry) or one vLLM 0.32 exports (the recorded /metrics text), and each must be
used the way its kind allows (rate() on counters, histogram_quantile() on buckets, deriv() on
gauges). tests/deploy/test_deploy_prometheus_live.py then runs every expression for real.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from deploy_files import (
    ALERT_RULES,
    BUCKET,
    COUNTER,
    DASHBOARD_PROVIDERS,
    DATASOURCES,
    GAUGE,
    GRAFANA_BUILTINS,
    PROMETHEUS_CONFIG,
    PROMETHEUS_SERIES,
    Query,
    Selector,
    alert_rules,
    all_panels,
    dashboard_queries,
    dashboards,
    kvgate_catalog,
    load_yaml,
    provisioned_datasource_uid,
    rule_queries,
    selectors,
    variable_queries,
    vllm_catalog,
    vllm_kinds,
)

GRID_COLUMNS = 24


def _kinds() -> dict[str, str]:
    return {**vllm_kinds(), **kvgate_catalog(), **PROMETHEUS_SERIES}


def _every_query() -> list[Query]:
    return dashboard_queries() + variable_queries() + rule_queries()


def test_panel_ids_are_unique_within_each_dashboard() -> None:
    for path, dashboard in dashboards().items():
        ids = [panel["id"] for panel in all_panels(dashboard)]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        assert not duplicates, f"{path.name}: duplicate panel ids {duplicates}"
        assert all(isinstance(i, int) and i > 0 for i in ids), f"{path.name}: panel ids must be positive ints"


def test_dashboard_uids_are_unique_and_stable() -> None:
    uids = [dashboard.get("uid") for dashboard in dashboards().values()]
    assert all(uids), "every dashboard needs a fixed uid (links and provisioning refer to it)"
    assert len(set(uids)) == len(uids)


def test_panels_fit_the_grid_without_overlapping() -> None:
    for path, dashboard in dashboards().items():
        boxes: list[tuple[str, int, int, int, int]] = []
        for panel in dashboard["panels"]:
            grid = panel["gridPos"]
            x, y, w, h = grid["x"], grid["y"], grid["w"], grid["h"]
            inside = x >= 0 and w > 0 and x + w <= GRID_COLUMNS
            assert inside, f"{path.name} panel {panel['id']} leaves the grid"
            for other, ox, oy, ow, oh in boxes:
                overlap = x < ox + ow and ox < x + w and y < oy + oh and oy < y + h
                assert not overlap, f"{path.name}: panel {panel['id']} overlaps panel {other}"
            boxes.append((str(panel["id"]), x, y, w, h))


def test_every_query_uses_the_provisioned_datasource() -> None:
    uid = provisioned_datasource_uid()
    for path, dashboard in dashboards().items():
        for panel in all_panels(dashboard):
            targets = panel.get("targets", [])
            if not targets:
                assert panel["type"] in {"row", "text"}, f"{path.name} panel {panel['id']} has no query"
                continue
            assert panel.get("datasource") == {"type": "prometheus", "uid": uid}, (
                f"{path.name} panel {panel['id']} {panel['title']!r}: datasource {panel.get('datasource')}"
            )
            for target in targets:
                assert target.get("datasource") == {"type": "prometheus", "uid": uid}, (
                    f"{path.name} panel {panel['id']} target {target.get('refId')}: {target.get('datasource')}"
                )
        for variable in dashboard.get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                assert variable["datasource"] == {"type": "prometheus", "uid": uid}, variable["name"]


def test_the_datasource_points_at_prometheus_with_its_scrape_interval() -> None:
    (source,) = load_yaml(next(DATASOURCES.glob("*.yml")))["datasources"]
    assert source["type"] == "prometheus"
    assert source["access"] == "proxy"
    # Grafana's $__rate_interval is only right when it knows the scrape interval.
    scrape_interval = load_yaml(PROMETHEUS_CONFIG)["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape_interval


def test_the_dashboard_provider_loads_files_read_only() -> None:
    (provider,) = load_yaml(next(DASHBOARD_PROVIDERS.glob("*.yml")))["providers"]
    assert provider["type"] == "file"
    assert provider["allowUiUpdates"] is False
    assert provider["options"]["path"].startswith("/")


def test_panels_name_only_metrics_that_exist_and_use_them_by_kind() -> None:
    kinds = _kinds()
    problems: list[str] = []
    for query in _every_query():
        for selector in selectors(query.expr):
            kind = kinds.get(selector.metric)
            if kind is None:
                problems.append(f"{query.origin}: no such metric {selector.metric}")
                continue
            problem = _misuse(selector, kind)
            if problem:
                problems.append(f"{query.origin}: {selector.text} {problem}")
    assert not problems, "\n".join(problems)


def _misuse(selector: Selector, kind: str) -> str | None:
    functions = selector.functions
    innermost = functions[-1] if functions else None
    if "histogram_quantile" in functions and kind != BUCKET:
        return "is not a histogram's _bucket series but feeds histogram_quantile()"
    if kind in (COUNTER, BUCKET) and innermost not in {"rate", "irate", "increase", "group"}:
        return f"is a {kind} used without rate()/increase() (its raw value only ever grows)"
    if kind == GAUGE and innermost in {"rate", "irate", "increase"}:
        return f"is a gauge inside {innermost}()"
    if kind == BUCKET and "histogram_quantile" not in functions and innermost != "increase":
        return "is a histogram bucket outside histogram_quantile() or a heatmap's increase()"
    return None


def test_vllm_selectors_use_labels_vllm_or_the_scrape_config_provides() -> None:
    vllm = vllm_catalog()
    target_labels = {"job", "instance", "backend"}
    for query in _every_query():
        for selector in selectors(query.expr):
            if selector.metric in vllm:
                unknown = selector.label_names() - vllm[selector.metric] - target_labels
                assert not unknown, f"{query.origin}: {selector.text} has no label {sorted(unknown)}"


def test_every_kvgate_and_vllm_panel_follows_the_backend_variable() -> None:
    for path, dashboard in dashboards().items():
        for panel in all_panels(dashboard):
            for target in panel.get("targets", []):
                raw = target["expr"].replace("$__rate_interval", "1m")
                for selector in selectors(raw):
                    if selector.metric.startswith(("kvgate_", "vllm:")):
                        assert selector.matcher("backend") == '=~"$backend"', (
                            f"{path.name} panel {panel['id']} {panel['title']!r}: {selector.text} ignores $backend"
                        )


def test_the_backend_variable_lists_kvgate_backends() -> None:
    kinds = kvgate_catalog()
    for path, dashboard in dashboards().items():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        backend = variables.get("backend")
        assert backend is not None, f"{path.name}: no `backend` variable"
        assert backend["includeAll"]
        assert backend["multi"]
        # Panels match with =~, so "All" must be a regex that matches every backend.
        assert backend["allValue"] == ".*"
        match = re.fullmatch(r"label_values\((kvgate_\w+),\s*backend\)", backend["definition"])
        assert match, backend["definition"]
        assert backend["query"]["query"] == backend["definition"]
        # A level kvgate reports for every backend it has, at every scrape: a backend shows up
        # in the list from its first scrape, whatever it has served.
        assert kinds.get(match.group(1)) == GAUGE, f"{match.group(1)} is not a per-backend gauge"
        # Re-read on every time-range change, so backends that joined since (a DNS name that
        # resolves to one more replica) appear without reloading the dashboard.
        assert backend["refresh"] == 2
        assert backend["current"]["value"] == ["$__all"], "the dashboard opens on every backend"
        assert set(variables) | set(GRAFANA_BUILTINS) >= _variables_used(dashboard)


def _kept_labels(expr: str) -> set[str] | None:
    """The labels an expression's series keep when every aggregation in it is `by (...)`:
    those of all its `by` clauses (histogram_quantile drops `le`); None for an expression
    without aggregation, which keeps every label of its selectors."""
    clauses = [
        {label.strip() for label in labels.split(",")} for labels in re.findall(r"\bby \(([^)]*)\)", expr)
    ]
    if not clauses:
        assert not re.search(r"\b(sum|max|min|avg|count)\s*\(", expr), f"aggregation without by: {expr}"
        return None
    kept = set.intersection(*clauses)
    return kept - {"le"} if "histogram_quantile" in expr else kept


def test_legends_name_the_backend_of_every_per_backend_series() -> None:
    """A query that keeps `backend` shows one series per backend and its legend says which
    ({{backend}}); a legend names only labels its query keeps (else Grafana prints the
    placeholder's name, and every series reads the same)."""
    per_backend = 0
    for path, dashboard in dashboards().items():
        for panel in all_panels(dashboard):
            for target in panel.get("targets", []):
                where = f"{path.name} panel {panel['id']} {panel['title']!r} target {target['refId']}"
                legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
                kept = _kept_labels(target["expr"])
                if kept is None:
                    continue
                assert legend <= kept, f"{where}: the legend names {sorted(legend - kept)}, aggregated away"
                if "backend" in kept:
                    per_backend += 1
                    assert "backend" in legend, (
                        f"{where}: one series per backend, but its legend lacks {{{{backend}}}}"
                    )
    assert per_backend, "no panel shows a series per backend"


def test_the_fleet_row_shows_how_the_backends_share_the_load() -> None:
    (dashboard,) = dashboards().values()
    rows = [panel for panel in dashboard["panels"] if panel["type"] == "row"]
    (fleet,) = [row for row in rows if row["title"].startswith("Fleet")]
    below = [p for p in dashboard["panels"] if p["gridPos"]["y"] == fleet["gridPos"]["y"] + 1]
    expressions = [target["expr"] for panel in below for target in panel["targets"]]
    assert any(e.startswith("sum by (backend) (rate(kvgate_admitted_total") for e in expressions)
    assert any("vllm:generation_tokens_total" in e and "group_left" in e for e in expressions)
    assert any("kvgate_kv_blocks_admissible" in e and "kvgate_kv_blocks_committed" in e for e in expressions)


def _variables_used(dashboard: dict[str, Any]) -> set[str]:
    used: set[str] = set()
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            used.update(m[0] or m[1] for m in re.findall(r"\$\{(\w+)[^}]*\}|\$(\w+)", target["expr"]))
    return used


# What the overview must show (the list), as the series that carry it.
REQUIRED_SERIES = {
    "requests by outcome": "kvgate_requests_total",
    "queue depth by priority": "kvgate_queue_depth",
    "queue wait p50/p99": "kvgate_queue_wait_seconds_bucket",
    "time to first token through the gateway": "kvgate_time_to_first_byte_seconds_bucket",
    "KV blocks total": "kvgate_kv_blocks_total",
    "KV blocks used by vLLM": "kvgate_kv_blocks_used",
    "KV blocks reserved by kvgate": "kvgate_kv_blocks_reserved",
    "KV blocks admissible": "kvgate_kv_blocks_admissible",
    "preemptions": "vllm:num_preemptions_total",
    "output-length prediction error": "kvgate_output_prediction_error_tokens_bucket",
    "queue wait prediction error": "kvgate_queue_wait_prediction_error_seconds_bucket",
    "backend health": "kvgate_backend_up",
    "metrics staleness": "kvgate_backend_metrics_age_seconds",
    "vLLM KV usage": "vllm:kv_cache_usage_perc",
    "vLLM running": "vllm:num_requests_running",
    "vLLM waiting": "vllm:num_requests_waiting",
    "vLLM time to first token": "vllm:time_to_first_token_seconds_bucket",
}


def test_the_overview_shows_what_operators_watch() -> None:
    shown = {selector.metric for query in dashboard_queries() for selector in selectors(query.expr)}
    missing = {what: series for what, series in REQUIRED_SERIES.items() if series not in shown}
    assert not missing, f"the dashboards do not show {missing}"
    expressions = " ".join(query.expr for query in dashboard_queries())
    for quantile in ("0.5", "0.99"):
        assert (
            f"histogram_quantile({quantile}, sum by (le) (rate(kvgate_queue_wait_seconds_bucket"
            in expressions
        )
    assert "sum by (priority) (kvgate_queue_depth" in expressions
    assert "sum by (outcome) (rate(kvgate_requests_total" in expressions


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: str(rule.get("alert")))
def test_every_alert_is_explained_and_actionable(rule: dict[str, Any]) -> None:
    name = rule["alert"]
    header = ALERT_RULES.read_text().split("groups:")[0]
    assert f"# - {name}:" in header, (
        f"{name} is not explained in the comments at the top of {ALERT_RULES.name}"
    )
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["annotations"]["summary"]
    assert rule["annotations"]["description"]
    assert re.fullmatch(r"\d+[smh]", rule["for"]), f"{name}: `for` keeps a blip from paging"
    # Alerts group by backend so that one backend's trouble is one alert, whatever the rest do.
    grouped = "by (backend)" in rule["expr"] or rule["expr"].strip().startswith("up{")
    assert grouped, f"{name}: aggregate by (backend)"


def test_rules_and_panels_name_only_scrape_jobs_that_exist() -> None:
    jobs = {job["job_name"] for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]}
    for query in _every_query():
        for selector in selectors(query.expr):
            matcher = selector.matcher("job")
            if matcher is None:
                continue
            assert matcher.startswith('=~"') or matcher.startswith('="'), matcher
            named = set(matcher.split('"')[1].split("|"))
            assert named <= jobs, f"{query.origin}: jobs {sorted(named - jobs)} are not scraped"
