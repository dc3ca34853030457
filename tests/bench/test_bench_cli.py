"""`kvgate bench` end to end against two fake servers in child processes."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.cli import build_workload
from bench.instant import wait_until_up
from gateway.cli import build_parser, main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "traces"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def fake_servers() -> Iterator[list[str]]:
    """Two instant servers, the second one slower per token."""
    processes, urls = [], []
    try:
        for interval in ("1", "5"):
            port = _free_port()
            processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.instant",
                        "--port",
                        str(port),
                        "--token-interval-ms",
                        interval,
                    ]
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_until_up(url)
        yield urls
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


def test_two_targets_same_arrivals_side_by_side(fake_servers: list[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "--target",
            fake_servers[0],
            "--target",
            fake_servers[1] + "/v1",
            "--synthetic",
            "n=30,rate=60,prompt=uniform:5:40,output=uniform:1:20,tenants=a:1/b:1,priorities=high:1/low:1",
            "--deadline",
            "20",
            "--ttft-slo",
            "1.5",
            "--header",
            "X-Run:cli-test",
            "--backend-metrics",
            fake_servers[0],
            "--eos-id",
            "2",
            "--seed",
            "5",
            "--sample-period",
            "0.05",
            "--repeat",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    # alternating rounds: A B A B
    first, second, third, fourth = summary["targets"]
    assert [t["target"] for t in summary["targets"]] == [
        f"{fake_servers[0]} #1",
        f"{fake_servers[1]} #1",
        f"{fake_servers[0]} #2",
        f"{fake_servers[1]} #2",
    ]
    assert third["useful_tokens"] == first["useful_tokens"]
    ok_means = next(r for r in summary["mean_over_rounds"] if r["metric"] == "ok")
    assert ok_means["means"] == [30.0, 30.0]
    assert ok_means["ratios"] == [1.0, 1.0]
    assert fourth["ok"] == 30
    assert first["sent"] == second["sent"] == 30
    assert first["ok"] == second["ok"] == 30
    assert first["forced_length_exact"] == 30
    # /tokenize of the fake counts words: the prompts had exactly the asked lengths
    assert first["prompt_length_exact"] == 30
    assert first["client_output_tokens"] == second["client_output_tokens"]
    # target [0] is also named as backend: its counter moved by what the client counted
    assert first["backend_generation_tokens"] == first["client_output_tokens"]
    assert first["backend_tokens_wasted"] == 0
    assert {t["tenant"] for t in first["tenants"]} == {"a", "b"}
    assert summary["settings"]["forced_output_lengths"] is True
    assert summary["settings"]["output_forcing"] == "xargs"
    assert summary["settings"]["headers"] == ["X-Run: cli-test"]
    ok_row = next(r for r in summary["comparison"] if r["metric"] == "ok")
    assert ok_row["ratios"] == [1.0, 1.0, 1.0, 1.0]
    # same arrivals against both targets
    requests = [
        [json.loads(line) for line in (out / f"requests-{i}.jsonl").read_text().splitlines()]
        for i in range(4)
    ]
    assert [r["scheduled_s"] for r in requests[0]] == [r["scheduled_s"] for r in requests[3]]
    assert [r["output_tokens_wanted"] for r in requests[0]] == [r["output_tokens"] for r in requests[1]]
    report = (out / "report.md").read_text()
    assert "### Mean over rounds" in report
    # lengths forced by the private field, not by min_tokens (which kvgate reads)
    assert "vllm_xargs.kvgate_bench_output_tokens" in report
    assert "min_tokens" not in report
    assert "(1.00x)" in report
    for name in ("latency_cdf.png", "outcomes.png", "timeseries.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    assert (out / "metrics-0.jsonl").read_text().strip()


def test_trace_flags_compose(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "bench",
            "--target",
            "http://x",
            "--trace",
            str(FIXTURES / "mooncake_sample.jsonl"),
            "-n",
            "5",
            "--rate",
            "2",
            "--ctx-scale",
            "0.1",
            "--gen-scale",
            "0.5",
            "--tenants",
            "a:1/b:3",
            "--out",
            str(tmp_path),
        ]
    )
    work = build_workload(args)
    assert len(work) == 5
    assert work.requests[-1].arrival_s == pytest.approx(2.0)  # 4 gaps at 2 req/s
    assert work.requests[0].prompt_tokens == 3  # 28 * 0.1
    assert work.requests[0].output_tokens == 222  # 445 * 0.5, rounded half to even
    assert work.block_tokens == 51
    assert {r.tenant for r in work.requests} <= {"a", "b"}


def test_unreachable_target_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--target", "http://127.0.0.1:9", "--synthetic", "n=2", "--out", str(tmp_path)])
    assert code == 2
    assert "pass --model" in capsys.readouterr().err


@pytest.mark.parametrize("blocked", ["matplotlib", "rich"])
def test_a_missing_bench_extra_is_named_before_anything_runs(
    blocked: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules makes `import` raise ImportError, as a missing package does.
    monkeypatch.setitem(sys.modules, blocked, None)
    out = tmp_path / "out"
    code = main(["bench", "--target", "http://127.0.0.1:9", "--synthetic", "n=2", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    # Said before any target was asked (an unreachable one would say "pass --model").
    assert f"needs {blocked} from the `bench` extra" in err
    assert "pip install 'kvgate[bench]'" in err
    assert "pass --model" not in err
    assert not out.exists()


def test_the_checked_modules_are_the_bench_extra_of_pyproject() -> None:
    import tomllib

    from bench.cli import BENCH_EXTRA_MODULES, BENCH_EXTRA_PEERS

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["bench"]
    names = [re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0] for requirement in extra]
    assert list(BENCH_EXTRA_MODULES) + list(BENCH_EXTRA_PEERS) == names
