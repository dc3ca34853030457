"""`kvgate serve`: run the admission-control gateway in front of one vLLM backend.

Every setting can come from a flag, a `KVGATE_*` environment variable or the `--config` file
(flags win, then the environment, then the file); the common ones have flags of their own,
any other is set with `--set NAME=VALUE` (names as in `gateway.settings.Settings`).
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys
from pathlib import Path
from typing import Any

EXIT_USAGE = 2


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="admit, queue or shed requests against a vLLM backend's live KV-block budget",
        description=(
            "Serve an OpenAI-compatible API in front of a vLLM server, admitting each request only "
            "when its KV-cache blocks fit the backend's live budget, queueing it otherwise, and "
            "shedding it with Retry-After when it cannot be served in time."
        ),
    )
    parser.add_argument(
        "--backend", dest="backend_url", metavar="URL", help="vLLM base URL, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--model", help="served model name, or a model folder / id for the tokenizer")
    parser.add_argument("--tokenizer", help="tokenizer folder or id in the local Hugging Face cache")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8080)")
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML or JSON file of settings")
    parser.add_argument("--backend-name", help="label of the backend in metrics (default 'default')")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--log-format", choices=["text", "json"], help="text (default), or one JSON object per line"
    )
    parser.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other setting, e.g. --set output_quantile=0.8 (repeatable)",
    )
    parser.set_defaults(func=run)


class UsageError(Exception):
    pass


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gives, as raw values for Settings to validate."""
    values: dict[str, Any] = {
        name: getattr(args, name)
        for name in (
            "backend_url",
            "model",
            "tokenizer",
            "host",
            "port",
            "backend_name",
            "log_level",
            "log_format",
        )
    }
    for assignment in args.assignments:
        name, sep, value = assignment.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--set expects NAME=VALUE, got {assignment!r}")
        values[name.strip().replace("-", "_")] = value
    return values


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from gateway.settings import ConfigFileError, load_settings

    try:
        settings = load_settings(overrides_from(args), config_file=args.config)
    except UsageError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigFileError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValidationError as exc:
        print(f"kvgate serve: {exc.error_count()} invalid setting(s):", file=sys.stderr)
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "settings"
            print(f"  {where}: {error['msg']}", file=sys.stderr)
        return EXIT_USAGE

    from gateway.app import create_app
    from gateway.lifecycle import serve
    from gateway.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    app = create_app(settings)
    # uvicorn stops gracefully on SIGTERM and then raises the signal again under the handler
    # that was in place before it started; with the default one the process would die with
    # -15. A graceful stop is a success: let that second SIGTERM do nothing, and exit 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    # What is loaded by now (FastAPI, pydantic, transformers: a few hundred thousand objects)
    # lives as long as the process. Frozen, it is left out of the collector's full passes,
    # which would otherwise walk all of it and stall every request in flight for tens of ms.
    gc.collect()
    gc.freeze()
    # SIGTERM drains, SIGHUP reloads from the same sources (see gateway.lifecycle).
    serve(
        app,
        settings,
        load_settings=lambda: load_settings(overrides_from(args), config_file=args.config),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # uvicorn's records go to the root handler too, in the same format (and as JSON).
        log_config=None,
        access_log=False,
        # Responses carry the backend's headers and kvgate's, not an advert for the server.
        server_header=False,
        lifespan="on",
        # One worker: the ledger and the queue live in this process.
        workers=1,
    )
    return 0
