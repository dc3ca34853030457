"""`kvgate serve`: flags to settings, every invalid setting reported, and a real process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis
from conftest import bound_socket
from redis_server import running_redis

from gateway.cli import build_parser, main
from gateway.redis_store import RESERVE_LEASE, KeyNames
from gateway.serve_cli import UsageError, overrides_from
from gateway.settings import Settings, load_settings
from gateway.workers import EXIT_FAILURE, SettingsSources, Supervisor, listening_sockets, worker_message
from sim.config import SimConfig
from sim.testing import running_sim

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_flags_and_assignments_become_overrides() -> None:
    args = parse(
        "--backend",
        "http://b:1",
        "--port",
        "9000",
        "--set",
        "output_quantile=0.8",
        "--set",
        "hol-deadline-share=0.3",
    )
    overrides = overrides_from(args)
    assert overrides["backend_url"] == "http://b:1"
    assert overrides["port"] == 9000
    assert overrides["output_quantile"] == "0.8"
    assert overrides["hol_deadline_share"] == "0.3"
    assert overrides["model"] is None  # absent flags are None and override nothing
    with pytest.raises(UsageError):
        overrides_from(parse("--set", "no-equals-sign"))


def test_invalid_settings_are_all_reported_with_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["serve", "--port", "70000", "--set", "output_quantile=3", "--set", "nonsense=1"])
    assert code == 2
    err = capsys.readouterr().err
    for name in ("port", "output_quantile", "nonsense"):
        assert name in err
    assert main(["serve"]) == 2
    assert "give either backend_url (one backend) or backends (several)" in capsys.readouterr().err
    missing = main(["serve", "--backend", "http://b:1", "--config", str(tmp_path / "absent.toml")])
    assert missing == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_kvgate_serve_process_answers_and_stops_on_sigterm(tmp_path: Path) -> None:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    config = tmp_path / "kvgate.toml"
    config.write_text('metrics_poll_interval_s = 0.05\nlog_level = "warning"\n')
    with running_sim(SimConfig()) as backend:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--backend",
                backend,
                "--port",
                str(port),
                "--config",
                str(config),
            ],
            cwd=REPO,
            env={**os.environ, "KVGATE_ADMIN_TOKEN": "t0ken"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
                try:
                    if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "kvgate serve did not become ready"
                time.sleep(0.05)
            body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200
            # The environment's admin token is in force.
            assert httpx.get(f"{url}/admin/state", timeout=5).status_code == 401
            state = httpx.get(
                f"{url}/admin/state", headers={"authorization": "Bearer t0ken"}, timeout=5
            ).json()
            assert state["settings"]["metrics_poll_interval_s"] == 0.05  # from the config file
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
            if process.stdout:
                process.stdout.close()


DESCRIPTOR_PROBE = """
import resource, sys
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
from gateway.lifecycle import client_connection_limit
from gateway.settings import Settings
limit = client_connection_limit(Settings(backend_url="http://127.0.0.1:9", max_connections=50))
print(limit, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize(
    ("soft", "hard", "expected"),
    [
        # The soft limit is raised to fit 4,096 client + 50 backend connections + headroom.
        (256, 8192, (4096, 4096 + 50 + 64)),
        # Even the hard limit is too low: the bound on client connections comes down instead.
        (256, 1024, (1024 - 50 - 64, 1024)),
    ],
)
def test_client_connections_are_bounded_below_the_descriptor_limit(
    soft: int, hard: int, expected: tuple[int, int]
) -> None:
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:
        pytest.skip(f"this process may not raise its descriptor limit to {hard}")
    result = subprocess.run(
        [sys.executable, "-c", DESCRIPTOR_PROBE, str(soft), str(hard)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
        timeout=60,
    )
    assert tuple(int(v) for v in result.stdout.split()) == expected


def test_redis_and_workers_flags_become_settings(capsys: pytest.CaptureFixture[str]) -> None:
    overrides = overrides_from(
        parse("--backend", "http://b:1", "--redis", "redis://r:6379/0", "--workers", "3")
    )
    assert (overrides["redis_url"], overrides["workers"]) == ("redis://r:6379/0", 3)
    settings = load_settings(overrides)
    assert settings.redis_url is not None
    assert settings.redis_url.get_secret_value() == "redis://r:6379/0"
    assert settings.workers == 3
    # Absent, they leave the defaults (and the environment) in force.
    assert load_settings(overrides_from(parse("--backend", "http://b:1"))).workers == 1
    # Several workers share their budget only through Redis: refused without it, at once.
    assert main(["serve", "--backend", "http://b:1", "--workers", "2"]) == 2
    assert "workers > 1 share one budget through Redis: set redis_url too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--workers", "two")


def test_a_workers_message_rebuilds_the_validated_settings() -> None:
    settings = Settings(
        backends=["a=http://a:1", "dns+http://pool.local:8000"],
        admin_token="s3cret",
        backend_api_key="key",
        redis_url="redis://:pw@r:6379/0",
        workers=4,
        metrics_stale_after_s=float("inf"),
        priority_classes={"low": {"queue_max": 3}},
    )
    sources = SettingsSources({"workers": 4, "model": None}, Path("/etc/kvgate.toml"))
    message = json.loads(worker_message(settings, sources, reload=True))
    assert Settings.model_validate(message["settings"]) == settings
    assert message["settings"]["admin_token"] == "s3cret"  # the worker needs the real secrets
    assert message["overrides"] == {"workers": 4, "model": None}
    assert (message["config_file"], message["reload"]) == ("/etc/kvgate.toml", True)


# A stand-in for `python -m gateway.workers` that records what the parent does to it, one line
# per event in the file named by argv[1]: "start PID RELOAD SOCKET", "hup PID", "term PID"
# (SOCKET: the inode of the listening socket it was passed).
FAKE_WORKER = """
import argparse, json, os, signal, sys, time
log_path = sys.argv[1]
parser = argparse.ArgumentParser()
parser.add_argument("--listen-fd", type=int)
parser.add_argument("--ready-fd", type=int)
args = parser.parse_args(sys.argv[2:])
def record(event, *details):
    with open(log_path, "a") as log:
        log.write(" ".join([event, str(os.getpid()), *map(str, details)]) + "\\n")
def on_term(signum, frame):
    record("term")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGHUP, lambda signum, frame: record("hup"))
message = json.loads(sys.stdin.readline())
if message.get("fail"):
    # Only once the other worker serves (it has its SIGTERM handler by then): then it is the
    # one that the parent must stop.
    while "start" not in (open(log_path).read() if os.path.exists(log_path) else ""):
        time.sleep(0.01)
    sys.exit(5)
record("start", message["reload"], os.fstat(args.listen_fd).st_ino)
os.write(args.ready_fd, b"1")
os.close(args.ready_fd)
while True:
    signal.pause()
"""


def events(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_supervisor_passes_signals_on_and_replaces_a_worker_that_died(tmp_path: Path) -> None:
    log = tmp_path / "events"
    command = (sys.executable, "-c", FAKE_WORKER, str(log))

    async def scenario() -> int:
        sockets = listening_sockets("127.0.0.1", 0, 2)
        with sockets[0], sockets[1]:
            supervisor = Supervisor(
                lambda reload: json.dumps({"reload": reload}).encode() + b"\n", sockets, command=command
            )
            running = asyncio.create_task(supervisor.run())
            await until(lambda: len(events(log)) == 2, "two workers to start")
            assert [event[2] for event in events(log)] == ["False", "False"]
            first, second = (int(event[1]) for event in events(log))
            # Each slot has a socket of its own.
            socket_of = {int(event[1]): event[3] for event in events(log)}
            assert socket_of[first] != socket_of[second]
            os.kill(os.getpid(), signal.SIGHUP)
            await until(lambda: sum(event[0] == "hup" for event in events(log)) == 2, "both to reload")
            os.kill(second, signal.SIGKILL)
            await until(lambda: len([e for e in events(log) if e[0] == "start"]) == 3, "a replacement")
            replacement = events(log)[-1]
            # It starts after the reload the others applied, so it applies it too, and it accepts
            # on the socket of the worker it replaces, where connections waited for it.
            assert replacement[0] == "start"
            assert replacement[2] == "True"
            assert replacement[3] == socket_of[second]
            # Ctrl-C on the parent: each worker is sent SIGTERM (the fake would die of SIGINT).
            os.kill(os.getpid(), signal.SIGINT)
            code = await asyncio.wait_for(running, 30)
            terms = {int(event[1]) for event in events(log) if event[0] == "term"}
            assert terms == {first, int(replacement[1])}
            return code

    assert asyncio.run(scenario()) == 0


def test_supervisor_stops_all_when_a_worker_never_serves(tmp_path: Path) -> None:
    log = tmp_path / "events"
    command = (sys.executable, "-c", FAKE_WORKER, str(log))
    messages = iter([{"reload": False}, {"reload": False, "fail": True}])

    async def scenario() -> int:
        sockets = listening_sockets("127.0.0.1", 0, 2)
        with sockets[0], sockets[1]:
            supervisor = Supervisor(
                lambda reload: json.dumps(next(messages)).encode() + b"\n", sockets, command=command
            )
            return await asyncio.wait_for(supervisor.run(), 60)

    # The one that failed is not restarted, and the one that served is stopped.
    assert asyncio.run(scenario()) == EXIT_FAILURE
    assert [event[0] for event in events(log)] == ["start", "term"]


def test_the_kernel_spreads_a_burst_of_connections_over_the_worker_slots() -> None:
    # One socket shared by the workers let whichever woke first take a whole burst.
    sockets = listening_sockets("127.0.0.1", 0, 2)
    port = sockets[0].getsockname()[1]
    assert sockets[1].getsockname()[1] == port
    accepted = [0, 0]
    clients: list[socket.socket] = []
    try:
        for sock in sockets:
            sock.setblocking(False)
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(200)]
        deadline = time.monotonic() + 10
        while sum(accepted) < len(clients):
            assert time.monotonic() < deadline, f"only {accepted} of {len(clients)} accepted"
            for slot, sock in enumerate(sockets):
                with contextlib.suppress(BlockingIOError):
                    connection, _ = sock.accept()
                    connection.close()
                    accepted[slot] += 1
    finally:
        for client in clients:
            client.close()
        for sock in sockets:
            sock.close()
    # Spread by the clients' addresses: 100 each on average, 7 the standard deviation.
    assert all(60 <= count <= 140 for count in accepted), accepted


def children_of(pid: int) -> set[int]:
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # After the command's closing parenthesis: state, then the parent's pid.
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.add(int(stat.parent.name))
    return children


def test_kvgate_serve_workers_share_the_port_and_the_budget(tmp_path: Path) -> None:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    output = tmp_path / "kvgate.log"
    keys = KeyNames("kvgate")
    with running_redis() as server, running_sim(SimConfig()) as backend, output.open("wb") as out:
        store = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--backend",
                backend,
                "--port",
                str(port),
                "--workers",
                "2",
                "--redis",
                server.url,
                "--log-level",
                "warning",
                "--set",
                "metrics_poll_interval_s=0.05",
                "--set",
                "redis_lease_ttl_s=2",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        workers: set[int] = set()
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, output.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                        break
                assert time.monotonic() < deadline, "kvgate serve --workers 2 did not become ready"
                time.sleep(0.05)
            workers = children_of(process.pid)
            assert len(workers) == 2, workers
            # Both accept on the one port (new connections reach either worker), and each
            # becomes ready on its own: wait until each has said so.
            ready: set[int] = set()
            deadline = time.monotonic() + 90
            while ready != workers:
                assert time.monotonic() < deadline, f"only {ready} of {workers} answered ready"
                state = httpx.get(f"{url}/admin/state", headers={"connection": "close"}, timeout=10).json()
                assert state["process"]["pid"] in workers
                if all(backend["ready"] for backend in state["backends"]):
                    ready.add(state["process"]["pid"])
            body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4}
            for _ in range(4):
                response = httpx.post(
                    f"{url}/v1/completions", json=body, headers={"connection": "close"}, timeout=30
                )
                assert response.status_code == 200, response.text
            # A worker killed: new connections keep coming to its slot's socket, where they wait
            # for its replacement rather than being refused.
            victim = min(workers)
            os.kill(victim, signal.SIGKILL)
            for _ in range(8):
                response = httpx.post(
                    f"{url}/v1/completions", json=body, headers={"connection": "close"}, timeout=60
                )
                assert response.status_code == 200, response.text
            deadline = time.monotonic() + 60
            while victim in workers or len(workers) != 2:
                assert time.monotonic() < deadline, f"no replacement for worker {victim}: {workers}"
                time.sleep(0.05)
                workers = children_of(process.pid)
            # They are two processes of one deployment in Redis, their requests were booked
            # there, and once every answer is in (and the killed worker's leases expired),
            # nothing is booked any more but the workers' standing reserves.
            deadline = time.monotonic() + 30
            lease = keys.backend("default")[0]
            while store.zcard(keys.alive) != 2 or not all(
                lease_id.endswith(f":{RESERVE_LEASE}".encode()) for lease_id in store.hkeys(lease)
            ):
                assert time.monotonic() < deadline, (
                    f"alive: {store.zrange(keys.alive, 0, -1)}, leases: {store.hgetall(lease)}"
                )
                time.sleep(0.05)
        finally:
            # SIGTERM on the parent drains and stops every worker, and the parent exits 0.
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                # Leave no process behind, then say which did not stop.
                stuck = children_of(process.pid)
                for pid in stuck:
                    os.kill(pid, signal.SIGKILL)
                process.kill()
                process.wait()
                pytest.fail(f"workers {stuck} did not stop within 60 s of SIGTERM:\n{output.read_text()}")
            assert code == 0, output.read_text()
            assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
        # Each worker stopped as a lone kvgate does: it left the deployment's processes and
        # gave its reserve back.
        assert store.zcard(keys.alive) == 0
        assert store.hget(keys.booked("default"), "total") == b"0"
        assert store.hlen(lease) == 0
        store.close()
