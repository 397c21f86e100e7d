"""The oracle band: Belady and the engine's LRU over a bounded window, at the cache's size and others."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli
from tierlab import ASSETS_DIR
from tierlab.app.lab.ab import run_ab
from tierlab.app.lab.belady import belady_hits, engine_lru_hits
from tierlab.app.lab.oracle import OracleBand, band_sizes
from tierlab.engine.checkpoint import Checkpoint
from tierlab.engine.config import load_config
from tierlab.engine.events import LayerRoute, TokenEvent
from tierlab.engine.expert_source import RawExpertSource
from tierlab.engine.expert_store import ExpertStore
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine

TINY = ASSETS_DIR / "tiny-moe"


def simple_lru(stream: list[list[int]], slots: int) -> tuple[int, int]:
    """The engine's cache rule (docs/tiers.md) as a list, least recent first: (hits, requests)."""
    held: list[int] = []
    hits = total = 0
    for experts in stream:
        experts = [e for e in experts if e >= 0]
        if len(experts) <= slots and len(set(experts)) == len(experts):
            resident = [e for e in experts if e in held]
            touches = resident + [e for e in experts if e not in resident]
        else:  # more experts than slots: one at a time, in rank order
            touches = experts
        for e in touches:
            total += 1
            if e in held:
                hits += 1
                held.remove(e)
            elif len(held) == slots:
                held.pop(0)
            held.append(e)
    return hits, total


def event(t: int, layers: list[np.ndarray], slots: int) -> TokenEvent:
    routes = []
    for i, ids in enumerate(layers):
        k = len(ids)
        routes.append(LayerRoute(i, np.asarray(ids, np.int32), np.full(k, 1.0 / k, np.float32),
                                 np.asarray(ids, np.int32), None, np.ones(k, np.int8), np.zeros(k, bool), slots=k))
    return TokenEvent(t, 0, "decode", routes, store={"ram_slots": slots})


def skewed_trace(rng, tokens: int, n_layers: int, n_experts: int, k: int) -> list[list[np.ndarray]]:
    p = 1.0 / np.arange(1, n_experts + 1) ** 1.1
    p /= p.sum()
    return [[rng.choice(n_experts, k, replace=False, p=p).astype(np.int32) for _ in range(n_layers)]
            for _ in range(tokens)]


def test_the_window_bounds_what_is_stored_and_replayed():
    """Per-token cost is bounded: the band stores at most W tokens, and a reading after 10 W tokens is
    the replay of the last W alone."""
    W, L, E, K, slots = 32, 3, 12, 2, 4
    rng = np.random.default_rng(11)
    trace = skewed_trace(rng, 10 * W, L, E, K)
    band = OracleBand(window=W, n_experts=E)
    for t, layers in enumerate(trace):
        band.add(event(t, layers, slots))
        assert len(band) <= W
        if t % 37 == 5:
            band.reading()  # readings along the way convert only the tokens that are new to them
    assert len(band) == W
    reading = band.reading()
    assert reading.window_tokens == W and reading.slots == slots
    last = trace[-W:]
    per_layer = [[tok[j].tolist() for tok in last] for j in range(L)]
    belady = sum((belady_hits(r, slots) for r in per_layer), belady_hits([], slots))
    assert reading.belady_hit == pytest.approx(belady.hit_rate)
    for size, rate in reading.lru_hit_by_size.items():
        hits, total = np.sum([simple_lru(r, size) for r in per_layer], axis=0)
        assert rate == pytest.approx(hits / total), size
    # the same figures from a band that only ever saw those W tokens
    fresh = OracleBand(window=W, n_experts=E)
    for t, layers in enumerate(last):
        fresh.add(event(t, layers, slots))
    again = fresh.reading()
    assert (again.belady_hit, again.lru_hit_by_size) == (reading.belady_hit, reading.lru_hit_by_size)
    # after a clear only what came after it counts
    band.clear()
    assert band.reading() is None and band.latest_reading is None
    for t, layers in enumerate(last[:5]):
        band.add(event(t, layers, slots))
    short = OracleBand(window=W, n_experts=E)
    for t, layers in enumerate(last[:5]):
        short.add(event(t, layers, slots))
    assert band.reading().lru_hit_by_size == short.reading().lru_hit_by_size
    assert band.reading().window_tokens == 5


def test_sizes_are_clipped_to_the_layer_and_replayed_once():
    assert band_sizes(12, 32) == {"lru_half": 6, "lru_1x": 12, "lru_2x": 24, "lru_4x": None, "lru_all_but_one": 31}
    assert band_sizes(1, 8) == {"lru_half": None, "lru_1x": 1, "lru_2x": 2, "lru_4x": 4, "lru_all_but_one": 7}
    assert band_sizes(32, 32)["lru_1x"] == 32 and band_sizes(32, 32)["lru_2x"] is None
    assert band_sizes(6, None)["lru_all_but_one"] is None
    # 2x of 6 and all-but-one of 13 experts are one size: replayed once, shown under both keys
    band = OracleBand(window=None, n_experts=13)
    rng = np.random.default_rng(2)
    for t, layers in enumerate(skewed_trace(rng, 60, 2, 13, 3)):
        band.add(event(t, layers, 6))
    reading = band.reading()
    assert sorted(reading.lru_hit_by_size) == [3, 6, 12]
    m = reading.meters()
    assert m["lru_2x"] == m["lru_all_but_one"] == reading.lru_hit_by_size[12]
    assert m["lru_4x"] is None and m["lru_half"] == reading.lru_hit_by_size[3]


