"""The built-in status page, `GET /dashboard`: one HTML file, its style and script inline.

The page is `gateway/static/dashboard.html` (package data). In the browser it polls
`admin/state` (relative, so it also works under a path prefix) and draws the queue by priority,
the KV blocks per backend, the budget's freshness and the latest requests; it loads nothing else.
Its Content-Security-Policy makes the browser hold it to that: the one inline style and the one
inline script are allowed by their SHA-256 hashes, computed here when the app is built, and
any other script, style, font, image, frame or connection to another origin is refused.

The admin token: the page holds no data, so it is served to anyone, while `/admin/state` keeps
demanding the token when one is set. The page asks for it on a 401, keeps it in the tab's
`sessionStorage` (gone with the tab; same-origin only) and sends it as `X-Kvgate-Admin-Token`
with each poll.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

PAGE_FILE = "dashboard.html"
_INLINE = {
    "style": re.compile(r"<style>(.*?)</style>", re.DOTALL),
    "script": re.compile(r"<script>(.*?)</script>", re.DOTALL),
}


@dataclass(frozen=True, slots=True)
class DashboardPage:
    html: bytes
    headers: dict[str, str]


def _source_hash(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return f"'sha256-{base64.b64encode(digest).decode('ascii')}'"


def content_security_policy(html: str) -> str:
    """The page's policy; raises ValueError unless it has exactly one inline style and one
    inline script (anything else would be blocked by the policy, or slip past the hashes)."""
    hashes: dict[str, str] = {}
    for tag, pattern in _INLINE.items():
        blocks = pattern.findall(html)
        if len(blocks) != 1:
            raise ValueError(f"the dashboard page must have exactly one <{tag}>, found {len(blocks)}")
        hashes[tag] = _source_hash(blocks[0])
    return "; ".join(
        [
            "default-src 'none'",
            f"script-src {hashes['script']}",
            f"style-src {hashes['style']}",
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


def page_from(html: str) -> DashboardPage:
    return DashboardPage(
        html=html.encode("utf-8"),
        headers={
            "content-security-policy": content_security_policy(html),
            "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer",
            "cache-control": "no-cache",
        },
    )


def load_page() -> DashboardPage:
    """Read the page from the package (call when the app is built, not at import)."""
    # Beside this module, where package data is installed (`importlib.resources.files` would
    # also look in any other folder named `gateway` that makes it a namespace, e.g. tests/).
    html = (Path(__file__).parent / "static" / PAGE_FILE).read_text(encoding="utf-8")
    return page_from(html)
