"""The shadow meter: the stock top-K's hits in the same cache state, counted where the realised hits are."""

from __future__ import annotations

import json

import pytest

from tierlab import ASSETS_DIR
from tierlab.engine.knobs import Knobs
from tierlab.engine.meters import MeterFold
from tierlab.engine.model import load_engine

MODEL = ASSETS_DIR / "tiny-moe"  # 32 experts, top-4
REF = json.loads((MODEL / "ref.json").read_text())


def decode_events(cache, n=24, **knobs):
    """Greedy decode of the shipped reference prompt; every token event of the run."""
    engine = load_engine(MODEL, cache_slots=cache, knobs=Knobs.from_env({}, **knobs), with_tokenizer=False)
    events = []
    engine.subscribe(events.append)
    try:
        logits = engine.prefill(REF["prompt_ids"])
        for _ in range(n):
            logits = engine.step(int(logits.argmax()))
    finally:
        engine.close()
    return events


@pytest.mark.parametrize("cache,knobs", [(8, {}), (8, {"PILOT": "1"}), (3, {}), (None, {}),
                                         (8, {"ROUTE_AGREE": "1"})],
                         ids=["cache8", "cache8-pilot", "cache3", "all-in-ram", "meters-only"])
def test_with_the_lever_off_the_shadow_is_the_realised_hit_exactly(cache, knobs):
    events = decode_events(cache, **knobs)
    fold = MeterFold()
    for event in events:
        fold.add(event)
        for route in event.layers:
            assert (route.shadow_ram_hits, route.shadow_ram_misses, route.shadow_vram) == (
                route.ram_hits, route.ram_misses, route.vram_served), (event.index, route.layer)
    m = fold.summary()
    assert m["shadow_hits"] + m["shadow_misses"] == m["ram_hits"] + m["ram_misses"] > 0
    assert m["shadow_hit"] == m["ram_hit"]
    assert fold.layer_shadow_rates() == fold.layer_hit_rates()
    if cache == 8:
        assert m["ram_misses"] > 0  # a small cache: the equality is not that of two perfect rates


def test_with_the_lever_on_the_stock_top_k_would_have_hit_less():
    events = decode_events(8, CACHE_ROUTE="1", ROUTE_J="1")
    fold = MeterFold()
    for event in events:
        fold.add(event)
    m = fold.summary()
    assert m["swaps"] > 0
    assert m["shadow_hit"] < m["ram_hit"]
    # the shadow counts the stock top-K, the realised figures the chosen set: same number of experts
    assert m["shadow_hits"] + m["shadow_misses"] == m["ram_hits"] + m["ram_misses"]
    worse = [layer for layer, (s, r) in enumerate(zip(fold.layer_shadow_rates(), fold.layer_hit_rates()))
             if s is not None and s < r]
    assert worse  # per layer too
