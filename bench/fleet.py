"""Gateways in front of a fleet of engines, compared on the same arrivals (pure).

`tests/benchmarks/fleet.py` replays one trace slice through each gateway in front of the same
vLLM engines (the SGLang model gateway with its `cache_aware` and `round_robin` policies,
kvgate), starting each run with cold prefix caches, and scrapes every engine's `/metrics`
just before and just after the run (both idle). This module turns one run into its figures:

- useful tokens: output tokens of requests finished within their deadline, as `kvgate bench`
  counts them (`useful_tokens`, per second of offered time: `useful_tokens_per_s`), the figure
  bench/peers.py judges deadline clients by;
- preemptions: the sum over engines of the delta of `vllm:num_preemptions_total`;
- prefix-cache hit rate: the sum over engines of the delta of `vllm:prefix_cache_hits_total`
  over that of `vllm:prefix_cache_queries_total` (tokens found over tokens looked up);
- each engine's share of the generated tokens (delta of `vllm:generation_tokens_total`);
- refusals by status (429, 503) and the first-token percentiles over requests that got one;
- the accounting: tokens the engines generated minus tokens the clients received (0 when every
  answer was read to its end; a client that gives up leaves the engine a token or two ahead;
  the clients' prompt tokens are those the answers' usage reported),
  and whether another client used the engines meanwhile (their prompt-token counters moved by
  more than all the prompts this run sent).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.promtext import Reading

SGLANG_POLICIES = ("cache_aware", "round_robin")
KVGATE = "kvgate"


def sglang_target(policy: str) -> str:
    """The name of the SGLang model gateway's run with `policy`."""
    return f"sglang {policy}"


CACHE_AWARE = sglang_target("cache_aware")
# The balance criterion: with balanced traffic each engine carries 40-60% of the tokens.
BALANCED_SHARE = (0.4, 0.6)


@dataclass(frozen=True, slots=True)
class EngineDelta:
    """What one run cost one engine: counter deltas (None when a scrape lacked the counter)."""

    engine: str
    generation_tokens: float | None
    prompt_tokens: float | None
    preemptions: float | None
    prefix_cache_queries: float | None
    prefix_cache_hits: float | None


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def engine_delta(engine: str, before: Reading, after: Reading) -> EngineDelta:
    return EngineDelta(
        engine=engine,
        generation_tokens=_delta(before.generation_tokens_total, after.generation_tokens_total),
        prompt_tokens=_delta(before.prompt_tokens_total, after.prompt_tokens_total),
        preemptions=_delta(before.preemptions_total, after.preemptions_total),
        prefix_cache_queries=_delta(before.prefix_cache_queries_total, after.prefix_cache_queries_total),
        prefix_cache_hits=_delta(before.prefix_cache_hits_total, after.prefix_cache_hits_total),
    )


def _total(values: Iterable[float | None]) -> float | None:
    """The sum, None when there is nothing to sum or a value is missing."""
    given = list(values)
    numbers = [v for v in given if v is not None]
    return sum(numbers) if given and len(numbers) == len(given) else None


