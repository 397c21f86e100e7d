"""Per-token events: what the engine tells the outside world after each token.

Session logs, meters, the heatmap and A/B tables all read these records, so
the engine never needs to know who is watching. A `LayerRoute` is the one
record of a routing decision: the router writes it, the MoE block adds what
the tiers served, and the token's event carries it out.
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
    """Routing of one token through one MoE layer. Unfilled slots have id -1 and weight 0."""

    layer: int
    chosen: np.ndarray  # int32[K], expert ids actually run
    weights: np.ndarray  # float32[K], gate weights after renormalisation
    true_topk: np.ndarray  # int32[K], the router's own top-K (-1 padded)
    true_weights: np.ndarray | None  # float32[K], router probabilities of true_topk
    level: np.ndarray  # int8[K], residency of each chosen expert when routed (2 once the GPU tier served it)
    swapped: np.ndarray  # bool[K], chosen only because it was resident
    slots: int = 0  # filled slots
    swaps: int = 0  # filled slots holding an expert outside the true top-K
    swaps_vram: int = 0  # of those, experts at the GPU tier when routed
    measured: bool = False  # the routing meters (swap, agree, KL) were on for this decision
    kl: float | None = None  # KL(true top-K mass || chosen mass) in nats; None when not known
    ram_hits: int = 0  # chosen experts found in the RAM cache
    ram_misses: int = 0  # chosen experts read from disk
    vram_served: int = 0  # chosen experts computed by the GPU tier
    # The shadow meter: what the router's stock top-K (`true_topk`) would have met in the same
    # cache state (the store counts it where it decides the realised hits; all 0 when not counted)
    shadow_ram_hits: int = 0  # stock top-K experts a RAM slot held
    shadow_ram_misses: int = 0  # stock top-K experts that would have been read from disk
    shadow_vram: int = 0  # stock top-K experts the GPU tier held
    probs: np.ndarray | None = None  # float32[E], the router's softmax over every expert (None where not kept)


@dataclass
class TokenEvent:
    """One token through the whole model.

    ``store`` holds what the expert store, the GPU tier and the prefetcher
    have counted since the meters were last reset (totals, not per-token
    shares), as the engine read them after the token's pass.
    """

    index: int  # position of the token in the sequence
    token_id: int  # the token fed in (prefill) or produced (decode)
    phase: str  # "prefill" or "decode"
    layers: list[LayerRoute] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)
    knob_seq: int = 0
    gpu_tier: bool = False  # a GPU tier was attached
    store: dict[str, int] = field(default_factory=dict)


TokenListener = Callable[[TokenEvent], None]
