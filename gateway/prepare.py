"""Preparing a request once, whatever backend it goes to, and sizing it for each.

`RequestPreparer.prepare` validates the body and the client's headers, finds the model in the
catalog, counts the prompt's tokens exactly (small bodies inline, the rest in the tokenizer
pool, templates in their sandbox) and hashes its full blocks the way vLLM's prefix cache does
(`estimator.prefix`), for routing. The result, `Prepared`, names no backend.

`size` then turns a prepared request into what it asks of one backend (`Sizing`): its
`Demand` in that backend's blocks and under its vLLM version's rules, the output reservation
and the queue deadline. Backends of one model usually share block size and version, so the
router sizes once per distinct (block size, version, prefix caching).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from estimator.demand import ContextLengthError, Demand, ServingRules, demand_of, output_limits
from estimator.prefix import prefix_seed
from estimator.tokens import ChatTemplateError, PromptCount, RequestBodyError, Route, TokenCounter
from gateway.admission import RETRY_AFTER_DEFAULT_S, Ask, Priority
from gateway.client_hints import (
    BODY_PRIORITY_FIELD,
    ClientHints,
    HintError,
    ServiceEstimate,
    parse_hints,
    queue_deadline,
)
from gateway.errors import ContextTooLongError, InvalidRequestError, ModelNotFoundError, UnavailableError
from gateway.models import ModelCatalog, ModelProfile
from gateway.output_model import OutputKey, OutputLengthModel, OutputPrediction, output_reservation
from gateway.render_pool import RenderPoolError
from gateway.request_id import new_request_id
from gateway.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated, counted request, not yet bound to a backend."""

    route: Route
    body: Mapping[str, Any]
    raw_body: bytes
    model: str
    streaming: bool
    hints: ClientHints
    prompt: PromptCount
    output_key: OutputKey
    arrived_at: float
    request_id: str
    # Chained hashes of the prompt's full blocks, at `hash_block_size` tokens (None: not hashed).
    hash_block_size: int | None = None


@dataclass(frozen=True, slots=True)
class Sizing:
    """What a prepared request asks of one backend."""

    demand: Demand
    prediction: OutputPrediction
    ask: Ask


@dataclass(frozen=True, slots=True)
class SizingKey:
    """What a sizing depends on besides the request: backends equal in it size it equally."""

    block_size: int
    version: str | None
    max_model_len: int
    prefix_caching: bool


