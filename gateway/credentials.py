"""Secrets at kvgate's edge (pure): comparing a token a client offers, and keeping the ones in
the backend's URL out of sight.

- `token_matches`: the one constant-time comparison of an offered token with a configured one
  (the admin token, the priority token).
- `redact_url` (`redact_urls_in` for free text): a URL with its user information (`user:password@`, or a bare token before
  the `@`) replaced by `***`, for every place a backend URL is shown: logs, /admin/state,
  the dashboard. Error bodies never carry the backend's URL at all.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"
# The user information of a URL in free text: scheme://user:password@ (a token alone too).
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"]+@")


def token_matches(offered: str, expected: str) -> bool:
    """Whether `offered` equals `expected`, in time that depends on neither's bytes nor length.
    An empty offer never matches (an unset token is None upstream of here, never "")."""
    # Digests of equal length, compared in constant time: neither the token's bytes nor its
    # length show in the time an answer takes.
    want = hashlib.sha256(expected.encode("utf-8", "surrogateescape")).digest()
    given = hashlib.sha256(offered.encode("utf-8", "surrogateescape")).digest()
    return bool(offered) and hmac.compare_digest(given, want)


def redact_url(url: str) -> str:
    """`url` without the credentials in its user information; unchanged when it has none.
    Never raises: what cannot be parsed is shown as `***` whole."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" not in netloc:
            return url
        host = netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{REDACTED}@{host}"))
    except ValueError:
        return REDACTED


def redact_urls_in(text: str) -> str:
    """`text` with the user information of every URL in it replaced by `***` (log lines: a
    library such as httpx logs the URLs it requests, credentials included)."""
    if "@" not in text:
        return text
    return _USERINFO.sub(rf"\1{REDACTED}@", text)
