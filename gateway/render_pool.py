"""Chat templates sent with requests, rendered where they cannot hurt the gateway.

A template is a program: `{{ 'a' * 10**10 }}` asks for 10 GB in one expression, nested loops
run for hours, and Python can neither interrupt a thread nor cap the memory of one. So a
`RenderPool` renders them in worker processes (spawned, never forked from the threaded gateway)
that load the same tokenizer, each bounded:

- memory: once its tokenizer is loaded, a worker's address space may grow by
  RENDER_MEMORY_BYTES at most (RLIMIT_AS); past it an allocation fails (MemoryError) and the
  worker answers, then exits, to be replaced by a fresh one;
- time: a render that has not answered within RENDER_TIMEOUT_S of wall-clock time is over: its
  worker is killed (SIGKILL) and replaced; RLIMIT_CPU stops a worker that loses its gateway;
- output: a prompt longer than the counter's `max_prompt_chars` (MAX_PROMPT_CHARS_PER_BODY_BYTE
  times max_body_bytes) is refused in the worker, so no more than that comes back.

Each exceeded bound is a 400 (`chat_template_too_costly`). Only the rendered text comes back: it
is tokenized in the gateway like any prompt (render there, count here), so the bounds cover the
template's work alone. Workers start on first use (about 2 s); `render_chat` blocks, so callers
run it on the pool's own `executor`, whose threads only wait: a slow template holds none of the
threads that tokenize other requests, and never the event loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

from estimator.tokens import (
    ChatTemplateError,
    ContentFormat,
    RenderedChat,
    RequestBodyError,
    TokenCounter,
    template_failure,
)

log = logging.getLogger(__name__)

# How many templates render at once; each worker holds its own tokenizer (~110 MB resident on
# the testbed's 32k vocabulary) and is started only when the first template arrives.
RENDER_WORKERS = 2
# Wall-clock time a render may take, from handing the body over to the answer. Real templates
# render a conversation in about a millisecond, and an 8 MiB message in well under a second.
RENDER_TIMEOUT_S = 2.0
# What a worker's address space may grow by past its size with the tokenizer loaded: room for
# a max_body_bytes body, its copies and the rendered text, not for a template's 10 GB string.
RENDER_MEMORY_BYTES = 256 * 1024 * 1024
# A rendered prompt may hold this many characters per byte of max_body_bytes. A template that
# adds a few markers per message stays far below it; one that repeats the conversation does not.
MAX_PROMPT_CHARS_PER_BODY_BYTE = 2
# Loading a worker's tokenizer, from the spawn to its "ready".
RENDER_STARTUP_TIMEOUT_S = 60.0
# CPU seconds a worker may spend per render, past which the kernel kills it (SIGXCPU): the
# wall-clock timeout's backstop should the gateway die while a render runs.
RENDER_CPU_BACKSTOP_S = 4 * RENDER_TIMEOUT_S
KILL_WAIT_S = 5.0

# Rendered in each new worker before it reports ready: compiles jinja, makes its tokenizer copy.
_WARM_UP_BODY = {"messages": [{"role": "user", "content": "warm up"}], "chat_template": "{{ messages }}"}


class RenderPoolError(RuntimeError):
    """No worker could be started (kvgate's fault, not the request's): the service answers 503."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker loads and the bounds it keeps (picklable: it crosses to the child)."""

    tokenizer_source: str
    max_model_len: int | None
    content_format: ContentFormat
    max_prompt_chars: int | None
    memory_bytes: int
    cpu_backstop_s: float


class _TimeoutError(Exception):
    pass


class _DiedError(Exception):
    pass


class _Worker:
    """One worker process and the parent's end of its pipe. Used by one thread at a time."""

    def __init__(self, process: subprocess.Popen[bytes], conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.ready = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout_s):
            raise RenderPoolError(f"the template renderer did not start within {timeout_s:g} s")
        try:
            message = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise RenderPoolError(
                f"the template renderer exited while starting ({self.exit_status()})"
            ) from exc
        if message[0] != "ready":
            raise RenderPoolError(f"the template renderer could not start: {message[1]}")
        self.ready = True

    def ask(self, body: Mapping[str, Any], timeout_s: float) -> tuple[bool, tuple[Any, ...]]:
        """The worker's answer, and whether the worker exits after it (it ran out of memory)."""
        try:
            self.conn.send(body)
        except (OSError, EOFError) as exc:
            raise _DiedError from exc
        if not self.conn.poll(timeout_s):
            raise _TimeoutError
        try:
            retiring, reply = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise _DiedError from exc
        return bool(retiring), reply

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(KILL_WAIT_S)
        with contextlib.suppress(OSError):
            self.conn.close()

    def exit_status(self) -> str:
        try:
            code = self.process.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            return "still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


