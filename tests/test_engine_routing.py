"""The routing lever inside the engine: off is byte-identical, meters alone only measure, knobs apply live."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from record_lever_off_ids import lever_off_ids
from tierlab import ASSETS_DIR
from tierlab.app.lab.evaluate import greedy_decode
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine

PROMPT = [int(i) for i in np.random.default_rng(3).integers(2, 250, 12)]
N = 24


@pytest.fixture(scope="module")
def folder(oracle_models):
    return oracle_models["qwen3_5_moe"][1]  # 8 experts, top-2


def decode_ids(folder, cache=None, **knobs):
    engine = load_engine(folder, cache_slots=cache, knobs=Knobs.from_env({}, **knobs))
    ids, _ = greedy_decode(engine, PROMPT, N)
    return engine, ids


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_moe"])
def test_lever_off_decodes_what_transformers_decodes(oracle_models, name):
    import oracle_models as om

    model, folder = oracle_models[name]
    want = om.hf_greedy(model, PROMPT, N)[len(PROMPT):]
    for cache in (2, 4, None):
        engine, ids = decode_ids(folder, cache=cache)
        assert ids == want, cache
        assert engine.meter_fold.slots == 0  # the lever's code never ran
    stock = load_engine(folder, cache_slots=4, knobs=Knobs.from_env({}))
    stock.router = None  # no routing module at all: the plain top-K path
    assert greedy_decode(stock, PROMPT, N)[0] == want


RECORDED = json.loads((Path(__file__).with_name("data") / "lever_off_ids.json").read_text())


@pytest.mark.parametrize("name", sorted(RECORDED["models"]))
def test_lever_off_ids_of_the_shipped_models_are_the_recorded_ones(name):
    """Byte-identical to ids recorded before any later change (and to ref.json, transformers' greedy)."""
    record = RECORDED["models"][name]
    folder = ASSETS_DIR / name
    reference = json.loads((folder / "ref.json").read_text())
    assert record["prompt_ids"] == reference["prompt_ids"]
    assert len(record["ids"]) >= 3
    for cache, want in record["ids"].items():
        ids = lever_off_ids(folder, record["prompt_ids"], None if cache == "None" else int(cache), record["n"])
        assert np.array(ids, dtype=np.int64).tobytes() == np.array(want, dtype=np.int64).tobytes(), (name, cache)
        assert ids == reference["full_ids"][len(reference["prompt_ids"]):][: record["n"]], (name, cache)


def test_route_agree_alone_only_measures(folder):
    _, ids_off = decode_ids(folder, cache=4)
    engine, ids = decode_ids(folder, cache=4, ROUTE_AGREE="1")
    assert ids == ids_off
    m = engine.meters()
    assert m["slots"] > 0
    assert m["route_agree"] == pytest.approx(1.0)
    assert m["route_kl"] == pytest.approx(0.0, abs=1e-9)
    assert m["swap"] == 0.0


def test_lever_raises_hit_rate_and_counts_swaps(folder):
    off, _ = decode_ids(folder, cache=4)
    on, _ = decode_ids(folder, cache=4, CACHE_ROUTE="1", ROUTE_J="1")
    m_off, m_on = off.meters(), on.meters()
    assert m_on["swaps"] > 0
    assert m_on["ram_hit"] > m_off["ram_hit"]
    assert m_on["route_agree"] < 1.0 and m_on["route_kl"] > 0


def test_default_j_on_a_top2_model_substitutes_nothing(folder):
    engine, ids = decode_ids(folder, cache=4, CACHE_ROUTE="1")
    _, ids_off = decode_ids(folder, cache=4)
    assert engine.meters()["swap"] == 0.0
    assert ids == ids_off


def test_knob_change_applies_at_the_next_token(folder):
    engine = load_engine(folder, cache_slots=4, knobs=Knobs.from_env({}))
    seen = []
    engine.subscribe(lambda ev: seen.append((ev.index, sum(int(r.swapped.sum()) for r in ev.layers))))
    logits = engine.prefill(PROMPT)
    for i in range(N):
        if i == N // 2:
            engine.knobs.set("CACHE_ROUTE", True)
            engine.knobs.set("ROUTE_J", 0)
        logits = engine.step(int(np.argmax(logits)))
    decode = seen[len(PROMPT):]
    assert sum(s for _, s in decode[: N // 2]) == 0
    assert sum(s for _, s in decode[N // 2:]) > 0


def test_events_describe_each_token(folder):
    engine = load_engine(folder, cache_slots=4, knobs=Knobs.from_env({}, CACHE_ROUTE="1", ROUTE_J="1"))
    events = []
    engine.subscribe(events.append)
    engine.prefill(PROMPT)
    assert [e.index for e in events] == list(range(len(PROMPT)))
    assert all(e.phase == "prefill" for e in events)
    layer = events[-1].layers[0]
    assert layer.chosen.shape == (2,) and layer.true_topk.shape == (2,)
    assert layer.chosen[0] == layer.true_topk[0]  # the sacred top-1
    assert layer.ram_hits + layer.ram_misses == 2
    assert engine.heat.sum() == len(PROMPT) * engine.config.n_layers * 2
