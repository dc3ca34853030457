"""The few Prometheus metrics the bench samples from targets and backends (pure).

One scrape becomes a `Reading`: kvgate's queue depth and the wait it predicts for a queue that
sheds nothing, and vLLM's KV usage, running and waiting
requests, and the counters whose deltas the report needs (preemptions, generated and prompt
tokens, prompt tokens found in the prefix cache, and the prefix cache's queried and hit tokens,
whose ratio is its hit rate). Series are summed over their labels (engines, models, priorities), except KV usage,
a fraction, which is averaged over engines.

Parsing uses prometheus_client's text parser on the lines of interest only: a vLLM scrape is
some 50 kB of histograms, and the bench parses while it keeps requests on schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# Sample name (as exposed) -> Reading field. Older vLLM releases named KV usage
# gpu_cache_usage_perc; counters appear with their `_total` suffix.
SAMPLE_FIELDS: Mapping[str, str] = {
    "kvgate_queue_depth": "queue_depth",
    "kvgate_budget_fraction": "budget_fraction",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:prompt_tokens_cached_total": "prompt_tokens_cached_total",
    # Tokens looked up in the local prefix cache and tokens found there; a preempted request
    # is looked up again when it is rescheduled, unlike prompt_tokens, counted once.
    "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
}
# Families as the parser names them: counters lose their `_total`.
_FAMILIES = frozenset(name.removesuffix("_total") for name in SAMPLE_FIELDS) | frozenset(SAMPLE_FIELDS)


@dataclass(frozen=True, slots=True)
class Reading:
    """One scrape of one /metrics URL. A field is None when the scrape did not have it."""

    queue_depth: float | None = None
    budget_fraction: float | None = None
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions_total: float | None = None
    generation_tokens_total: float | None = None
    prompt_tokens_total: float | None = None
    prompt_tokens_cached_total: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None

    @property
    def is_vllm(self) -> bool:
        """Whether this looks like a vLLM engine (it reports its generated tokens)."""
        return self.generation_tokens_total is not None

    @property
    def busy(self) -> float | None:
        """Requests running or waiting in the engine; None when not reported."""
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)


def _wanted(line: str) -> bool:
    if line.startswith("#"):
        parts = line.split(" ", 3)
        return len(parts) >= 3 and parts[1] in ("TYPE", "HELP") and parts[2] in _FAMILIES
    end = len(line)
    for stop in ("{", " "):
        at = line.find(stop)
        if 0 <= at < end:
            end = at
    return line[:end] in SAMPLE_FIELDS


def parse_reading(text: str) -> Reading:
    """Read the sampled metrics from Prometheus exposition text. Raises ValueError on text
    the parser rejects."""
    relevant = "\n".join(line for line in text.splitlines() if _wanted(line)) + "\n"
    sums: dict[str, float] = {}
    usage: list[float] = []
    for family in text_string_to_metric_families(relevant):
        for sample in family.samples:
            field = SAMPLE_FIELDS.get(sample.name)
            if field is None:
                continue
            if field == "kv_usage":
                usage.append(float(sample.value))
            else:
                sums[field] = sums.get(field, 0.0) + float(sample.value)
    return Reading(kv_usage=sum(usage) / len(usage) if usage else None, **sums)
