"""`kvgate sim`: serve the vLLM emulator (also `python -m sim.cli` with the same flags).

Example, the CPU testbed's shape with its calibrated step cost (all defaults):

    kvgate sim --port 8100 --num-blocks 64 --block-size 32 --max-model-len 1024

Faults can be set here (`--fault-*`) and changed while running through `POST /sim/faults`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from sim import engine as engine_defaults
from sim.config import DEFAULT_EOS_TOKEN_ID, DEFAULT_MODEL_NAME, SimConfig
from sim.faults import Faults, MetricsMode

DEFAULT_PORT = 8100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve = parser.add_argument_group("server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--log-level", default="warning")

    eng = parser.add_argument_group("engine (vLLM's names)")
    eng.add_argument(
        "--num-blocks",
        type=int,
        default=engine_defaults.DEFAULT_NUM_BLOCKS,
        help="KV blocks, as vLLM's num_gpu_blocks (block 0 is the null block)",
    )
    eng.add_argument("--block-size", type=int, default=engine_defaults.DEFAULT_BLOCK_SIZE)
    eng.add_argument("--max-model-len", type=int, default=engine_defaults.DEFAULT_MAX_MODEL_LEN)
    eng.add_argument("--max-num-seqs", type=int, default=engine_defaults.DEFAULT_MAX_NUM_SEQS)
    eng.add_argument(
        "--max-num-batched-tokens", type=int, default=engine_defaults.DEFAULT_MAX_NUM_BATCHED_TOKENS
    )
    eng.add_argument("--watermark", type=float, default=0.0)
    eng.add_argument("--long-prefill-token-threshold", type=int, default=0)
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    eng.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=None,
        help="vLLM 0.32's frontend limit on unfinished sequences (503 beyond)",
    )
    eng.add_argument(
        "--max-num-queued-tokens",
        type=int,
        default=None,
        help="vLLM 0.32's frontend limit on prompt tokens awaiting prefill (503)",
    )

    cost = parser.add_argument_group(
        "step time = base + per_token * tokens + per_seq * seqs + per_request * new requests"
    )
    cost.add_argument("--step-base-ms", type=float, default=engine_defaults.DEFAULT_STEP_BASE_S * 1e3)
    cost.add_argument(
        "--step-per-token-ms", type=float, default=engine_defaults.DEFAULT_STEP_PER_TOKEN_S * 1e3
    )
    cost.add_argument("--step-per-seq-ms", type=float, default=engine_defaults.DEFAULT_STEP_PER_SEQ_S * 1e3)
    cost.add_argument(
        "--step-per-request-ms", type=float, default=engine_defaults.DEFAULT_STEP_PER_REQUEST_S * 1e3
    )

    model = parser.add_argument_group("model")
    model.add_argument("--model-name", "--served-model-name", dest="model_name", default=DEFAULT_MODEL_NAME)
    model.add_argument(
        "--tokenizer",
        default=None,
        help="model folder whose tokenizer counts prompts exactly (default: approximate counts)",
    )
    model.add_argument("--eos-token-id", type=int, default=DEFAULT_EOS_TOKEN_ID)
    model.add_argument(
        "--output-len",
        default="max",
        help="natural output length when nothing forces it: max, fixed:N, "
        "uniform:LO:HI, exponential:MEAN, lognormal:MEDIAN:SIGMA",
    )
    model.add_argument("--seed", type=int, default=0)

    faults = parser.add_argument_group("faults (also POST /sim/faults at run time)")
    faults.add_argument("--fault-crash-after-tokens", type=int, default=None)
    faults.add_argument("--fault-reset-after-tokens", type=int, default=None)
    faults.add_argument("--fault-stall-after-tokens", type=int, default=None)
    faults.add_argument("--fault-error-rate", type=float, default=0.0)
    faults.add_argument("--fault-error-status", type=int, default=500)
    faults.add_argument("--fault-first-byte-delay-s", type=float, default=0.0)
    faults.add_argument("--fault-hang", action="store_true")
    faults.add_argument("--fault-metrics-delay-s", type=float, default=0.0)
    faults.add_argument(
        "--fault-metrics-mode", choices=[m.value for m in MetricsMode], default=MetricsMode.NORMAL.value
    )
    faults.add_argument("--fault-metrics-status", type=int, default=404)
    faults.add_argument("--fault-omit-cache-config-info", action="store_true")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The validated config; ValueError lists every problem at once."""
    from sim.engine import EngineConfig, StepCost
    from sim.lengths import OutputLengthModel

    problems: list[str] = []
    try:
        output_len = OutputLengthModel.parse(args.output_len)
    except ValueError as exc:
        problems.append(str(exc))
        output_len = OutputLengthModel()
    fault_values: dict[str, Any] = {
        name: getattr(args, "fault_" + name) for name in Faults.__dataclass_fields__
    }
    try:
        faults = Faults().updated(fault_values)
    except ValueError as exc:
        problems.append(str(exc))
        faults = Faults()
    config = SimConfig(
        engine=EngineConfig(
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            watermark=args.watermark,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            enable_prefix_caching=args.enable_prefix_caching,
            step_cost=StepCost(
                base_s=args.step_base_ms / 1e3,
                per_token_s=args.step_per_token_ms / 1e3,
                per_seq_s=args.step_per_seq_ms / 1e3,
                per_request_s=args.step_per_request_ms / 1e3,
            ),
        ),
        model_name=args.model_name,
        tokenizer=args.tokenizer,
        eos_token_id=args.eos_token_id,
        output_len=output_len,
        seed=args.seed,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        faults=faults,
    )
    problems.extend(config.errors())
    if problems:
        raise ValueError("; ".join(problems))
    return config


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from sim.server import create_sim_app

    uvicorn.run(
        create_sim_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        backlog=4096,
        timeout_graceful_shutdown=5,
    )
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="serve a fast block-level emulator of vLLM (OpenAI API, /metrics, faults)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.cli", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