@pytest.mark.parametrize("seed", range(6))
def test_lru_at_each_size_equals_a_simple_replay_and_belady_is_never_below(seed):
    rng = np.random.default_rng(seed)
    E, K, L = int(rng.integers(6, 24)), int(rng.integers(1, 5)), 2
    slots = int(rng.integers(K, E))
    trace = skewed_trace(rng, 150, L, E, K)
    band = OracleBand(window=None, n_experts=E)
    for t, layers in enumerate(trace):
        band.add(event(t, layers, slots))
    reading = band.reading()
    assert set(reading.lru_hit_by_size) == {s for s in band_sizes(slots, E).values() if s is not None}
    for size, rate in reading.lru_hit_by_size.items():
        hits, total = np.sum([simple_lru([tok[j].tolist() for tok in trace], size) for j in range(L)], axis=0)
        assert rate == pytest.approx(hits / total), (size, K)
    assert reading.belady_hit >= reading.lru_hit_by_size[slots]
    assert reading.meters()["lru_1x"] == reading.lru_hit_by_size[slots]
    assert reading.meters()["oracle_hit"] == reading.belady_hit


def test_the_replay_is_the_engines_cache():
    """engine_lru_hits against the real ExpertStore, with fewer and more experts per token than slots."""
    source = RawExpertSource(Checkpoint(TINY, load_config(TINY)))
    rng = np.random.default_rng(4)
    for slots, k in ((4, 3), (3, 2), (2, 3), (5, 4)):
        store = ExpertStore(source, 1, 32, slots, [True], notice=print)
        stream = [[int(e) for e in rng.choice(10, k, replace=False)] for _ in range(80)]
        for experts in stream:
            held = store.acquire(0, experts)
            if held is None:  # more experts than slots: the store takes them one at a time
                for e in experts:
                    h = store.acquire(0, [e])
                    store.blob(h, 0)
                    store.release(h)
                continue
            for i in range(len(experts)):
                store.blob(held, i)
            store.release(held)
        replay = engine_lru_hits(stream, slots, 32)
        stats = store.stats()
        assert (replay.hits, replay.requests - replay.hits) == (int(stats.hits[0]), int(stats.misses[0])), (slots, k)
        store.close()


def test_a_runs_band_at_its_own_size_is_the_realised_hit_rate():
    """From a cold cache, without PILOT, pins or a GPU tier, the band's LRU at the cache's size replays
    exactly what the engine's RAM cache did."""
    prompt = json.loads((TINY / "ref.json").read_text())["prompt_ids"]
    engine = load_engine(TINY, cache_slots=6, knobs=Knobs.from_env({}))
    band = OracleBand(window=None, n_experts=engine.config.n_experts)
    engine.subscribe(band.add)
    logits = engine.prefill(prompt)
    for _ in range(16):
        logits = engine.step(int(np.argmax(logits)))
    reading = band.reading()
    m = engine.meters()
    assert reading.lru_hit_by_size[6] == pytest.approx(m["ram_hit"])
    assert reading.belady_hit >= m["ram_hit"]
    assert reading.lru_hit_by_size[3] < m["ram_hit"] < reading.lru_hit_by_size[12] <= reading.lru_hit_by_size[31]
    engine.close()


def test_the_watch_exposes_the_latest_reading():
    from tierlab.app.tui.engine_watch import EngineWatch

    engine = load_engine(TINY, cache_slots=6, knobs=Knobs.from_env({}))
    watch = EngineWatch(engine)
    try:
        assert watch.oracle_reading() is None
        logits = engine.prefill([5, 6, 7, 8])
        for _ in range(6):
            logits = engine.step(int(np.argmax(logits)))
        watch.refresh_oracle()
        reading = watch.oracle_reading()
        assert reading.window_tokens == 10 and reading.slots == 6
        assert reading.sizes == band_sizes(6, 32)
        assert set(reading.meters()) == {"oracle_hit", "lru_half", "lru_1x", "lru_2x", "lru_4x", "lru_all_but_one"}
    finally:
        watch.close()
        engine.close()


def test_eval_and_ab_outputs_carry_the_band():
    ref = TINY / "ref.json"
    proc = run_cli("eval", "--model", str(TINY), "--ref", str(ref), "--cache", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["lru_sizes"] == band_sizes(6, 32)
    assert out["lru_1x"] == pytest.approx(out["ram_hit"])  # percent, like every rate in the JSON
    assert out["lru_half"] < out["lru_1x"] < out["lru_2x"] <= out["lru_4x"] <= out["lru_all_but_one"] <= 100.0
    assert out["oracle_hit"] >= out["lru_1x"]
    data = json.loads(ref.read_text())
    full = data["full_ids"][: len(data["prompt_ids"]) + 8]
    row = run_ab(TINY, data["prompt_ids"], full, ["off"], repeat=0, default_engine={"CACHE": "6"},
                 tf_nll=False)[0].as_row()
    assert row["lru_sizes"] == band_sizes(6, 32)
    assert row["lru_1x"] == pytest.approx(row["ram_hit"]) and row["oracle_hit"] >= row["lru_1x"]
    assert 0.0 < row["lru_half"] < row["lru_4x"] <= 1.0