class RequestPreparer:
    def __init__(
        self,
        settings: Settings,
        catalog: ModelCatalog,
        output_model: OutputLengthModel,
        executor: ThreadPoolExecutor,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.output_model = output_model
        self._executor = executor
        self._pending_counts = 0

    async def prepare(
        self,
        route: Route,
        body: Any,
        raw_body: bytes,
        headers: Mapping[str, str],
        arrived_at: float,
        request_id: str | None = None,
        hash_block_size: int | None = None,
    ) -> Prepared:
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequestError("'model' must be a string", param="model")
        profile = self.catalog.get(model) if model is not None else self.catalog.default()
        if profile is None:
            if not len(self.catalog):
                raise UnavailableError("no backend has been reached yet", retry_after_s=RETRY_AFTER_DEFAULT_S)
            raise ModelNotFoundError(
                f"the model '{model}' does not exist; served here: {', '.join(self.catalog.names())}",
                param="model",
            )
        streaming = body.get("stream", False)
        if streaming is None:
            streaming = False
        if not isinstance(streaming, bool):
            raise InvalidRequestError("'stream' must be a boolean", param="stream")
        try:
            hints = parse_hints(
                headers,
                streaming=streaming,
                priority_token=token.get_secret_value() if (token := self.settings.priority_token) else None,
                body_priority=body.get("priority"),
            )
        except HintError as exc:
            raise InvalidRequestError(exc.message, param=exc.header) from exc
        if self.settings.priority_to_backend and BODY_PRIORITY_FIELD not in body:
            raw_body = with_backend_priority(raw_body, hints.priority)
        salt = body.get("cache_salt")
        seed = prefix_seed(profile.id, salt if isinstance(salt, str) else None)
        prompt = await self._count(profile.counter, route, body, len(raw_body), hash_block_size, seed)
        return Prepared(
            route,
            body,
            raw_body,
            profile.id,
            streaming,
            hints,
            prompt,
            OutputKey(profile.id, route.value),
            arrived_at,
            request_id if request_id is not None else new_request_id(),
            hash_block_size if prompt.block_hashes else None,
        )

    def size(
        self,
        prepared: Prepared,
        profile: ModelProfile,
        key: SizingKey,
        service_for: Callable[[int], ServiceEstimate],
    ) -> Sizing:
        """Size `prepared` for backends of `key`; `service_for(output_tokens)` predicts how
        long they take to serve it.
        Raises ContextTooLongError / InvalidRequestError when those backends would refuse it."""
        rules = ServingRules.for_version(key.version, key.max_model_len, prefix_caching=key.prefix_caching)
        try:
            limits = output_limits(prepared.route, prepared.body, prepared.prompt, rules)
            prediction = output_reservation(
                self.output_model,
                prepared.output_key,
                cap=limits.cap,
                floor=limits.floor,
                told=prepared.hints.expected_output_tokens,
            )
            demand = demand_of(
                prepared.route,
                prepared.body,
                prepared.prompt,
                cost=profile.block_cost(key.block_size),
                rules=rules,
                expected_output_tokens=prediction.tokens,
                limits=limits,
            )
        except ContextLengthError as exc:
            raise ContextTooLongError(exc.message, param=exc.param) from exc
        except RequestBodyError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from exc
        hints = prepared.hints
        deadline_at = queue_deadline(
            prepared.arrived_at,
            hints,
            self.settings.priority_classes[hints.priority].queue_timeout_s,
            # When it ends is predicted from a typical answer, not from the reservation's
            # high quantile: that bounds its blocks, and would refuse answers that end in time.
            service_for(self.output_model.typical(prediction, prepared.output_key, limits.cap)),
        )
        ask = Ask(
            reserve_blocks=demand.reserved_blocks,
            max_blocks=demand.max_blocks,
            priority=hints.priority,
            arrived_at=prepared.arrived_at,
            deadline_at=deadline_at,
        )
        return Sizing(demand, prediction, ask)

    async def _count(
        self,
        counter: TokenCounter,
        route: Route,
        body: Mapping[str, Any],
        body_bytes: int,
        block_size: int | None,
        seed: int,
    ) -> PromptCount:
        """Count the prompt: small bodies here (see DEFAULT_TOKENIZER_INLINE_MAX_BYTES), the
        rest in the tokenizer pool, so that the event loop is never held for long. The loop
        never waits for the pool: each thread counts with a tokenizer copy of its own. A body
        with a template of its own is refused here unless trusted, and then counted on the
        template sandbox's threads, which wait for its worker processes without holding a
        tokenizer thread."""
        try:
            sandbox = counter.screen(route, body)
        except RequestBodyError as exc:
            raise _body_error(exc) from exc

        def count() -> PromptCount:
            return counter.count(route, body, block_size=block_size, seed=seed)

        if sandbox is None and body_bytes <= self.settings.tokenizer_inline_max_bytes:
            try:
                return count()
            except RequestBodyError as exc:
                raise _body_error(exc) from exc
            except (UnicodeError, TypeError) as exc:
                raise _text_error(body) from exc
        if self._pending_counts >= self.settings.tokenizer_max_pending:
            raise UnavailableError(
                "the gateway's tokenizer is saturated", retry_after_s=RETRY_AFTER_DEFAULT_S
            )
        self._pending_counts += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                sandbox.executor if sandbox is not None else self._executor, count
            )
        except RequestBodyError as exc:
            raise _body_error(exc) from exc
        except RenderPoolError as exc:
            raise UnavailableError(
                "kvgate cannot render request chat templates right now",
                retry_after_s=RETRY_AFTER_DEFAULT_S,
            ) from exc
        except (UnicodeError, TypeError) as exc:
            raise _text_error(body) from exc
        finally:
            self._pending_counts -= 1


# What vLLM's priority scheduling is told for each class: it serves lower values first.
BACKEND_PRIORITY: Mapping[Priority, int] = {Priority.HIGH: -1, Priority.NORMAL: 0, Priority.LOW: 1}


def with_backend_priority(raw_body: bytes, priority: Priority) -> bytes:
    """`raw_body` (a JSON object without a `priority` member) with vLLM's `priority` for the
    class as its first member; the rest of its bytes unchanged. Normal is vLLM's default."""
    value = BACKEND_PRIORITY[priority]
    if value == 0:
        return raw_body
    opening = raw_body.index(b"{") + 1
    rest = raw_body[opening:].lstrip()
    separator = b"" if rest.startswith(b"}") else b","
    return raw_body[:opening] + b'"priority":%d' % value + separator + raw_body[opening:]


def _unencodable(value: Any, path: str) -> str | None:
    """The path of the first string in a parsed body that is not valid Unicode (JSON's \\u
    escapes can spell lone surrogates, which no tokenizer takes), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items: Iterable[tuple[str, Any]] = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, item in items:
        found = _unencodable(item, where)
        if found is not None:
            return found
    return None


def _body_error(exc: RequestBodyError) -> InvalidRequestError:
    code = exc.code if isinstance(exc, ChatTemplateError) else None
    return InvalidRequestError(exc.message, param=exc.param, code=code)


def _text_error(body: Mapping[str, Any]) -> Exception:
    """What a tokenizer's UnicodeError or TypeError means: text that is not valid Unicode (a
    client error), else a fault of kvgate's own, left to surface as one (500)."""
    where = _unencodable(body, "")
    if where is None:
        return RuntimeError("the token counter failed on a body it had accepted")
    return InvalidRequestError(
        f"'{where}' is not valid Unicode text (it holds a lone surrogate)", param=where
    )
