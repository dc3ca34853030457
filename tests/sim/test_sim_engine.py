"""The engine core against vLLM V1's scheduling rules, with a fake clock (no sleeping)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine import (
    Batch,
    Engine,
    EngineConfig,
    FinishReason,
    RequestSpec,
    RequestStatus,
    StepCost,
    StepOutput,
)
from sim.lengths import eos_position

# Tiny pools make every block boundary visible: 4-token blocks, 6 usable blocks.
SMALL = EngineConfig(
    num_blocks=7,
    block_size=4,
    max_model_len=24,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    enable_prefix_caching=False,
    step_cost=StepCost(base_s=0.01, per_token_s=0.001, per_seq_s=0.002, per_request_s=0.0),
)


def spec(rid: str, prompt: int, max_tokens: int = 100, **kw: object) -> RequestSpec:
    return RequestSpec(request_id=rid, prompt_tokens=prompt, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


class Driver:
    """Steps an engine on a fake clock, as the server loop does."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.now = 0.0
        self.outputs: list[StepOutput] = []
        self.batches: list[Batch] = []

    def step(self) -> tuple[Batch | None, StepOutput | None]:
        batch = self.engine.begin_step(self.now)
        if batch is None:
            return None, None
        self.now += batch.duration_s
        out = self.engine.end_step(batch, self.now)
        self.batches.append(batch)
        self.outputs.append(out)
        return batch, out

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        for steps in range(max_steps):
            batch, _ = self.step()
            if batch is None:
                return steps
        raise AssertionError("engine did not go idle")

    def tokens_of(self, rid: str) -> int:
        return sum(1 for out in self.outputs for t in out.tokens if t.request_id == rid)

    def finish_reason(self, rid: str) -> FinishReason | None:
        for out in self.outputs:
            for token in out.tokens:
                if token.request_id == rid and token.finish_reason is not None:
                    return token.finish_reason
        return None


def test_step_cost_is_affine_in_tokens_sequences_and_arrivals() -> None:
    cost = StepCost(base_s=0.004, per_token_s=0.00003, per_seq_s=0.0004, per_request_s=0.002)
    assert cost.duration_s(0, 0) == pytest.approx(0.004)
    assert cost.duration_s(100, 1) == pytest.approx(0.004 + 0.003 + 0.0004)
    assert cost.duration_s(16, 16) == pytest.approx(0.004 + 16 * 0.00043)
    assert cost.duration_s(16, 16, 3) == pytest.approx(0.004 + 16 * 0.00043 + 0.006)


def test_new_requests_are_charged_once_to_the_next_step() -> None:
    cost = StepCost(base_s=0.01, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.005)
    engine = Engine(replace(SMALL, step_cost=cost))
    driver = Driver(engine)
    engine.add(spec("a", prompt=4, max_tokens=3), now=0.0)
    engine.add(spec("b", prompt=4, max_tokens=3), now=0.0)
    first, _ = driver.step()
    second, _ = driver.step()
    assert first is not None
    assert second is not None
    assert first.duration_s == pytest.approx(0.01 + 2 * 0.005)
    assert second.duration_s == pytest.approx(0.01)


def test_one_request_allocates_a_block_at_each_boundary_and_frees_all() -> None:
    engine = Engine(SMALL)
    driver = Driver(engine)
    engine.add(spec("a", prompt=6, max_tokens=5), now=0.0)
    held: list[int] = []
    for _ in range(5):
        driver.step()
        held.append(engine.blocks_held("a"))
    # Prefill computes 6 tokens (2 blocks); decodes compute tokens 7, 8, 9, 10: the 9th
    # token crosses into a third block. The fifth output ends the request and frees it.
    assert held == [2, 2, 2, 3, 0]
    assert driver.tokens_of("a") == 5
    assert driver.finish_reason("a") is FinishReason.LENGTH
    snap = engine.snapshot()
    assert snap.num_free_blocks == SMALL.num_usable_blocks == 6
    assert snap.kv_cache_usage == 0.0
    assert snap.generation_tokens_total == 5
    assert snap.prompt_tokens_total == 6


def test_step_durations_and_token_timestamps_follow_the_cost_model() -> None:
    engine = Engine(SMALL)
    driver = Driver(engine)
    engine.add(spec("a", prompt=10, max_tokens=2), now=0.0)
    first, out1 = driver.step()
    assert first is not None
    assert out1 is not None
    assert first.duration_s == pytest.approx(0.01 + 10 * 0.001 + 0.002)
    assert out1.time_to_first_token_s == pytest.approx((first.duration_s,))
    second, out2 = driver.step()
    assert second is not None
    assert out2 is not None
    assert second.num_tokens == 1
    assert out2.inter_token_latency_s == pytest.approx((second.duration_s,))
    (done,) = out2.finished
    assert done.output_tokens == 2
    assert done.e2e_s == pytest.approx(first.duration_s + second.duration_s)


