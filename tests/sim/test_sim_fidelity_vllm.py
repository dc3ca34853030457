"""A short fidelity check: the same burst on the real testbed and on the calibrated emulator.

Eight requests of 200 prompt and 300 output tokens arrive at once. Each grows to 16 blocks
and the pool has 63, so vLLM must preempt while they decode: this exercises the block
accounting, the victim choice and recompute, and the step cost, in a few seconds. The full
comparison (a trace slice at three loads) is `python -m sim.fidelity compare`.

The emulator's step cost is calibrated first, on the same testbed and in the same minute: the
testbed's speed drifts by a fifth or more between sessions on this shared machine (the same burst
ran at 446-532 tok/s in one CI run and 556-710 in others), so defaults fitted on another day would
test the day rather than the model. The calibration probes (decode steps, single prefills, bursts
of one-token requests) share nothing with the burst below but the engine, so a wrong model of
batching, preemption or recompute still fails.
"""

from __future__ import annotations

import os

import pytest

from sim.fidelity import (
    OTHER_LOAD_LIMIT_CORES,
    TraceRequest,
    calibrate,
    replay_alone,
    sim_config_for_testbed,
    within_targets,
)
from sim.testing import running_sim_process

pytestmark = pytest.mark.vllm

BURST = [TraceRequest(arrival_s=0.0, prompt_tokens=200, output_tokens=300) for _ in range(8)]


@pytest.fixture
def real_vllm_url() -> str:
    url = os.environ.get("KVGATE_TEST_VLLM_URL")
    if not url:
        pytest.skip("KVGATE_TEST_VLLM_URL is not set")
    return url.rstrip("/")


# Even within a minute the testbed's speed varies by a tenth or more, and so does a calibration
# taken from it: each attempt calibrates anew, runs the emulator, then the testbed, and the test
# passes when one attempt is within the targets.
ATTEMPTS = 3


# Three attempts of a calibration and two replays of the burst take 1-2 minutes on a quick
# machine; on one several times slower (seen: 10M loop iterations of Python in 3.3 s) over 5.
@pytest.mark.timeout(1200)
async def test_burst_throughput_and_preemptions_match_the_testbed(real_vllm_url: str) -> None:
    reports = []
    busy_attempts = 0
    for _ in range(ATTEMPTS):
        calibration = await calibrate(real_vllm_url, repeats=3)
        with running_sim_process(sim_config_for_testbed(calibration.cost)) as sim_url:
            sim = await replay_alone(sim_url, BURST, seed=3)
        real = await replay_alone(real_vllm_url, BURST, seed=3)
        busy = max(real.other_load_cores, sim.other_load_cores)
        report = (
            f"real {real.tokens_per_s:.0f} tok/s, {real.preemptions:.0f} preemptions; "
            f"sim {sim.tokens_per_s:.0f} tok/s, {sim.preemptions:.0f} preemptions "
            f"(calibrated {calibration.cost})"
        )
        reports.append(report)
        if busy > OTHER_LOAD_LIMIT_CORES:
            busy_attempts += 1  # timing means nothing while other work takes the machine's CPU
            continue
        assert real.completed == sim.completed == len(BURST), report
        assert real.output_tokens == sim.output_tokens == 8 * 300, report
        # The burst cannot fit: both must preempt.
        assert real.preemptions > 0, report
        if all(within_targets(real, sim)):
            return
    if busy_attempts == ATTEMPTS:
        pytest.skip("the machine was busy with other work on every attempt")
    pytest.fail("no attempt within the fidelity targets: " + " | ".join(reports))
