"""What a warmstart plan is worth: tier hit rate of a routing trace, index order vs heat order.

The GPU tier is filled once at start and then kept, so its hit rate on a
trace is simply the share of routed slots whose (layer, expert) was planned
in. Index order fills whole layers from layer 0 and leaves the rest empty;
heat order takes the hottest experts of every layer, so on a skewed trace
it serves far more slots; `compare_warmstarts` measures both on any trace,
for benchmarks and docs (docs/tiers.md, "Warmstart").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tierlab.engine.heat import HeatProfile, index_order

# trace[token][layer] = the experts routed for that token in that layer (-1 = unfilled slot);
# an int array [tokens, layers, K] works too.
Trace = Sequence[Sequence[Sequence[int]]] | np.ndarray


def trace_heat(trace: Trace, n_layers: int, n_experts: int) -> HeatProfile:
    """Routing counts of a trace, as a heat profile."""
    heat = HeatProfile(n_layers, n_experts)
    if isinstance(trace, np.ndarray):
        tokens, layers, _ = trace.shape
        if layers != n_layers:
            raise ValueError(f"trace has {layers} layers, expected {n_layers}")
        ids = trace.astype(np.int64)
        layer_idx = np.broadcast_to(np.arange(layers)[None, :, None], ids.shape)
        keep = ids >= 0
        np.add.at(heat.counts, (layer_idx[keep], ids[keep]), 1)
        return heat
    for token in trace:
        if len(token) != n_layers:
            raise ValueError(f"a token of the trace has {len(token)} layers, expected {n_layers}")
        for layer, experts in enumerate(token):
            heat.add(layer, experts)
    return heat


def resident_mask(plan: Sequence[tuple[int, int]], n_layers: int, n_experts: int) -> np.ndarray:
    mask = np.zeros((n_layers, n_experts), dtype=bool)
    for layer, expert in plan:
        mask[layer, expert] = True
    return mask


def hit_rate(counts: np.ndarray, mask: np.ndarray) -> float:
    """Share of routed slots served by the tier (0 when nothing was routed)."""
    total = int(counts.sum())
    return float(counts[mask].sum()) / total if total else 0.0


@dataclass(frozen=True)
class WarmstartComparison:
    budget_experts: int
    budget_share: float  # budget / (layers x experts)
    index_hit: float  # hit rate with the index-order warmstart
    heat_hit: float  # hit rate with the heat-planned warmstart
    routed_slots: int


def compare_warmstarts(
    trace: Trace,
    budget_experts: int,
    n_layers: int,
    n_experts: int,
    plan_from: Trace | HeatProfile | None = None,
) -> WarmstartComparison:
    """Tier hit rate on `trace` for both warmstarts.

    The heat plan comes from `plan_from` (another trace or a profile, e.g. an
    earlier run), else from `trace` itself, which is the best case for a profile.
    """
    counts = trace_heat(trace, n_layers, n_experts).counts
    if plan_from is None:
        planner = HeatProfile(n_layers, n_experts, counts)
    elif isinstance(plan_from, HeatProfile):
        planner = plan_from
    else:
        planner = trace_heat(plan_from, n_layers, n_experts)
    index_mask = resident_mask(index_order(n_layers, n_experts, budget_experts), n_layers, n_experts)
    heat_mask = resident_mask(planner.plan(budget_experts), n_layers, n_experts)
    return WarmstartComparison(
        budget_experts=int(budget_experts),
        budget_share=min(1.0, budget_experts / (n_layers * n_experts)),
        index_hit=hit_rate(counts, index_mask),
        heat_hit=hit_rate(counts, heat_mask),
        routed_slots=int(counts.sum()),
    )


def synthetic_trace(
    n_tokens: int,
    n_layers: int,
    n_experts: int,
    k: int,
    skew: float = 1.0,
    seed: int = 0,
    popularity_seed: int | None = None,
) -> np.ndarray:
    """A skewed routing trace int32[tokens, layers, k]: K distinct experts per token and layer.

    Each layer has its own Zipf-like popularity (weight 1/(rank+1)**skew over a
    random permutation of the experts, fixed by `popularity_seed`); `seed`
    drives the sampling, so two seeds with one popularity_seed model two runs
    of the same model on different prompts. skew=0 is uniform routing.
    """
    pop_rng = np.random.default_rng(seed if popularity_seed is None else popularity_seed)
    rng = np.random.default_rng([seed, 1])
    weights = 1.0 / np.arange(1, n_experts + 1, dtype=np.float64) ** skew
    trace = np.empty((n_tokens, n_layers, k), dtype=np.int32)
    for layer in range(n_layers):
        p = np.empty(n_experts)
        p[pop_rng.permutation(n_experts)] = weights / weights.sum()
        # Gumbel top-k: K distinct draws without replacement, proportional to p, all tokens at once.
        keys = np.log(p)[None, :] + rng.gumbel(size=(n_tokens, n_experts))
        trace[:, layer, :] = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    return trace
