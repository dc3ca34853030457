"""One settings object for an emulator instance, built once at start and validated whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.engine import EngineConfig
from sim.faults import Faults
from sim.lengths import OutputLengthModel

DEFAULT_MODEL_NAME = "tiny-llama"
# EOS of the Llama/Mistral 32k vocabulary the testbed's tokenizer uses. With `tokenizer` set,
# the tokenizer's own EOS id replaces it.
DEFAULT_EOS_TOKEN_ID = 2


@dataclass(frozen=True, slots=True)
class SimConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    model_name: str = DEFAULT_MODEL_NAME
    # Model folder whose tokenizer counts prompts exactly; None counts approximately.
    tokenizer: str | None = None
    eos_token_id: int = DEFAULT_EOS_TOKEN_ID
    output_len: OutputLengthModel = field(default_factory=OutputLengthModel)
    # Seeds the output-length draws and the 5xx fault draws.
    seed: int = 0
    # vLLM 0.32's frontend limits (`--max-num-queued-reqs`, `--max-num-queued-tokens`): 503
    # when unfinished sequences (or prompt tokens not yet prefilled) would exceed them.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    faults: Faults = field(default_factory=Faults)

    def errors(self) -> list[str]:
        problems = list(self.engine.errors())
        problems.extend(self.faults.errors())
        if not self.model_name:
            problems.append("model_name must not be empty")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                problems.append(f"{name} must be >= 0")
        return problems

    def validated(self) -> SimConfig:
        problems = self.errors()
        if problems:
            raise ValueError("invalid emulator configuration: " + "; ".join(problems))
        return self
