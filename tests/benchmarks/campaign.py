"""Benchmark campaign on the real vLLM CPU testbed: vLLM straight, vLLM's own queue guard, kvgate.

    .venv/bin/python tests/benchmarks/campaign.py --trace ../shared/traces/AzureLLMInferenceTrace_code.csv \\
        --ctx-scale 0.125 --rates 2,4,12 --guards none,8,16,32,48 --kvgate --out build/campaign/azure

For every guard (`none` = vLLM straight, `N` = vLLM started with `--max-num-queued-reqs N`) it
starts a fresh testbed (engine pinned to the last core, loading the bench's length-forcing
logits processor, see tests/testbed/bench_lengths.py), replays the same arrivals at every
rate with `kvgate bench` (pinned to core 0), and, for `none` with `--kvgate`, also through a
kvgate in front of that same vLLM (bench alternates the targets: A B A B with `--repeat`).
It writes each bench run's report under --out and prints one table of the figures that the
issues compare. Not a test: it takes minutes per guard.

To judge a change to kvgate's code (not a setting) on the same arrivals, `--baseline DIR` also
runs a kvgate with its defaults from another checkout, e.g. the commit before the change:

    git worktree add build/baseline HEAD~1
    .venv/bin/python tests/benchmarks/campaign.py ... --kvgate --baseline build/baseline
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "testbed"))
import testbed  # noqa: E402

from bench.peers import Run, against_peers, render_peers  # noqa: E402

REPO = HERE.parent.parent
BIN = REPO / ".venv" / "bin"
COLUMNS = [
    ("ok", "ok", "{:.0f}"),
    ("late", "late", "{:.0f}"),
    ("shed", "shed", "{:.0f}"),
    ("err", "errors", "{:.0f}"),
    ("useful tok/s", "useful_tokens_per_s", "{:.1f}"),
    ("goodput SLO tok/s", "goodput_slo_tokens_per_s", "{:.1f}"),
    ("goodput req/s", "goodput_rps", "{:.2f}"),
    ("preempt", "preemptions", "{:.0f}"),
    ("TTFT p50 s", ("ttft_s", "p50"), "{:.3f}"),
    ("e2e p99 s", ("e2e_s", "p99"), "{:.2f}"),
    ("reject p99 s", ("time_to_rejection_s", "p99"), "{:.3f}"),
]


def pick(summary: dict[str, Any], key: str | tuple[str, str]) -> Any:
    if isinstance(key, tuple):
        inner = summary.get(key[0]) or {}
        return inner.get(key[1])
    return summary.get(key)


def start_kvgate(
    backend: str, port: int, log: Path, extra: list[str], code: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start `kvgate serve`, from this checkout or, with `code`, from the sources there (this
    environment's installed packages serve both)."""
    serve = ["serve", "--backend", backend, "--port", str(port), *extra]
    command = [str(BIN / "kvgate"), *serve]
    cwd = None
    if code is not None:
        # `python -m` puts its working folder first on the path, before the installed checkout.
        cwd = code.resolve()
        command = [str(BIN / "python"), "-m", "gateway.cli", *serve]
    if os.cpu_count() and (os.cpu_count() or 1) > 1:
        command = ["taskset", "-c", "0", *command]
    process = subprocess.Popen(
        command,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=cwd,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvgate exited: {log.read_text()[-2000:]}")
        try:
            import urllib.request

            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("kvgate did not become ready")


def run_bench(
    targets: list[str], backend: str, rate: float, args: argparse.Namespace, out: Path
) -> list[dict[str, Any]]:
    command = [
        str(BIN / "kvgate"), "bench",
        *[part for target in targets for part in ("--target", target)],
        "--trace", args.trace, "--rate", str(rate), "-n", str(args.n),
        "--ctx-scale", str(args.ctx_scale), "--gen-scale", str(args.gen_scale),
        "--max-tokens", str(args.max_tokens), "--deadline", str(args.deadline),
        "--ttft-slo", str(args.ttft_slo), "--backend-metrics", f"{backend}/metrics",
        "--seed", str(args.seed), "--repeat", str(args.repeat), "--out", str(out),
        "--force-output", args.force_output,
    ]  # fmt: skip
    if (os.cpu_count() or 1) > 1:
        command = ["taskset", "-c", "0", *command]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    results: list[dict[str, Any]] = summary["targets"]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", required=True)
    parser.add_argument("--ctx-scale", type=float, default=0.125)
    parser.add_argument("--gen-scale", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--rates", default="2,4,12")
    parser.add_argument("-n", type=int, default=150)
    parser.add_argument("--deadline", type=float, default=10.0)
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--guards", default="none")
    parser.add_argument(
        "--kvgate", action="store_true", help="also run through kvgate in front of vLLM straight"
    )
    parser.add_argument(
        "--kvgate-args",
        action="append",
        help="extra `kvgate serve` arguments; repeat to run several kvgates side by side, "
        "each with its own (implies --kvgate)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        action="append",
        default=[],
        help="also run a kvgate with its defaults from the checkout at this folder; repeat for "
        "several (implies --kvgate)",
    )
    parser.add_argument(
        "--force-output",
        choices=("xargs", "min-tokens"),
        default="xargs",
        help="how the bench forces output lengths (see `kvgate bench --help`): the private field "
        "that the testbed's logits processor reads (default), or min_tokens + an EOS logit_bias, "
        "which a kvgate that reserves min_tokens reads as the answer",
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for baseline in args.baseline:
        if not (baseline / "gateway" / "cli.py").is_file():
            parser.error(f"--baseline {baseline}: no kvgate sources there (gateway/cli.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    rates = [float(rate) for rate in args.rates.split(",")]
    rows: list[tuple[str, float, dict[str, Any]]] = []
    runs: list[Run] = []

    for guard in args.guards.split(","):
        extra = [] if guard == "none" else ["--max-num-queued-reqs", guard]
        label = "vllm" if guard == "none" else f"vllm N={guard}"
        vllm = testbed.start(args.port, args.out / f"vllm-{guard}.log", extra)
        kvgates: list[subprocess.Popen[bytes]] = []
        names: dict[str, str] = {}  # kvgate URL -> its row label
        variant_of: dict[str, str] = {}  # kvgate URL -> its extra arguments
        backend = f"http://127.0.0.1:{args.port}"
        try:
            targets = [backend]
            # (label, extra arguments, sources: None for this checkout)
            kvgate_args = args.kvgate_args or ([""] if args.kvgate or args.baseline else [])
            variants: list[tuple[str, str, Path | None]] = [(extra, extra, None) for extra in kvgate_args]
            variants += [(f"baseline {baseline}", "", baseline) for baseline in args.baseline]
            for index, (variant, extra_args, code) in enumerate(variants if guard == "none" else []):
                port = args.port + 1 + index
                log = args.out / ("kvgate.log" if index == 0 else f"kvgate-{index}.log")
                kvgates.append(start_kvgate(backend, port, log, extra_args.split(), code))
                url = f"http://127.0.0.1:{port}"
                targets.append(url)
                names[url] = f"kvgate {variant}".strip() if len(variants) > 1 else "kvgate"
                variant_of[url] = variant
            for rate in rates:
                results = run_bench(targets, backend, rate, args, args.out / f"{guard}-rate{rate:g}")
                # With --repeat the bench alternates the targets round after round (A B A B):
                # one result per target and round, in that order.
                for index, result in enumerate(results):
                    target = targets[index % len(targets)]
                    name = names.get(target, label)
                    round_ = index // len(targets) + 1
                    if args.repeat > 1:
                        name += f" #{round_}"
                    rows.append((name, rate, result))
                    runs.append(Run(guard, variant_of.get(target), rate, round_, result))
                    print(
                        f"{name:14} rate {rate:5.2f}: "
                        + ", ".join(
                            f"{title} {fmt.format(v) if (v := pick(result, key)) is not None else '-'}"
                            for title, key, fmt in COLUMNS
                        ),
                        flush=True,
                    )
        finally:
            for kvgate in kvgates:
                testbed.stop_process(kvgate.pid)
                kvgate.wait(timeout=30)
            testbed.stop_process(vllm.pid)
            vllm.wait(timeout=30)

    header = "| target | rate/s | " + " | ".join(title for title, _, _ in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 2)]
    for name, rate, result in rows:
        cells = []
        for _, key, fmt in COLUMNS:
            value = pick(result, key)
            cells.append(fmt.format(value) if value is not None else "-")
        lines.append(f"| {name} | {rate:g} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    # kvgate against its peers, as the issues judge it (see bench.peers).
    comparisons = render_peers(against_peers(runs))
    if comparisons:
        table += "\n" + comparisons
    (args.out / "campaign.md").write_text(table)
    (args.out / "campaign.json").write_text(
        json.dumps(
            [
                {
                    "guard": r.guard,
                    "variant": r.variant,
                    "rate": r.rate,
                    "round": r.round,
                    "summary": r.summary,
                }
                for r in runs
            ],
            indent=1,
        )
    )
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