def test_chunked_prefill_respects_the_token_budget_running_first() -> None:
    config = replace(SMALL, num_blocks=65, max_model_len=200, max_num_batched_tokens=64)
    engine = Engine(config)
    driver = Driver(engine)
    engine.add(spec("a", prompt=100, max_tokens=3), now=0.0)
    engine.add(spec("b", prompt=100, max_tokens=3), now=0.0)
    scheduled = []
    for _ in range(4):
        batch, out = driver.step()
        assert batch is not None
        assert out is not None
        assert batch.num_tokens <= config.max_num_batched_tokens
        scheduled.append((batch.num_tokens, [t.request_id for t in out.tokens]))
    # Step 1: a takes the whole budget. Step 2: a finishes its prompt (36) and b starts (28).
    # Step 3: a decodes (1) before b continues (63). Step 4: a decodes, b completes (9).
    assert scheduled == [(64, []), (64, ["a"]), (64, ["a"]), (10, ["a", "b"])]


def test_waiting_requests_are_bounded_by_max_num_seqs() -> None:
    engine = Engine(replace(SMALL, num_blocks=65, max_num_seqs=2))
    driver = Driver(engine)
    for rid in "abc":
        engine.add(spec(rid, prompt=4, max_tokens=3), now=0.0)
    driver.step()
    assert engine.running_ids() == ["a", "b"]
    assert engine.waiting_ids() == ["c"]
    driver.run_until_idle()
    assert driver.tokens_of("c") == 3


def test_preemption_happens_exactly_when_no_block_is_free_and_takes_the_newest() -> None:
    engine = Engine(SMALL)  # 6 usable blocks of 4 tokens
    driver = Driver(engine)
    for rid in ("a", "b", "c"):
        engine.add(spec(rid, prompt=8, max_tokens=10), now=0.0)
    batch, _ = driver.step()
    assert batch is not None
    assert batch.preempted == ()
    # Three prompts of exactly two blocks fill the pool; each got its first token.
    assert engine.snapshot().num_free_blocks == 0
    assert engine.running_ids() == ["a", "b", "c"]

    batch, out = driver.step()
    assert batch is not None
    assert out is not None
    # a needs a third block for its 9th token: nothing is free, so the most recently admitted
    # request, c, loses its blocks; a takes one and b the other.
    assert batch.preempted == ("c",)
    assert engine.running_ids() == ["a", "b"]
    assert engine.waiting_ids() == ["c"]
    assert engine.status("c") is RequestStatus.PREEMPTED
    assert engine.blocks_held("c") == 0
    assert [t.request_id for t in out.tokens] == ["a", "b"]
    assert engine.snapshot().num_preemptions_total == 1

    # c resumes only after blocks come back, recomputing prompt and the token it had.
    driver.run_until_idle()
    assert driver.tokens_of("c") == 10
    assert engine.snapshot().num_free_blocks == 6


def test_no_admission_from_waiting_in_a_step_that_preempted() -> None:
    engine = Engine(SMALL)
    driver = Driver(engine)
    for rid in ("a", "b", "c"):
        engine.add(spec(rid, prompt=8, max_tokens=10), now=0.0)
    driver.step()
    engine.add(spec("d", prompt=1, max_tokens=1), now=driver.now)
    batch, _ = driver.step()
    assert batch is not None
    assert batch.preempted == ("c",)
    # d would fit nowhere anyway, but vLLM skips the waiting queue after any preemption.
    assert engine.waiting_ids() == ["c", "d"]


def test_a_request_that_is_itself_the_newest_preempts_itself() -> None:
    engine = Engine(replace(SMALL, num_blocks=4, max_model_len=12))  # 3 usable blocks
    driver = Driver(engine)
    engine.add(spec("a", prompt=5, max_tokens=3), now=0.0)  # 2 blocks, room up to 8 tokens
    engine.add(spec("b", prompt=4, max_tokens=3), now=0.0)  # 1 block, full
    driver.step()
    assert engine.snapshot().num_free_blocks == 0
    batch, out = driver.step()
    # a fits its 6th token; b needs a block for its 5th and is itself the newest: it goes.
    assert batch is not None
    assert out is not None
    assert batch.preempted == ("b",)
    assert [t.request_id for t in out.tokens] == ["a"]
    driver.run_until_idle()
    assert driver.tokens_of("b") == 3
    assert engine.snapshot().num_free_blocks == 3


