"""Aggregation of run records into the figures the bench reports, and their rendering (pure).

The definitions of every figure are in `DEFINITIONS`, which report.md prints as well.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from bench.promtext import Reading
from bench.records import RequestRecord, RunResult

DEFAULT_TTFT_SLO_S = 2.0
# A refusal is early when it comes this soon after the request was sent (issue 20: at least
# 98% of 429s within 1 s of arrival).
PROMPT_REFUSAL_S = 1.0

DEFINITIONS = """\
- outcome of a request: `shed` when answered 429 or 503; `late` when the client gave up at its
  deadline; `ok` when the stream finished properly within the deadline (always, without one);
  `error` otherwise (other statuses, broken streams, transport errors).
- offered time: the span over which the workload offers its load, n / mean arrival rate (the
  same for every target of a comparison, so per-second figures compare like tokens).
- useful output tokens: the client's count of output tokens of `ok` requests.
- goodput: `ok` requests (and their output tokens) per second of offered time; the SLO form
  also requires the first token within the TTFT objective (DistServe's goodput).
- backend generated tokens, prompt tokens (and those found in the prefix cache) and
  preemptions: deltas of vLLM's `generation_tokens_total`, `prompt_tokens_total`
  (`prompt_tokens_cached_total`) and `num_preemptions_total` over the run, from the scrape before it to the scrape after the
  backend went idle; wasted = backend generated tokens - useful output tokens. The client's own
  count is reported beside the backend's: under preemption vLLM's counter has been seen below
  what clients received, and the client side is the one to trust. vLLM counts a request's
  prompt once, at its first token; when its prompt-token counter moved by more than all the
  prompts this run sent, someone else used the backend meanwhile and the report says so.
- refusals (429 and 503, `shed`): the share that came within 1 s of the request's start, and
  how many came after the request's own deadline (`--deadline`; none without one) or after its
  first-token objective; a refusal after either is one the client could no longer use.
- TTFT over requests that received a token; TPOT (time per output token after the first) and
  end-to-end latency over `ok` requests; time to a rejection over `shed` requests.
- fairness: each tenant's served fraction x = useful output tokens / output tokens it asked
  for; Jain's index (sum x)^2 / (n * sum x^2) over tenants, 1 when all are served alike.
"""

SHED_STATUSES = frozenset({429, 503})


class Outcome(StrEnum):
    OK = "ok"
    LATE = "late"
    SHED = "shed"
    ERROR = "error"


def classify(record: RequestRecord, deadline_s: float | None) -> Outcome:
    if record.status in SHED_STATUSES:
        return Outcome.SHED
    if record.gave_up:
        return Outcome.LATE
    if record.status == 200 and record.finished and record.error is None:
        if deadline_s is not None and record.e2e_s is not None and record.e2e_s > deadline_s:
            return Outcome.LATE
        return Outcome.OK
    return Outcome.ERROR


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default method); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index of non-negative allocations: 1 when all equal, 1/n when one
    gets everything; None when there is nothing to judge (no values, or all zero)."""
    squares = sum(v * v for v in values)
    if not values or squares == 0:
        return None
    return sum(values) ** 2 / (len(values) * squares)


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99))


@dataclass(frozen=True, slots=True)
class TenantShare:
    """A tenant's demand and service. `service_share` is its part of all useful tokens;
    `served_fraction` the part of its own demand it got."""

    tenant: str
    sent: int
    ok: int
    demand_tokens: int
    useful_tokens: int
    service_share: float
    demand_share: float
    served_fraction: float


