"""The shadow meter: the stock top-K's hits in the same cache state, counted where the realised hits are."""

from __future__ import annotations

import json

import pytest

from tierlab import ASSETS_DIR
from tierlab.engine.knobs import Knobs
from tierlab.engine.meters import MeterFold
from tierlab.engine.model import load_engine

MODEL = ASSETS_DIR / "tiny-moe"  # 32 experts, top-4
MODEL_EXPERT_BYTES = 49152  # one bf16 expert of tiny-moe
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


def test_the_vram_shadow_equals_the_vram_hit_with_the_lever_off(opencl_device):
    from tierlab.engine.tiering import TierOptions

    expert_gib = MODEL_EXPERT_BYTES / 2**30
    engine = load_engine(MODEL, cache_slots=8, knobs=Knobs.from_env({}), with_tokenizer=False,
                         tier=TierOptions(enabled=True, budget=str(60 * expert_gib)))
    events = []
    engine.subscribe(events.append)
    try:
        assert engine.tier_description() is not None
        logits = engine.prefill(REF["prompt_ids"])
        for _ in range(12):
            logits = engine.step(int(logits.argmax()))
        blob = engine.store_stats().blob_nbytes
    finally:
        engine.close()
    assert blob == MODEL_EXPERT_BYTES
    fold = MeterFold()
    for event in events:
        fold.add(event)
        for route in event.layers:
            assert (route.shadow_ram_hits, route.shadow_ram_misses, route.shadow_vram) == (
                route.ram_hits, route.ram_misses, route.vram_served)
    m = fold.summary()
    assert 0 < m["vram_hit"] < 1 and m["shadow_vram"] == m["vram_hit"] and m["shadow_hit"] == m["ram_hit"]