def test_watermark_keeps_blocks_free_for_running_requests() -> None:
    config = replace(SMALL, num_blocks=11, watermark=0.3)  # 10 usable, watermark 3 blocks
    engine = Engine(config)
    driver = Driver(engine)
    engine.add(spec("a", prompt=16, max_tokens=20), now=0.0)  # 4 blocks
    engine.add(spec("b", prompt=16, max_tokens=20), now=0.0)  # 4 more would leave 2 < 3
    driver.step()
    assert engine.running_ids() == ["a"]
    assert engine.waiting_ids() == ["b"]


def test_eos_position_ends_with_stop_and_counts_the_eos_token() -> None:
    engine = Engine(SMALL)
    driver = Driver(engine)
    engine.add(spec("a", prompt=4, max_tokens=10, eos_at=6), now=0.0)
    driver.run_until_idle()
    assert driver.tokens_of("a") == 6
    assert driver.finish_reason("a") is FinishReason.STOP


def test_generation_stops_at_max_model_len() -> None:
    engine = Engine(SMALL)  # max_model_len 24
    driver = Driver(engine)
    engine.add(spec("a", prompt=20, max_tokens=10), now=0.0)
    driver.run_until_idle()
    assert driver.tokens_of("a") == 4
    assert driver.finish_reason("a") is FinishReason.LENGTH


def test_abort_frees_blocks_at_once_even_mid_step() -> None:
    engine = Engine(SMALL)
    engine.add(spec("a", prompt=8, max_tokens=10), now=0.0)
    engine.add(spec("b", prompt=8, max_tokens=10), now=0.0)
    batch = engine.begin_step(0.0)
    assert batch is not None
    assert engine.snapshot().num_free_blocks == 2
    assert engine.abort("a")
    assert engine.snapshot().num_free_blocks == 4
    out = engine.end_step(batch, 1.0)
    assert [t.request_id for t in out.tokens] == ["b"]
    assert engine.abort("b")
    assert not engine.abort("b")
    assert engine.snapshot().num_free_blocks == 6
    assert engine.num_unfinished == 0


def test_abort_of_a_waiting_request() -> None:
    engine = Engine(replace(SMALL, max_num_seqs=1))
    engine.add(spec("a", prompt=4), now=0.0)
    engine.add(spec("b", prompt=4), now=0.0)
    Driver(engine).step()
    assert engine.waiting_ids() == ["b"]
    assert engine.abort("b")
    assert engine.waiting_ids() == []


def test_identical_prompts_share_cached_blocks() -> None:
    config = replace(SMALL, num_blocks=33, max_model_len=64, enable_prefix_caching=True)
    engine = Engine(config)
    driver = Driver(engine)
    engine.add(spec("a", prompt=20, max_tokens=2, prompt_key="p"), now=0.0)
    driver.run_until_idle()
    engine.add(spec("b", prompt=20, max_tokens=2, prompt_key="p"), now=driver.now)
    batch, _ = driver.step()
    assert batch is not None
    # 19 tokens could hit; whole blocks only: 4 blocks (16 tokens) are reused.
    assert batch.prefix_cache_hits == 16
    assert batch.num_tokens == 4
    assert engine.snapshot().prefix_cache_hits_total == 16
    driver.run_until_idle()
    assert engine.snapshot().num_free_blocks == 32


def test_a_resumed_request_reuses_its_surviving_blocks() -> None:
    engine = Engine(replace(SMALL, num_blocks=8, enable_prefix_caching=True))  # 7 usable
    driver = Driver(engine)
    engine.add(spec("a", prompt=8, max_tokens=2), now=0.0)
    engine.add(spec("b", prompt=8, max_tokens=10), now=0.0)
    engine.add(spec("c", prompt=8, max_tokens=10), now=0.0)
    driver.step()  # 6 blocks used, 1 free
    batch, _ = driver.step()
    # a takes the free block; b needs one more, so c is preempted. c's blocks return to the
    # free queue's tail, last block first, so b's allocation evicts c's second block and
    # c's first block survives with its hash. a then finishes.
    assert batch is not None
    assert batch.preempted == ("c",)
    batch, _ = driver.step()
    assert batch is not None
    # c (8 prompt + 1 output token) is readmitted with its first block from the cache and
    # recomputes the other 5 tokens beside b's decode.
    assert batch.num_tokens == 1 + 5  # 4 of c's 9 tokens came from the cache
    # vLLM's prefix-cache counters leave resumed requests out.
    assert batch.prefix_cache_hits == 0
    assert engine.snapshot().prefix_cache_queries_total == 3 * 8
    driver.run_until_idle()
    assert driver.tokens_of("c") == 10
    assert engine.snapshot().num_free_blocks == 7