@dataclass(frozen=True, slots=True)
class Summary:
    """Every figure of one run (see the module docstring for definitions)."""

    target: str
    sent: int
    ok: int
    late: int
    shed: int
    errors: int
    offered_s: float
    duration_s: float
    deadline_s: float | None
    ttft_slo_s: float
    useful_tokens: int
    useful_tokens_per_s: float
    goodput_rps: float
    goodput_tokens_per_s: float
    goodput_slo_requests: int
    goodput_slo_rps: float
    goodput_slo_tokens_per_s: float
    client_output_tokens: int
    client_prompt_tokens: int
    backend_generation_tokens: float | None
    backend_prompt_tokens: float | None
    backend_cached_prompt_tokens: float | None
    backend_shared: bool | None
    backend_tokens_wasted: float | None
    preemptions: float | None
    ttft_s: Percentiles
    tpot_s: Percentiles
    e2e_s: Percentiles
    itl_s: Percentiles
    time_to_rejection_s: Percentiles
    refusals_within_1s_share: float | None  # None without refusals
    refusals_after_deadline: int | None  # None without a deadline
    refusals_after_ttft_slo: int
    retry_after_s: Percentiles
    start_lag_s: Percentiles
    start_lag_max_s: float | None
    max_in_flight: int
    forced_length_exact: int
    prompt_length_exact: int
    tenants: tuple[TenantShare, ...]
    jain_index: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def counter_delta(
    baseline: Mapping[str, Reading],
    final: Mapping[str, Reading],
    sources: Sequence[str],
    field: str,
) -> float | None:
    """Sum over `sources` of final - baseline of a counter field; None when any side lacks it."""
    total = 0.0
    for source in sources:
        before = baseline.get(source)
        after = final.get(source)
        if before is None or after is None:
            return None
        a, b = getattr(after, field), getattr(before, field)
        if a is None or b is None:
            return None
        total += a - b
    return total if sources else None


def _per_second(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def tenant_shares(
    records: Sequence[RequestRecord], outcomes: Sequence[Outcome]
) -> tuple[tuple[TenantShare, ...], float | None]:
    """Per-tenant demand and service (unlabelled requests count as tenant '-'), and Jain's
    index over the tenants' served fractions."""
    sent: dict[str, int] = {}
    ok: dict[str, int] = {}
    demand: dict[str, int] = {}
    useful: dict[str, int] = {}
    for record, outcome in zip(records, outcomes, strict=True):
        name = record.tenant or "-"
        sent[name] = sent.get(name, 0) + 1
        demand[name] = demand.get(name, 0) + record.output_tokens_wanted
        if outcome is Outcome.OK:
            ok[name] = ok.get(name, 0) + 1
            useful[name] = useful.get(name, 0) + record.output_tokens
    total_useful = sum(useful.values())
    total_demand = sum(demand.values())
    shares = tuple(
        TenantShare(
            tenant=name,
            sent=sent[name],
            ok=ok.get(name, 0),
            demand_tokens=demand[name],
            useful_tokens=useful.get(name, 0),
            service_share=_ratio(useful.get(name, 0), total_useful),
            demand_share=_ratio(demand[name], total_demand),
            served_fraction=_ratio(useful.get(name, 0), demand[name]),
        )
        for name in sorted(sent)
    )
    return shares, jain_index([s.served_fraction for s in shares])


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def summarize(
    result: RunResult,
    *,
    offered_s: float,
    deadline_s: float | None,
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S,
) -> Summary:
    records = result.records
    outcomes = [classify(r, deadline_s) for r in records]
    ok_records = [r for r, o in zip(records, outcomes, strict=True) if o is Outcome.OK]
    shed_records = [r for r, o in zip(records, outcomes, strict=True) if o is Outcome.SHED]
    slo_records = [r for r in ok_records if r.ttft_s is not None and r.ttft_s <= ttft_slo_s]
    useful = sum(r.output_tokens for r in ok_records)
    # Offered time is the workload's; a burst at one instant has none, so fall back to the
    # run's duration rather than divide by zero.
    seconds = offered_s if offered_s > 0 else result.duration_s
    generated = counter_delta(result.baseline, result.final, result.vllm_sources, "generation_tokens_total")
    backend_prompt = counter_delta(result.baseline, result.final, result.vllm_sources, "prompt_tokens_total")
    tpots = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok_records
        if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1
    ]
    lags = [r.start_lag_s for r in records]
    shares, jain = tenant_shares(records, outcomes)
    refusal_s = [r.e2e_s for r in shed_records if r.e2e_s is not None]
    return Summary(
        target=result.target,
        sent=len(records),
        ok=len(ok_records),
        late=outcomes.count(Outcome.LATE),
        shed=len(shed_records),
        errors=outcomes.count(Outcome.ERROR),
        offered_s=offered_s,
        duration_s=result.duration_s,
        deadline_s=deadline_s,
        ttft_slo_s=ttft_slo_s,
        useful_tokens=useful,
        useful_tokens_per_s=_per_second(useful, seconds),
        goodput_rps=_per_second(len(ok_records), seconds),
        goodput_tokens_per_s=_per_second(useful, seconds),
        goodput_slo_requests=len(slo_records),
        goodput_slo_rps=_per_second(len(slo_records), seconds),
        goodput_slo_tokens_per_s=_per_second(sum(r.output_tokens for r in slo_records), seconds),
        client_output_tokens=sum(r.output_tokens for r in records),
        client_prompt_tokens=sum(r.usage_prompt_tokens or 0 for r in records),
        backend_generation_tokens=generated,
        backend_prompt_tokens=backend_prompt,
        backend_cached_prompt_tokens=counter_delta(
            result.baseline, result.final, result.vllm_sources, "prompt_tokens_cached_total"
        ),
        backend_shared=(
            None if backend_prompt is None else backend_prompt > sum(r.prompt_tokens_wanted for r in records)
        ),
        backend_tokens_wasted=None if generated is None else generated - useful,
        preemptions=counter_delta(result.baseline, result.final, result.vllm_sources, "preemptions_total"),
        ttft_s=Percentiles.of([r.ttft_s for r in records if r.ttft_s is not None]),
        tpot_s=Percentiles.of(tpots),
        e2e_s=Percentiles.of([r.e2e_s for r in ok_records if r.e2e_s is not None]),
        itl_s=Percentiles.of([g for r in ok_records for g in r.gaps_s]),
        time_to_rejection_s=Percentiles.of(refusal_s),
        refusals_within_1s_share=(
            sum(1 for s in refusal_s if s <= PROMPT_REFUSAL_S) / len(refusal_s) if refusal_s else None
        ),
        refusals_after_deadline=(None if deadline_s is None else sum(1 for s in refusal_s if s > deadline_s)),
        refusals_after_ttft_slo=sum(1 for s in refusal_s if s > ttft_slo_s),
        retry_after_s=Percentiles.of([r.retry_after_s for r in shed_records if r.retry_after_s is not None]),
        start_lag_s=Percentiles.of(lags),
        start_lag_max_s=max(lags) if lags else None,
        max_in_flight=result.max_in_flight,
        forced_length_exact=sum(1 for r in ok_records if r.output_tokens == r.output_tokens_wanted),
        prompt_length_exact=sum(1 for r in records if r.usage_prompt_tokens == r.prompt_tokens_wanted),
        tenants=shares,
        jain_index=jain,
    )


