"""/dashboard in a real headless Chromium, reading a real kvgate under load.

kvgate runs under uvicorn on a socket, with an admin token, in front of the vLLM emulator; a
load generator keeps its queue busy (mixed priorities, a tiny low-priority queue and some tight
deadlines, so that requests are shed too). The browser opens the page, gets the token through
the page's own form, and must then show the numbers `/admin/state` has, see them move, and
list the requests the load sent, by their ids. Nothing may be loaded from anywhere else, and
the console must stay free of errors. The screenshot, taken under load, goes to
build/screenshots/dashboard.png (git-ignored).

Needs /usr/bin/chromium and /usr/bin/chromedriver (Debian packages `chromium` and
`chromium-driver`, installed by tests/system_deps.sh): missing, they fail the test under CI
and skip it elsewhere.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import served_gateway
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from sim.config import SimConfig
from sim.lengths import OutputLengthModel
from sim.testing import running_sim

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "build" / "screenshots" / "dashboard.png"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
    "--window-size=1360,1000",
)
ADMIN_TOKEN = "dash-board-token"
POLL_MS = 250
WAIT_S = 45.0

CLIENTS = 12
PRIORITIES = ("high", "normal", "low")
# Raising priority to high takes the priority token (see gateway.client_hints).
PRIORITY_TOKEN = "dashboard-priority-token"
PROMPT = "word " * 150
MAX_TOKENS = 64
LOAD_LIMIT_S = 120.0


def _browser_binaries() -> tuple[str, str]:
    found = [
        shutil.which(name) or path for name, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER))
    ]
    missing = [path for path in found if not os.access(path, os.X_OK)]
    if missing:
        message = f"{', '.join(missing)} missing (Debian packages chromium, chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found[0], found[1]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    chromium, chromedriver = _browser_binaries()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium then never looks for (or downloads) a driver itself.
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Load:
    """Clients sending completions through kvgate until stopped (or LOAD_LIMIT_S), each with
    its own `x-request-id`; records the ids kvgate answered with and the statuses."""

    def __init__(self, url: str, model: str) -> None:
        self._url = url
        self._model = model
        self.request_ids: set[str] = set()
        self.statuses: Counter[int | str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="load", daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the load generator did not stop"

    async def _main(self) -> None:
        deadline = time.monotonic() + LOAD_LIMIT_S
        async with httpx.AsyncClient(timeout=30.0, limits=httpx.Limits(max_connections=CLIENTS)) as client:
            await asyncio.gather(*(self._client(client, index, deadline) for index in range(CLIENTS)))

    async def _client(self, client: httpx.AsyncClient, index: int, deadline: float) -> None:
        n = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            n += 1
            headers = {
                "x-kvgate-priority": PRIORITIES[index % 3],
                "x-kvgate-priority-token": PRIORITY_TOKEN,
                "x-request-id": f"load-{index}-{n}",
            }
            if n % 5 == 0:
                headers["x-kvgate-deadline-ms"] = "300"
            body = {"model": self._model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": n % 2 == 0}
            try:
                async with client.stream(
                    "POST", f"{self._url}/v1/completions", json=body, headers=headers
                ) as r:
                    async for _ in r.aiter_raw():
                        pass
                self.request_ids.add(r.headers["x-request-id"])
                self.statuses[r.status_code] += 1
                if r.status_code in (429, 503):
                    # Back off as the OpenAI SDK would, rather than spin on a full queue.
                    await asyncio.sleep(0.1)
            except httpx.HTTPError as exc:
                self.statuses[type(exc).__name__] += 1


# One read of the page's numbers (all from the same DOM state).
READ_PAGE = """
const root = document.querySelector('[data-backend]');
if (!root) return null;
const text = (k) => root.querySelector(`[data-k="${k}"]`).textContent.replace(/,/g, '');
return {
  backend: root.dataset.backend,
  total: text('kv.total'), used: text('kv.used'), reserved: text('kv.reserved'),
  admissible: text('kv.admissible'), queued: text('queue.total'), inflight: text('inflight'),
  recent: text('recent.total'), state: text('state'), ready: text('ready'),
  rows: Array.from(root.querySelectorAll('tbody tr')).map((tr) => tr.dataset.requestId),
  codes: Array.from(root.querySelectorAll('tbody tr')).map(
    (tr) => [tr.dataset.rowOutcome, tr.querySelector('[data-code]').dataset.code]),
  outcomes: Object.fromEntries(Array.from(root.querySelectorAll('[data-outcome]')).map(
    (chip) => [chip.dataset.outcome, chip.querySelector('b').textContent.replace(/,/g, '')])),
  status: document.getElementById('status').dataset.state,
};
"""


def _read(driver: WebDriver) -> dict[str, Any] | None:
    page: dict[str, Any] | None = driver.execute_script(READ_PAGE)
    return page


def _number(page: dict[str, Any], key: str) -> int:
    return int(page[key])


def _wait_page(driver: WebDriver, what: str, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll the page's numbers until `predicate` holds; the last read is in the failure."""
    last: list[dict[str, Any] | None] = [None]

    def check(driver: WebDriver) -> dict[str, Any] | bool:
        page = last[0] = _read(driver)
        return page if page is not None and predicate(page) else False

    try:
        found: dict[str, Any] = WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(check)
    except TimeoutException:
        status = driver.find_element(By.ID, "status-text").text
        raise AssertionError(
            f"timed out waiting for {what}; status {status!r}, last read {last[0]}"
        ) from None
    return found