@dataclass(frozen=True, slots=True)
class RunFigures:
    """One gateway's run on one trace slice at one rate (see the module docstring)."""

    target: str
    trace: str
    rate: float
    round: int
    sent: int
    ok: int
    late: int
    errors: int
    refused_429: int
    refused_503: int
    useful_tokens: int
    useful_tokens_per_s: float
    client_output_tokens: int
    client_prompt_tokens: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    engines: tuple[EngineDelta, ...]
    prompt_tokens_sent: int

    @property
    def preemptions(self) -> float | None:
        return _total(e.preemptions for e in self.engines)

    @property
    def generated_tokens(self) -> float | None:
        return _total(e.generation_tokens for e in self.engines)

    @property
    def prefix_hit_rate(self) -> float | None:
        queries = _total(e.prefix_cache_queries for e in self.engines)
        hits = _total(e.prefix_cache_hits for e in self.engines)
        return None if queries is None or hits is None or queries == 0 else hits / queries

    @property
    def generation_shares(self) -> tuple[float | None, ...]:
        """Each engine's part of the generated tokens, in the order of `engines`."""
        total = self.generated_tokens
        return tuple(
            None
            if total is None or total == 0 or e.generation_tokens is None
            else e.generation_tokens / total
            for e in self.engines
        )

    @property
    def accounting_gap(self) -> float | None:
        """Tokens the engines generated minus tokens the clients received."""
        generated = self.generated_tokens
        return None if generated is None else generated - self.client_output_tokens

    @property
    def engines_shared(self) -> bool | None:
        """Whether the engines served other clients during the run (see the module docstring)."""
        prompt = _total(e.prompt_tokens for e in self.engines)
        return None if prompt is None else prompt > self.prompt_tokens_sent

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "trace": self.trace,
            "rate": self.rate,
            "round": self.round,
            "sent": self.sent,
            "ok": self.ok,
            "late": self.late,
            "errors": self.errors,
            "refused_429": self.refused_429,
            "refused_503": self.refused_503,
            "useful_tokens": self.useful_tokens,
            "useful_tokens_per_s": self.useful_tokens_per_s,
            "client_output_tokens": self.client_output_tokens,
            "client_prompt_tokens": self.client_prompt_tokens,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "preemptions": self.preemptions,
            "prefix_hit_rate": self.prefix_hit_rate,
            "generated_tokens": self.generated_tokens,
            "generation_shares": list(self.generation_shares),
            "accounting_gap": self.accounting_gap,
            "engines_shared": self.engines_shared,
            "prompt_tokens_sent": self.prompt_tokens_sent,
            "engines": [
                {
                    "engine": e.engine,
                    "generation_tokens": e.generation_tokens,
                    "prompt_tokens": e.prompt_tokens,
                    "preemptions": e.preemptions,
                    "prefix_cache_queries": e.prefix_cache_queries,
                    "prefix_cache_hits": e.prefix_cache_hits,
                }
                for e in self.engines
            ],
        }


def _count(summary: Mapping[str, Any], key: str) -> int:
    value = summary.get(key)
    return int(value) if isinstance(value, int | float) else 0


def _p(summary: Mapping[str, Any], key: str, which: str) -> float | None:
    inner = summary.get(key)
    value = inner.get(which) if isinstance(inner, Mapping) else None
    return float(value) if isinstance(value, int | float) else None


