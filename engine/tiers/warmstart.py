"""Filling the GPU tier at start: which experts (heat or index order), then the uploads.

Kept apart from the engine so the engine only says where blobs come from:
``read_into(layer, expert, out)`` fills a uint8 buffer of blob_nbytes (the
signature of the expert sources' ``read``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from tierlab.engine.heat import HeatProfile, index_order


@dataclass(frozen=True)
class WarmstartReport:
    order: str  # "heat" or "index"
    planned: int  # experts the plan asked for
    uploaded: int  # experts actually uploaded
    seconds: float


def warmstart_plan(
    n_layers: int,
    n_experts: int,
    capacity: int,
    heat: HeatProfile | None = None,
    moe_layers: Sequence[bool] | None = None,
) -> list[tuple[int, int]]:
    """Up to `capacity` (layer, expert) pairs: heat order with a profile, else index order.

    Layers without experts (`moe_layers[i]` False, e.g. qwen3_moe's mlp_only_layers)
    are skipped so no slot is planned for them.
    """
    total = n_layers * n_experts
    full = heat.plan(total) if heat is not None else index_order(n_layers, n_experts, total)
    if moe_layers is not None:
        full = [(layer, expert) for layer, expert in full if moe_layers[layer]]
    return full[: max(0, int(capacity))]


def warmstart(
    tier,
    read_into: Callable[[int, int, np.ndarray], None],
    n_layers: int,
    n_experts: int,
    heat_file: str | None = None,
    moe_layers: Sequence[bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> WarmstartReport:
    """Plan and upload until the plan is done or the tier says no (full, out of memory, failed).

    A bad heat file raises FormatError before anything is uploaded: the user asked
    for that profile, so silently falling back to index order would mislead.
    """
    started = time.perf_counter()
    heat = HeatProfile.read(heat_file, n_layers, n_experts) if heat_file else None
    plan = warmstart_plan(n_layers, n_experts, tier.capacity, heat, moe_layers)
    buf = np.empty(tier.blob_nbytes, dtype=np.uint8)
    uploaded = 0
    for layer, expert in plan:
        read_into(layer, expert, buf)
        if not tier.upload(layer, expert, buf):  # uploads are blocking, so buf can be reused
            break
        uploaded += 1
        if progress is not None:
            progress(uploaded, len(plan))
    return WarmstartReport("heat" if heat is not None else "index", len(plan), uploaded,
                           time.perf_counter() - started)
