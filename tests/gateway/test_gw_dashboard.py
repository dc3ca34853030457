"""`GET /dashboard` and the recent requests behind it, in process (no browser: see
test_gw_dashboard_browser.py for the page at work)."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest
from conftest import gateway_over_sim

from gateway.dashboard import content_security_policy, load_page
from gateway.outcomes import Outcome
from gateway.recent import RecentRequests, RequestSummary

COMPLETION = {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
# The one absolute URL the page may hold: an XML namespace name, never fetched.
SVG_NAMESPACE = "http://www.w3.org/2000/svg"


def _inline(html: str, tag: str) -> str:
    (block,) = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
    return block


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


async def test_the_page_is_self_contained_and_says_so_in_its_policy() -> None:
    async with gateway_over_sim() as harness:
        response = await harness.client.get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.headers["x-content-type-options"] == "nosniff"
    html = response.text
    policy = dict(
        directive.strip().split(" ", 1)
        for directive in response.headers["content-security-policy"].split(";")
    )
    assert policy["default-src"] == "'none'"
    assert policy["connect-src"] == "'self'"
    assert policy["script-src"] == f"'sha256-{_sha256(_inline(html, 'script'))}'"
    assert policy["style-src"] == f"'sha256-{_sha256(_inline(html, 'style'))}'"
    # Nothing to load from elsewhere: no external URL, no src attribute, no stylesheet import.
    assert re.findall(r"https?://[^\s\"'`]+", html) == [SVG_NAMESPACE]
    assert not re.search(r"\ssrc\s*=", html)
    assert re.findall(r"\shref\s*=\s*\"([^\"]*)\"", html) == ["data:,"]
    assert "@import" not in html
    assert "url(" not in html
    assert "style=" not in html  # inline style attributes would be blocked by the policy
    assert 'fetch("admin/state"' in html  # relative: works under a path prefix too


async def test_the_page_is_served_without_the_admin_token_but_its_data_is_not() -> None:
    async with gateway_over_sim(admin_token="s3cret") as harness:
        page = await harness.client.get("/dashboard")
        assert page.status_code == 200
        assert "s3cret" not in page.text
        assert (await harness.client.get("/admin/state")).status_code == 401
        state = await harness.client.get("/admin/state", headers={"x-kvgate-admin-token": "s3cret"})
        assert state.status_code == 200
    # The page sends the token the way /admin/state takes it.
    assert "X-Kvgate-Admin-Token" in page.text


def test_the_policy_covers_exactly_one_script_and_one_style() -> None:
    html = load_page().html.decode()
    assert content_security_policy(html)
    with pytest.raises(ValueError, match="exactly one <script>"):
        content_security_policy(html.replace("</body>", "<script>alert(1)</script></body>"))
    with pytest.raises(ValueError, match="exactly one <style>"):
        content_security_policy(html.replace("<style>", "<style></style><style>"))


async def test_admin_state_lists_the_latest_requests_newest_first() -> None:
    async with gateway_over_sim(recent_requests=3) as harness:
        client = harness.client
        ids = []
        for n in range(4):
            response = await client.post(
                "/v1/completions",
                json=COMPLETION,
                headers={"x-request-id": f"r{n}", "x-kvgate-priority": "low"},
            )
            assert response.status_code == 200
            ids.append(response.headers["x-request-id"])
        invalid = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": -1})
        assert invalid.status_code == 400
        ids.append(invalid.headers["x-request-id"])
        recent = (await client.get("/admin/state")).json()["backends"][0]["recent"]

    assert recent["total"] == 5
    assert recent["capacity"] == 3
    assert recent["outcomes"]["completed"] == 4
    assert recent["outcomes"]["rejected_invalid"] == 1
    assert set(recent["outcomes"]) == {outcome.value for outcome in Outcome}
    rows = recent["requests"]
    assert [row["request_id"] for row in rows] == ids[::-1][:3]
    newest, completed, _ = rows
    assert (newest["outcome"], newest["status"], newest["priority"]) == ("rejected_invalid", 400, None)
    assert completed["outcome"] == "completed"
    assert completed["priority"] == "low"
    assert completed["completion_tokens"] == 4
    assert completed["estimated_blocks"] >= completed["actual_blocks"] >= 1
    assert all(row["age_s"] >= 0 for row in rows)
    assert rows[0]["age_s"] <= rows[-1]["age_s"]


def _summary(n: int, outcome: Outcome = Outcome.COMPLETED) -> RequestSummary:
    return RequestSummary(f"id{n}", "b", "chat", outcome, 200, arrived_at=float(n), finished_at=n + 0.5)


def test_recent_requests_keep_the_last_few_and_count_all() -> None:
    recent = RecentRequests(2)
    for n in range(5):
        recent.add(_summary(n, Outcome.COMPLETED if n % 2 else Outcome.SHED_QUEUE_FULL))
    assert [s.request_id for s in recent.latest()] == ["id4", "id3"]
    assert recent.total == 5
    counts = recent.counts()
    assert counts[Outcome.SHED_QUEUE_FULL] == 3
    assert counts[Outcome.COMPLETED] == 2
    assert sum(counts.values()) == 5
    described = recent.describe(now=10.0)
    assert [row["age_s"] for row in described["requests"]] == [5.5, 6.5]
    assert described["requests"][0]["duration_ms"] == 500

    nothing_kept = RecentRequests(0)
    nothing_kept.add(_summary(1))
    assert nothing_kept.latest() == []
    assert nothing_kept.total == 1
    with pytest.raises(ValueError, match="capacity"):
        RecentRequests(-1)
