"""The request id: one per HTTP request, sent back on its response, on every log line for it.

A client's own `x-request-id` is kept when it is sane (1 to 128 letters, digits or `-_.:`), so
that the client's logs and kvgate's join on it; anything else is replaced by a fresh random id,
so that a log line never carries arbitrary header text. The id also goes upstream as vLLM's
`X-Request-Id`, which vLLM logs (it appends its own suffix, so a repeated id stays unique there).

`RequestIdMiddleware` is plain ASGI: streaming and disconnects pass through untouched. It puts
the id in the request's scope (`request_id_of`) and, for the duration of the request, in a
context variable that the log filter reads. That variable is the one piece of ambient state:
log calls made deep inside libraries cannot be handed the id as an argument.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_HEADER = REQUEST_ID_HEADER.encode("latin-1")
_SANE = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_REQUEST_ID_CHARS}}}")
_SCOPE_KEY = "kvgate.request_id"

_current: ContextVar[str | None] = ContextVar("kvgate_request_id", default=None)


def is_sane(value: str) -> bool:
    return _SANE.fullmatch(value) is not None


def new_request_id() -> str:
    return uuid.uuid4().hex


def choose_request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's `x-request-id` when sane, else a new one."""
    for name, value in headers:
        if name.lower() == _HEADER:
            offered = value.decode("latin-1")
            return offered if is_sane(offered) else new_request_id()
    return new_request_id()


def current_request_id() -> str | None:
    """The id of the request being handled in this context, None outside any request."""
    return _current.get()


def request_id_of(scope: Scope) -> str:
    """The id `RequestIdMiddleware` gave this request (a new one if it did not run)."""
    found = scope.get(_SCOPE_KEY)
    if isinstance(found, str):
        return found
    request_id = new_request_id()
    scope[_SCOPE_KEY] = request_id
    return request_id


class RequestIdMiddleware:
    """Gives each HTTP request its id and sets `x-request-id` on its response, replacing any
    the backend sent (one id per response, the one in kvgate's logs)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = choose_request_id(scope["headers"])
        scope[_SCOPE_KEY] = request_id
        header = (_HEADER, request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [pair for pair in message.get("headers", ()) if pair[0].lower() != _HEADER]
                headers.append(header)
                message = {**message, "headers": headers}
            await send(message)

        token = _current.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
