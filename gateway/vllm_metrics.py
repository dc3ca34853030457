"""vLLM's Prometheus metrics, read into one `BackendReading` (pure).

This module owns the table of vLLM metric names kvgate depends on, including the names older
vLLM releases used for the same quantity, and the arithmetic that turns one scrape into a
block budget. It consumes samples that are already parsed (`MetricSample`); the adapter that
runs a real Prometheus text parser lives in `gateway.budget`, so this core stays free of I/O
and of foreign libraries.

Data-parallel vLLM reports one series per engine (label `engine`): the pool is the sum of the
engines' pools. That sum is an approximation (each request lands on one engine, so the pool is
fragmented), good enough for a budget that the closed loop corrects.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum


class VllmMetric(StrEnum):
    """The quantities kvgate reads, under their current vLLM names."""

    KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
    RUNNING = "vllm:num_requests_running"
    WAITING = "vllm:num_requests_waiting"
    # The waiting requests by why they wait (vLLM 0.32 on): `capacity` (no room to schedule
    # them) or `deferred` (LoRA budget, KV transfer, a blocked status: not a lack of blocks).
    WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
    PREEMPTIONS = "vllm:num_preemptions_total"
    CACHE_CONFIG = "vllm:cache_config_info"
    # The sample count of the per-step token histogram: one per engine step, whatever the step
    # did (a prefill chunk or a decode). It moves whenever vLLM works on anything.
    ENGINE_STEPS = "vllm:iteration_tokens_total_count"
    # The cumulative buckets of the histogram of finished requests' output lengths (one
    # observation per sequence): what the backend has seen answers run to, before kvgate has.
    GENERATION_TOKENS = "vllm:request_generation_tokens_bucket"


# Every name a quantity has been exported under, newest first. vLLM's V0 engine called the KV
# usage gauge `gpu_cache_usage_perc` (a fraction in [0, 1], like its successor); counters are
# matched with and without the `_total` suffix that Prometheus clients append.
METRIC_NAMES: Mapping[VllmMetric, tuple[str, ...]] = {
    VllmMetric.KV_CACHE_USAGE: ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    VllmMetric.RUNNING: ("vllm:num_requests_running",),
    VllmMetric.WAITING: ("vllm:num_requests_waiting",),
    VllmMetric.WAITING_BY_REASON: ("vllm:num_requests_waiting_by_reason",),
    VllmMetric.PREEMPTIONS: ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    VllmMetric.CACHE_CONFIG: ("vllm:cache_config_info",),
    VllmMetric.ENGINE_STEPS: ("vllm:iteration_tokens_total_count",),
    VllmMetric.GENERATION_TOKENS: ("vllm:request_generation_tokens_bucket",),
}

_CANONICAL: Mapping[str, VllmMetric] = {
    name: metric for metric, names in METRIC_NAMES.items() for name in names
}
# Preference among aliases: a lower index is a newer name, used when a scrape has both.
_ALIAS_RANK: Mapping[str, int] = {
    name: rank for names in METRIC_NAMES.values() for rank, name in enumerate(names)
}

ENGINE_LABEL = "engine"
# vLLM's V1 block pool sets one block aside as the "null block" (padding for skipped
# positions) and computes kv_cache_usage_perc over the others (BlockPool.get_usage, 0.32):
# the pool a request can use is one block smaller than cache_config_info says. V0, whose
# gauge had the older name, had no such block.
V1_NULL_BLOCKS_PER_ENGINE = 1


# Bounds on what one scrape may claim. They are far beyond any real engine (an 8 x 141 GB node
# serving a tiny model at block size 16 holds a few million blocks; vLLM's block sizes are at
# most a few thousand tokens, hybrid models included) and keep every sum and product exact in a
# float: a scrape past them is refused as malformed, never let through to the arithmetic.
MAX_BLOCK_SIZE_TOKENS = 1 << 16
MAX_ENGINE_BLOCKS = 1 << 32
MAX_ENGINE_TOKENS = MAX_ENGINE_BLOCKS * MAX_BLOCK_SIZE_TOKENS
MAX_REQUESTS_PER_SERIES = 1 << 32
# Counters past 2**53 are no longer whole numbers in a float (vLLM's Prometheus client keeps
# them as floats): such a value is noise, not a count.
MAX_COUNTER = float(1 << 53)
# Usage above the pool by more than rounding noise is a broken exporter, not a full pool.
USAGE_NOISE = 1e-6
MAX_LABEL_CHARS = 4096


class MetricsFormatError(ValueError):
    """A scrape lacks or mangles something the budget needs; the budget counts as unknown."""


@dataclass(frozen=True, slots=True)
class MetricSample:
    """One parsed Prometheus sample: name as exposed (with `_total` etc.), labels, value."""

    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class BackendReading:
    """What one scrape says about a backend's KV pool, summed over its engines.

    `total_blocks` counts the blocks requests can use (V1's null block excluded), the same
    denominator vLLM's usage gauge has. `used_blocks` is a float: vLLM reports a usage fraction, and rounding it would hide the
    difference between one block and none on small pools. `preemptions_total` is None when the
    backend does not export the counter (the AIMD controller then stays where it is).
    `engine_steps_total` counts the engine steps run so far (None when not exported): a value
    that has not moved since a request was sent means vLLM has not started on it yet.
    `read_backend` guarantees 1 <= total_blocks, 0 <= used_blocks <= total_blocks, every
    count finite and within the MAX_ bounds above.
    """

    total_blocks: int
    block_size: int
    used_blocks: float
    running: int
    waiting: int
    preemptions_total: float | None
    engines: int
    prefix_caching: bool | None
    engine_steps_total: float | None = None
    # A digest of the whole scrape, set by whoever read the text (None: not known). Two equal
    # digests mean nothing at all changed in between, not even vLLM's process metrics.
    digest: float | None = None
    # (upper bound, cumulative count) of the output-length histogram, summed over engines and
    # model names, by increasing bound, the last one +inf; empty when not exported.
    output_length_buckets: tuple[tuple[float, float], ...] = ()
    # Of the waiting requests, those waiting for room (None: vLLM does not say why they wait).
    waiting_for_capacity: int | None = None

    @property
    def saturated_waiting(self) -> int:
        """Requests vLLM holds back for lack of room: those waiting for capacity where it
        says why they wait, else every waiting one."""
        return self.waiting if self.waiting_for_capacity is None else self.waiting_for_capacity

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 1.0


@dataclass(slots=True)
class _Engine:
    block_size: int | None = None
    total_tokens: int | None = None
    gpu_blocks: int | None = None
    prefix_caching: bool | None = None
    usage: float | None = None
    usage_rank: int = 1 << 30


_UNSET = ("", "none", "null")


def _int_label(labels: Mapping[str, str], name: str, upper: int) -> int | None:
    """A whole-number label of cache_config_info within [1, upper]; None when unset (vLLM
    writes "None" for fields it has not resolved). Anything else is a malformed scrape: a pool
    size of 1e308 or 32.5 tokens must not be rounded into something that looks sane."""
    raw = labels.get(name)
    if raw is None or raw.strip().lower() in _UNSET:
        return None
    where = f"vllm:cache_config_info label {name}"
    try:
        value = int(raw)
    except ValueError:
        try:
            number = float(raw)
        except ValueError:
            raise MetricsFormatError(f"{where} is not a number: {raw[:40]!r}") from None
        if not math.isfinite(number) or not number.is_integer():
            raise MetricsFormatError(f"{where} is not a whole number: {raw[:40]!r}") from None
        if not 1 <= number <= upper:  # compared as a float: int(1e308) is exact but absurd
            raise MetricsFormatError(f"{where} is out of range [1, {upper}]: {raw[:40]!r}") from None
        value = int(number)
    if not 1 <= value <= upper:
        raise MetricsFormatError(f"{where} is out of range [1, {upper}]: {raw[:40]!r}")
    return value


def _cache_config(engine: _Engine, labels: Mapping[str, str]) -> None:
    block_size = _int_label(labels, "block_size", MAX_BLOCK_SIZE_TOKENS)
    if block_size is None:
        raise MetricsFormatError("vllm:cache_config_info has no usable block_size label")
    # kv_cache_size_tokens is what the engine actually built (vLLM >= 0.11); num_gpu_blocks is
    # the older way to say the same thing and can disagree with it when blocks are padded.
    tokens = _int_label(labels, "kv_cache_size_tokens", MAX_ENGINE_TOKENS)
    blocks = _int_label(labels, "num_gpu_blocks", MAX_ENGINE_BLOCKS)
    if tokens is None:
        if blocks is None:
            raise MetricsFormatError(
                "vllm:cache_config_info has neither kv_cache_size_tokens nor num_gpu_blocks"
            )
        tokens = blocks * block_size
    engine.block_size = block_size
    engine.total_tokens = tokens
    engine.gpu_blocks = blocks
    prefix = labels.get("enable_prefix_caching")
    engine.prefix_caching = None if prefix is None else prefix.lower() == "true"


def _bounded(value: float, name: str, upper: float) -> float:
    """`value` when it is a finite number in [0, upper]; else the scrape is malformed."""
    if not 0.0 <= value <= upper:  # also false for NaN
        raise MetricsFormatError(f"{name} has an impossible value {value!r}")
    return value


def _check_labels(sample: MetricSample) -> None:
    for key, value in sample.labels.items():
        if len(key) + len(value) > MAX_LABEL_CHARS:
            raise MetricsFormatError(
                f"{sample.name} has a label {key[:40]!r} of {len(value)} characters "
                f"(at most {MAX_LABEL_CHARS} are read)"
            )


def read_backend(samples: Iterable[MetricSample]) -> BackendReading:
    """Turn one scrape's samples into a `BackendReading`; raise `MetricsFormatError` when the
    pool size or its usage is missing, or when anything read is out of its bounds. Nothing
    else is raised, whatever the samples hold."""
    engines: dict[str, _Engine] = {}
    running = 0.0
    waiting = 0.0
    waiting_for_capacity = 0.0
    preemptions: float | None = None
    seen_running = seen_waiting = seen_by_reason = False
    preemption_rank = 1 << 30
    preemption_by_rank: dict[int, float] = {}
    steps: float | None = None
    output_lengths: dict[float, float] = {}
    output_lengths_spoiled = False

    for sample in samples:
        metric = _CANONICAL.get(sample.name)
        if metric is None:
            continue
        _check_labels(sample)
        engine_id = sample.labels.get(ENGINE_LABEL, "")
        rank = _ALIAS_RANK[sample.name]
        if metric is VllmMetric.CACHE_CONFIG:
            _cache_config(engines.setdefault(engine_id, _Engine()), sample.labels)
        elif metric is VllmMetric.KV_CACHE_USAGE:
            engine = engines.setdefault(engine_id, _Engine())
            value = _bounded(sample.value, sample.name, 1.0 + USAGE_NOISE)
            # Prefer the newest name; with several series under one name (one per model name
            # on a single engine) the largest is the engine's, they share one pool.
            if rank < engine.usage_rank:
                engine.usage, engine.usage_rank = value, rank
            elif rank == engine.usage_rank and engine.usage is not None:
                engine.usage = max(engine.usage, value)
        elif metric is VllmMetric.RUNNING:
            running += _bounded(sample.value, sample.name, MAX_REQUESTS_PER_SERIES)
            seen_running = True
        elif metric is VllmMetric.WAITING:
            waiting += _bounded(sample.value, sample.name, MAX_REQUESTS_PER_SERIES)
            seen_waiting = True
        elif metric is VllmMetric.WAITING_BY_REASON:
            value = _bounded(sample.value, sample.name, MAX_REQUESTS_PER_SERIES)
            if sample.labels.get("reason") == "capacity":
                waiting_for_capacity += value
            seen_by_reason = True
        elif metric is VllmMetric.PREEMPTIONS:
            # A counter that falls between scrapes is a restarted vLLM: the AIMD limit takes
            # it as a new baseline (see AimdLimit.observe), so only the value is checked here.
            value = _bounded(sample.value, sample.name, MAX_COUNTER)
            preemption_by_rank[rank] = preemption_by_rank.get(rank, 0.0) + value
            preemption_rank = min(preemption_rank, rank)
        elif metric is VllmMetric.ENGINE_STEPS:
            steps = (steps or 0.0) + _bounded(sample.value, sample.name, MAX_COUNTER)
        elif metric is VllmMetric.GENERATION_TOKENS:
            # A hint, not part of the budget: a bad sample spoils the histogram, not the scrape.
            bound = _bucket_bound(sample.labels.get("le"))
            if bound is None or not 0.0 <= sample.value <= MAX_COUNTER:
                output_lengths_spoiled = True
            else:
                output_lengths[bound] = output_lengths.get(bound, 0.0) + sample.value

    if preemption_by_rank:
        preemptions = preemption_by_rank[preemption_rank]

    configured = {eid: e for eid, e in engines.items() if e.total_tokens is not None}
    if not configured:
        raise MetricsFormatError("the scrape has no vllm:cache_config_info: pool size unknown")
    block_sizes = {e.block_size for e in configured.values()}
    if len(block_sizes) != 1:
        raise MetricsFormatError(f"engines disagree on the block size: {sorted(map(str, block_sizes))}")
    (block_size,) = block_sizes
    assert block_size is not None

    total_blocks = 0
    used_blocks = 0.0
    for engine_id, engine in configured.items():
        assert engine.total_tokens is not None
        if engine.usage is None:
            raise MetricsFormatError(f"engine {engine_id[:40]!r} reports no KV cache usage")
        blocks = engine.total_tokens // block_size
        if engine.gpu_blocks is not None:
            # The token capacity is derived from the maximum concurrency (vLLM's
            # get_kv_cache_capacity) and can exceed what the pool's blocks hold (sliding-window
            # and Mamba layers need fewer blocks per request); the pool has num_gpu_blocks.
            blocks = min(blocks, engine.gpu_blocks)
        if engine.usage_rank == 0:  # the V1 gauge: its engine keeps a null block
            blocks = max(0, blocks - V1_NULL_BLOCKS_PER_ENGINE)
        total_blocks += blocks
        # vLLM reports a fraction; clamp rounding noise so used never exceeds the pool.
        used_blocks += min(1.0, engine.usage) * blocks
    if total_blocks < 1:
        raise MetricsFormatError("the KV pool has no blocks")

    prefix_flags = {e.prefix_caching for e in configured.values()}
    return BackendReading(
        total_blocks=total_blocks,
        block_size=block_size,
        used_blocks=min(used_blocks, float(total_blocks)),
        # Missing request gauges count as idle: they refine the budget, they do not size it.
        running=round(running) if seen_running else 0,
        waiting=round(waiting) if seen_waiting else 0,
        waiting_for_capacity=round(waiting_for_capacity) if seen_by_reason else None,
        preemptions_total=preemptions,
        engines=len(configured),
        prefix_caching=prefix_flags.pop() if len(prefix_flags) == 1 else None,
        engine_steps_total=steps,
        output_length_buckets=() if output_lengths_spoiled else _cumulative(output_lengths),
    )


def _bucket_bound(raw: str | None) -> float | None:
    """A histogram bucket's `le` label as a number (None when missing or not a number)."""
    if raw is None:
        return None
    try:
        bound = float(raw)
    except ValueError:
        return None
    # Output lengths are whole tokens; a negative or absurd bound would make a reservation of
    # it (see quantile_from_buckets), so such a histogram is dropped.
    return bound if bound == math.inf or 0.0 <= bound <= MAX_COUNTER else None


def _cumulative(counts: Mapping[float, float]) -> tuple[tuple[float, float], ...]:
    """The buckets by increasing bound, or none at all when they do not form a histogram
    (no +inf bucket, or counts that fall as the bound grows: engines exporting different
    bounds). The histogram is a hint for a cold start; a doubtful one is dropped, not fixed."""
    ordered = tuple(sorted(counts.items()))
    if not ordered or ordered[-1][0] != math.inf or not ordered[-1][1] <= MAX_COUNTER:
        return ()
    if any(later < earlier for (_, earlier), (_, later) in itertools.pairwise(ordered)):
        return ()
    return ordered
