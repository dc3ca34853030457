"""Several kvgate processes in front of one engine, one budget booked in Redis (pure).

`tests/benchmarks/shared_budget.py` replays the same arrivals through one, two and three
kvgate processes that share a Redis ledger, the client dealing requests round-robin over
their ports (`bench.spread`), and meanwhile reads, every 50 ms, the shared total booked in
Redis (`HGETALL {prefix}:booked:<backend>`: the `total` field and each owner's sum) and every
process's admissible budget (`/admin/state`, `budget.admissible_blocks`). This module turns
those samples, the bench's summary and the engine's counters into the figures:

- over the budget: the samples whose shared total exceeded the smallest admissible budget
  of the processes read at that moment, and the largest excess (blocks); beside it, the
  same against the smallest cap the processes published in Redis (`HGETALL
  {prefix}:peer:<backend>`), which is what the booking script holds the total to: a
  process's admissible blocks less the usage no request explains plus its credit. Such a sample means
  over-admission only when the total grew into it; when it was the budget that shrank under
  leases already granted (the AIMD share cut after a preemption) it does not. Samples where
  the total rose while over the budget are therefore counted apart (`rose_over`);
- the ledger's own consistency: samples whose owners' sums did not add up to the total;
- per case: useful tokens (`bench.report`'s: output tokens of answers complete within the
  client's deadline), preemptions (delta of `vllm:num_preemptions_total`), 429s and 503s,
  useful tokens relative to the one-process case;
- the admission overhead: per request, the first response byte's time through a kvgate
  with Redis and through one without (measured side by side, same backend), and the queue
  time each reports in `x-kvgate-queue-ms`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOTAL_FIELD = "total"


def booked_key(prefix: str, backend: str) -> str:
    """The Redis hash of blocks booked on `backend` (its `total` and each owner's sum)."""
    return f"{{{prefix}}}:booked:{backend}"


def peer_key(prefix: str, backend: str) -> str:
    """The Redis hash of what each process published of `backend`: owner -> "expiry cap view"."""
    return f"{{{prefix}}}:peer:{backend}"


@dataclass(frozen=True, slots=True)
class BudgetSample:
    """One reading: `t_s` after the run's start; the booked hash (None: Redis did not answer,
    {} when the hash is absent); each process's admissible blocks (None when its
    /admin/state did not answer or did not say); the caps the processes published in Redis
    (owner -> blocks; None when not read), the bound the booking script enforces."""

    t_s: float
    booked: Mapping[str, int] | None
    admissible: tuple[int | None, ...]
    caps: Mapping[str, int] | None = None

    @property
    def total(self) -> int | None:
        if self.booked is None:
            return None
        return self.booked.get(TOTAL_FIELD, 0)

    @property
    def owners_sum(self) -> int | None:
        if self.booked is None:
            return None
        return sum(v for k, v in self.booked.items() if k != TOTAL_FIELD)

    @property
    def smallest_cap(self) -> int | None:
        return min(self.caps.values()) if self.caps else None

    @property
    def smallest_admissible(self) -> int | None:
        known = [a for a in self.admissible if a is not None]
        return min(known) if known and len(known) == len(self.admissible) else None

    def to_json(self) -> dict[str, Any]:
        return {
            "t_s": round(self.t_s, 4),
            "booked": None if self.booked is None else dict(self.booked),
            "admissible": list(self.admissible),
            "caps": None if self.caps is None else dict(self.caps),
        }


def parse_booked(raw: Mapping[bytes | str, bytes | str]) -> dict[str, int]:
    """An HGETALL answer as field -> blocks (fields that are not integers are dropped)."""
    out: dict[str, int] = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else key
        text = value.decode() if isinstance(value, bytes) else value
        try:
            out[name] = int(float(text))
        except ValueError:
            continue
    return out


def parse_caps(raw: Mapping[bytes | str, bytes | str]) -> dict[str, int]:
    """The peer hash (owner -> "expiry_ms cap view") as owner -> cap; expiry is not judged
    here (the booking script drops expired entries itself)."""
    out: dict[str, int] = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else key
        text = value.decode() if isinstance(value, bytes) else value
        parts = text.split(" ", 2)
        try:
            out[name] = int(float(parts[1]))
        except (IndexError, ValueError):
            continue
    return out


@dataclass(frozen=True, slots=True)
class Overrun:
    """What the samples of one run say about the shared total against the budget."""

    samples: int
    complete: int  # samples with the total and every process's budget
    over: int  # complete samples whose total exceeded the smallest admissible budget
    max_excess_blocks: int
    rose_over: int  # over samples whose total had grown since the sample before
    inconsistent: int  # samples whose owners' sums differ from the total
    max_total_blocks: int | None
    min_admissible_blocks: int | None
    # Against the smallest cap published in Redis (admissible - unexplained usage + credit):
    over_cap: int = 0
    max_excess_over_cap_blocks: int = 0
    rose_over_cap: int = 0  # over-cap samples whose total had grown since the sample before

    def to_json(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "complete": self.complete,
            "over": self.over,
            "max_excess_blocks": self.max_excess_blocks,
            "rose_over": self.rose_over,
            "inconsistent": self.inconsistent,
            "max_total_blocks": self.max_total_blocks,
            "min_admissible_blocks": self.min_admissible_blocks,
            "over_cap": self.over_cap,
            "max_excess_over_cap_blocks": self.max_excess_over_cap_blocks,
            "rose_over_cap": self.rose_over_cap,
        }


def overrun(samples: Sequence[BudgetSample]) -> Overrun:
    over = rose = inconsistent = complete = over_cap = rose_cap = 0
    max_excess = max_excess_cap = 0
    previous_total: int | None = None
    totals: list[int] = []
    budgets: list[int] = []
    for sample in samples:
        total = sample.total
        budget = sample.smallest_admissible
        owners = sample.owners_sum
        if total is not None:
            totals.append(total)
            if owners is not None and sample.booked and owners != total:
                inconsistent += 1
        if budget is not None:
            budgets.append(budget)
        if total is not None and budget is not None:
            complete += 1
            if total > budget:
                over += 1
                max_excess = max(max_excess, total - budget)
                if previous_total is not None and total > previous_total:
                    rose += 1
        cap = sample.smallest_cap
        if total is not None and cap is not None and total > cap:
            over_cap += 1
            max_excess_cap = max(max_excess_cap, total - cap)
            if previous_total is not None and total > previous_total:
                rose_cap += 1
        if total is not None:
            previous_total = total
    return Overrun(
        samples=len(samples),
        complete=complete,
        over=over,
        max_excess_blocks=max_excess,
        rose_over=rose,
        inconsistent=inconsistent,
        max_total_blocks=max(totals) if totals else None,
        min_admissible_blocks=min(budgets) if budgets else None,
        over_cap=over_cap,
        max_excess_over_cap_blocks=max_excess_cap,
        rose_over_cap=rose_cap,
    )


# --------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True, slots=True)
class CaseFigures:
    """One case: `processes` kvgates (with Redis or not) on the same arrivals."""

    name: str
    processes: int
    redis: bool
    sent: int
    ok: int
    late: int
    refused_429: int
    refused_503: int
    errors: int
    useful_tokens: int
    useful_tokens_per_s: float
    preemptions: float | None
    ttft_p50_s: float | None
    requests_per_process: tuple[int, ...]
    overrun: Overrun | None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "processes": self.processes,
            "redis": self.redis,
            "sent": self.sent,
            "ok": self.ok,
            "late": self.late,
            "refused_429": self.refused_429,
            "refused_503": self.refused_503,
            "errors": self.errors,
            "useful_tokens": self.useful_tokens,
            "useful_tokens_per_s": self.useful_tokens_per_s,
            "preemptions": self.preemptions,
            "ttft_p50_s": self.ttft_p50_s,
            "requests_per_process": list(self.requests_per_process),
            "overrun": None if self.overrun is None else self.overrun.to_json(),
        }


