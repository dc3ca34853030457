"""Fault injection, at start (config / CLI flags) and at run time (POST /sim/faults)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sim.cli import add_arguments, config_from_args
from sim.config import SimConfig
from sim.engine import StepCost
from sim.faults import Faults, MetricsMode
from sim.testing import SimServer, cli_args, engine_idle, running_sim_server, wait_for


def set_faults(url: str, **changes: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}/sim/faults", json=changes)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def streamed_chunks(url: str, body: dict[str, Any]) -> tuple[int, BaseException | None]:
    chunks = 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=5) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
    except httpx.TransportError as exc:
        return chunks, exc
    return chunks, None


STREAM = {"prompt": [1] * 10, "max_tokens": 20, "stream": True}


def test_crash_after_n_tokens_closes_the_stream_without_its_end(sim: SimServer) -> None:
    set_faults(sim.url, crash_after_tokens=3)
    chunks, error = streamed_chunks(sim.url, STREAM)
    assert chunks == 3
    assert isinstance(error, httpx.RemoteProtocolError)
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{sim.url}/v1/completions", json={"prompt": [1], "max_tokens": 20})
    wait_for(lambda: engine_idle(sim.url))


def test_stall_after_n_tokens_keeps_the_connection_open_and_silent(sim: SimServer) -> None:
    set_faults(sim.url, stall_after_tokens=4)
    chunks = 0
    with (
        httpx.Client(timeout=httpx.Timeout(5, read=0.5)) as client,
        client.stream("POST", f"{sim.url}/v1/completions", json=STREAM) as response,
    ):
        lines = response.iter_lines()

        def count_chunks() -> None:
            nonlocal chunks
            for line in lines:
                if line.startswith("data: {"):
                    chunks += 1

        with pytest.raises(httpx.ReadTimeout):
            count_chunks()
    assert chunks == 4
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{sim.url}/v1/completions", json={"prompt": [1], "max_tokens": 20}, timeout=0.5)
    # Leaving releases the stalled responses and their sequences.
    wait_for(lambda: engine_idle(sim.url))


def test_reset_after_n_tokens_sends_a_tcp_reset(sim: SimServer) -> None:
    set_faults(sim.url, reset_after_tokens=2)
    chunks, error = streamed_chunks(sim.url, STREAM)
    assert chunks == 2
    assert isinstance(error, httpx.ReadError)
    assert "reset" in str(error).lower()
    wait_for(lambda: engine_idle(sim.url))


def test_faults_switch_off_at_run_time(sim: SimServer) -> None:
    set_faults(sim.url, crash_after_tokens=1)
    assert streamed_chunks(sim.url, STREAM)[1] is not None
    cleared = httpx.delete(f"{sim.url}/sim/faults").json()
    assert cleared == Faults().to_json()
    assert streamed_chunks(sim.url, STREAM) == (20, None)


def test_error_rate_answers_a_seeded_share_with_5xx(sim: SimServer) -> None:
    set_faults(sim.url, error_rate=1.0, error_status=503)
    response = httpx.post(f"{sim.url}/v1/completions", json={"prompt": [1], "max_tokens": 2})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == 503
    set_faults(sim.url, error_rate=0.3, error_status=500)
    with httpx.Client(base_url=sim.url) as client:
        statuses = [
            client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code
            for _ in range(200)
        ]
    failed = statuses.count(500)
    assert statuses.count(200) + failed == 200
    assert 35 <= failed <= 85  # 30% of 200, loosely (a seeded draw)


def test_slow_first_byte(sim: SimServer) -> None:
    set_faults(sim.url, first_byte_delay_s=0.3)
    started = time.monotonic()
    response = httpx.post(f"{sim.url}/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert response.status_code == 200
    assert time.monotonic() - started >= 0.3


def test_hang_accepts_and_never_answers(sim: SimServer) -> None:
    set_faults(sim.url, hang=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{sim.url}/v1/completions", json={"prompt": [1]}, timeout=0.3)
    # The client gave up; the server forgets the request. Health is unaffected.
    wait_for(lambda: engine_idle(sim.url))
    assert httpx.get(f"{sim.url}/health").status_code == 200


def test_hung_requests_do_not_block_shutdown(fast_config: SimConfig) -> None:
    config = replace(fast_config, faults=Faults(hang=True))
    started = time.monotonic()
    with running_sim_server(config) as server, pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={"prompt": [1]}, timeout=0.2)
    assert time.monotonic() - started < 3


def metrics_families(url: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}


def test_metrics_can_be_slow(sim: SimServer) -> None:
    set_faults(sim.url, metrics_delay_s=0.3)
    started = time.monotonic()
    assert httpx.get(f"{sim.url}/metrics").status_code == 200
    assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize("status", [404, 500])
def test_metrics_can_be_missing(sim: SimServer, status: int) -> None:
    set_faults(sim.url, metrics_mode="missing", metrics_status=status)
    assert httpx.get(f"{sim.url}/metrics").status_code == status


def test_metrics_can_be_malformed(sim: SimServer) -> None:
    set_faults(sim.url, metrics_mode="malformed")
    response = httpx.get(f"{sim.url}/metrics")
    assert response.status_code == 200
    with pytest.raises(ValueError):  # noqa: PT011 - the parser raises a bare ValueError
        list(text_string_to_metric_families(response.text))


def test_stale_metrics_freeze_at_the_switch(sim: SimServer) -> None:
    httpx.post(f"{sim.url}/v1/completions", json={"prompt": [1], "max_tokens": 3})
    set_faults(sim.url, metrics_mode="stale")
    frozen = httpx.get(f"{sim.url}/metrics").text
    httpx.post(f"{sim.url}/v1/completions", json={"prompt": [1], "max_tokens": 3})
    assert httpx.get(f"{sim.url}/metrics").text == frozen
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny-llama"} 3.0' in frozen
    set_faults(sim.url, metrics_mode="normal")
    assert (
        'generation_tokens_total{engine="0",model_name="tiny-llama"} 6.0'
        in httpx.get(f"{sim.url}/metrics").text
    )


def test_cache_config_info_can_go_missing(sim: SimServer) -> None:
    assert "vllm:cache_config_info" in metrics_families(sim.url)
    set_faults(sim.url, omit_cache_config_info=True)
    families = metrics_families(sim.url)
    assert "vllm:cache_config_info" not in families
    assert "vllm:kv_cache_usage_perc" in families


def test_bad_fault_changes_are_rejected_all_at_once(sim: SimServer) -> None:
    response = httpx.post(
        f"{sim.url}/sim/faults", json={"error_rate": 2, "bogus": 1, "metrics_mode": "weird"}
    )
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "bogus" in message
    assert "metrics_mode" in message
    assert httpx.get(f"{sim.url}/sim/faults").json() == Faults().to_json()


def test_restart_changes_the_pool_resets_counters_and_cuts_open_streams(
    fast_config: SimConfig,
) -> None:
    slow = replace(fast_config, engine=replace(fast_config.engine, step_cost=StepCost(0.01, 0, 0, 0)))
    with running_sim_server(slow) as server:
        url = server.url
        httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 2})
        restarts: list[int] = []

        def stream_and_restart() -> None:
            body = {"prompt": [1] * 10, "max_tokens": 500, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and not restarts:
                        restart = httpx.post(f"{url}/sim/restart", json={"num_blocks": 40})
                        restarts.append(restart.status_code)

        with pytest.raises(httpx.RemoteProtocolError):
            stream_and_restart()
        assert restarts == [200]
        text = httpx.get(f"{url}/metrics").text
        assert 'num_gpu_blocks="40"' in text
        assert 'kv_cache_size_tokens="1280"' in text
        assert 'vllm:generation_tokens_total{engine="0",model_name="tiny-llama"} 0.0' in text
        state = httpx.get(f"{url}/sim/state").json()
        assert state["num_usable_blocks"] == 39
        wait_for(lambda: engine_idle(url))
        # The new engine serves.
        after = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert after.json()["usage"]["completion_tokens"] == 2
        # A pool that cannot hold one max_model_len request is refused, as vLLM refuses to start.
        refused = httpx.post(f"{url}/sim/restart", json={"num_blocks": 10})
        assert refused.status_code == 400


def test_frontend_queue_limit_answers_503_and_counts_rejections(fast_config: SimConfig) -> None:
    slow = replace(
        fast_config,
        engine=replace(fast_config.engine, step_cost=StepCost(0.01, 0, 0, 0)),
        max_num_queued_reqs=1,
    )
    with running_sim_server(slow) as server:
        body = {"prompt": [1], "max_tokens": 300, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            # Keep the iterator: dropping it would close the stream (a client disconnect).
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            rejected = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1]})
        assert rejected.status_code == 503
        assert rejected.json()["error"]["type"] == "Service Unavailable"
        text = httpx.get(f"{server.url}/metrics").text
        assert (
            'vllm:admission_rejections_total{model_name="tiny-llama",reason="max_num_queued_reqs"} 1.0'
            in text
        )


def test_cli_flags_build_the_config_and_round_trip() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--num-blocks", "256", "--block-size", "16", "--max-model-len", "2048",
            "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
            "--step-base-ms", "5", "--step-per-token-ms", "0.05", "--step-per-seq-ms", "0.5",
            "--step-per-request-ms", "2",
            "--model-name", "m", "--output-len", "lognormal:13:1.1", "--seed", "7",
            "--fault-crash-after-tokens", "4", "--fault-metrics-mode", "stale",
            "--fault-omit-cache-config-info", "--max-num-queued-reqs", "16",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.engine.num_blocks == 256
    assert config.engine.step_cost == StepCost(0.005, 0.00005, 0.0005, 0.002)
    assert config.faults.crash_after_tokens == 4
    assert config.faults.metrics_mode is MetricsMode.STALE
    assert config.faults.omit_cache_config_info
    assert config.max_num_queued_reqs == 16
    assert config.output_len.spec() == "lognormal:13:1.1"
    # `cli_args` (used to start an emulator process) reproduces the same config.
    again = config_from_args(parser.parse_args(cli_args(config)))
    assert again == config


def test_cli_reports_every_invalid_flag_together() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--num-blocks", "3", "--output-len", "zipf:2", "--fault-error-rate", "1.5"])
    with pytest.raises(ValueError, match="zipf") as info:
        config_from_args(args)
    assert "error_rate" in str(info.value)
    assert "max_model_len" in str(info.value)
