"""What a backend serves (`/v1/models`), and where its tokenizer comes from.

vLLM's `/v1/models` lists each served name with `max_model_len` and `root` (the folder or id
it loaded). The gateway needs the context limit to validate requests and the root to find
the very tokenizer vLLM uses. Tokenizers load only from a local folder or the local Hugging
Face cache, never from the network.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from estimator.tokens import RequestTemplates, TokenCounter
from gateway.render_pool import MAX_PROMPT_CHARS_PER_BODY_BYTE, RenderPool

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServedModel:
    id: str
    root: str | None
    max_model_len: int | None


@dataclass(frozen=True, slots=True)
class BackendInfo:
    models: tuple[ServedModel, ...]

    def find(self, name: str) -> ServedModel | None:
        for model in self.models:
            if model.id == name:
                return model
        return None

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def names(self) -> list[str]:
        return [model.id for model in self.models]


class DiscoveryError(Exception):
    pass


def parse_models(payload: Any) -> BackendInfo:
    """Read an OpenAI `/v1/models` answer; raise DiscoveryError when it lists no model."""
    if not isinstance(payload, Mapping) or not isinstance(payload.get("data"), list):
        raise DiscoveryError("the backend's /v1/models answer has no 'data' list")
    models: list[ServedModel] = []
    for item in payload["data"]:
        if not isinstance(item, Mapping) or not isinstance(item.get("id"), str):
            continue
        root = item.get("root")
        limit = item.get("max_model_len")
        models.append(
            ServedModel(
                id=item["id"],
                root=root if isinstance(root, str) and root else None,
                max_model_len=limit
                if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
                else None,
            )
        )
    if not models:
        raise DiscoveryError("the backend serves no model")
    return BackendInfo(tuple(models))


async def fetch_models(
    client: httpx.AsyncClient, base_url: str, *, timeout_s: float, headers: Mapping[str, str]
) -> BackendInfo:
    try:
        response = await client.get(
            f"{base_url}/v1/models", timeout=httpx.Timeout(timeout_s), headers=dict(headers)
        )
        response.raise_for_status()
        return parse_models(response.json())
    except (httpx.HTTPError, ValueError) as exc:
        raise DiscoveryError(f"cannot list the backend's models: {exc!r}") from exc


def tokenizer_candidates(tokenizer: str | None, model: str | None, info: BackendInfo | None) -> list[str]:
    """Where to look for the tokenizer, best first, without duplicates."""
    candidates: list[str] = []
    for value in (tokenizer, model):
        if value:
            candidates.append(value)
    if info is not None:
        served = info.find(model) if model else None
        served = served or info.default
        for value in (served.root, served.id):
            if value:
                candidates.append(value)
    return list(dict.fromkeys(candidates))


def load_token_counter(
    candidates: Sequence[str],
    *,
    max_model_len: int | None,
    trust_request_chat_template: bool = False,
    max_body_bytes: int | None = None,
    inline_thread: int | None = None,
) -> tuple[TokenCounter, str]:
    """Load the first tokenizer that exists locally; fall back on approximate counting.

    Templates sent in requests are refused unless `trust_request_chat_template`, and then
    rendered by a RenderPool loading the same tokenizer. Rendered prompts longer than
    MAX_PROMPT_CHARS_PER_BODY_BYTE x `max_body_bytes` characters are refused. The tokenizer copy
    of `inline_thread` (the event loop's, which counts small bodies inline) is made here, so that
    the loop never spends the 0.3 s a copy takes.

    Blocking (file I/O, tokenizer construction): run it in a thread.
    """
    max_prompt_chars = MAX_PROMPT_CHARS_PER_BODY_BYTE * max_body_bytes if max_body_bytes else None
    for candidate in candidates:
        templates: RequestTemplates = "refuse"
        if trust_request_chat_template:
            templates = RenderPool(candidate, max_model_len=max_model_len, max_prompt_chars=max_prompt_chars)
        try:
            counter = TokenCounter.from_pretrained(
                candidate,
                max_model_len=max_model_len,
                request_templates=templates,
                max_prompt_chars=max_prompt_chars,
            )
        except (OSError, ValueError) as exc:
            log.info("no local tokenizer at %r: %s", candidate, exc)
            continue
        if inline_thread is not None:
            counter.prepare_thread(inline_thread)
        return counter, candidate
    log.warning(
        "no tokenizer found locally (tried %s): prompt tokens are estimated from bytes",
        ", ".join(candidates) or "nothing",
    )
    approximate = TokenCounter.approximate()
    if trust_request_chat_template:
        # Nothing is rendered without a tokenizer: the template is accepted and not run.
        approximate = TokenCounter(None, request_templates="render")
    return approximate, "approximate"
