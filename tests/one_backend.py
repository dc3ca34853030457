"""What tests of a single-backend gateway read: the router with its only backend's parts.

A gateway in front of one backend is the fleet of one (`gateway.router`); tests written for it
read the backend's ledger, budget and pace, the model's queue and tokenizer, and the router's
own parts (settings, output model, recent requests, readiness) through one object.
"""

from __future__ import annotations

from typing import Any

from estimator.kv import ModelShape
from gateway.backend import Backend
from gateway.router import Router
from gateway.waitqueue import WaitQueue


class OneBackend:
    def __init__(self, router: Router) -> None:
        self.router = router

    @property
    def backend(self) -> Backend:
        [backend] = self.router.backends
        return backend

    @property
    def queue(self) -> WaitQueue:
        queues = list(self.router.queues.values())
        if not queues:
            raise AssertionError("no model discovered yet")
        return queues[0]

    @property
    def model_shape(self) -> ModelShape | None:
        profile = self.router.catalog.default()
        return profile.shape if profile is not None else None

    @property
    def counter_source(self) -> str | None:
        profile = self.router.catalog.default()
        return profile.counter_source if profile is not None else None

    def __getattr__(self, name: str) -> Any:
        if name in ("ledger", "budget", "snapshot", "pace", "poller", "info", "upstream", "prefixes"):
            return getattr(self.backend, name)
        return getattr(self.router, name)
