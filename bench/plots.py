"""PNG plots of a comparison (matplotlib, headless Agg backend).

Three figures: latency CDFs (TTFT and end-to-end), outcomes per target, and the time series
sampled from /metrics during each run (KV-cache usage, requests running and waiting in the
engine, kvgate's queue depth when a target exports it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.records import RunResult
from bench.report import Outcome, classify


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(i: int, target: str) -> str:
    return f"[{i}] {target}"


def plot_latency_cdfs(results: Sequence[RunResult], deadline_s: float | None, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, result in enumerate(results):
        ttft = sorted(r.ttft_s for r in result.records if r.ttft_s is not None)
        e2e = sorted(
            r.e2e_s for r in result.records if r.e2e_s is not None and classify(r, deadline_s) is Outcome.OK
        )
        for ax, values in ((axes[0], ttft), (axes[1], e2e)):
            if values:
                n = len(values)
                ax.step(values, [(k + 1) / n for k in range(n)], where="post", label=_label(i, result.target))
    axes[0].set_title("time to first token")
    axes[1].set_title("end-to-end latency (ok requests)")
    for ax in axes:
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_outcomes(results: Sequence[RunResult], deadline_s: float | None, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 2 + 1.5 * len(results)), 4))
    labels = [_label(i, r.target) for i, r in enumerate(results)]
    bottoms = [0] * len(results)
    colors = {
        Outcome.OK: "tab:green",
        Outcome.LATE: "tab:orange",
        Outcome.SHED: "tab:blue",
        Outcome.ERROR: "tab:red",
    }
    for outcome in Outcome:
        counts = [sum(1 for rec in r.records if classify(rec, deadline_s) is outcome) for r in results]
        ax.bar(labels, counts, bottom=bottoms, label=outcome.value, color=colors[outcome])
        bottoms = [b + c for b, c in zip(bottoms, counts, strict=True)]
    ax.set_ylabel("requests")
    ax.set_title("outcomes per target")
    ax.legend()
    ax.tick_params(axis="x", labelsize="small", labelrotation=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timeseries(results: Sequence[RunResult], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    panels = (
        ("kv_usage", "vLLM KV-cache usage (fraction)"),
        ("busy", "vLLM requests running + waiting"),
        ("queue_depth", "kvgate queue depth"),
        ("budget_fraction", "kvgate: admissible share of the KV pool"),
    )
    for i, result in enumerate(results):
        for source in dict.fromkeys(p.source for p in result.samples):
            points = [p for p in result.samples if p.source == source]
            for ax, (attr, _) in zip(axes, panels, strict=True):
                series = [(p.t_s, getattr(p.reading, attr)) for p in points]
                series = [(t, v) for t, v in series if v is not None]
                if series:
                    ax.plot([t for t, _ in series], [v for _, v in series], label=f"[{i}] {source}")
    for ax, (_, title) in zip(axes, panels, strict=True):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
        else:
            ax.text(
                0.5,
                0.5,
                "not reported by any sampled /metrics",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
    axes[-1].set_xlabel("seconds since the run started")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(results: Sequence[RunResult], deadline_s: float | None, out: Path) -> list[str]:
    """Write every plot into `out`; returns their file names."""
    names = ["latency_cdf.png", "outcomes.png", "timeseries.png"]
    plot_latency_cdfs(results, deadline_s, out / names[0])
    plot_outcomes(results, deadline_s, out / names[1])
    plot_timeseries(results, out / names[2])
    return names
