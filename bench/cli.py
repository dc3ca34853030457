"""`kvgate bench`: replay a trace or a synthetic workload against one or more targets.

The steps: build the workload (trace or SPEC, then -n, tenants/priorities, --rate, length
scales), learn the model, its context length and tokenizer from the first target, clamp the
workload to the context, synthesise every prompt with its exact token count, serialise every
request once, then run the same arrivals against each target in turn (waiting between runs
until the backends are idle) and write summary.json, report.md, per-request JSONL and plots.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from bench.records import RunResult
    from bench.workload import Workload

T = TypeVar("T")

DEFAULT_MAX_TOKENS = 4096
DEFAULT_SEED = 0
# The modules of pyproject's `bench` extra (a test keeps the two alike). The base install
# lacks them, and matplotlib is imported only when the plots are drawn, after the whole run:
# `main` checks them all before anything starts.
BENCH_EXTRA_MODULES: tuple[str, ...] = ("matplotlib", "rich", "numpy", "h11")
# The rest of the extra: peer gateways that benchmarks run beside kvgate (tests/benchmarks/fleet.py),
# as distributions; `kvgate bench` runs without them.
BENCH_EXTRA_PEERS: tuple[str, ...] = ("sglang-router",)
BENCH_EXTRA_INSTALL = "pip install 'kvgate[bench]' (in a clone of kvgate: pip install -e '.[bench]')"
CLIENT_KINDS = ("deadline", "ttft", "both")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="replay a trace against OpenAI endpoints and report goodput side by side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of an OpenAI-compatible server (repeat to compare)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="Azure LLM inference CSV or Mooncake JSONL trace")
    source.add_argument(
        "--synthetic",
        metavar="SPEC",
        help="synthetic workload: comma-separated k=v with keys n, rate, "
        "arrival (poisson | gamma:CV), prompt and output (N | "
        "uniform:LO:HI | lognormal:MEDIAN:SIGMA | exp:MEAN), tenants and "
        "priorities (name:weight/name:weight), prefix (GROUPS:TOKENS); "
        "or a .json file holding an object with those keys",
    )
    parser.add_argument("--rate", type=float, help="rescale arrivals to this mean rate (req/s)")
    parser.add_argument("-n", type=int, dest="n", help="use only the first N requests")
    parser.add_argument("--ctx-scale", type=float, default=1.0, help="multiply prompt lengths")
    parser.add_argument("--gen-scale", type=float, default=1.0, help="multiply output lengths")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        metavar="CAP",
        help="max_tokens sent with every request (a cap, as real clients set)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        metavar="S",
        help="clients give up after S seconds (sent as X-Kvgate-Deadline-Ms)",
    )
    parser.add_argument(
        "--ttft-slo",
        type=float,
        metavar="S",
        help="first-token objective for goodput (default 2 s; sent as X-Kvgate-TTFT-Ms only when given)",
    )
    parser.add_argument(
        "--clients",
        choices=CLIENT_KINDS,
        help="the kind of client replayed, by the headers it sends: deadline (X-Kvgate-Deadline-Ms "
        "only, gives up at --deadline), ttft (X-Kvgate-TTFT-Ms only, waits for the whole answer; "
        "no --deadline), both (both headers, gives up at --deadline); default: the headers of "
        "whichever of --deadline and --ttft-slo is given. --ttft-slo (default 2 s) stays the "
        "objective of first-token goodput for every kind",
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="tell the targets each request's true output length in X-Kvgate-Expected-Output-Tokens "
        "(kvgate then reserves it instead of its learned estimate; vLLM ignores it): the learned "
        "model against perfect knowledge",
    )
    parser.add_argument(
        "--header", action="append", default=[], metavar="K:V", help="extra request header (repeatable)"
    )
    parser.add_argument(
        "--backend-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="a vLLM /metrics URL to sample and diff (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--model", help="model name to send (default: the target's first model)")
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer folder or cached model id (default: the model's root "
        "folder from /v1/models when local, else the target's /tokenize)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    parser.add_argument(
        "--api",
        choices=("completions", "chat"),
        default="completions",
        help="endpoint to drive (completions gives exact prompt lengths)",
    )
    parser.add_argument(
        "--max-model-len", type=int, help="context length when the target's /v1/models does not say"
    )
    parser.add_argument(
        "--force-output",
        choices=("xargs", "min-tokens", "none"),
        default="xargs",
        help="how output lengths are forced: xargs (default) sends the length in the private "
        "vllm_xargs field that the testbed's logits processor and the emulator read, unseen by "
        "kvgate; min-tokens sends min_tokens + an EOS logit_bias, for a vLLM without that "
        "processor (it tells kvgate the answer); none lets the model decide",
    )
    parser.add_argument("--no-force-output", action="store_true", help="same as --force-output none")
    parser.add_argument(
        "--eos-id",
        type=int,
        help="EOS token id for --force-output min-tokens (default: from the model folder)",
    )
    parser.add_argument(
        "--no-token-ids", action="store_true", help="do not ask for return_token_ids (for non-vLLM servers)"
    )
    parser.add_argument("--tenants", metavar="SHARES", help="tenant mix for trace requests, e.g. a:3/b:1")
    parser.add_argument(
        "--priorities", metavar="SHARES", help="priority mix for trace requests, e.g. high:1/normal:4/low:1"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="K",
        help="run the targets K times, alternating (A B A B), so that machine "
        "noise shows; the report adds means over rounds",
    )
    parser.add_argument(
        "--sample-period",
        type=float,
        default=0.5,
        metavar="S",
        help="how often /metrics is scraped during a run",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="longest wait for the backend to go idle between runs",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="give up on a connection silent this long (with or without --deadline)",
    )
    parser.set_defaults(func=main)


def client_headers(
    clients: str | None, deadline_s: float | None, ttft_slo_s: float | None, default_ttft_slo_s: float
) -> tuple[float | None, float | None]:
    """The deadline and first-token objective a kind of client sends as headers (seconds,
    None for a header not sent); ValueError for a kind that contradicts the flags."""
    if clients is None:
        return deadline_s, ttft_slo_s
    if clients == "ttft":
        if deadline_s is not None:
            raise ValueError(
                "ttft clients have no deadline (they wait for the whole answer): drop --deadline"
            )
        return None, ttft_slo_s if ttft_slo_s is not None else default_ttft_slo_s
    if deadline_s is None:
        raise ValueError(f"{clients} clients need --deadline")
    if clients == "deadline":
        return deadline_s, None
    return deadline_s, ttft_slo_s if ttft_slo_s is not None else default_ttft_slo_s


def missing_modules(names: Sequence[str]) -> list[str]:
    """The modules among `names` that cannot be imported (missing, or broken installs)."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(args: argparse.Namespace) -> int:
    from bench.prompts import PromptError
    from bench.workload import WorkloadError

    missing = missing_modules(BENCH_EXTRA_MODULES)
    if missing:
        print(
            f"kvgate bench needs {', '.join(missing)} from the `bench` extra, not installed here: "
            f"{BENCH_EXTRA_INSTALL}",
            file=sys.stderr,
        )
        return 2
    try:
        return _bench(args)
    except (WorkloadError, PromptError, ValueError, RuntimeError, OSError) as exc:
        print(f"kvgate bench: {exc}", file=sys.stderr)
        return 2


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload the flags describe, before clamping to the model's context."""
    from bench import workload as wl

    if args.trace:
        work = wl.load_trace(args.trace)
    else:
        work = wl.generate_synthetic(wl.parse_synthetic_spec(args.synthetic), args.seed)
    if args.n is not None:
        work = wl.take_first(work, args.n)
    if args.tenants or args.priorities:
        work = wl.assign_mix(
            work,
            wl.parse_shares(args.tenants or ""),
            wl.parse_shares(args.priorities or ""),
            args.seed,
        )
    if args.rate is not None:
        work = wl.rescale_rate(work, args.rate)
    return wl.scale_lengths(work, args.ctx_scale, args.gen_scale)


