"""`make demo`'s table for one burst: vLLM straight against kvgate, and what changed, in words.

Reads the summary.json that `kvgate bench` wrote for two targets (vLLM first, kvgate second).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROWS = (
    ("finished within 10 s", "ok", "{:.0f}", None),
    ("late (client gave up)", "late", "{:.0f}", None),
    ("refused at once with Retry-After", "shed", "{:.0f}", None),
    ("vLLM preemptions", "preemptions", "{:.0f}", None),
    ("useful output tokens/s", "useful_tokens_per_s", "{:.1f}", None),
    ("backend tokens wasted", "backend_tokens_wasted", "{:.0f}", None),
    ("time to first token p50 (s)", "ttft_s", "{:.2f}", "p50"),
    ("end-to-end p90 (s)", "e2e_s", "{:.2f}", "p90"),
    ("Retry-After p50 (s)", "retry_after_s", "{:.2f}", "p50"),
)


def figure(target: dict[str, Any], key: str, sub: str | None) -> Any:
    value = target.get(key)
    return (value or {}).get(sub) if sub else value


def table(direct: dict[str, Any], gated: dict[str, Any]) -> list[str]:
    lines = [f"  {'':38} {'vLLM':>12} {'via kvgate':>12}"]
    for name, key, fmt, sub in ROWS:
        cells = [figure(t, key, sub) for t in (direct, gated)]
        shown = ["-" if v is None else fmt.format(v) for v in cells]
        lines.append(f"  {name:38} {shown[0]:>12} {shown[1]:>12}")
    return lines


def _count(number: float, noun: str) -> str:
    return f"{number:.0f} {noun}" + ("" if round(number) == 1 else "s")


def in_words(direct: dict[str, Any], gated: dict[str, Any]) -> str:
    useful = (direct.get("useful_tokens_per_s") or 0.0, gated.get("useful_tokens_per_s") or 0.0)
    share = useful[1] / useful[0] if useful[0] else None
    said = [
        f"kvgate finished {gated.get('ok', 0)} in time where vLLM alone finished {direct.get('ok', 0)}",
        f"with {_count(gated.get('preemptions') or 0, 'preemption')} against {direct.get('preemptions') or 0:.0f}",
    ]
    if gated.get("shed"):
        said.append(f"and refused {gated['shed']} at once rather than letting them time out")
    text = ", ".join(said) + "."
    if share is not None:
        text += f" It kept {share:.0%} of vLLM's useful tokens."
    return "   " + text


def main(path: str) -> int:
    summary = json.loads(Path(path).read_text())
    direct, gated = summary["targets"][:2]
    print("\n".join(table(direct, gated)))
    print(in_words(direct, gated))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