class RenderPool:
    """A `TemplateSandbox` (estimator.tokens): renders request templates in bounded worker
    processes. Thread-safe; `close` stops every worker, and the pool starts new ones on demand."""

    def __init__(
        self,
        tokenizer_source: str,
        *,
        max_model_len: int | None,
        max_prompt_chars: int | None,
        content_format: ContentFormat = "auto",
        workers: int = RENDER_WORKERS,
        timeout_s: float = RENDER_TIMEOUT_S,
        memory_bytes: int = RENDER_MEMORY_BYTES,
    ) -> None:
        self.spec = WorkerSpec(
            tokenizer_source=tokenizer_source,
            max_model_len=max_model_len,
            content_format=content_format,
            max_prompt_chars=max_prompt_chars,
            memory_bytes=memory_bytes,
            cpu_backstop_s=max(RENDER_CPU_BACKSTOP_S, 4 * timeout_s),
        )
        self.timeout_s = timeout_s
        self._workers = workers
        # One slot per worker; None until a worker is started there. A render takes a slot for
        # its whole duration, so at most `workers` render at once and the rest wait here.
        self._idle: list[_Worker | None] = [None] * workers
        self._idle_changed = threading.Condition()
        self._lock = threading.Lock()  # guards the fields below
        self._threads: ThreadPoolExecutor | None = None
        self._live: set[_Worker] = set()
        self.started = 0  # workers started so far (the first ones and every replacement)

    @property
    def executor(self) -> Executor:
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(
                    max_workers=self._workers, thread_name_prefix="kvgate-render"
                )
            return self._threads

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [worker.pid for worker in self._live]

    def render_chat(self, body: Mapping[str, Any]) -> RenderedChat | int:
        worker = self._take()
        try:
            worker = self._ready(worker)
            try:
                retiring, reply = worker.ask(body, self.timeout_s)
            except _TimeoutError:
                log.warning(
                    "a request's chat template ran past %g s: its renderer was killed", self.timeout_s
                )
                self._forget(worker)
                worker = self._spawn()  # the replacement loads while nobody waits for it
                raise ChatTemplateError(
                    f"the chat template did not render within kvgate's bound of {self.timeout_s:g} s",
                    "messages",
                    "chat_template_too_costly",
                ) from None
            except _DiedError:
                status = worker.exit_status()
                log.warning("a request's chat template ended its renderer (%s)", status)
                self._forget(worker)
                worker = self._spawn()
                raise ChatTemplateError(
                    f"the chat template exceeded kvgate's bounds (its renderer ended: {status})",
                    "messages",
                    "chat_template_too_costly",
                ) from None
            if retiring:
                self._forget(worker)
                worker = self._spawn()
        finally:
            with self._idle_changed:
                self._idle.append(worker)
                self._idle_changed.notify()
        return _from_reply(reply)

    def _take(self) -> _Worker | None:
        """An idle slot: a loaded worker first, then one still loading (a replacement), then an
        empty slot, so that a render after a killed worker need not wait for its replacement."""

        def rank(worker: _Worker | None) -> int:
            if worker is None:
                return 0
            return 2 if worker.ready else 1

        with self._idle_changed:
            while not self._idle:
                self._idle_changed.wait()
            best = max(range(len(self._idle)), key=lambda index: rank(self._idle[index]))
            return self._idle.pop(best)

    def _ready(self, worker: _Worker | None) -> _Worker:
        """`worker` once it has loaded, or a new one in its place if it is gone."""
        if worker is None or not worker.alive():
            self._forget(worker)
            worker = self._spawn()
        try:
            worker.wait_ready(RENDER_STARTUP_TIMEOUT_S)
        except RenderPoolError:
            self._forget(worker)
            raise
        return worker

    def close(self) -> None:
        """Kill every worker (a render in progress is refused); later renders start new ones."""
        with self._lock:
            live, self._live = self._live, set()
        for worker in live:
            worker.kill()

    def _spawn(self) -> _Worker:
        # A fresh interpreter, not a fork (the gateway has threads, whose locks a fork copies
        # mid-use) and not multiprocessing's spawn (which re-imports the parent's __main__).
        parent_end, child_end = Pipe(duplex=True)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(_SOURCE_ROOT), os.environ.get("PYTHONPATH")])),
            # No tokenizer threads in a worker: their stacks would count against its memory cap.
            "TOKENIZERS_PARALLELISM": "false",
            "TRANSFORMERS_VERBOSITY": "error",
        }
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_ENTRY, str(child_end.fileno())],
                pass_fds=(child_end.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
            )
        except OSError as exc:
            parent_end.close()
            raise RenderPoolError(f"cannot start a template renderer: {exc}") from exc
        finally:
            child_end.close()
        parent_end.send(self.spec)
        worker = _Worker(process, parent_end)
        with self._lock:
            self._live.add(worker)
            self.started += 1
        return worker

    def _forget(self, worker: _Worker | None) -> None:
        if worker is None:
            return
        with self._lock:
            self._live.discard(worker)
        worker.kill()


