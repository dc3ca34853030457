"""Token counters for prompt synthesis, and the model facts the bench needs from a target.

Two ways to count the tokens of a prompt exactly as the target will: the project's own
`estimator.tokens.TokenCounter` over a local tokenizer folder (fast, in process), or a vLLM
server's `/tokenize` endpoint (the server's own tokenizer, one HTTP call per count). Both are
used before a run starts, never while requests are in flight, so they may block.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.prompts import CountTokens

# Timeout of the set-up calls (/v1/models, /tokenize): the server is idle then.
SETUP_TIMEOUT_S = 10.0


class Api:
    """The two OpenAI endpoints the bench can drive."""

    COMPLETIONS = "completions"
    CHAT = "chat"


def count_body(api: str, model: str, text: str) -> dict[str, Any]:
    """The minimal request body whose prompt is `text` (what the counters count)."""
    if api == Api.CHAT:
        return {"model": model, "messages": [{"role": "user", "content": text}]}
    return {"model": model, "prompt": text}


def local_counter(tokenizer_dir: str | Path, api: str, model: str) -> CountTokens:
    """Count with the project's TokenCounter over a local tokenizer folder or cached model id."""
    from estimator.tokens import Route, TokenCounter

    counter = TokenCounter.from_pretrained(tokenizer_dir)
    if not counter.exact:
        raise RuntimeError(f"{tokenizer_dir}: no exact tokenizer")
    route = Route.CHAT if api == Api.CHAT else Route.COMPLETIONS

    def count(text: str) -> int:
        return counter.count(route, count_body(api, model, text)).tokens

    return count


def tokenize_endpoint_counter(client: httpx.Client, base_url: str, api: str, model: str) -> CountTokens:
    """Count with a vLLM server's `/tokenize` (it accepts the same prompt or messages)."""
    url = f"{base_url}/tokenize"

    def count(text: str) -> int:
        response = client.post(url, json=count_body(api, model, text))
        response.raise_for_status()
        return int(response.json()["count"])

    return count


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a target's `/v1/models` says about the model it serves."""

    name: str
    max_model_len: int | None
    root: str | None


def fetch_model_info(client: httpx.Client, base_url: str, model: str | None) -> ModelInfo | None:
    """The entry for `model` (or the first one) from `/v1/models`; None when the target has no
    such endpoint or it cannot be read."""
    try:
        response = client.get(f"{base_url}/v1/models")
        response.raise_for_status()
        data = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    entries = [d for d in data if isinstance(d, Mapping)]
    chosen = next((d for d in entries if d.get("id") == model), None) if model else None
    if chosen is None and entries:
        chosen = entries[0]
    if chosen is None:
        return None
    max_len = chosen.get("max_model_len")
    root = chosen.get("root")
    return ModelInfo(
        name=str(chosen.get("id")),
        max_model_len=int(max_len) if isinstance(max_len, int) else None,
        root=str(root) if isinstance(root, str) else None,
    )


def honours_forced_length(client: httpx.Client, base_url: str, model: str, field: str) -> bool:
    """Whether the target reads the bench's private length field `vllm_xargs.<field>`.

    It sends the field with the invalid length 0 and no generation can follow: the testbed's
    logits processor, the emulator and the instant fake refuse it with a 400 naming the field,
    and so does a gateway in front of them (it relays the answer). A vLLM without the processor
    ignores unknown keys and answers 200 after one token; then the field would force nothing.
    """
    body = {"model": model, "prompt": "x", "max_tokens": 1, "vllm_xargs": {field: 0}}
    try:
        response = client.post(f"{base_url}/v1/completions", json=body)
    except httpx.HTTPError:
        return False
    return response.status_code == 400 and field in response.text


def eos_token_id(model_dir: str | Path) -> int | None:
    """The EOS token id from a model folder (generation_config.json, then config.json)."""
    folder = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        # Some models list several EOS ids; the first is the tokenizer's own EOS.
        if isinstance(value, list) and value and isinstance(value[0], int):
            return int(value[0])
        if isinstance(value, int):
            return value
    return None


def choose_counter(
    *,
    tokenizer_dir: str | None,
    api: str,
    model: str,
    tokenize_url: str | None,
    client: httpx.Client,
    log: Callable[[str], None],
) -> CountTokens:
    """A local TokenCounter when a tokenizer folder is known, else the target's `/tokenize`."""
    if tokenizer_dir is not None:
        log(f"counting prompt tokens with the local tokenizer in {tokenizer_dir}")
        return local_counter(tokenizer_dir, api, model)
    if tokenize_url is not None:
        probe = tokenize_endpoint_counter(client, tokenize_url, api, model)
        try:
            probe("hello")
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise RuntimeError(
                f"no tokenizer: pass --tokenizer DIR ({tokenize_url}/tokenize failed: {exc})"
            ) from exc
        log(f"counting prompt tokens with {tokenize_url}/tokenize")
        return probe
    raise RuntimeError("no tokenizer: pass --tokenizer DIR")