def run_figures(
    *,
    target: str,
    trace: str,
    rate: float,
    round_: int,
    summary: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    engines: Sequence[EngineDelta],
) -> RunFigures:
    """The figures of one run from the bench's summary of it (one target of summary.json),
    its per-request records (requests-N.jsonl, as dicts) and the engines' counter deltas."""
    statuses = [record.get("status") for record in records]
    return RunFigures(
        target=target,
        trace=trace,
        rate=rate,
        round=round_,
        sent=_count(summary, "sent"),
        ok=_count(summary, "ok"),
        late=_count(summary, "late"),
        errors=_count(summary, "errors"),
        refused_429=statuses.count(429),
        refused_503=statuses.count(503),
        useful_tokens=_count(summary, "useful_tokens"),
        useful_tokens_per_s=float(summary.get("useful_tokens_per_s") or 0.0),
        client_output_tokens=_count(summary, "client_output_tokens"),
        client_prompt_tokens=_count(summary, "client_prompt_tokens"),
        ttft_p50_s=_p(summary, "ttft_s", "p50"),
        ttft_p99_s=_p(summary, "ttft_s", "p99"),
        engines=tuple(engines),
        prompt_tokens_sent=sum(int(record.get("prompt_tokens_wanted") or 0) for record in records),
    )


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _percent(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def render_runs(runs: Sequence[RunFigures]) -> str:
    """Markdown: one row per run."""
    header = [
        "trace",
        "rate/s",
        "round",
        "target",
        "ok",
        "late",
        "err",
        "429",
        "503",
        "useful tok",
        "useful tok/s",
        "preempt",
        "prefix hit",
        "token share per engine",
        "TTFT p50 s",
        "TTFT p99 s",
        "engines - clients tok",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        shares = " / ".join(_percent(share) for share in run.generation_shares)
        cells = [
            run.trace,
            f"{run.rate:.3g}",
            str(run.round),
            run.target + (" (engines shared)" if run.engines_shared else ""),
            str(run.ok),
            str(run.late),
            str(run.errors),
            str(run.refused_429),
            str(run.refused_503),
            str(run.useful_tokens),
            f"{run.useful_tokens_per_s:.1f}",
            _fmt(run.preemptions, "{:.0f}"),
            # One decimal: on a slice with little sharing the rate is a fraction of a percent.
            _percent(run.prefix_hit_rate, 1),
            shares,
            _fmt(run.ttft_p50_s, "{:.3f}"),
            _fmt(run.ttft_p99_s, "{:.2f}"),
            _fmt(run.accounting_gap, "{:+.0f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class Verdict:
    """kvgate against the SGLang policies on one slice, rate and round, by the issue's
    criteria: useful tokens over the best policy's, prefix-cache hit rate minus cache_aware's,
    preemptions against the fewest of the policies, and whether kvgate's token shares are
    within `BALANCED_SHARE`. A figure is None when a run it needs is missing."""

    trace: str
    rate: float
    round: int
    useful_vs_best: float | None
    best_policy: str | None
    hit_rate_minus_cache_aware: float | None
    preemptions: float | None
    fewest_peer_preemptions: float | None
    balanced: bool | None

    @property
    def met(self) -> bool | None:
        if (
            self.useful_vs_best is None
            or self.hit_rate_minus_cache_aware is None
            or self.preemptions is None
            or self.fewest_peer_preemptions is None
            or self.balanced is None
        ):
            return None
        return (
            self.useful_vs_best >= 1.0
            and self.hit_rate_minus_cache_aware >= 0.0
            and self.preemptions < self.fewest_peer_preemptions
            and self.balanced
        )


def _fewest(values: Sequence[float | None]) -> float | None:
    numbers = [v for v in values if v is not None]
    return min(numbers) if numbers and len(numbers) == len(values) else None


def verdicts(runs: Sequence[RunFigures]) -> list[Verdict]:
    """One verdict per kvgate run that has SGLang runs beside it (same slice, rate, round)."""
    out: list[Verdict] = []
    for run in runs:
        if run.target != KVGATE:
            continue
        peers = {
            p.target: p
            for p in runs
            if p.target != KVGATE and (p.trace, p.rate, p.round) == (run.trace, run.rate, run.round)
        }
        if not peers:
            continue
        best_name, best = max(peers.items(), key=lambda item: item[1].useful_tokens_per_s)
        cache_aware = peers.get(CACHE_AWARE)
        peer_hit = None if cache_aware is None else cache_aware.prefix_hit_rate
        own_hit = run.prefix_hit_rate
        peer_preemptions = [p.preemptions for p in peers.values()]
        shares = run.generation_shares
        out.append(
            Verdict(
                trace=run.trace,
                rate=run.rate,
                round=run.round,
                useful_vs_best=(
                    run.useful_tokens_per_s / best.useful_tokens_per_s if best.useful_tokens_per_s else None
                ),
                best_policy=best_name,
                hit_rate_minus_cache_aware=None
                if own_hit is None or peer_hit is None
                else own_hit - peer_hit,
                preemptions=run.preemptions,
                fewest_peer_preemptions=_fewest(peer_preemptions),
                balanced=(
                    None
                    if len(shares) < 2 or any(s is None for s in shares)
                    else all(BALANCED_SHARE[0] <= (s or 0.0) <= BALANCED_SHARE[1] for s in shares)
                ),
            )
        )
    return out


def render_verdicts(items: Sequence[Verdict]) -> str:
    """Markdown: kvgate against the SGLang policies (empty string without verdicts)."""
    if not items:
        return ""
    header = [
        "trace",
        "rate/s",
        "round",
        "useful / best SGLang (policy)",
        "prefix hit - cache_aware's",
        "preemptions (fewest SGLang)",
        "shares in 40-60%",
        "met",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for v in items:
        hit = v.hit_rate_minus_cache_aware
        cells = [
            v.trace,
            f"{v.rate:.3g}",
            str(v.round),
            _percent(v.useful_vs_best) + ("" if v.best_policy is None else f" ({v.best_policy})"),
            "-" if hit is None else f"{100 * hit:+.1f} pt",
            f"{_fmt(v.preemptions, '{:.0f}')} ({_fmt(v.fewest_peer_preemptions, '{:.0f}')})",
            "-" if v.balanced is None else ("yes" if v.balanced else "no"),
            "-" if v.met is None else ("yes" if v.met else "no"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
