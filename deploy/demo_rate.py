"""`make demo`'s load, measured on the machine at hand: the rate of the demo's burst that vLLM
straight sustains.

The testbed's speed differs by 2x between machines and by a fifth between runs, so a burst
fixed in requests per second is within capacity on one machine and far beyond it on another.
The demo therefore measures its own 1x as the campaigns do (`bench.loads`): bursts of the
demo's requests straight to vLLM, doubling and then bisecting the rate, until it knows the
highest rate at which vLLM finished at least 98% within the deadline; 1x is that rate times
the margin (0.8). Prints `1x=<rate>` on standard output, what it tried on standard error.
The load generator runs where this script runs (`make demo` pins both to the gateway's core).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench import loads


def finished_share(args: argparse.Namespace, rate: float) -> float:
    """One burst at `rate` straight to vLLM: the share of it finished within the deadline."""
    out = args.out / f"rate-{rate:.4g}"
    command = [
        sys.executable, "-m", "gateway.cli", "bench", "--target", args.vllm,
        "--synthetic", f"n={args.n},rate={rate:.4g},{args.requests}",
        "--max-tokens", str(args.max_tokens), "--clients", "deadline", "--deadline", str(args.deadline),
        "--seed", str(args.seed), "--out", str(out),
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    with (out / "bench.log").open("wb") as log:
        done = subprocess.run(command, check=False, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"kvgate bench exited with {done.returncode}: see {out / 'bench.log'}")
    [result] = json.loads((out / "summary.json").read_text())["targets"]
    share = loads.finished_share_of(result)
    print(
        f"   {rate:.3g}/s: vLLM finished {result['ok']} of {result['sent']} within {args.deadline:g} s",
        file=sys.stderr,
    )
    return share


def measure(args: argparse.Namespace) -> loads.RateSearch:
    """The search, one burst straight to vLLM per rate tried."""
    return loads.find_rate(
        lambda rate: finished_share(args, rate),
        start_rate=args.start_rate,
        max_doublings=args.max_doublings,
        bisections=args.bisections,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm", required=True, help="vLLM's base URL")
    parser.add_argument(
        "--requests", required=True, help="the burst's prompt and output keys (kvgate bench --synthetic)"
    )
    parser.add_argument("-n", type=int, default=40, help="requests per burst")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--deadline", type=float, default=10.0)
    parser.add_argument("--start-rate", type=float, default=4.0)
    parser.add_argument("--max-doublings", type=int, default=loads.DEFAULT_MAX_DOUBLINGS)
    parser.add_argument("--bisections", type=int, default=2)
    parser.add_argument("--seed", type=int, default=5, help="not the bursts' seed: other prompts")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    search = measure(parse_args(argv))
    if search.one_x is None:
        print("no rate tried was sustained: the testbed is too slow for the demo's deadline", file=sys.stderr)
        return 1
    print(f"1x={search.one_x:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
