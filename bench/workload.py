"""Workloads: what to send and when, as plain values.

A workload is a list of `RequestSpec`s (arrival offset, prompt and output lengths in tokens,
tenant, priority, shared prefix blocks). It comes from a recorded trace (the Azure LLM inference
CSV or the Mooncake JSONL format) or from a seeded synthetic generator, and is then cut
(`take_first`), rescaled in time (`rescale_rate`) and in length (`scale_lengths`), and clamped to
the model's context (`clamp_to_context`). Everything here is pure and deterministic for a given
seed: the same arguments give the same arrivals for every target of a comparison.

Synthetic SPEC format (chosen to need no YAML and to fit on a command line): comma-separated
`key=value` pairs, or the path of a JSON file holding one object with the same keys (values may
then be numbers or the same strings). Keys:

- `n` requests (default 100), `rate` mean arrivals per second (default 1.0);
- `arrival`: `poisson` (default) or `gamma:CV` (alias `bursty:CV`), gamma-distributed gaps with
  coefficient of variation CV (CV > 1 is burstier than Poisson, CV < 1 more regular);
- `prompt`, `output`: a length distribution, one of `N` or `const:N`, `uniform:LO:HI`
  (inclusive), `lognormal:MEDIAN:SIGMA`, `exp:MEAN`; lengths are whole tokens >= 1. Defaults
  `const:128` and `const:64`;
- `tenants`, `priorities`: shares as `name:weight/name:weight` (weights need not sum to 1);
- `prefix`: `GROUPS:TOKENS`: each request starts with one of GROUPS shared prefixes of TOKENS
  tokens (chosen uniformly), so that prefix caching has something to find.

Example: `n=300,rate=4,arrival=gamma:2,prompt=lognormal:200:0.6,output=uniform:10:120,
tenants=a:3/b:1,priorities=high:1/normal:4`.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

# Mooncake's hash_ids each stand for this many prompt tokens (see its trace README).
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload.

    `arrival_s` is the offset in seconds from the start of the run (the first request of a
    trace arrives at 0). `prompt_tokens` and `output_tokens` are the lengths the request must
    have on the wire, as counted by the target's tokenizer. `prefix_blocks` are ids of shared
    prefix blocks of the workload's `block_tokens` tokens each: two requests whose lists start
    alike start with the same text.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    tenant: str | None = None
    priority: str | None = None
    prefix_blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Workload:
    """An ordered (by arrival) list of requests plus what is needed to interpret it."""

    requests: tuple[RequestSpec, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    source: str = ""

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(frozen=True, slots=True)
class ClampStats:
    """How many requests `clamp_to_context` had to shorten, and by how many tokens in all."""

    outputs_clamped: int = 0
    prompts_clamped: int = 0
    output_tokens_removed: int = 0
    prompt_tokens_removed: int = 0


class WorkloadError(ValueError):
    """A trace or spec that cannot be turned into a workload."""


# --------------------------------------------------------------------------------------------
# Traces


def _parse_azure_timestamp(text: str) -> float:
    """'2023-11-16 18:17:03.9799600' -> POSIX seconds (UTC). The trace has 7 fractional
    digits, more than strptime's %f accepts, so the fraction is parsed on its own."""
    whole, _, fraction = text.strip().partition(".")
    moment = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    return moment.timestamp() + (float("0." + fraction) if fraction else 0.0)