def case_figures(
    *,
    name: str,
    processes: int,
    redis: bool,
    summary: Mapping[str, Any],
    statuses: Sequence[int | None],
    requests_per_process: Sequence[int],
    samples: Sequence[BudgetSample] | None,
) -> CaseFigures:
    """A case's figures from `bench.report.Summary.to_json()` of its merged run, every
    request's HTTP status and the budget samples (None: not sampled)."""

    def count(key: str) -> int:
        value = summary.get(key)
        return int(value) if isinstance(value, int | float) else 0

    ttft = summary.get("ttft_s")
    p50 = ttft.get("p50") if isinstance(ttft, Mapping) else None
    preemptions = summary.get("preemptions")
    return CaseFigures(
        name=name,
        processes=processes,
        redis=redis,
        sent=count("sent"),
        ok=count("ok"),
        late=count("late"),
        refused_429=sum(1 for s in statuses if s == 429),
        refused_503=sum(1 for s in statuses if s == 503),
        errors=count("errors"),
        useful_tokens=count("useful_tokens"),
        useful_tokens_per_s=float(summary.get("useful_tokens_per_s") or 0.0),
        preemptions=float(preemptions) if isinstance(preemptions, int | float) else None,
        ttft_p50_s=float(p50) if isinstance(p50, int | float) else None,
        requests_per_process=tuple(requests_per_process),
        overrun=None if samples is None else overrun(samples),
    )


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def render_cases(cases: Sequence[CaseFigures], reference: str | None = None) -> str:
    """Markdown, one row per case; useful tokens relative to the case named `reference`
    (default: the first one-process case with Redis, else the first case)."""
    ref = next((c for c in cases if c.name == reference), None)
    if ref is None:
        ref = next((c for c in cases if c.processes == 1 and c.redis), cases[0] if cases else None)
    header = [
        "case",
        "ok / late / err",
        "429",
        "503",
        "useful tok",
        f"vs {ref.name if ref else '-'}",
        "preempt",
        "TTFT p50 s",
        "requests per process",
        "samples over budget (rose) / complete",
        "max excess blocks",
        "max booked / min admissible",
        "samples over smallest cap (rose; max excess)",
        "ledger sums off",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case in cases:
        relative = (
            None if ref is None or not ref.useful_tokens else case.useful_tokens / ref.useful_tokens - 1.0
        )
        o = case.overrun
        cells = [
            case.name,
            f"{case.ok} / {case.late} / {case.errors}",
            str(case.refused_429),
            str(case.refused_503),
            str(case.useful_tokens),
            "-" if relative is None else f"{100 * relative:+.1f}%",
            _fmt(case.preemptions, "{:.0f}"),
            _fmt(case.ttft_p50_s, "{:.3f}"),
            " / ".join(str(n) for n in case.requests_per_process),
            "-" if o is None else f"{o.over} ({o.rose_over}) / {o.complete}",
            "-" if o is None or not o.complete else str(o.max_excess_blocks),
            "-" if o is None else f"{_fmt(o.max_total_blocks, '{}')} / {_fmt(o.min_admissible_blocks, '{}')}",
            "-" if o is None else f"{o.over_cap} ({o.rose_over_cap}; {o.max_excess_over_cap_blocks})",
            "-" if o is None else str(o.inconsistent),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Admission overhead


@dataclass(frozen=True, slots=True)
class Probe:
    """One request of the overhead measurement: which target, the first response byte's time
    (seconds from sending), the first token's, the queue time the gateway reported (ms, None
    when it did not say), and the status."""

    target: str
    first_byte_s: float | None
    first_token_s: float | None
    queue_ms: int | None
    status: int | None


@dataclass(frozen=True, slots=True)
class OverheadFigures:
    """Medians per target, and the median of the paired differences against `baseline`
    (requests sent one after the other, alternating, so each pair saw the same machine)."""

    baseline: str
    medians_first_byte_ms: dict[str, float | None]
    medians_first_token_ms: dict[str, float | None]
    medians_queue_ms: dict[str, float | None]
    added_first_byte_ms: dict[str, float | None]
    counts: dict[str, int]
    failures: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "medians_first_byte_ms": self.medians_first_byte_ms,
            "medians_first_token_ms": self.medians_first_token_ms,
            "medians_queue_ms": self.medians_queue_ms,
            "added_first_byte_ms": self.added_first_byte_ms,
            "counts": self.counts,
            "failures": self.failures,
        }


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def overhead(rounds: Sequence[Mapping[str, Probe]], baseline: str) -> OverheadFigures:
    """`rounds`: per round, one probe per target (the baseline among them)."""
    targets = list(dict.fromkeys(t for r in rounds for t in r))
    ok = {t: [r[t] for r in rounds if t in r and r[t].status == 200] for t in targets}

    def med(values: Sequence[float | int | None], scale: float = 1.0) -> float | None:
        known = [float(v) * scale for v in values if v is not None]
        return _median(known)

    added: dict[str, float | None] = {}
    for target in targets:
        if target == baseline:
            continue
        pairs = [
            (r[target].first_byte_s, r[baseline].first_byte_s)
            for r in rounds
            if target in r and baseline in r and r[target].status == 200 and r[baseline].status == 200
        ]
        added[target] = _median([1000 * (a - b) for a, b in pairs if a is not None and b is not None])
    return OverheadFigures(
        baseline=baseline,
        medians_first_byte_ms={t: med([p.first_byte_s for p in ok[t]], 1000) for t in targets},
        medians_first_token_ms={t: med([p.first_token_s for p in ok[t]], 1000) for t in targets},
        medians_queue_ms={t: med([p.queue_ms for p in ok[t]]) for t in targets},
        added_first_byte_ms=added,
        counts={t: len(ok[t]) for t in targets},
        failures={t: sum(1 for r in rounds if t in r and r[t].status != 200) for t in targets},
    )


def render_overhead(figures: OverheadFigures) -> str:
    header = [
        "target",
        "ok (failed)",
        "first byte p50 ms",
        "first token p50 ms",
        "x-kvgate-queue-ms p50",
        "added first byte ms (paired p50)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for target, count in figures.counts.items():
        cells = [
            target,
            f"{count} ({figures.failures.get(target, 0)})",
            _fmt(figures.medians_first_byte_ms.get(target), "{:.3f}"),
            _fmt(figures.medians_first_token_ms.get(target), "{:.3f}"),
            _fmt(figures.medians_queue_ms.get(target), "{:.1f}"),
            "(baseline)"
            if target == figures.baseline
            else _fmt(figures.added_first_byte_ms.get(target), "{:+.3f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
