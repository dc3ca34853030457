"""The emulator's `/metrics`: vLLM 0.32's families, names, types, labels and buckets.

The gateway parses these exactly as it parses a real vLLM, so they are pinned against the
golden recording `tests/fixtures/vllm/metrics_0.32.0.txt`. Every `vllm:` family of that
recording is present; the ones the engine model can feed (requests, KV usage, preemptions,
token counters, prefix cache, latency histograms) carry real values, the rest (multimodal
cache, external KV transfer, FLOPs estimates) stay at zero as they do on the testbed.

Each server instance owns its registries (no global state): a simulated restart builds a new
`VllmMetrics`, so counters reset as they do when vLLM restarts.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from sim.engine import Batch, EngineConfig, EngineSnapshot, FinishedRequest, StepOutput

# Bucket boundaries of vLLM 0.32 (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# The testbed's CPU backend reserves VLLM_CPU_KVCACHE_SPACE=1 GiB for 2,048 tokens; the
# emulator reports memory at that ratio so that cache_config_info stays self-consistent.
KV_CACHE_BYTES_PER_TOKEN = 1_073_741_824 // 2048

ENGINE_LABELS = ("engine", "model_name")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
WAITING_REASONS = ("capacity", "deferred")


def request_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to max_model_len (1, 2, 5, 10, ..., 1000 for 1024)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(value)
        scale *= 10


def cache_config_labels(config: EngineConfig) -> dict[str, str]:
    """The labels of vllm:cache_config_info as the testbed reports them, for this pool."""
    tokens = config.kv_cache_size_tokens
    return {
        "_block_size_resolved": "True",
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(config.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "engine": "0",
        "gpu_memory_utilization": "0.92",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(round(tokens / config.max_model_len, 2)),
        "kv_cache_memory_bytes": str(tokens * KV_CACHE_BYTES_PER_TOKEN),
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(config.num_blocks),
        "num_gpu_blocks_override": str(config.num_blocks),
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "True",
    }


class VllmMetrics:
    """Prometheus families of one emulated engine; fed by the server loop, read by scrapes."""

    def __init__(self, engine_config: EngineConfig, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Kept apart so the fault "missing cache_config_info" can leave it out.
        self.info_registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        labels = ("0", model_name)
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ENGINE_LABELS, registry=reg).labels(*labels)

        def counters_by(name: str, doc: str, label: str, values: Sequence[str]) -> dict[str, Counter]:
            family = Counter(name, doc, (*ENGINE_LABELS, label), registry=reg)
            return {value: family.labels(*labels, value) for value in values}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ENGINE_LABELS, registry=reg).labels(*labels)

        def gauges_by(name: str, doc: str, label: str, values: Sequence[str]) -> dict[str, Gauge]:
            family = Gauge(name, doc, (*ENGINE_LABELS, label), registry=reg)
            return {value: family.labels(*labels, value) for value in values}

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, ENGINE_LABELS, buckets=buckets, registry=reg).labels(*labels)

        # Declaration order is the order of the testbed's exposition.
        counter(
            "vllm:estimated_flops_per_gpu",
            "Estimated number of floating point operations per GPU "
            "(for Model Flops Utilization calculations).",
        )
        counter(
            "vllm:estimated_read_bytes_per_gpu",
            "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).",
        )
        counter(
            "vllm:estimated_write_bytes_per_gpu",
            "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).",
        )
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.waiting_by_reason = gauges_by(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV "
            "transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            "reason",
            WAITING_REASONS,
        )
        sleep = gauges_by(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            "sleep_state",
            SLEEP_STATES,
        )
        sleep["awake"].set(1)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
        )
        counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms "
            "of number of cached tokens.",
        )
        counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = counters_by(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source", PROMPT_SOURCES
        )
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.prompt_cached_by_source = counters_by(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            "source",
            CACHED_SOURCES,
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("engine", "finished_reason", "model_name"),
            registry=reg,
        )
        self.request_success = {r: success.labels("0", r, model_name) for r in FINISH_REASONS}
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ("model_name", "reason"),
            registry=reg,
        )
        self.admission_rejections = {r: rejections.labels(model_name, r) for r in ADMISSION_REASONS}
        token_buckets = request_token_buckets(engine_config.max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )
        info = cache_config_labels(engine_config)
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            tuple(info),
            registry=self.info_registry,
        ).labels(**info).set(1)

    def record_step(self, batch: Batch, out: StepOutput) -> None:
        if batch.preempted:
            self.preemptions.inc(len(batch.preempted))
        if batch.prefix_cache_queries:
            self.prefix_queries.inc(batch.prefix_cache_queries)
            self.prefix_hits.inc(batch.prefix_cache_hits)
        prompt = out.prompt_tokens_computed + out.prompt_tokens_cached
        if prompt:
            self.prompt_tokens.inc(prompt)
            self.prompt_by_source["local_compute"].inc(out.prompt_tokens_computed)
            self.prompt_by_source["local_cache_hit"].inc(out.prompt_tokens_cached)
            self.prompt_cached.inc(out.prompt_tokens_cached)
            self.prompt_cached_by_source["device"].inc(out.prompt_tokens_cached)
        if out.generation_tokens:
            self.generation_tokens.inc(out.generation_tokens)
        # vLLM observes computed prompt tokens plus generated tokens per iteration.
        self.iteration_tokens.observe(out.prompt_tokens_computed + out.generation_tokens)
        for value in out.time_to_first_token_s:
            self.ttft.observe(value)
        for value in out.inter_token_latency_s:
            self.itl.observe(value)
        for finished in out.finished:
            self._record_finished(finished)

    def _record_finished(self, done: FinishedRequest) -> None:
        self.request_success[done.finish_reason.value].inc()
        self.e2e.observe(done.e2e_s)
        self.queue_time.observe(done.queued_s)
        self.prefill_time.observe(done.prefill_s)
        self.inference_time.observe(done.inference_s)
        self.decode_time.observe(done.decode_s)
        self.request_preemptions.observe(done.num_preemptions)
        self.prefill_kv_computed.observe(done.prompt_tokens - done.cached_prompt_tokens)
        self.request_prompt_tokens.observe(done.prompt_tokens)
        self.request_generation_tokens.observe(done.output_tokens)
        self.tpot.observe(done.mean_time_per_output_token_s)
        self.params_max_tokens.observe(done.max_tokens)

    def record_completed_request(self, n: int, max_generation_tokens: int) -> None:
        """A whole client request (all its sequences) finished without abort."""
        self.params_n.observe(n)
        self.max_generation_tokens.observe(max_generation_tokens)

    def record_rejection(self, reason: str) -> None:
        self.admission_rejections[reason].inc()

    def render(self, snapshot: EngineSnapshot, *, include_cache_config: bool = True) -> bytes:
        self.running.set(snapshot.num_running)
        self.waiting.set(snapshot.num_waiting)
        self.waiting_by_reason["capacity"].set(snapshot.num_waiting)
        self.waiting_by_reason["deferred"].set(0)
        self.kv_usage.set(snapshot.kv_cache_usage)
        text = generate_latest(self.registry)
        if include_cache_config:
            text += generate_latest(self.info_registry)
        return text
