"""Start, check and stop the real vLLM CPU testbed.

    python tests/testbed/testbed.py start [--port 8011] [--pidfile F] [--log F]
    python tests/testbed/testbed.py stop  [--pidfile F]

`start` installs the testbed if needed (tests/testbed/install.sh), launches vLLM's OpenAI
server on the tiny model with a small KV pool (64 blocks of 32 tokens: contention is real),
waits until it answers, and prints its URL. Every engine loads the bench's length-forcing logits
processor (bench_lengths.py beside this file). The engine is pinned to the last core so that the
gateway and the load generator on the other core do not steal its time; `--core N` pins it to
core N instead, so that two engines side by side (tests/benchmarks/fleet.py) each get a core of
their own rather than sharing the last one. Used by `make test`, `make demo` and the session
fixture in tests/conftest.py; standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_PORT = 8011
STARTUP_TIMEOUT_S = 600.0
SERVED_MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 32
NUM_BLOCKS = 64
# The bench forces output lengths through this logits processor (tests/testbed/bench_lengths.py,
# importable because server_env puts this folder on the engine's path): a private
# `vllm_xargs` field no gateway reads, instead of `min_tokens`, which kvgate reserves for.
LOGITS_PROCESSOR = "bench_lengths:ForcedOutputLength"


def install() -> tuple[Path, Path]:
    """Create the vLLM venv and the tiny model if missing; return (venv, model folder)."""
    out = (
        subprocess.run(["bash", str(HERE / "install.sh")], check=True, stdout=subprocess.PIPE, text=True)
        .stdout.strip()
        .splitlines()
    )
    venv = Path(out[-1])
    cache = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate"))
    return venv, cache / "tiny-llama"


def model_dir() -> Path:
    cache = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate"))
    return cache / "tiny-llama"


def engine_core(core: int | None) -> int | None:
    """The core an engine is pinned to: `core` when given, else the last one; None on a
    single-core machine (nothing to keep apart)."""
    cores = os.cpu_count() or 1
    if core is not None:
        if not 0 <= core < cores:
            raise ValueError(f"core {core} does not exist: this machine has cores 0..{cores - 1}")
        return core
    return cores - 1 if cores > 1 else None


def server_command(
    venv: Path, model: Path, port: int, extra: list[str], core: int | None = None
) -> list[str]:
    command = [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(NUM_BLOCKS),
        "--dtype",
        "bfloat16",
        "--disable-uvicorn-access-log",
        "--logits-processors",
        LOGITS_PROCESSOR,
        *extra,
    ]
    pinned = engine_core(core)
    if pinned is not None and shutil.which("taskset"):
        command = ["taskset", "-c", str(pinned), *command]
    return command


def server_env(core: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    # Both the API server (which validates the field) and the engine core import the processor.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    # vLLM binds its compute threads itself too: to the same core as the process, or the
    # taskset above and its OpenMP binding would disagree.
    pinned = engine_core(core)
    if pinned is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(pinned)
    return env


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start(
    port: int, log_path: Path, extra: list[str] | None = None, core: int | None = None
) -> subprocess.Popen[bytes]:
    """Launch the server in its own process group, pinned to `core` (default: the last
    core), and wait until it is healthy."""
    venv, model = install()
    url = f"http://127.0.0.1:{port}"
    if is_ready(url):
        raise RuntimeError(f"something already answers on {url}; pick another port")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:  # the server keeps its own copy of the descriptor
        process = subprocess.Popen(
            server_command(venv, model, port, extra or [], core),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(core),
            start_new_session=True,
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM exited with {process.returncode} during start-up:\n{tail}")
        if is_ready(url):
            return process
        time.sleep(1.0)
    stop_process(process.pid)
    raise RuntimeError(f"vLLM did not become healthy within {STARTUP_TIMEOUT_S:.0f} s; see {log_path}")


def stop_process(pid: int, grace_s: float = 20.0) -> None:
    """Stop the server's whole process group (API server, engine core, worker)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def serving(url_env: str, log_dir: Path, flags: list[str], port: int) -> Iterator[str]:
    """Base URL of a testbed serving the tiny model with `flags`, for a test session or module:
    the one the environment variable `url_env` names when it is set (it must answer), else one
    started here on `port` and stopped after."""
    given = os.environ.get(url_env)
    if given:
        url = given.rstrip("/")
        if not is_ready(url):
            raise RuntimeError(f"{url_env}={url} does not answer /health")
        yield url
        return
    process = start(port, log_dir / "vllm.log", flags)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(process.pid)
        process.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="action", required=True)
    start_parser = sub.add_parser("start")
    start_parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    start_parser.add_argument("--pidfile", type=Path, default=Path("build/vllm.pid"))
    start_parser.add_argument("--log", type=Path, default=Path("build/vllm.log"))
    start_parser.add_argument("--core", type=int, help="pin the engine to this core (default: the last one)")
    start_parser.add_argument("extra", nargs="*", help="more vLLM flags, after --")
    stop_parser = sub.add_parser("stop")
    stop_parser.add_argument("--pidfile", type=Path, default=Path("build/vllm.pid"))
    sub.add_parser("install")
    args = parser.parse_args()

    if args.action == "install":
        venv, model = install()
        print(f"{venv}\n{model}")
        return 0
    if args.action == "start":
        process = start(args.port, args.log, args.extra, args.core)
        args.pidfile.parent.mkdir(parents=True, exist_ok=True)
        args.pidfile.write_text(str(process.pid))
        print(f"http://127.0.0.1:{args.port}")
        return 0
    if not args.pidfile.exists():
        print(f"no pidfile at {args.pidfile}: nothing to stop", file=sys.stderr)
        return 0
    stop_process(int(args.pidfile.read_text().strip()))
    args.pidfile.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
