"""What the app, the lab and CLI commands and the tests may use of an engine.

`EngineSurface` lists it as a `typing.Protocol`: the model's settings, the
knobs, the tokenizer, notices and token events, the forward pass and
generation, residency and the expert store's counters, meters, and the
life cycle. `tierlab.engine.model.Engine` provides it; callers are annotated
with it, so a reach past it into the engine's parts shows up in review and
in a type checker.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import numpy as np

if TYPE_CHECKING:  # annotations only: importing the surface loads no kernels
    from tierlab.engine.config import ModelConfig
    from tierlab.engine.events import TokenEvent
    from tierlab.engine.expert_store import StoreStats
    from tierlab.engine.knobs import Knobs
    from tierlab.engine.routing import Router
    from tierlab.engine.tiering import TierOptions
    from tierlab.engine.tokenizer import Tokenizer


class EngineSurface(Protocol):
    config: ModelConfig
    knobs: Knobs
    tokenizer: Tokenizer | None
    model_dir: Path
    notices: list[str]  # lines for the user not yet shown; the reader pops them
    router: Router | None  # the routing lever (None: plain top-K only)
    heat: np.ndarray  # int64[L, E] routings since the last reset_meters
    timers: dict[str, float]  # seconds per phase, summed over all passes
    tokens_timed: int
    tier_options: TierOptions  # the GPU tier settings the engine was opened with

    @property
    def fingerprint(self) -> str: ...  # the model's fingerprint (engine/fingerprint.py)

    # -- events --------------------------------------------------------------------
    def notice(self, text: str) -> None: ...
    def subscribe(self, listener: Callable[[TokenEvent], None]) -> None: ...
    def unsubscribe(self, listener: Callable[[TokenEvent], None]) -> None: ...

    # -- running -------------------------------------------------------------------
    def prefill(self, ids, all_logits: bool = False) -> np.ndarray: ...
    def step(self, token_id: int) -> np.ndarray: ...
    def forward(self, ids, all_logits: bool = False, phase: str | None = None) -> np.ndarray: ...
    def generate(self, prompt_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, stop_event: threading.Event | None = None, eos_ids=None) -> Iterator[int]: ...
    def eos_ids(self) -> list[int]: ...

    # -- where the experts are -------------------------------------------------------
    def residency(self, layer: int) -> np.ndarray: ...
    def cache_slots(self) -> int: ...
    def set_cache_slots(self, slots: int) -> None: ...
    def store_stats(self) -> StoreStats: ...
    def tier_description(self) -> dict | None: ...

    # -- meters and weights ------------------------------------------------------------
    def meters(self) -> dict: ...
    def reset_meters(self) -> None: ...
    def weight_nbytes(self) -> dict: ...
    def dense_matrices(self) -> list: ...

    # -- life cycle ----------------------------------------------------------------------
    def reset(self) -> None: ...
    def cold_start(self) -> None: ...
    def close(self) -> None: ...