def test_invalid_configuration_reports_every_problem() -> None:
    bad = EngineConfig(num_blocks=2, block_size=4, max_model_len=100, max_num_seqs=0)
    problems = bad.errors()
    assert len(problems) == 2
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine(bad)


def test_add_rejects_duplicates_and_prompts_without_room() -> None:
    engine = Engine(SMALL)
    engine.add(spec("a", prompt=4), now=0.0)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add(spec("a", prompt=4), now=0.0)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add(spec("b", prompt=24), now=0.0)


# -- properties ------------------------------------------------------------------------------

arrival = st.tuples(
    st.integers(min_value=1, max_value=40),  # prompt tokens
    st.integers(min_value=1, max_value=30),  # max tokens
    st.sampled_from([None, 1, 5]),  # eos_at
    st.integers(min_value=0, max_value=6),  # steps before arriving
    st.sampled_from([None, "shared"]),  # prompt key (shared prompts share blocks)
    st.sampled_from([None, None, None, 0, 3]),  # abort after this many steps
)


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=25),
    num_blocks=st.integers(min_value=14, max_value=40),
    budget=st.integers(min_value=1, max_value=80),
    max_num_seqs=st.integers(min_value=1, max_value=10),
    caching=st.booleans(),
)
def test_pool_is_never_overallocated_and_everything_finishes(
    arrivals: list[tuple[int, int, int | None, int, str | None, int | None]],
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    caching: bool,
) -> None:
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=48,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        step_cost=StepCost(0.001, 0.0, 0.0, 0.0),
    )
    engine = Engine(config)
    driver = Driver(engine)
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][3])
    aborts: dict[int, list[str]] = {}
    expected: dict[str, int] = {}
    step = 0
    while pending or engine.num_unfinished:
        while pending and pending[0][1][3] <= step:
            index, (prompt, max_tokens, eos_at, _, key, abort_after) = pending.pop(0)
            rid = f"r{index}"
            prompt = min(prompt, config.max_model_len - 1)
            engine.add(
                RequestSpec(rid, prompt, max_tokens, eos_at, None if key is None else f"{key}{prompt}"),
                now=driver.now,
            )
            expected[rid] = min(max_tokens, eos_at or max_tokens, config.max_model_len - prompt)
            if abort_after is not None:
                aborts.setdefault(step + abort_after, []).append(rid)
        for rid in aborts.pop(step, []):
            if engine.abort(rid):
                expected.pop(rid)
        batch, _ = driver.step()
        snap = engine.snapshot()
        assert 0 <= snap.num_free_blocks <= config.num_usable_blocks
        assert snap.num_running <= max_num_seqs
        if batch is not None:
            assert 0 < batch.num_tokens <= budget
        held = sum(engine.blocks_held(rid) for rid in expected)
        if not caching:
            # Without sharing, every used block belongs to exactly one live request.
            assert held == config.num_usable_blocks - snap.num_free_blocks
        else:
            assert held >= config.num_usable_blocks - snap.num_free_blocks
        step += 1
        assert step < 5_000, "the engine stopped making progress"
    assert engine.snapshot().num_free_blocks == config.num_usable_blocks
    for rid, tokens in expected.items():
        assert driver.tokens_of(rid) == tokens, rid


@pytest.mark.parametrize(
    ("min_tokens", "ignore_eos", "eos_bias", "natural", "forced", "expected"),
    [
        (0, False, None, None, 7, 7),  # the bench's private field alone
        (20, False, 100.0, None, 7, 7),  # wins over min_tokens and a bias (vLLM stops at any EOS)
        (0, False, -100.0, 3, 7, 7),  # and over a bias against EOS: the processor runs last
        (0, False, None, 3, 7, 7),  # and over the natural length
        (0, True, None, None, 7, None),  # ignore_eos: nothing to force
        (5, False, 100.0, None, None, 6),  # without it, as before
    ],
)
def test_eos_position_with_the_forced_length(
    min_tokens: int, ignore_eos: bool, eos_bias: float | None, natural: int | None, forced: int | None,
    expected: int | None,
) -> None:  # fmt: skip
    position = eos_position(
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        eos_bias=eos_bias,
        natural_length=natural,
        forced_length=forced,
    )
    assert position == expected
