"""A vLLM logits processor that forces a request's output length by a private field.

The bench replays traces whose output lengths are known, on a random-weight model that would
otherwise never stop before `max_tokens`. It used to force them with `min_tokens` plus a large
EOS `logit_bias`, but kvgate reads `min_tokens` (a floor on the answer is KV it must reserve),
so that path hands the gateway the answer it is meant to predict. This processor reads the
length from `vllm_xargs.kvgate_bench_output_tokens` instead, a field no gateway has a reason
to read: vLLM's OpenAI server puts `vllm_xargs` into `SamplingParams.extra_args`, where this
processor finds it.

For a request carrying the field with value N (an integer >= 1) it masks EOS and every stop
token while fewer than N - 1 tokens exist, then allows only EOS as token N, so that the answer
has exactly N completion tokens (vLLM counts the EOS, as it did with the old path), or fewer if
`max_tokens` or the context ends it first. Requests without the field are untouched. With
`ignore_eos` the request has no EOS to force, and the field is ignored.

Loaded by every testbed engine (tests/testbed/testbed.py adds this folder to the engine's
PYTHONPATH and passes `--logits-processors bench_lengths:ForcedOutputLength`). It runs inside
vLLM's own environment, so it imports vLLM and torch; kvgate never imports it. The emulator
(sim/lengths.py) and the bench (bench/payload.py) name the same field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm.config import VllmConfig

FIELD = "kvgate_bench_output_tokens"
PROCESSOR = "bench_lengths:ForcedOutputLength"


def forced_length(params: SamplingParams) -> int | None:
    """The forced output length of a request, None without the field; ValueError if bad."""
    extra = params.extra_args or {}
    if FIELD not in extra:
        return None
    value = extra[FIELD]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"vllm_xargs.{FIELD} must be an integer >= 1, got {value!r}")
    return value


class _Row:
    """What the processor tracks for one forced request in the persistent batch."""

    __slots__ = ("eos", "output", "stops", "target")

    def __init__(self, target: int, output: list[int], stops: torch.Tensor, eos: int) -> None:
        self.target = target
        # A reference to the request's running output token list (BatchUpdate's contract):
        # its length is the number of tokens produced so far.
        self.output = output
        self.stops = stops
        self.eos = eos


class ForcedOutputLength(LogitsProcessor):
    """Exactly `vllm_xargs.kvgate_bench_output_tokens` completion tokens, EOS last."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        # Runs in the API server: a bad value is a 400, not an engine error.
        forced_length(sampling_params)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        # Masking EOS and forcing it changes which token greedy sampling picks.
        return False

    def _new_row(self, params: SamplingParams, _prompt: list[int] | None, output: list[int]) -> _Row | None:
        target = forced_length(params)
        eos = params.eos_token_id  # None with ignore_eos: nothing to force
        if target is None or eos is None:
            return None
        stops = sorted(set(params.all_stop_token_ids) | {eos})
        return _Row(target, output, torch.tensor(stops, dtype=torch.long, device=self.device), eos)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # Custom processors run after vLLM's built-in ones (min_tokens, logit_bias), so the
        # forcing below has the last word over them.
        for index, row in self.rows.items():
            position = len(row.output) + 1  # the 1-based position of the token sampled now
            if position < row.target:
                logits[index, row.stops] = float("-inf")
            elif position == row.target:
                logits[index] = float("-inf")
                logits[index, row.eos] = 0.0
        return logits
