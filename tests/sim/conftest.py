"""Fixtures for the emulator's tests: fast configurations and a real server per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sim.config import SimConfig
from sim.engine import EngineConfig, StepCost
from sim.testing import SimServer, running_sim_server

# The testbed's pool and limits with a step cost small enough for unit-speed tests.
FAST_ENGINE = EngineConfig(
    step_cost=StepCost(base_s=0.001, per_token_s=0.0, per_seq_s=0.0, per_request_s=0.0)
)


@pytest.fixture
def fast_config() -> SimConfig:
    return SimConfig(engine=FAST_ENGINE)


@pytest.fixture
def sim(fast_config: SimConfig) -> Iterator[SimServer]:
    """A fresh emulator served by uvicorn in a background thread."""
    with running_sim_server(fast_config) as server:
        yield server