# --------------------------------------------------------------------------------------------
# Comparison and rendering

# (label, how to read it from a Summary, format) for the side-by-side table.
_ROWS: tuple[tuple[str, str, str], ...] = (
    ("sent", "sent", "{:.0f}"),
    ("ok", "ok", "{:.0f}"),
    ("late", "late", "{:.0f}"),
    ("shed (429/503)", "shed", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("useful output tokens/s", "useful_tokens_per_s", "{:.1f}"),
    ("goodput req/s", "goodput_rps", "{:.3f}"),
    ("goodput (TTFT SLO) req/s", "goodput_slo_rps", "{:.3f}"),
    ("goodput (TTFT SLO) tokens/s", "goodput_slo_tokens_per_s", "{:.1f}"),
    ("client output tokens", "client_output_tokens", "{:.0f}"),
    ("backend generated tokens", "backend_generation_tokens", "{:.0f}"),
    ("backend tokens wasted", "backend_tokens_wasted", "{:.0f}"),
    ("backend prompt tokens", "backend_prompt_tokens", "{:.0f}"),
    ("  of which prefix-cache hits", "backend_cached_prompt_tokens", "{:.0f}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("TTFT p50 s", "ttft_s.p50", "{:.3f}"),
    ("TTFT p99 s", "ttft_s.p99", "{:.3f}"),
    ("TPOT p50 s", "tpot_s.p50", "{:.4f}"),
    ("TPOT p99 s", "tpot_s.p99", "{:.4f}"),
    ("e2e p50 s", "e2e_s.p50", "{:.3f}"),
    ("e2e p90 s", "e2e_s.p90", "{:.3f}"),
    ("e2e p99 s", "e2e_s.p99", "{:.3f}"),
    ("time to rejection p99 s", "time_to_rejection_s.p99", "{:.3f}"),
    ("refusals within 1 s", "refusals_within_1s_share", "{:.1%}"),
    ("refusals after the deadline", "refusals_after_deadline", "{:.0f}"),
    ("refusals after the TTFT objective", "refusals_after_ttft_slo", "{:.0f}"),
    ("Jain's fairness index", "jain_index", "{:.3f}"),
    ("start lag p99 ms", "start_lag_ms_p99", "{:.2f}"),
)


def _value(summary: Summary, path: str) -> float | None:
    if path == "start_lag_ms_p99":
        p99 = summary.start_lag_s.p99
        return None if p99 is None else p99 * 1000.0
    value: Any = summary
    for part in path.split("."):
        value = getattr(value, part)
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class ComparisonRow:
    label: str
    values: tuple[float | None, ...]
    ratios: tuple[float | None, ...]  # value / first target's value
    fmt: str


def compare(summaries: Sequence[Summary]) -> tuple[ComparisonRow, ...]:
    rows = []
    for label, path, fmt in _ROWS:
        values = tuple(_value(s, path) for s in summaries)
        first = values[0] if values else None
        ratios = tuple(None if v is None or first is None or first == 0 else v / first for v in values)
        rows.append(ComparisonRow(label, values, ratios, fmt))
    return tuple(rows)


@dataclass(frozen=True, slots=True)
class RoundsRow:
    """One metric over repeated rounds: per target its mean, min and max, and the mean's
    ratio to the first target's mean."""

    label: str
    means: tuple[float | None, ...]
    mins: tuple[float | None, ...]
    maxs: tuple[float | None, ...]
    ratios: tuple[float | None, ...]
    fmt: str


def mean_over_rounds(groups: Sequence[Sequence[Summary]]) -> tuple[RoundsRow, ...]:
    """`groups[i]` holds target i's summaries, one per round."""
    rows = []
    for label, path, fmt in _ROWS:
        per_target = [[v for v in (_value(s, path) for s in group) if v is not None] for group in groups]
        means = tuple(sum(v) / len(v) if v else None for v in per_target)
        first = means[0] if means else None
        rows.append(
            RoundsRow(
                label=label,
                means=means,
                mins=tuple(min(v) if v else None for v in per_target),
                maxs=tuple(max(v) if v else None for v in per_target),
                ratios=tuple(None if m is None or first is None or first == 0 else m / first for m in means),
                fmt=fmt,
            )
        )
    return tuple(rows)


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def comparison_markdown(summaries: Sequence[Summary]) -> str:
    header = ["metric", *(f"[{i}] {s.target}" for i, s in enumerate(summaries))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in compare(summaries):
        cells = [row.label]
        for i, (value, ratio) in enumerate(zip(row.values, row.ratios, strict=True)):
            text = _cell(value, row.fmt)
            if i > 0 and ratio is not None:
                text += f" ({ratio:.2f}x)"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


FORCING_NOTE = (
    "Output lengths are forced to the trace's values the way real traffic looks to the server: "
    "`max_tokens` stays at the cap (`--max-tokens`, lowered only where the context leaves less "
    "room), and each request carries its length L in the private field "
    "`vllm_xargs.kvgate_bench_output_tokens`, which no gateway reads: the testbed's logits "
    "processor (tests/testbed/bench_lengths.py) and the emulator hold EOS back until then and make "
    "it the L-th completion token."
)
MIN_TOKENS_FORCING_NOTE = (
    "Output lengths are forced with `min_tokens` = L - 1 plus a `logit_bias` of +100 on the EOS "
    "token (`--force-output min-tokens`), with `max_tokens` at the cap. A gateway that reserves "
    "at least `min_tokens` is told each answer's length: its figures here flatter its output "
    "prediction."
)
NO_FORCING_NOTE = "Output lengths are not forced (`--force-output none`): the model decides."
_FORCING_NOTES = {"xargs": FORCING_NOTE, "min-tokens": MIN_TOKENS_FORCING_NOTE, "none": NO_FORCING_NOTE}


def render_markdown(
    summaries: Sequence[Summary],
    *,
    workload: Mapping[str, Any],
    settings: Mapping[str, Any],
    plots: Sequence[str] = (),
    notes: Sequence[str] = (),
    rounds: Sequence[RoundsRow] = (),
    round_targets: Sequence[str] = (),
) -> str:
    """report.md: workload, settings, the side-by-side table, per-target details, plots."""
    out = ["# kvgate bench report", ""]
    out += ["## Workload", ""]
    out += [f"- {k}: {_fmt_any(v)}" for k, v in workload.items()]
    out += ["", "## Settings", ""]
    out += [f"- {k}: {_fmt_any(v)}" for k, v in settings.items()]
    out += ["", _FORCING_NOTES.get(str(settings.get("output_forcing", "xargs")), FORCING_NOTE), ""]
    out += [f"- {n}" for n in notes]
    out += ["", "## Results", "", comparison_markdown(summaries), ""]
    out += [
        "Ratios in brackets are to the first target. Goodput and useful tokens are per second of "
        "offered time; see Definitions below.",
        "",
    ]
    if rounds:
        out += ["### Mean over rounds (min..max)", ""]
        header = ["metric", *round_targets]
        out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rounds:
            cells = [row.label]
            for j, (m, lo, hi, r) in enumerate(zip(row.means, row.mins, row.maxs, row.ratios, strict=True)):
                text = (
                    "-"
                    if m is None
                    else (f"{row.fmt.format(m)} ({row.fmt.format(lo)}..{row.fmt.format(hi)})")
                )
                if j and r is not None:
                    text += f" {r:.2f}x"
                cells.append(text)
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    for i, s in enumerate(summaries):
        out += [f"### [{i}] {s.target}", ""]
        if s.backend_shared:
            out += [
                "**Warning: the backend processed more prompt tokens during this run than the "
                "run sent: another client used it meanwhile, so the backend deltas (generated "
                "tokens, waste, preemptions) are not this run's alone.**",
                "",
            ]
        out += [
            f"- forced output length exact for {s.forced_length_exact} of {s.ok} ok requests; "
            f"prompt length as reported by usage exact for {s.prompt_length_exact} of {s.sent}",
            f"- client output tokens {s.client_output_tokens}, backend generated tokens "
            f"{_fmt_any(s.backend_generation_tokens)}, useful {s.useful_tokens}; prompt "
            f"tokens in usage {s.client_prompt_tokens}, backend prompt tokens "
            f"{_fmt_any(s.backend_prompt_tokens)}",
            f"- start lag p50/p99/max ms: {_ms(s.start_lag_s.p50)} / {_ms(s.start_lag_s.p99)} / "
            f"{_ms(s.start_lag_max_s)}; most requests in flight {s.max_in_flight}",
            f"- run duration {s.duration_s:.1f} s over {s.offered_s:.1f} s of offered time",
        ]
        if s.shed:
            out.append(
                f"- Retry-After p50/p99 s: {_fmt_any(s.retry_after_s.p50)} / {_fmt_any(s.retry_after_s.p99)}"
            )
        if len(s.tenants) > 1 or (s.tenants and s.tenants[0].tenant != "-"):
            out += [
                "",
                "| tenant | sent | ok | demand share | service share | served | ",
                "|---|---|---|---|---|---|",
            ]
            out += [
                f"| {t.tenant} | {t.sent} | {t.ok} | {t.demand_share:.3f} | "
                f"{t.service_share:.3f} | {t.served_fraction:.3f} |"
                for t in s.tenants
            ]
            out.append(f"\nJain's fairness index: {_fmt_any(s.jain_index)}")
        out.append("")
    if plots:
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    out += ["## Definitions", "", DEFINITIONS]
    return "\n".join(out)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f}"


def _fmt_any(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
