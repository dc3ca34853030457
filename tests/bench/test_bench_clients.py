"""The kinds of client `kvgate bench --clients` replays: the headers each sends, and how each
behaves at its deadline, against the emulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import client_headers
from gateway.cli import main
from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.testing import running_sim_server


@pytest.mark.parametrize(
    ("clients", "deadline", "ttft", "sent"),
    [
        (None, 10.0, None, (10.0, None)),  # today's behaviour: the headers of the flags given
        (None, None, 1.5, (None, 1.5)),
        (None, 10.0, 1.5, (10.0, 1.5)),
        ("deadline", 10.0, 1.5, (10.0, None)),  # the objective is kept for the goodput figure only
        ("ttft", None, None, (None, 2.0)),
        ("ttft", None, 1.5, (None, 1.5)),
        ("both", 10.0, None, (10.0, 2.0)),
    ],
)
def test_each_kind_sends_its_own_headers(
    clients: str | None, deadline: float | None, ttft: float | None, sent: tuple[float | None, float | None]
) -> None:
    assert client_headers(clients, deadline, ttft, 2.0) == sent


@pytest.mark.parametrize(
    ("clients", "deadline", "message"),
    [("ttft", 10.0, "no deadline"), ("deadline", None, "need --deadline"), ("both", None, "need --deadline")],
)
def test_a_kind_that_contradicts_the_flags_is_refused(
    clients: str, deadline: float | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        client_headers(clients, deadline, None, 2.0)


def test_deadline_clients_give_up_and_ttft_clients_wait_for_the_whole_answer(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # 20 ms per engine step: a 40-token answer takes about 0.8 s, past the 0.4 s deadline, and
    # its first token comes well within the 0.3 s objective.
    config = SimConfig(
        engine=EngineConfig(step_cost=StepCost(base_s=0.02, per_token_s=0.0, per_seq_s=0.0)),
        tokenizer=str(tiny_model_dir),
    )
    summaries = {}
    with running_sim_server(config) as sim:
        for clients, flags in (("deadline", ["--deadline", "0.4"]), ("ttft", [])):
            out = tmp_path / clients
            code = main(
                [
                    "bench", "--target", sim.url, "--clients", clients, *flags, "--ttft-slo", "0.3",
                    "--synthetic", "n=4,rate=20,prompt=20,output=40", "--sample-period", "0.05",
                    "--tokenizer", str(tiny_model_dir), "--out", str(out),
                ]
            )  # fmt: skip
            assert code == 0
            summaries[clients] = json.loads((out / "summary.json").read_text())
    deadline = summaries["deadline"]["targets"][0]
    ttft = summaries["ttft"]["targets"][0]
    assert (deadline["late"], deadline["ok"], deadline["useful_tokens"]) == (4, 0, 0)
    assert summaries["deadline"]["settings"]["headers_ttft_s"] is None
    # No deadline: every answer finishes, and first-token goodput counts those whose first token
    # came within the objective, per second of offered time.
    assert (ttft["ok"], ttft["late"], ttft["useful_tokens"]) == (4, 0, 160)
    assert ttft["goodput_slo_requests"] == 4
    assert ttft["goodput_slo_tokens_per_s"] == pytest.approx(160 / ttft["offered_s"])
    assert summaries["ttft"]["settings"]["headers_deadline_s"] is None
    assert summaries["ttft"]["settings"]["headers_ttft_s"] == 0.3
