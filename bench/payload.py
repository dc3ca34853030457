"""Request bodies and headers for each request of a workload (pure).

Output lengths are forced the way a real client's traffic looks to the server: `max_tokens`
stays at a large cap (clients set it far above what the model writes), and the trace's true
length L reaches the backend by a path a gateway has no reason to read: the private field
`vllm_xargs.kvgate_bench_output_tokens` = L. vLLM's OpenAI server passes `vllm_xargs` to the
engine as `SamplingParams.extra_args`; the testbed's engines load a logits processor
(tests/testbed/bench_lengths.py) that masks EOS until then and makes it the L-th completion
token, and the emulator (sim/) honours the same field. Without forcing the tiny random-weight
model would never stop before the cap.

The older path, `min_tokens` = L - 1 plus a large positive `logit_bias` on EOS, stays as an
explicit choice (`Forcing.MIN_TOKENS`) for a vLLM that does not load the processor (one the
bench cannot restart): vLLM ignores unknown `vllm_xargs` keys, so there the field would not
force anything. It tells kvgate the answer, since kvgate reserves at least `min_tokens`, so
figures measured with it flatter kvgate's output prediction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from bench.workload import RequestSpec

# OpenAI's documented maximum for a logit bias; vLLM adds it to the logit as is.
EOS_LOGIT_BIAS = 100.0
# The private `vllm_xargs` key that carries the forced output length (completion tokens, EOS
# included). tests/testbed/bench_lengths.py and sim/lengths.py name the same key.
OUTPUT_TOKENS_FIELD = "kvgate_bench_output_tokens"


class Forcing(StrEnum):
    """How a request's output length is forced (see the module docstring)."""

    XARGS = "xargs"
    MIN_TOKENS = "min-tokens"
    NONE = "none"


TENANT_HEADER = "X-Kvgate-Tenant"
PRIORITY_HEADER = "X-Kvgate-Priority"
DEADLINE_HEADER = "X-Kvgate-Deadline-Ms"
TTFT_HEADER = "X-Kvgate-TTFT-Ms"
# The output length a client expects (completion tokens); kvgate reserves it instead of its
# learned estimate. The bench's oracle (`oracle`) sends every request's true forced length in it.
EXPECTED_OUTPUT_HEADER = "X-Kvgate-Expected-Output-Tokens"


@dataclass(frozen=True, slots=True)
class PayloadOptions:
    """How every request of a run is shaped.

    `forcing` chooses how output lengths are forced; `Forcing.MIN_TOKENS` needs
    `eos_token_id`, the others ignore it. `Forcing.NONE` lets the model decide (outputs end at
    the cap with random weights). `token_ids` asks vLLM to return the generated token ids in every
    chunk (`return_token_ids`), which makes the client's own token count exact even for a
    stream cut short. `deadline_s` / `ttft_slo_s` become the X-Kvgate deadline headers.
    `oracle` tells the gateway each request's true output length (`EXPECTED_OUTPUT_HEADER`),
    to measure how far its learned estimate is from perfect knowledge.
    """

    model: str
    api: str = "completions"
    max_tokens_cap: int = 4096
    max_model_len: int | None = None
    forcing: Forcing = Forcing.XARGS
    eos_token_id: int | None = None
    token_ids: bool = True
    deadline_s: float | None = None
    ttft_slo_s: float | None = None
    oracle: bool = False
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.forcing is Forcing.MIN_TOKENS and self.eos_token_id is None:
            raise ValueError("forcing output lengths by min_tokens needs the EOS token id")


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """A request ready to send: the spec it realises, its path, JSON body and headers."""

    index: int
    spec: RequestSpec
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...]


def max_tokens_for(spec: RequestSpec, options: PayloadOptions) -> int:
    """The cap sent as `max_tokens`: the configured cap, lowered when the prompt leaves less
    room in the context (vLLM refuses prompt + max_tokens > max_model_len)."""
    cap = options.max_tokens_cap
    if options.max_model_len is not None:
        cap = min(cap, options.max_model_len - spec.prompt_tokens)
    return max(cap, 1)


def forced_output_tokens(spec: RequestSpec) -> int:
    """The length a forced answer has: the trace's, at least one token (the EOS)."""
    return max(1, spec.output_tokens)


def build_body(spec: RequestSpec, prompt: str, options: PayloadOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"model": options.model}
    if options.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["max_tokens"] = max_tokens_for(spec, options)
    if options.forcing is Forcing.XARGS:
        body["vllm_xargs"] = {OUTPUT_TOKENS_FIELD: forced_output_tokens(spec)}
    elif options.forcing is Forcing.MIN_TOKENS:
        body["min_tokens"] = max(0, spec.output_tokens - 1)
        body["logit_bias"] = {str(options.eos_token_id): EOS_LOGIT_BIAS}
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if options.token_ids:
        body["return_token_ids"] = True
    return body


def build_headers(spec: RequestSpec, options: PayloadOptions) -> tuple[tuple[str, str], ...]:
    headers: list[tuple[str, str]] = [("content-type", "application/json")]
    if spec.tenant is not None:
        headers.append((TENANT_HEADER, spec.tenant))
    if spec.priority is not None:
        headers.append((PRIORITY_HEADER, spec.priority))
    if options.deadline_s is not None:
        headers.append((DEADLINE_HEADER, str(round(options.deadline_s * 1000))))
    if options.ttft_slo_s is not None:
        headers.append((TTFT_HEADER, str(round(options.ttft_slo_s * 1000))))
    if options.oracle:
        headers.append((EXPECTED_OUTPUT_HEADER, str(forced_output_tokens(spec))))
    headers.extend(options.headers)
    return tuple(headers)


def plan_requests(
    specs: Sequence[RequestSpec], prompts: Sequence[str], options: PayloadOptions
) -> tuple[PlannedRequest, ...]:
    """Serialise every request once, before the run, so that sending costs no CPU."""
    path = "/v1/chat/completions" if options.api == "chat" else "/v1/completions"
    return tuple(
        PlannedRequest(
            index=i,
            spec=spec,
            path=path,
            body=json.dumps(build_body(spec, prompt, options)).encode(),
            headers=build_headers(spec, options),
        )
        for i, (spec, prompt) in enumerate(zip(specs, prompts, strict=True))
    )


def parse_header_option(text: str) -> tuple[str, str]:
    """'K:V' (from --header) -> ('K', 'V'); ValueError without a colon or name."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"bad header {text!r} (want NAME:VALUE)")
    return name.strip(), value.strip()
