"""What a backend serves (`/v1/models`), and where its tokenizer comes from.

vLLM's `/v1/models` lists each served name with `max_model_len` and `root` (the folder or id
it loaded); LoRA adapters appear beside their base with a `parent` and no `max_model_len`
(they run in the base's engine, with its context and its tokenizer). The gateway needs the
context limit to validate requests, the root to find the very tokenizer vLLM uses, and the
version (`/version`) because vLLM's validation of output caps changed between versions (see
`estimator.demand.ContextRule`). Tokenizers load only from a local folder or the local Hugging
Face cache, never from the network.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from estimator import kv
from estimator.modelconfig import ModelNotFoundError, load_config
from estimator.tokens import RequestTemplates, TokenCounter
from gateway.errors import failure_reason
from gateway.render_pool import MAX_PROMPT_CHARS_PER_BODY_BYTE, RenderPool

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServedModel:
    id: str
    root: str | None
    max_model_len: int | None
    parent: str | None = None  # the base model of a LoRA adapter


@dataclass(frozen=True, slots=True)
class BackendInfo:
    models: tuple[ServedModel, ...]
    version: str | None = None  # what the backend's /version says; None when it does not say

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


def parse_models(payload: Any, version: str | None = None) -> BackendInfo:
    """Read an OpenAI `/v1/models` answer; raise DiscoveryError when it lists no model."""
    if not isinstance(payload, Mapping) or not isinstance(payload.get("data"), list):
        raise DiscoveryError("the backend's /v1/models answer has no 'data' list")
    models: list[ServedModel] = []
    for item in payload["data"]:
        if not isinstance(item, Mapping) or not isinstance(item.get("id"), str):
            continue
        root, parent = item.get("root"), item.get("parent")
        limit = item.get("max_model_len")
        models.append(
            ServedModel(
                id=item["id"],
                root=root if isinstance(root, str) and root else None,
                max_model_len=limit
                if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
                else None,
                parent=parent if isinstance(parent, str) and parent and parent != item["id"] else None,
            )
        )
    if not models:
        raise DiscoveryError("the backend serves no model")
    # An adapter without a context of its own runs in its base's engine: it has the base's.
    by_id = {model.id: model for model in models}
    for index, model in enumerate(models):
        base = by_id.get(model.parent) if model.parent else None
        if model.max_model_len is None and base is not None and base.max_model_len is not None:
            models[index] = replace(model, max_model_len=base.max_model_len)
    return BackendInfo(tuple(models), version)


def parse_version(payload: Any) -> str | None:
    """The version in a vLLM `/version` answer (`{"version": "0.32.0"}`), else None."""
    if isinstance(payload, Mapping):
        version = payload.get("version")
        if isinstance(version, str) and version.strip():
            return version.strip()[:64]
    return None


async def fetch_models(
    client: httpx.AsyncClient, base_url: str, *, timeout_s: float, headers: Mapping[str, str]
) -> BackendInfo:
    """Read /v1/models and /version; only the models are required."""
    try:
        response = await client.get(
            f"{base_url}/v1/models", timeout=httpx.Timeout(timeout_s), headers=dict(headers)
        )
        response.raise_for_status()
        payload = response.json()
    except httpx.HTTPStatusError as exc:  # its text names the URL, credentials and all
        raise DiscoveryError(f"cannot list the backend's models: HTTP {exc.response.status_code}") from exc
    except httpx.HTTPError as exc:
        raise DiscoveryError(f"cannot list the backend's models: {failure_reason(exc)}") from exc
    except ValueError as exc:
        raise DiscoveryError(f"cannot list the backend's models: {exc}") from exc
    return parse_models(payload, await fetch_version(client, base_url, timeout_s=timeout_s, headers=headers))


async def fetch_version(
    client: httpx.AsyncClient, base_url: str, *, timeout_s: float, headers: Mapping[str, str]
) -> str | None:
    """The backend's `/version`, or None when it has none (not vLLM, or an error): the
    validation rules then default to the current vLLM's."""
    try:
        response = await client.get(
            f"{base_url}/version", timeout=httpx.Timeout(timeout_s), headers=dict(headers)
        )
        if response.status_code != 200:
            return None
        return parse_version(response.json())
    except (httpx.HTTPError, ValueError) as exc:
        log.info("no version from the backend's /version: %s", failure_reason(exc))
        return None


def tokenizer_candidates(tokenizer: str | None, model: str | None, info: BackendInfo | None) -> list[str]:
    """Where to look for the tokenizer, best first, without duplicates."""
    candidates: list[str] = []
    for value in (tokenizer, model):
        if value:
            candidates.append(value)
    if info is not None:
        served = info.find(model) if model else None
        served = served or info.default
        # vLLM 0.32 tokenizes an adapter's requests with its base's tokenizer (it has no
        # per-adapter tokenizer), so the base's folder comes before the adapter's.
        base = info.find(served.parent) if served.parent else None
        for entry in (base, served):
            if entry is not None:
                candidates.extend(value for value in (entry.root, entry.id) if value)
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
            # The served model's config.json says which media it takes (estimator/media.py);
            # a tokenizer-only folder has none, so the other candidates are asked too.
            counter = TokenCounter.from_pretrained(
                candidate,
                max_model_len=max_model_len,
                config_sources=candidates,
                request_templates=templates,
                max_prompt_chars=max_prompt_chars,
            )
        except (OSError, ValueError) as exc:
            log.info("no local tokenizer at %r: %s", candidate, exc)
            continue
        log.info("media parts for %r: %s", candidate, counter.media.describe())
        if inline_thread is not None:
            counter.prepare_thread(inline_thread)
        return counter, candidate
    log.warning(
        "no tokenizer found locally (tried %s): prompt tokens are estimated from bytes",
        ", ".join(candidates) or "nothing",
    )
    approximate = TokenCounter.approximate(max_model_len=max_model_len)
    if trust_request_chat_template:
        # Nothing is rendered without a tokenizer: the template is accepted and not run.
        approximate = TokenCounter(None, max_model_len=max_model_len, request_templates="render")
    return approximate, "approximate"


def load_model_shape(candidates: Sequence[str]) -> tuple[kv.ModelShape | None, str | None]:
    """The served model's shape from the first candidate with a usable `config.json`, and
    where it came from; (None, None) when none has one (requests then count plain paged
    attention blocks). Blocking file I/O: run it in a thread."""
    for candidate in candidates:
        try:
            return kv.model_shape(load_config(candidate)), candidate
        except (ModelNotFoundError, kv.ConfigError, OSError, ValueError) as exc:
            log.info("no usable model config at %r: %s", candidate, exc)
    return None, None