def _bench(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console

    from bench import counting
    from bench import workload as wl
    from bench.payload import (
        OUTPUT_TOKENS_FIELD,
        Forcing,
        PayloadOptions,
        parse_header_option,
        plan_requests,
    )
    from bench.prompts import PromptFactory
    from bench.report import DEFAULT_TTFT_SLO_S

    deadline_header_s, ttft_header_s = client_headers(
        args.clients, args.deadline, args.ttft_slo, DEFAULT_TTFT_SLO_S
    )
    console = Console(stderr=True)
    log: Callable[[str], None] = console.print
    targets = [t.rstrip("/").removesuffix("/v1") for t in args.target]
    headers = tuple(parse_header_option(h) for h in args.header)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    work = build_workload(args)
    with httpx.Client(timeout=counting.SETUP_TIMEOUT_S) as client:
        infos = [counting.fetch_model_info(client, t, args.model) for t in targets]
        known = [i for i in infos if i is not None]
        model = args.model or (known[0].name if known else None)
        if model is None:
            raise RuntimeError("no target answers /v1/models: pass --model")
        lens = [i.max_model_len for i in known if i.max_model_len is not None]
        max_model_len = args.max_model_len or (min(lens) if lens else None)
        if max_model_len is None:
            log("[yellow]max_model_len unknown (pass --max-model-len): lengths not clamped")
        tokenizer_dir = args.tokenizer
        if tokenizer_dir is None:
            roots = [i.root for i in known if i.root and Path(i.root).is_dir()]
            tokenizer_dir = roots[0] if roots else None
        tokenize_base = (
            None
            if tokenizer_dir is not None
            else _first_tokenize_base(client, targets, args.backend_metrics, model)
        )
        count = counting.choose_counter(
            tokenizer_dir=tokenizer_dir,
            api=args.api,
            model=model,
            tokenize_url=tokenize_base,
            client=client,
            log=log,
        )
        forcing = Forcing.NONE if args.no_force_output else Forcing(args.force_output)
        eos: int | None = None
        if forcing is Forcing.MIN_TOKENS:
            eos = args.eos_id
            if eos is None and tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
                eos = counting.eos_token_id(tokenizer_dir)
            if eos is None:
                raise RuntimeError("EOS token id unknown: pass --eos-id or another --force-output")

        unforced: list[str] = []
        if forcing is Forcing.XARGS:
            unforced = [
                t
                for t in targets
                if not counting.honours_forced_length(client, t, model, OUTPUT_TOKENS_FIELD)
            ]
            for target in unforced:
                log(
                    f"[yellow]{target} does not read vllm_xargs.{OUTPUT_TOKENS_FIELD}: its output lengths "
                    "are not forced (start vLLM with tests/testbed/testbed.py, which loads the logits "
                    "processor, or pass --force-output min-tokens)"
                )

        work, clamp = wl.clamp_to_context(work, max_model_len, args.max_tokens)
        factory = PromptFactory.calibrate(count, seed=args.seed, block_tokens=work.block_tokens)
        with console.status(f"synthesising {len(work)} prompts"):
            prompts = [factory.text_for(spec, i)[0] for i, spec in enumerate(work.requests)]

    options = PayloadOptions(
        model=model,
        api=args.api,
        max_tokens_cap=args.max_tokens,
        max_model_len=max_model_len,
        forcing=forcing,
        eos_token_id=eos,
        token_ids=not args.no_token_ids,
        deadline_s=deadline_header_s,
        ttft_slo_s=ttft_header_s,
        oracle=args.oracle,
        headers=headers,
    )
    plan = plan_requests(work.requests, prompts, options)
    offered_s = wl.offered_seconds(work)
    workload_facts: dict[str, Any] = {
        **wl.describe(work),
        "trace": args.trace,
        "synthetic": args.synthetic,
        "ctx_scale": args.ctx_scale,
        "gen_scale": args.gen_scale,
        "rate": args.rate,
        "max_model_len": max_model_len,
        "clamped": asdict(clamp),
        "prompt_overhead_tokens": factory.overhead,
        # Prompts shorter than the template allows could not be built at their length.
        "prompts_lengthened": sum(1 for r in work.requests if r.prompt_tokens < factory.min_prompt_tokens),
    }
    settings: dict[str, Any] = {
        "targets": targets,
        "backend_metrics": args.backend_metrics,
        "model": model,
        "api": args.api,
        "max_tokens": args.max_tokens,
        "deadline_s": args.deadline,
        "ttft_slo_s": args.ttft_slo,
        "clients": args.clients,
        "headers_deadline_s": deadline_header_s,
        "headers_ttft_s": ttft_header_s,
        "oracle": args.oracle,
        "seed": args.seed,
        "output_forcing": forcing.value,
        "eos_token_id": eos,
        "forced_output_lengths": forcing is not Forcing.NONE,
        "targets_ignoring_the_length_field": unforced,
        "headers": [f"{k}: {v}" for k, v in headers],
    }
    results = _run_all(targets, plan, args, console)
    return _write_outputs(results, out, offered_s, workload_facts, settings, args, console)


def _first_tokenize_base(
    client: Any, targets: Sequence[str], backend_metrics: Sequence[str], model: str
) -> str | None:
    """The first server among the targets and backends that answers /tokenize."""
    import httpx

    bases = list(targets) + [u.rstrip("/").removesuffix("/metrics") for u in backend_metrics]
    for base in dict.fromkeys(bases):
        try:
            response = client.post(f"{base}/tokenize", json={"model": model, "prompt": "a"})
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            return base
    return None


def _run_all(targets: Sequence[str], plan: Any, args: argparse.Namespace, console: Any) -> list[RunResult]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskID,
        TimeElapsedColumn,
    )

    from bench.records import RequestRecord
    from bench.runner import RunOptions, metrics_url, quiet_gc, run_target

    async def run() -> list[RunResult]:
        results: list[RunResult] = []
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            runs = [(r, t) for r in range(args.repeat) for t in targets]
            for i, (round_no, target) in enumerate(runs):
                label = target if args.repeat == 1 else f"{target} #{round_no + 1}"
                task = progress.add_task(f"[{i}] {label}", total=len(plan))
                urls = tuple(
                    dict.fromkeys([metrics_url(target), *(metrics_url(u) for u in args.backend_metrics)])
                )
                options = RunOptions(
                    deadline_s=args.deadline,
                    metrics_urls=urls,
                    sample_period_s=args.sample_period,
                    idle_timeout_s=args.idle_timeout,
                    request_timeout_s=args.request_timeout,
                )

                def advance(_record: RequestRecord, task_id: TaskID = task) -> None:
                    progress.advance(task_id)

                results.append(await run_target(target, plan, options, on_record=advance, label=label))
        return results

    with quiet_gc():
        return run_on_fast_loop(run())


