"""`kvgate serve`: run the admission-control gateway in front of one vLLM backend.

Every setting can come from a flag, a `KVGATE_*` environment variable or the `--config` file
(flags win, then the environment, then the file); the common ones have flags of their own,
any other is set with `--set NAME=VALUE` (names as in `gateway.settings.Settings`).

`--workers N` (with `--redis URL`) runs N kvgate processes on the one port, which share their
budget through Redis; this process then only holds their listening sockets and watches them
(gateway.workers).
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.settings import Settings
    from gateway.workers import SettingsSources

log = logging.getLogger(__name__)

EXIT_USAGE = 2


# Flags whose value lands in settings of other names: one --backend is `backend_url`, several
# are `backends`.
FLAG_SETTINGS = {"backend_urls": ("backend_url", "backends")}


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
        "--backend",
        dest="backend_urls",
        action="append",
        metavar="URL",
        help="vLLM base URL, e.g. http://127.0.0.1:8000; repeat for several (NAME=URL names one)",
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
        "--redis",
        dest="redis_url",
        metavar="URL",
        help="share one budget with every kvgate on this Redis, e.g. redis://127.0.0.1:6379/0",
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="processes serving on this host, sharing the port (default 1; more need --redis)",
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
            "model",
            "tokenizer",
            "host",
            "port",
            "backend_name",
            "log_level",
            "log_format",
            "redis_url",
            "workers",
        )
    }
    urls = args.backend_urls or []
    if len(urls) == 1 and "=" not in urls[0].split("://", 1)[0]:
        values["backend_url"] = urls[0]
    elif urls:
        values["backends"] = urls
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
        overrides = overrides_from(args)
        settings = load_settings(overrides, config_file=args.config)
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

    from gateway.workers import SettingsSources, supervise

    sources = SettingsSources(overrides, args.config)
    if settings.workers > 1:
        # This process only holds the listening sockets and watches the workers (gateway.workers).
        return supervise(settings, sources)
    serve_gateway(settings, sources)
    return 0


def serve_gateway(
    settings: Settings,
    sources: SettingsSources,
    *,
    sockets: list[socket.socket] | None = None,
    on_started: Callable[[], None] | None = None,
) -> bool:
    """Run one whole kvgate in this process until it is stopped: on settings.host and port, or
    on `sockets` inherited from the parent of several workers. `sources` are where the settings
    came from, re-read on reloads. Returns whether it ever served (see gateway.lifecycle.serve)."""
    from gateway.app import create_app
    from gateway.lifecycle import serve
    from gateway.logs import configure_logging
    from gateway.malloc import return_large_blocks_to_the_system

    configure_logging(settings.log_level, settings.log_format)
    if not return_large_blocks_to_the_system():
        log.info("the C library's mmap threshold could not be fixed: freed large bodies may stay resident")
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
    return serve(
        app,
        settings,
        load_settings=sources.load,
        sockets=sockets,
        on_started=on_started,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # uvicorn's records go to the root handler too, in the same format (and as JSON).
        log_config=None,
        access_log=False,
        # Responses carry the backend's headers and kvgate's, not an advert for the server.
        server_header=False,
        lifespan="on",
        # One worker per process: the ledger and the queue live in it (several processes are
        # gateway.workers' job, each with a whole kvgate of its own).
        workers=1,
    )
