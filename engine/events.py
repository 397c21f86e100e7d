"""Per-token events: what the engine tells the outside world after each token.

Session logs, meters, the heatmap and A/B tables all read these records, so
the engine never needs to know who is watching.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# Residency levels, as in the routing contract.
LEVEL_DISK = 0
LEVEL_RAM = 1
LEVEL_GPU = 2


@dataclass
class LayerRoute:
    """Routing of one token through one MoE layer."""

    layer: int
    chosen: np.ndarray  # int32[K], expert ids actually run (-1 = unfilled slot)
    weights: np.ndarray  # float32[K], gate weights after renormalisation
    true_topk: np.ndarray  # int32[K], the router's own top-K
    level: np.ndarray  # int8[K], residency level of each chosen expert when routed
    swapped: np.ndarray  # bool[K], chosen only because it was resident
    ram_hits: int = 0  # chosen experts found in the RAM cache
    ram_misses: int = 0  # chosen experts read from disk
    vram_served: int = 0  # chosen experts computed by the GPU tier
    true_weights: np.ndarray | None = None  # float32[K], router probabilities of true_topk


@dataclass
class TokenEvent:
    """One token through the whole model."""

    index: int  # position of the token in the sequence
    token_id: int  # the token fed in (prefill) or produced (decode)
    phase: str  # "prefill" or "decode"
    layers: list[LayerRoute] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)
    knob_seq: int = 0


TokenListener = Callable[[TokenEvent], None]
