"""The `kvgate` command line: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives and exposes `register(subparsers)`, which adds
its parser and sets `func`; heavy imports stay inside the functions so that `kvgate --help`
is instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Modules that contribute a subcommand, in the order `kvgate --help` lists them.
SUBCOMMAND_MODULES: tuple[str, ...] = ("estimator.cli", "gateway.serve_cli", "sim.cli", "bench.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="Admission control for vLLM against its live KV-cache block budget.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # kvgate uses transformers for tokenizers only and never needs PyTorch, whose absence
    # transformers announces on import as "Models won't be available": advice, not an error,
    # that would look like one to someone starting kvgate. An explicit setting still wins.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_code: int = args.func(args)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
