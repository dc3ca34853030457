"""The models the fleet serves, each with the tokenizer and KV shape its requests are counted by.

Backends say what they serve (`/v1/models`); the first backend that names a model brings it
into the catalog, and its tokenizer and `config.json` (KV-cache groups, see `estimator.kv`)
are loaded once, in a thread, from the local folder or Hugging Face cache its `root` names.
Models that share a tokenizer folder share one counter. A request without a `model` field
goes to the default: `Settings.model` when it names a served model, else the first model of
the first backend that answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from estimator.demand import BlockCost
from estimator.kv import ConfigError, ModelShape, kv_cache_layout
from estimator.tokens import TokenCounter
from gateway.discovery import (
    BackendInfo,
    ServedModel,
    load_model_shape,
    load_token_counter,
    tokenizer_candidates,
)
from gateway.settings import Settings

log = logging.getLogger(__name__)
# How long the counting threads wait for one another while their tokenizer copies are made.
COPIES_TIMEOUT_S = 5.0


@dataclass(slots=True)
class ModelProfile:
    """One served model: how its prompts are counted and what a sequence holds in blocks."""

    served: ServedModel
    counter: TokenCounter
    counter_source: str
    shape: ModelShape | None
    _costs: dict[int, BlockCost] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.served.id

    def block_cost(self, block_size: int) -> BlockCost:
        """Through the model's KV groups when its config is known (a hybrid model's request
        holds blocks in every group), else plain paged attention."""
        cost = self._costs.get(block_size)
        if cost is None:
            layout = None
            if self.shape is not None:
                try:
                    layout = kv_cache_layout(self.shape, block_size=block_size)
                except (ConfigError, ValueError) as exc:
                    log.warning("model %s: KV groups unusable, counting plain blocks: %s", self.id, exc)
            cost = self._costs[block_size] = BlockCost(block_size, layout)
        return cost


class ModelCatalog:
    def __init__(
        self, settings: Settings, executor: ThreadPoolExecutor, token_counter: TokenCounter | None = None
    ) -> None:
        self._settings = settings
        self._executor = executor
        self._injected = token_counter
        self._profiles: dict[str, ModelProfile] = {}
        self._order: list[str] = []
        # Counters and shapes by the folders they were looked for in, shared between models.
        self._counters: dict[tuple[str, ...], tuple[TokenCounter, str]] = {}
        self._shapes: dict[tuple[str, ...], tuple[ModelShape | None, str | None]] = {}
        self._lock = asyncio.Lock()

    def get(self, model: str) -> ModelProfile | None:
        return self._profiles.get(model)

    def default(self) -> ModelProfile | None:
        wanted = self._settings.model
        if wanted is not None and wanted in self._profiles:
            return self._profiles[wanted]
        return self._profiles[self._order[0]] if self._order else None

    def names(self) -> list[str]:
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def profiles(self) -> Iterable[ModelProfile]:
        return (self._profiles[name] for name in self._order)

    async def learn(self, info: BackendInfo) -> None:
        """Bring the models a backend serves into the catalog (once each)."""
        async with self._lock:  # two backends discovered at once load a tokenizer once
            for served in info.models:
                if served.id in self._profiles:
                    continue
                candidates = tuple(self._candidates(served, info))
                counter, source = await self._counter(candidates, served)
                shape, shape_source = await self._shape(candidates)
                self._profiles[served.id] = ModelProfile(served, counter, source, shape)
                self._order.append(served.id)
                log.info(
                    "model %s: tokenizer from %s, KV groups from %s",
                    served.id,
                    source,
                    shape_source or "no config (plain paged attention)",
                )

    def _candidates(self, served: ServedModel, info: BackendInfo) -> list[str]:
        settings = self._settings
        # The configured tokenizer and model folder speak for the default model (the one the
        # settings name, or the first served when they name none).
        named = settings.model is not None and info.find(settings.model) is not None
        speaks_for = (served.id == settings.model) if named else not self._order
        if speaks_for:
            return tokenizer_candidates(settings.tokenizer, settings.model if not named else served.id, info)
        return tokenizer_candidates(None, served.id, info)

    async def _counter(self, candidates: tuple[str, ...], served: ServedModel) -> tuple[TokenCounter, str]:
        if self._injected is not None:
            return self._injected, "injected"
        known = self._counters.get(candidates)
        if known is None:
            settings = self._settings
            loop_thread = threading.get_ident()
            known = await asyncio.get_running_loop().run_in_executor(
                self._executor,
                lambda: load_token_counter(
                    candidates,
                    max_model_len=served.max_model_len,
                    trust_request_chat_template=settings.trust_request_chat_template,
                    max_body_bytes=settings.max_body_bytes,
                    inline_thread=loop_thread,
                ),
            )
            await self._prepare_copies(known[0])
            self._counters[candidates] = known
        return known

    async def _prepare_copies(self, counter: TokenCounter) -> None:
        """Make every counting thread's copy of the tokenizer now, before a request needs it.
        Made on first use, each copy (0.3 s of the interpreter, which the copy holds) stalled
        the loop when the first large body arrived, as long after start as that was. Each task
        waits for the others, so that they land on as many threads."""
        if not counter.exact:
            return  # no tokenizer, nothing to copy
        threads = self._settings.tokenizer_threads
        together = threading.Barrier(threads, timeout=COPIES_TIMEOUT_S)

        def prepare() -> None:
            counter.prepare_thread(threading.get_ident())
            with contextlib.suppress(threading.BrokenBarrierError):  # a thread busy elsewhere
                together.wait()

        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._executor, prepare) for _ in range(threads)))

    async def _shape(self, candidates: tuple[str, ...]) -> tuple[ModelShape | None, str | None]:
        known = self._shapes.get(candidates)
        if known is None:
            known = await asyncio.get_running_loop().run_in_executor(
                self._executor, load_model_shape, candidates
            )
            self._shapes[candidates] = known
        return known

    def close(self) -> None:
        counters = {id(counter): counter for counter, _ in self._counters.values()}
        if self._injected is not None:
            counters[id(self._injected)] = self._injected
        for counter in counters.values():
            counter.close()  # its template renderers, if it started any
