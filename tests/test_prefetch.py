"""PILOT prefetch and HOT pins move bytes, never results."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tierlab import ASSETS_DIR
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine
from tierlab.engine.prefetch import Pilot

PROMPT = [int(i) for i in np.random.default_rng(5).integers(2, 250, 10)]
N = 20


def run(folder, cache, prompt=PROMPT, n=N, **knobs):
    engine = load_engine(folder, cache_slots=cache, knobs=Knobs.from_env({}, **knobs))
    logits = [engine.prefill(prompt)]
    for _ in range(n):
        if engine.pilot is not None:
            engine.pilot.loader.drain()
        logits.append(engine.step(int(np.argmax(logits[-1]))))
    return engine, np.stack(logits)


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_moe"])
def test_pilot_and_pins_never_change_logits(oracle_models, name):
    folder = oracle_models[name][1]
    _, base = run(folder, 3)
    for knobs in ({"PILOT": "1"}, {"PILOT": "3", "WIDE": "2"}, {"HOT": "2", "WARMUP": "3"},
                  {"PILOT": "2", "HOT": "1", "ROUTE_AGREE": "1"}):
        engine, logits = run(folder, 3, **knobs)
        assert np.array_equal(logits, base), knobs
        engine.close()


def test_pilot_meters_and_hit_rate(oracle_models):
    folder = oracle_models["qwen3_5_moe"][1]
    on, _ = run(folder, 3, PILOT="1")
    m = on.meters()
    assert m["prefetch_issued"] > 0
    assert 0 <= m["prefetch_useful"] <= m["prefetch_issued"]
    assert m["prefetch_wasted"] == m["prefetch_issued"] - m["prefetch_useful"]
    assert m["ram_hit"] >= m["ram_hit_without_prefetch"]
    assert m["prefetch_useful"] > 0
    # the hits prefetch bought are the difference between the two hit rates
    assert m["ram_hit"] - m["ram_hit_without_prefetch"] == pytest.approx(
        on.pilot.prefetch_hits / (m["ram_hits"] + m["ram_misses"]))
    on.close()


@pytest.mark.parametrize("cache", [6, 8])
def test_pilot_raises_the_ram_hit_rate_of_the_shipped_model(cache):
    """What PILOT is for: with a small cache (6 or 8 of 32 experts), prefetching turns misses into hits."""
    folder = ASSETS_DIR / "tiny-moe"
    prompt = json.loads((folder / "ref.json").read_text())["prompt_ids"]
    off, logits_off = run(folder, cache, prompt, 24)
    on, logits_on = run(folder, cache, prompt, 24, PILOT="1")
    assert np.array_equal(logits_on, logits_off)
    assert on.meters()["ram_hit"] > off.meters()["ram_hit"] + 0.02
    off.close()
    on.close()


def test_choose_takes_mass_between_k_and_k_times_wide():
    knobs = Knobs.from_env({}, CONF_LIMIT="0.85", WIDE="3").snapshot()
    z = np.log(np.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.02], dtype=np.float32))
    assert Pilot.choose(z, 2, knobs) == [0, 1, 2]
    knobs = Knobs.from_env({}, CONF_LIMIT="0.999", WIDE="2").snapshot()
    assert Pilot.choose(z, 2, knobs) == [0, 1, 2, 3]
    knobs = Knobs.from_env({}, CONF_LIMIT="0.1", WIDE="2").snapshot()
    assert Pilot.choose(z, 2, knobs) == [0, 1]


def test_hot_pins_survive_eviction(oracle_models):
    folder = oracle_models["qwen3_5_moe"][1]
    engine, _ = run(folder, 3, HOT="1", WARMUP="2")
    store = engine.store
    pinned = store.pinned(0)
    assert len(pinned) == 1
    # the pinned expert stays resident while the cache churns through all the others
    for e in range(engine.config.n_experts):
        if e not in pinned:
            held = store.acquire(0, [e])
            store.blob(held, 0)
            store.release(held)
    assert store.in_ram(0, pinned[0])


def test_token_fetch_reads_right_bytes_and_protects_its_own_hits(oracle_models):
    """A token's misses never evict its own resident experts; background reads give the right bytes."""
    from tierlab.engine.checkpoint import Checkpoint
    from tierlab.engine.config import load_config
    from tierlab.engine.expert_source import RawExpertSource
    from tierlab.engine.expert_store import ExpertStore

    folder = oracle_models["qwen3_moe"][1]
    source = RawExpertSource(Checkpoint(folder, load_config(folder)))
    store = ExpertStore(source, 1, 8, 2, [True], notice=print)
    reference = np.empty(source.blob_nbytes, dtype=np.uint8)

    def token(experts):
        held = store.acquire(0, experts)
        try:
            for i, e in enumerate(experts):
                source.read(0, e, reference)
                assert np.array_equal(store.blob(held, i), reference)
        finally:
            store.release(held)

    token([0, 1])  # A=0 (older), B=1 (newer)
    token([2, 0])  # C misses: it must evict B, not this token's A
    assert store.in_ram(0, 0) and store.in_ram(0, 2) and not store.in_ram(0, 1)
    assert (int(store.stats().hits[0]), int(store.stats().misses[0])) == (1, 3)
    store.close()
    # over random streams the hits and the residency are exactly those of the rule in docs/tiers.md
    rng = np.random.default_rng(0)
    for slots, k in ((4, 3), (3, 2), (5, 3)):
        store = ExpertStore(source, 1, 8, slots, [True], notice=print)
        stream = [[int(e) for e in rng.choice(8, k, replace=False)] for _ in range(60)]
        held: list[int] = []  # the rule's LRU order, least recent first
        hits = 0
        for experts in stream:
            token(experts)
            resident = [e for e in experts if e in held]
            hits += len(resident)
            for e in resident + [e for e in experts if e not in resident]:
                if e in held:
                    held.remove(e)
                elif len(held) == slots:
                    held.pop(0)
                held.append(e)
            assert sorted(np.flatnonzero(store.levels(0) == 1).tolist()) == sorted(held)
        stats = store.stats()
        assert int(stats.hits[0]) == hits and int(stats.misses[0]) == k * len(stream) - hits, (slots, k)
        store.close()
    store = ExpertStore(source, 1, 8, 4, [True], notice=print)
    assert store.acquire(0, [0, 1, 2, 3, 4]) is None  # more experts than slots
    store.close()


def test_prefetch_while_another_thread_resizes_the_cache():
    """PILOT's loads run while the app's cache worker resizes the RAM cache: a prefetch takes the
    layer as it is under the store's lock, so it never claims a slot of the new layer and then
    fails on the old one (which left the slot loading and every later resize waiting forever)."""
    import threading

    engine = load_engine(ASSETS_DIR / "tiny-moe", cache_slots=4, warmup=False)
    store, cfg = engine.store, engine.config
    layer = cfg.moe_layers.index(True)
    errors, stop = [], threading.Event()

    def load_ahead():
        i = 0
        while not stop.is_set():
            try:
                store.prefetch(layer, i % cfg.n_experts, for_pass=0)
            except Exception as exc:
                errors.append(repr(exc))
            i += 1

    loader = threading.Thread(target=load_ahead, daemon=True)
    loader.start()
    for r in range(60):  # 4 and n_experts slots in turn, ending at 4
        resize = threading.Thread(target=engine.set_cache_slots, args=(4 if r % 2 else cfg.n_experts,), daemon=True)
        resize.start()
        resize.join(10)
        if resize.is_alive():
            errors.append("the resize never finished")
            break
    stop.set()
    loader.join(10)
    assert errors == []
    assert engine.cache_slots() == 4
    engine.close()