def run_on_fast_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop when installed (less overhead per request and chunk)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _write_outputs(
    results: Sequence[RunResult],
    out: Path,
    offered_s: float,
    workload_facts: dict[str, Any],
    settings: dict[str, Any],
    args: argparse.Namespace,
    console: Any,
) -> int:
    from rich.table import Table

    from bench.plots import write_plots
    from bench.report import (
        DEFAULT_TTFT_SLO_S,
        compare,
        mean_over_rounds,
        render_markdown,
        summarize,
    )

    slo = args.ttft_slo if args.ttft_slo is not None else DEFAULT_TTFT_SLO_S
    summaries = [summarize(r, offered_s=offered_s, deadline_s=args.deadline, ttft_slo_s=slo) for r in results]
    for i, result in enumerate(results):
        with (out / f"requests-{i}.jsonl").open("w", encoding="utf-8") as handle:
            for record in result.records:
                handle.write(json.dumps(record.to_json()) + "\n")
        with (out / f"metrics-{i}.jsonl").open("w", encoding="utf-8") as handle:
            for point in result.samples:
                handle.write(
                    json.dumps({"t_s": point.t_s, "source": point.source, **asdict(point.reading)}) + "\n"
                )
    plots = write_plots(results, args.deadline, out)
    rows = compare(summaries)
    targets = settings["targets"]
    groups = [[s for j, s in enumerate(summaries) if j % len(targets) == i] for i in range(len(targets))]
    rounds = mean_over_rounds(groups) if args.repeat > 1 else ()
    summary = {
        "workload": workload_facts,
        "settings": settings,
        "targets": [s.to_json() for s in summaries],
        "comparison": [{"metric": r.label, "values": list(r.values), "ratios": list(r.ratios)} for r in rows],
        "mean_over_rounds": [
            {
                "metric": r.label,
                "means": list(r.means),
                "mins": list(r.mins),
                "maxs": list(r.maxs),
                "ratios": list(r.ratios),
            }
            for r in rounds
        ],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    notes = [
        f"start lag p99 for [{i}]: {s.start_lag_s.p99 * 1000:.2f} ms"
        for i, s in enumerate(summaries)
        if s.start_lag_s.p99 is not None
    ]
    (out / "report.md").write_text(
        render_markdown(
            summaries,
            workload=workload_facts,
            settings=settings,
            plots=plots,
            notes=notes,
            rounds=rounds,
            round_targets=targets,
        ),
        encoding="utf-8",
    )
    table = Table(title=f"kvgate bench ({len(results[0].records) if results else 0} requests)")
    table.add_column("metric")
    for i, s in enumerate(summaries):
        table.add_column(f"[{i}] {s.target}", justify="right")
    for row in rows:
        cells = []
        for j, (value, ratio) in enumerate(zip(row.values, row.ratios, strict=True)):
            text = "-" if value is None else row.fmt.format(value)
            cells.append(text + (f" ({ratio:.2f}x)" if j and ratio is not None else ""))
        table.add_row(row.label, *cells)
    console.print(table)
    if rounds:
        means = Table(title=f"mean over {args.repeat} rounds (min..max)")
        means.add_column("metric")
        for target in targets:
            means.add_column(target, justify="right")
        for mrow in rounds:
            means.add_row(
                mrow.label,
                *(
                    "-"
                    if m is None
                    else f"{mrow.fmt.format(m)} ({mrow.fmt.format(lo)}.."
                    f"{mrow.fmt.format(hi)})" + (f" {r:.2f}x" if j and r is not None else "")
                    for j, (m, lo, hi, r) in enumerate(
                        zip(mrow.means, mrow.mins, mrow.maxs, mrow.ratios, strict=True)
                    )
                ),
            )
        console.print(means)
    for s in summaries:
        if s.backend_shared:
            console.print(
                f"[yellow]warning: during the run against {s.target} the backend also "
                "served other clients; its deltas are not this run's alone"
            )
    console.print(f"wrote {out / 'report.md'} and {out / 'summary.json'}")
    return 0