def parse_azure_csv(lines: Iterable[str], source: str = "azure") -> Workload:
    """Azure LLM inference trace: columns TIMESTAMP, ContextTokens, GeneratedTokens."""
    reader = csv.DictReader(lines)
    needed = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if reader.fieldnames is None or not needed <= set(reader.fieldnames):
        raise WorkloadError(f"{source}: expected columns {sorted(needed)}, got {reader.fieldnames}")
    rows: list[tuple[float, int, int]] = []
    for line_no, row in enumerate(reader, start=2):
        try:
            rows.append(
                (
                    _parse_azure_timestamp(row["TIMESTAMP"]),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
        except (TypeError, ValueError) as exc:
            raise WorkloadError(f"{source}:{line_no}: {exc}") from exc
    return _from_rows(((t, p, o, ()) for t, p, o in rows), MOONCAKE_BLOCK_TOKENS, source)


def parse_mooncake_jsonl(lines: Iterable[str], source: str = "mooncake") -> Workload:
    """Mooncake trace: one JSON object per line with timestamp (ms), input_length,
    output_length and hash_ids (ids of 512-token prefix blocks)."""
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            rows.append(
                (
                    float(obj["timestamp"]) / 1000.0,
                    int(obj["input_length"]),
                    int(obj["output_length"]),
                    tuple(int(h) for h in obj.get("hash_ids", ())),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(f"{source}:{line_no}: {exc!r}") from exc
    return _from_rows(rows, MOONCAKE_BLOCK_TOKENS, source)


def _from_rows(
    rows: Iterable[tuple[float, int, int, tuple[int, ...]]], block_tokens: int, source: str
) -> Workload:
    # Stable sort: rows recorded at the same instant keep their order in the file.
    ordered = sorted(rows, key=lambda row: row[0])
    if not ordered:
        raise WorkloadError(f"{source}: no requests")
    start = ordered[0][0]
    requests = tuple(
        RequestSpec(
            arrival_s=t - start,
            # A trace row with 0 tokens still costs one token on a real server.
            prompt_tokens=max(1, p),
            output_tokens=max(1, o),
            prefix_blocks=h,
        )
        for t, p, o, h in ordered
    )
    return Workload(requests=requests, block_tokens=block_tokens, source=source)


def load_trace(path: str | Path) -> Workload:
    """Load a trace file; the suffix picks the format (.csv: Azure, .jsonl/.json: Mooncake)."""
    file = Path(path)
    suffix = file.suffix.lower()
    with file.open(encoding="utf-8", newline="") as handle:
        if suffix == ".csv":
            return parse_azure_csv(handle, source=file.name)
        if suffix in (".jsonl", ".json"):
            return parse_mooncake_jsonl(handle, source=file.name)
    raise WorkloadError(f"{file}: unknown trace format (expected .csv or .jsonl)")


# --------------------------------------------------------------------------------------------
# Transformations


def take_first(workload: Workload, n: int) -> Workload:
    """The first `n` arrivals (all of them when n is larger)."""
    if n < 1:
        raise WorkloadError("n must be at least 1")
    return replace(workload, requests=workload.requests[:n])


def mean_rate(workload: Workload) -> float | None:
    """Arrivals per second between the first and the last arrival; None when undefined."""
    reqs = workload.requests
    if len(reqs) < 2:
        return None
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    return (len(reqs) - 1) / span if span > 0 else None


def offered_seconds(workload: Workload) -> float:
    """The time over which the load is offered: n arrivals at mean rate r cover n / r seconds
    (the arrival span plus one mean gap). 0 for a single request or a burst at one instant."""
    rate = mean_rate(workload)
    return len(workload) / rate if rate else 0.0


def rescale_rate(workload: Workload, rate: float) -> Workload:
    """Stretch or squeeze arrival times so that the mean rate becomes `rate` requests per
    second, keeping the trace's shape (bursts stay bursts, relatively)."""
    if rate <= 0 or not math.isfinite(rate):
        raise WorkloadError("rate must be a positive number")
    current = mean_rate(workload)
    if current is None:
        if len(workload) < 2:
            return workload
        raise WorkloadError("cannot rescale: all requests arrive at the same instant")
    factor = current / rate
    return replace(
        workload,
        requests=tuple(replace(r, arrival_s=r.arrival_s * factor) for r in workload.requests),
    )


def _scaled(tokens: int, scale: float) -> int:
    return max(1, round(tokens * scale))


def scale_lengths(workload: Workload, ctx_scale: float = 1.0, gen_scale: float = 1.0) -> Workload:
    """Multiply prompt lengths by `ctx_scale` and output lengths by `gen_scale` (rounded, at
    least 1). Prefix blocks shrink with the prompt so that shared prefixes stay proportional."""
    if ctx_scale <= 0 or gen_scale <= 0:
        raise WorkloadError("scales must be positive")
    return replace(
        workload,
        block_tokens=_scaled(workload.block_tokens, ctx_scale),
        requests=tuple(
            replace(
                r,
                prompt_tokens=_scaled(r.prompt_tokens, ctx_scale),
                output_tokens=_scaled(r.output_tokens, gen_scale),
            )
            for r in workload.requests
        ),
    )


def clamp_to_context(
    workload: Workload, max_model_len: int | None, max_output_tokens: int | None = None
) -> tuple[Workload, ClampStats]:
    """Make every request fit: output <= `max_output_tokens` and prompt + output <=
    `max_model_len`. The output keeps its length when it can (it is what the trace says the
    client wanted) and the prompt gives way; the prompt keeps at least one token."""
    outputs_clamped = prompts_clamped = out_removed = prompt_removed = 0
    out: list[RequestSpec] = []
    for r in workload.requests:
        output = r.output_tokens
        if max_output_tokens is not None:
            output = min(output, max_output_tokens)
        if max_model_len is not None:
            output = min(output, max_model_len - 1)
        prompt = r.prompt_tokens
        if max_model_len is not None:
            prompt = min(prompt, max_model_len - output)
        if output != r.output_tokens:
            outputs_clamped += 1
            out_removed += r.output_tokens - output
        if prompt != r.prompt_tokens:
            prompts_clamped += 1
            prompt_removed += r.prompt_tokens - prompt
        out.append(replace(r, prompt_tokens=prompt, output_tokens=output))
    stats = ClampStats(outputs_clamped, prompts_clamped, out_removed, prompt_removed)
    return replace(workload, requests=tuple(out)), stats


# --------------------------------------------------------------------------------------------
# Tenants and priorities


@dataclass(frozen=True, slots=True)
class Shares:
    """Named weights, e.g. tenants a:3 and b:1. Empty means "not set"."""

    names: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()

    def pick(self, rng: random.Random) -> str | None:
        if not self.names:
            return None
        return rng.choices(self.names, weights=self.weights, k=1)[0]


def parse_shares(text: str) -> Shares:
    """'a:3/b:1' -> Shares(('a', 'b'), (3.0, 1.0)); a name without weight weighs 1."""
    names: list[str] = []
    weights: list[float] = []
    for part in text.split("/"):
        part = part.strip()
        if not part:
            continue
        name, _, weight = part.partition(":")
        try:
            value = float(weight) if weight else 1.0
        except ValueError as exc:
            raise WorkloadError(f"bad share {part!r}") from exc
        if not name or value < 0 or not math.isfinite(value):
            raise WorkloadError(f"bad share {part!r}")
        names.append(name)
        weights.append(value)
    if names and sum(weights) <= 0:
        raise WorkloadError(f"shares {text!r} weigh nothing")
    return Shares(tuple(names), tuple(weights))


def assign_mix(workload: Workload, tenants: Shares, priorities: Shares, seed: int) -> Workload:
    """Give each request a tenant and a priority drawn by share (seeded, independent of the
    arrivals so that the same seed labels the same requests alike)."""
    rng = random.Random(f"{seed}:mix")
    return replace(
        workload,
        requests=tuple(
            replace(
                r,
                tenant=tenants.pick(rng) or r.tenant,
                priority=priorities.pick(rng) or r.priority,
            )
            for r in workload.requests
        ),
    )


# --------------------------------------------------------------------------------------------
# Synthetic workloads


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution of token lengths; `sample` returns whole tokens >= 1."""

    kind: str
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "const":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "lognormal":
            value = self.a * math.exp(rng.gauss(0.0, self.b))
        elif self.kind == "exp":
            value = rng.expovariate(1.0 / self.a)
        else:  # pragma: no cover - parse_length_dist only builds the kinds above
            raise WorkloadError(f"unknown distribution {self.kind!r}")
        return max(1, round(value))


def parse_length_dist(text: str) -> LengthDist:
    kind, _, rest = text.strip().partition(":")
    try:
        if not rest and kind.replace(".", "", 1).isdigit():
            return LengthDist("const", float(kind))
        args = [float(x) for x in rest.split(":")] if rest else []
        if kind == "const" and len(args) == 1 and args[0] >= 1:
            return LengthDist("const", args[0])
        if kind == "uniform" and len(args) == 2 and 1 <= args[0] <= args[1]:
            return LengthDist("uniform", args[0], args[1])
        if kind == "lognormal" and len(args) == 2 and args[0] > 0 and args[1] >= 0:
            return LengthDist("lognormal", args[0], args[1])
        if kind == "exp" and len(args) == 1 and args[0] > 0:
            return LengthDist("exp", args[0])
    except ValueError as exc:
        raise WorkloadError(f"bad length distribution {text!r}") from exc
    raise WorkloadError(
        f"bad length distribution {text!r} (want N, const:N, uniform:LO:HI, "
        "lognormal:MEDIAN:SIGMA or exp:MEAN)"
    )


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """Parameters of a synthetic workload (see the module docstring for the text format)."""

    n: int = 100
    rate: float = 1.0
    arrival_cv: float = 1.0  # 1.0 is Poisson
    prompt: LengthDist = LengthDist("const", 128)
    output: LengthDist = LengthDist("const", 64)
    tenants: Shares = Shares()
    priorities: Shares = Shares()
    prefix_groups: int = 0
    prefix_tokens: int = 0


_SPEC_KEYS = ("n", "rate", "arrival", "prompt", "output", "tenants", "priorities", "prefix")


def parse_synthetic_spec(text: str) -> SyntheticSpec:
    """Parse a SPEC string or the path of a JSON file with the same keys."""
    candidate = Path(text)
    fields: Mapping[str, object]
    if text.endswith(".json") and candidate.is_file():
        loaded = json.loads(candidate.read_text(encoding="utf-8"))
        if not isinstance(loaded, dict):
            raise WorkloadError(f"{text}: expected a JSON object")
        fields = loaded
    else:
        pairs: dict[str, object] = {}
        for part in text.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep:
                raise WorkloadError(f"bad SPEC item {part!r} (want key=value)")
            pairs[key.strip()] = value.strip()
        fields = pairs
    unknown = sorted(set(fields) - set(_SPEC_KEYS))
    if unknown:
        raise WorkloadError(f"unknown SPEC keys {unknown}; known: {list(_SPEC_KEYS)}")
    spec = SyntheticSpec()
    try:
        if "n" in fields:
            spec = replace(spec, n=int(str(fields["n"])))
        if "rate" in fields:
            spec = replace(spec, rate=float(str(fields["rate"])))
        if "arrival" in fields:
            spec = replace(spec, arrival_cv=_parse_arrival(str(fields["arrival"])))
        if "prompt" in fields:
            spec = replace(spec, prompt=parse_length_dist(str(fields["prompt"])))
        if "output" in fields:
            spec = replace(spec, output=parse_length_dist(str(fields["output"])))
        if "tenants" in fields:
            spec = replace(spec, tenants=parse_shares(str(fields["tenants"])))
        if "priorities" in fields:
            spec = replace(spec, priorities=parse_shares(str(fields["priorities"])))
        if "prefix" in fields:
            groups, _, tokens = str(fields["prefix"]).partition(":")
            spec = replace(spec, prefix_groups=int(groups), prefix_tokens=int(tokens))
    except ValueError as exc:
        raise WorkloadError(f"bad SPEC {text!r}: {exc}") from exc
    if spec.n < 1 or spec.rate <= 0 or spec.prefix_groups < 0 or spec.prefix_tokens < 0:
        raise WorkloadError(f"bad SPEC {text!r}: n >= 1, rate > 0, prefix >= 0 required")
    if spec.prefix_groups and not spec.prefix_tokens:
        raise WorkloadError(f"bad SPEC {text!r}: prefix wants GROUPS:TOKENS")
    return spec


def _parse_arrival(text: str) -> float:
    kind, _, arg = text.partition(":")
    if kind == "poisson" and not arg:
        return 1.0
    if kind in ("gamma", "bursty"):
        cv = float(arg)
        if cv > 0:
            return cv
    raise WorkloadError(f"bad arrival {text!r} (want poisson or gamma:CV)")


def generate_synthetic(spec: SyntheticSpec, seed: int) -> Workload:
    """Draw a workload from `spec`. Gaps are gamma-distributed with mean 1/rate and the given
    coefficient of variation (shape 1/CV^2; CV 1 is the exponential, i.e. Poisson arrivals)."""
    rng = random.Random(f"{seed}:synthetic")
    shape = 1.0 / (spec.arrival_cv**2)
    scale = 1.0 / (spec.rate * shape)
    now = 0.0
    requests: list[RequestSpec] = []
    for i in range(spec.n):
        if i:
            now += rng.gammavariate(shape, scale)
        prompt = spec.prompt.sample(rng)
        prefix: tuple[int, ...] = ()
        if spec.prefix_groups:
            # One block per group: ids far from 0 never collide with a trace's own hash ids.
            prefix = (1_000_000_000 + rng.randrange(spec.prefix_groups),)
            prompt += spec.prefix_tokens
        requests.append(
            RequestSpec(
                arrival_s=now,
                prompt_tokens=prompt,
                output_tokens=spec.output.sample(rng),
                tenant=spec.tenants.pick(rng),
                priority=spec.priorities.pick(rng),
                prefix_blocks=prefix,
            )
        )
    return Workload(
        requests=tuple(requests),
        block_tokens=spec.prefix_tokens or MOONCAKE_BLOCK_TOKENS,
        source="synthetic",
    )


def describe(workload: Workload) -> dict[str, float | int | str]:
    """Headline numbers of a workload for the report."""
    prompts = sorted(r.prompt_tokens for r in workload.requests)
    outputs = sorted(r.output_tokens for r in workload.requests)
    return {
        "source": workload.source,
        "requests": len(workload),
        "offered_s": offered_seconds(workload),
        "mean_rate_per_s": mean_rate(workload) or 0.0,
        "prompt_tokens_total": sum(prompts),
        "output_tokens_total": sum(outputs),
        "prompt_tokens_p50": _median(prompts),
        "output_tokens_p50": _median(outputs),
        "prompt_tokens_max": prompts[-1] if prompts else 0,
        "output_tokens_max": outputs[-1] if outputs else 0,
        "prefix_block_tokens": workload.block_tokens,
        "requests_with_prefix_blocks": sum(1 for r in workload.requests if r.prefix_blocks),
    }


def _median(sorted_values: Sequence[int]) -> float:
    if not sorted_values:
        return 0.0
    mid = len(sorted_values) // 2
    if len(sorted_values) % 2:
        return float(sorted_values[mid])
    return (sorted_values[mid - 1] + sorted_values[mid]) / 2.0
