"""Where a sequence ends: the sampling parameters that force it, else a length distribution.

The testbed's model has random weights, so on its own it practically never samples EOS and
every request runs to `max_tokens`. Clients and the bench control the length the way vLLM
lets them: `ignore_eos`, `min_tokens`, and a large `logit_bias` on the EOS token, which makes
EOS the first token the `min_tokens` mask allows. The bench forces lengths by a private path
instead, which a gateway has no reason to read: `vllm_xargs.kvgate_bench_output_tokens` = N,
honoured by the testbed's logits processor (tests/testbed/bench_lengths.py) and here alike:
EOS as output token N exactly. Anything else draws the model's "natural" length from a
configurable distribution, seeded so that runs repeat.

Distribution specs (`--output-len`):
  max                      never EOS: run to max_tokens (what the testbed's model does)
  fixed:N                  EOS as output token N
  uniform:LO:HI            N uniform in [LO, HI]
  exponential:MEAN         geometric-like, mean MEAN
  lognormal:MEDIAN:SIGMA   N = round(MEDIAN * exp(SIGMA * z)), z standard normal
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import StrEnum

# A logit bias at least this large on EOS makes it win as soon as it is allowed; one at most
# its negative keeps it from ever winning. vLLM clamps biases to [-100, 100]; the bench
# uses +100.
FORCE_EOS_BIAS = 20.0
# The private `vllm_xargs` key of the bench's forced output length; bench/payload.py and the
# testbed's logits processor name the same key.
OUTPUT_TOKENS_FIELD = "kvgate_bench_output_tokens"


class LengthKind(StrEnum):
    MAX = "max"
    FIXED = "fixed"
    UNIFORM = "uniform"
    EXPONENTIAL = "exponential"
    LOGNORMAL = "lognormal"


@dataclass(frozen=True, slots=True)
class OutputLengthModel:
    """The natural output length (EOS included) of a sequence nothing else stops."""

    kind: LengthKind = LengthKind.MAX
    a: float = 0.0
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> OutputLengthModel:
        """Parse a spec such as `lognormal:13:1.2`; raises ValueError with the reason."""
        name, *raw = spec.strip().split(":")
        try:
            kind = LengthKind(name)
        except ValueError:
            choices = ", ".join(k.value for k in LengthKind)
            raise ValueError(f"unknown output length model {name!r}; use one of {choices}") from None
        arity = {
            LengthKind.MAX: 0,
            LengthKind.FIXED: 1,
            LengthKind.UNIFORM: 2,
            LengthKind.EXPONENTIAL: 1,
            LengthKind.LOGNORMAL: 2,
        }[kind]
        if len(raw) != arity:
            raise ValueError(f"{kind.value} takes {arity} parameter(s), got {spec!r}")
        try:
            values = [float(v) for v in raw]
        except ValueError:
            raise ValueError(f"non-numeric parameter in {spec!r}") from None
        a = values[0] if values else 0.0
        b = values[1] if len(values) > 1 else 0.0
        if kind is not LengthKind.MAX and a < 1:
            raise ValueError(f"first parameter of {spec!r} must be >= 1")
        if kind is LengthKind.UNIFORM and b < a:
            raise ValueError(f"uniform needs LO <= HI, got {spec!r}")
        if kind is LengthKind.LOGNORMAL and b < 0:
            raise ValueError(f"lognormal SIGMA must be >= 0, got {spec!r}")
        return cls(kind, a, b)

    def spec(self) -> str:
        """The spec string `parse` reads back into this model."""
        params = {
            LengthKind.MAX: (),
            LengthKind.FIXED: (self.a,),
            LengthKind.UNIFORM: (self.a, self.b),
            LengthKind.EXPONENTIAL: (self.a,),
            LengthKind.LOGNORMAL: (self.a, self.b),
        }[self.kind]
        return ":".join([self.kind.value, *(f"{p:g}" for p in params)])

    def draw(self, rng: random.Random) -> int | None:
        """A length >= 1, or None when the model never stops by itself."""
        if self.kind is LengthKind.MAX:
            return None
        if self.kind is LengthKind.FIXED:
            value = self.a
        elif self.kind is LengthKind.UNIFORM:
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind is LengthKind.EXPONENTIAL:
            value = math.ceil(rng.expovariate(1.0 / self.a))
        else:
            value = round(self.a * math.exp(self.b * rng.gauss(0.0, 1.0)))
        return max(1, int(value))


def eos_position(
    *,
    min_tokens: int,
    ignore_eos: bool,
    eos_bias: float | None,
    natural_length: int | None,
    forced_length: int | None = None,
) -> int | None:
    """The output position (1-based, EOS counted) where EOS is sampled, or None for never.

    vLLM masks EOS while fewer than `min_tokens` tokens were generated, so the earliest EOS
    is token `min_tokens + 1`: `min_tokens=5` with a forcing bias yields 6 completion tokens,
    as the testbed answers. A `forced_length` (the bench's private field) wins over both: the
    testbed's processor runs after vLLM's own and allows only EOS at that position, and vLLM
    0.32 stops at an EOS whatever `min_tokens` said. With `ignore_eos` there is no EOS to force.
    """
    if ignore_eos:
        return None
    if forced_length is not None:
        return forced_length
    if eos_bias is not None and eos_bias <= -FORCE_EOS_BIAS:
        return None
    earliest = min_tokens + 1
    if eos_bias is not None and eos_bias >= FORCE_EOS_BIAS:
        return earliest
    if natural_length is None:
        return None
    return max(natural_length, earliest)