def _from_reply(reply: tuple[Any, ...]) -> RenderedChat | int:
    kind = reply[0]
    if kind == "rendered":
        rendered: RenderedChat | int = reply[1]  # a count when there is no tokenizer
        return rendered
    if kind == "template":
        raise ChatTemplateError(reply[1], reply[2], reply[3])
    raise RequestBodyError(reply[1], reply[2])


# -- the worker process ---------------------------------------------------------------------------

# The folder that holds the gateway and estimator packages, for the worker's imports.
_SOURCE_ROOT = Path(__file__).resolve().parent.parent
_WORKER_ENTRY = "import sys; from gateway.render_pool import worker_main; worker_main(int(sys.argv[1]))"


def worker_main(fd: int) -> None:
    """Entry point of a worker process: its end of the pipe is file descriptor `fd`, and the
    first message on it is the WorkerSpec."""
    # The terminal's Ctrl-C reaches the whole process group; shutting down is the gateway's job.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        spec = conn.recv()
    except (EOFError, OSError):
        return
    serve_worker(conn, spec)


def serve_worker(conn: Connection, spec: WorkerSpec) -> None:
    """A worker's life: load the tokenizer, cap the address space, then render bodies until the
    pipe closes. Ends after any MemoryError (a fresh worker replaces it)."""
    try:
        counter = TokenCounter.from_pretrained(
            spec.tokenizer_source,
            content_format=spec.content_format,
            max_model_len=spec.max_model_len,
            request_templates="render",
            max_prompt_chars=spec.max_prompt_chars,
        )
        counter.render_chat(_WARM_UP_BODY)
        loaded = _address_space_bytes()
        if loaded is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            soft = loaded + spec.memory_bytes
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(("failed", repr(exc)))
        return
    try:
        conn.send(("ready", loaded))
    except OSError:
        return  # the gateway went away while this worker loaded
    while True:
        try:
            body = conn.recv()
        except (EOFError, OSError):
            return  # the gateway is gone, or closed the pool
        except MemoryError:
            return  # the body alone did not fit: the parent sees the pipe close
        _limit_cpu(spec.cpu_backstop_s)
        out_of_memory = False
        reply: tuple[Any, ...]
        try:
            rendered = counter.render_chat(body)
        except ChatTemplateError as exc:
            reply = ("template", exc.message, exc.param, exc.code)
            out_of_memory = isinstance(exc.__cause__, MemoryError)
        except RequestBodyError as exc:
            reply = ("body", exc.message, exc.param)
        except Exception as exc:  # the body's normalisation can run out of memory too
            failure = template_failure(exc)
            reply = ("template", failure.message, failure.param, failure.code)
            out_of_memory = isinstance(exc, MemoryError)
        else:
            reply = ("rendered", rendered)
        del body
        try:
            conn.send((out_of_memory, reply))
        except MemoryError:
            return
        if out_of_memory:
            return  # its heap may be fragmented or held: a fresh worker takes its place


def _address_space_bytes() -> int | None:
    """This process's virtual memory size (Linux), or None where /proc does not say."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _limit_cpu(seconds: float) -> None:
    """Let this process use `seconds` more CPU time from now, then be killed (SIGXCPU)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used + seconds)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
