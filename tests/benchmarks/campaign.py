"""Benchmark campaign on the real vLLM CPU testbed: vLLM straight, vLLM's own queue guard, kvgate.

    .venv/bin/python tests/benchmarks/campaign.py --trace bench/traces/AzureLLMInferenceTrace_code_600.csv \\
        --ctx-scale 0.125 --rates 2,4,12 --guards none,8,16,32,48 --kvgate --out build/campaign/azure

The traces default to the samples shipped in bench/traces/ (the first 600 requests of the
public Azure code and Mooncake traces, see NOTICE); a longer slice needs the full trace.

For every guard (`none` = vLLM straight, `N` = vLLM started with `--max-num-queued-reqs N`) it
starts a fresh testbed (engine pinned to the last core, loading the bench's length-forcing
logits processor, see tests/testbed/bench_lengths.py), replays the same arrivals at every
rate with `kvgate bench` (pinned to core 0), and, for `none` with `--kvgate`, also through a
kvgate in front of that same vLLM (bench alternates the targets: A B A B with `--repeat`).
It writes each bench run's report under --out and prints one table of the figures that the
issues compare. Not a test: it takes minutes per guard.

Issue 20 judges kvgate by what each kind of client wants. `--clients deadline,ttft,both`
replays the same arrivals once per kind, on the same testbeds (one start per guard): deadline
clients send only X-Kvgate-Deadline-Ms and give up at --deadline; ttft clients send only
X-Kvgate-TTFT-Ms (--ttft-slo) and wait for the whole answer; `both` (the default, what the
campaign always sent) sends both and gives up at the deadline. Each kind is judged by its own
figure (see bench/peers.py). `--oracle` runs every kvgate a second time on the same arrivals
with the true output lengths in X-Kvgate-Expected-Output-Tokens, so that the report compares
the learned estimate with perfect knowledge.

The loads are defined by measurement: `--find-1x` first searches, against vLLM straight on
the same slice with deadline clients, the rate at which it finishes at least 98% within the
deadline (doubling, then a few bisections). A slice that arrives faster than vLLM keeps up
still finishes in time while its backlog drains within the deadline, so that rate overstates
what vLLM keeps up with; from it, the slice's length and the deadline, the search derives the
rate it does keep up with (bench/loads.py), and 1x = that x --margin (0.8). `--rates` may then
name multiples (`--rates 0.5x,1x,3x`), or give `--one-x R` from an earlier search.
`--find-1x` without multiples in --rates only reports the rates (find-1x.json):

    .venv/bin/python tests/benchmarks/campaign.py --ctx-scale 0.125 -n 600 --find-1x --out build/find-1x

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

from bench import loads  # noqa: E402
from bench.peers import Clients, Run, against_peers, render_peers  # noqa: E402

REPO = HERE.parent.parent
BIN = REPO / ".venv" / "bin"
DEFAULT_TRACE = REPO / "bench" / "traces" / "AzureLLMInferenceTrace_code_600.csv"
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
    # The p99 of the time to a refusal stays in campaign.json; issue 20 judges the share.
    ("429s within 1 s", "refusals_within_1s_share", "{:.1%}"),
    # After the request's own deadline; for ttft clients, after their first-token objective.
    ("429s late", "late_refusals", "{:.0f}"),
]


def pick(summary: dict[str, Any], key: str | tuple[str, str]) -> Any:
    if key == "late_refusals":
        ttft_only = summary.get("deadline_s") is None
        return summary.get("refusals_after_ttft_slo" if ttft_only else "refusals_after_deadline")
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
    targets: list[str],
    backend: str,
    rate: float,
    args: argparse.Namespace,
    out: Path,
    clients: Clients,
    *,
    oracle: bool = False,
    repeat: int | None = None,
) -> list[dict[str, Any]]:
    command = [
        str(BIN / "kvgate"), "bench",
        *[part for target in targets for part in ("--target", target)],
        "--trace", args.trace, "--rate", str(rate), "-n", str(args.n),
        "--ctx-scale", str(args.ctx_scale), "--gen-scale", str(args.gen_scale),
        "--max-tokens", str(args.max_tokens), "--clients", clients.value,
        "--ttft-slo", str(args.ttft_slo), "--backend-metrics", f"{backend}/metrics",
        "--seed", str(args.seed), "--repeat", str(repeat or args.repeat), "--out", str(out),
        "--force-output", args.force_output,
    ]  # fmt: skip
    if clients is not Clients.TTFT:
        command += ["--deadline", str(args.deadline)]
    if oracle:
        command.append("--oracle")
    if (os.cpu_count() or 1) > 1:
        command = ["taskset", "-c", "0", *command]
    out.mkdir(parents=True, exist_ok=True)
    # The bench's own tables and progress go to its folder: the campaign prints one line a run.
    log = out / "bench.log"
    with log.open("wb") as handle:
        done = subprocess.run(command, check=False, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"kvgate bench exited with {done.returncode}:\n{log.read_text()[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    results: list[dict[str, Any]] = summary["targets"]
    return results


def find_one_x(args: argparse.Namespace) -> loads.RateSearch:
    """Search the rate vLLM straight sustains on the slice (deadline clients), on a testbed of
    its own; writes find-1x.json under --out."""
    backend = f"http://127.0.0.1:{args.port}"
    vllm = testbed.start(args.port, args.out / "vllm-find-1x.log", [])
    try:

        def finished_share(rate: float) -> float:
            [result] = run_bench(
                [backend], backend, rate, args, args.out / f"find-1x-rate{rate:.4g}",
                Clients.DEADLINE, repeat=1,
            )  # fmt: skip
            share = loads.finished_share_of(result)
            print(f"find-1x: rate {rate:.4g}/s: {100 * share:.1f}% finished within the deadline", flush=True)
            return share

        search = loads.find_rate(
            finished_share,
            start_rate=args.start_rate,
            target_share=args.finished_share,
            margin=args.margin,
            max_doublings=args.max_doublings,
            bisections=args.bisections,
            slice_requests=args.n,
            deadline_s=args.deadline,
        )
    finally:
        testbed.stop_process(vllm.pid)
        vllm.wait(timeout=30)
    report = {
        "trace": args.trace,
        "n": args.n,
        "ctx_scale": args.ctx_scale,
        "gen_scale": args.gen_scale,
        "deadline_s": args.deadline,
        **search.to_json(),
    }
    (args.out / "find-1x.json").write_text(json.dumps(report, indent=1))
    print(loads.describe(search), flush=True)
    return search


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--ctx-scale", type=float, default=0.125)
    parser.add_argument("--gen-scale", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument(
        "--rates",
        default="2,4,12",
        help="requests/s, comma-separated; or multiples of 1x (0.5x,1x,3x) with --find-1x or --one-x",
    )
    parser.add_argument("-n", type=int, default=150)
    parser.add_argument("--deadline", type=float, default=10.0)
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument(
        "--clients",
        default=Clients.BOTH.value,
        help="kinds of client to replay, comma-separated: deadline, ttft, both (default: both, "
        "the deadline and TTFT headers together, as campaigns always sent)",
    )
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
        "--oracle",
        action="store_true",
        help="run every kvgate a second time on the same arrivals with the true output lengths "
        "in X-Kvgate-Expected-Output-Tokens (implies --kvgate)",
    )
    parser.add_argument(
        "--force-output",
        choices=("xargs", "min-tokens"),
        default="xargs",
        help="how the bench forces output lengths (see `kvgate bench --help`): the private field "
        "that the testbed's logits processor reads (default), or min_tokens + an EOS logit_bias, "
        "which a kvgate that reserves min_tokens reads as the answer",
    )
    search = parser.add_argument_group("loads by measurement")
    search.add_argument(
        "--find-1x",
        action="store_true",
        help="first search the rate vLLM straight sustains on this slice (see above)",
    )
    search.add_argument("--one-x", type=float, metavar="R", help="1x in requests/s, from an earlier search")
    search.add_argument("--start-rate", type=float, default=loads.DEFAULT_START_RATE)
    search.add_argument(
        "--finished-share",
        type=float,
        default=loads.DEFAULT_FINISHED_SHARE,
        help="share of the slice vLLM straight must finish within the deadline",
    )
    search.add_argument(
        "--margin", type=float, default=loads.DEFAULT_MARGIN, help="1x = the rate vLLM keeps up with x this"
    )
    search.add_argument("--max-doublings", type=int, default=loads.DEFAULT_MAX_DOUBLINGS)
    search.add_argument("--bisections", type=int, default=loads.DEFAULT_BISECTIONS)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for baseline in args.baseline:
        if not (baseline / "gateway" / "cli.py").is_file():
            parser.error(f"--baseline {baseline}: no kvgate sources there (gateway/cli.py)")
    try:
        args.kinds = [Clients(kind.strip()) for kind in args.clients.split(",")]
    except ValueError:
        parser.error(f"--clients {args.clients}: choose from {', '.join(k.value for k in Clients)}")
    if args.find_1x and args.one_x is not None:
        parser.error("--find-1x measures 1x: drop --one-x")
    if not args.find_1x:
        try:
            args.rate_list = loads.parse_rates(args.rates, args.one_x)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.find_1x:
        search = find_one_x(args)
        if not any(part.strip().endswith("x") for part in args.rates.split(",")):
            return 0 if search.one_x is not None else 1
        if search.one_x is None:
            return 1
        args.rate_list = loads.parse_rates(args.rates, search.one_x)
    rates: list[float] = args.rate_list
    rows: list[tuple[str, Clients, float, dict[str, Any]]] = []
    runs: list[Run] = []

    def record(
        results: list[dict[str, Any]],
        targets: list[str],
        names: dict[str, str],
        variant_of: dict[str, str],
        guard: str,
        label: str,
        clients: Clients,
        rate: float,
        oracle: bool,
    ) -> None:
        # With --repeat the bench alternates the targets round after round (A B A B):
        # one result per target and round, in that order.
        for index, result in enumerate(results):
            target = targets[index % len(targets)]
            name = names.get(target, label) + (" oracle" if oracle else "")
            round_ = index // len(targets) + 1
            if args.repeat > 1:
                name += f" #{round_}"
            rows.append((name, clients, rate, result))
            runs.append(Run(guard, variant_of.get(target), rate, round_, result, clients, oracle))
            print(
                f"{name:14} {clients.value:8} rate {rate:5.2f}: "
                + ", ".join(
                    f"{title} {fmt.format(v) if (v := pick(result, key)) is not None else '-'}"
                    for title, key, fmt in COLUMNS
                ),
                flush=True,
            )

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
            wants_kvgate = args.kvgate or args.baseline or args.oracle
            kvgate_args = args.kvgate_args or ([""] if wants_kvgate else [])
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
            kvgate_targets = targets[1:]
            # Every kind of client on the testbeds of this guard: one start per guard.
            for clients in args.kinds:
                for rate in rates:
                    folder = args.out / f"{guard}-{clients.value}-rate{rate:g}"
                    results = run_bench(targets, backend, rate, args, folder, clients)
                    record(results, targets, names, variant_of, guard, label, clients, rate, False)
                    if args.oracle and kvgate_targets:
                        results = run_bench(
                            kvgate_targets, backend, rate, args, folder.with_name(folder.name + "-oracle"),
                            clients, oracle=True,
                        )  # fmt: skip
                        record(results, kvgate_targets, names, variant_of, guard, label, clients, rate, True)
        finally:
            for kvgate in kvgates:
                testbed.stop_process(kvgate.pid)
                kvgate.wait(timeout=30)
            testbed.stop_process(vllm.pid)
            vllm.wait(timeout=30)

    header = "| target | clients | rate/s | " + " | ".join(title for title, _, _ in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 3)]
    for name, clients, rate, result in rows:
        cells = []
        for _, key, fmt in COLUMNS:
            value = pick(result, key)
            cells.append(fmt.format(value) if value is not None else "-")
        lines.append(f"| {name} | {clients.value} | {rate:g} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    # kvgate against its peers, as the issues judge it, one table per kind (see bench.peers).
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
                    "clients": r.clients.value,
                    "oracle": r.oracle,
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