def _save_screenshot(driver: WebDriver, path: Path) -> None:
    """The whole page, not only the window (Chromium's DevTools protocol)."""
    width, height = driver.execute_script(
        "const e = document.documentElement; return [e.scrollWidth, e.scrollHeight];"
    )
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
        },
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))


def test_dashboard_shows_live_numbers_under_load(browser: WebDriver) -> None:
    sim_config = SimConfig(output_len=OutputLengthModel.parse(f"uniform:8:{MAX_TOKENS}"))
    with contextlib.ExitStack() as stack:
        sim_url = stack.enter_context(running_sim(sim_config))
        served = stack.enter_context(
            served_gateway(
                sim_url,
                admin_token=ADMIN_TOKEN,
                priority_token=PRIORITY_TOKEN,
                priority_classes={"low": {"queue_max": 2}},
                recent_requests=50,
            )
        )
        admin = {"x-kvgate-admin-token": ADMIN_TOKEN}

        # The page itself needs no token; the data behind it does.
        page = httpx.get(f"{served.url}/dashboard", timeout=10)
        assert page.status_code == 200
        assert httpx.get(f"{served.url}/admin/state", timeout=10).status_code == 401

        browser.get(f"{served.url}/dashboard?interval={POLL_MS}")
        WebDriverWait(browser, WAIT_S, poll_frequency=0.05).until(
            lambda d: d.find_element(By.ID, "auth").is_displayed(), "the page did not ask for the token"
        )
        assert browser.find_element(By.ID, "status").get_attribute("data-state") == "auth"
        browser.find_element(By.ID, "token-input").send_keys(ADMIN_TOKEN)
        browser.find_element(By.ID, "token-submit").click()
        first = _wait_page(browser, "the first state", lambda page: page["status"] == "live")
        assert not browser.find_element(By.ID, "auth").is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('kvgate.adminToken')") == ADMIN_TOKEN

        # Idle numbers agree with /admin/state.
        state = httpx.get(f"{served.url}/admin/state", headers=admin, timeout=10).json()["backends"][0]
        assert first["backend"] == state["name"] == "default"
        assert _number(first, "total") == state["budget"]["total_blocks"] > 0
        assert _number(first, "admissible") == state["budget"]["admissible_blocks"]
        assert first["state"] == "budget fresh"
        assert first["ready"] == "ready"
        assert _number(first, "recent") == 0
        assert first["rows"] == []

        load = stack.enter_context(Load(served.url, sim_config.model_name))
        seen: set[tuple[int, int, int]] = set()

        def busy(page: dict[str, Any]) -> bool:
            seen.add((_number(page, "queued"), _number(page, "reserved"), _number(page, "inflight")))
            # Enough finished requests that the page has a few seconds of history to draw.
            loaded = (
                _number(page, "queued") > 0
                and _number(page, "reserved") > 0
                and _number(page, "recent") >= 60
            )
            return loaded and len(seen) >= 3

        during = _wait_page(browser, "a queue, reservations and finished requests on the page", busy)
        _save_screenshot(browser, SCREENSHOT)

        # The numbers keep moving, and the requests the clients sent show up by their ids.
        later = _wait_page(
            browser,
            "more finished requests",
            lambda page: _number(page, "recent") > _number(during, "recent"),
        )
        assert set(later["rows"]) & load.request_ids, (later["rows"], sorted(load.request_ids)[:10])
        assert all(row.startswith("load-") for row in later["rows"])
        # A shed request's row carries the code of the error it was sent; a served one none.
        for outcome, code in later["codes"]:
            assert bool(code) == outcome.startswith("shed"), later["codes"]
        assert _number(later, "total") == _number(first, "total")
        assert 0 < int(later["outcomes"]["completed"]) <= _number(later, "recent")
        assert sum(int(count) for count in later["outcomes"].values()) == _number(later, "recent")

        resources = browser.execute_script(
            "return performance.getEntriesByType('resource').map((entry) => entry.name)"
        )
        origin = urlsplit(served.url).netloc
        assert resources, "the page fetched nothing"
        assert {urlsplit(name).netloc for name in resources} == {origin}, resources
        assert {urlsplit(name).path for name in resources} == {"/admin/state"}, resources
        # No script error and no blocked load (a CSP violation is logged as an error); read
        # before kvgate stops, which the page would rightly report.
        problems = [
            entry
            for entry in browser.get_log("browser")
            if entry["level"] == "SEVERE" and "status of 401" not in entry["message"]
        ]
        assert not problems, problems

    assert load.statuses[200] > 0, dict(load.statuses)
    assert SCREENSHOT.stat().st_size > 10_000
