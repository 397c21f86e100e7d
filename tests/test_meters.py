"""The meter fold over token events, its catalogue, and the oracle's bounded window."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tierlab.app.lab.abtable import COLUMNS
from tierlab.app.lab.belady import belady_hit_rate
from tierlab.app.lab.oracle import OracleBand
from tierlab.engine.events import LayerRoute, TokenEvent
from tierlab.engine.meters import CATALOGUE, MISSING, METER_BY_KEY, MeterFold, meters_json
from tierlab.widgets.meters import METERS


def route(layer, chosen, hits, misses, *, vram=0, slots=2, swaps=0, swaps_vram=0, kl=None, measured=True):
    ids = np.array(chosen, dtype=np.int32)
    k = len(chosen)
    return LayerRoute(layer, ids, np.full(k, 1.0 / k, np.float32), ids.copy(), None, np.ones(k, np.int8),
                      np.zeros(k, bool), slots=slots, swaps=swaps, swaps_vram=swaps_vram, measured=measured, kl=kl,
                      ram_hits=hits, ram_misses=misses, vram_served=vram)


def two_tokens() -> list[TokenEvent]:
    """Two decode tokens through two MoE layers, every count chosen by hand."""
    return [
        TokenEvent(0, 10, "decode", [route(0, [1, 2], 1, 1, swaps=1, swaps_vram=1, kl=0.5),
                                     route(1, [3, 4], 2, 0, kl=0.0)],
                   {"fetch": 2.0, "compute": 3.0, "total": 6.0}, gpu_tier=True,
                   store={"ram_slots": 4, "bytes_read": 100}),
        TokenEvent(1, 11, "decode", [route(0, [1, 5], 0, 1, vram=1, kl=0.25),
                                     route(1, [3, -1], 1, 0, slots=1, swaps=1, kl=None)],
                   {"fetch": 4.0, "compute": 1.0, "total": 4.0}, gpu_tier=True,
                   store={"ram_slots": 4, "bytes_read": 300}),
    ]


def test_fold_of_a_hand_computed_trace():
    fold = MeterFold()
    for event in two_tokens():
        fold.add(event)
    m = fold.summary()
    assert (m["tokens"], m["ram_hits"], m["ram_misses"]) == (2, 4, 2)
    assert m["ram_hit"] == pytest.approx(4 / 6)
    assert fold.layer_hits == [1, 3] and fold.layer_misses == [2, 0]
    assert fold.layer_hit_rates() == [pytest.approx(1 / 3), 1.0]
    assert m["vram_served"] == 1 and m["vram_hit"] == pytest.approx(1 / 8)
    assert (m["decisions"], m["slots"], m["swaps"], m["swaps_vram"]) == (4, 7, 2, 1)
    assert m["swap"] == pytest.approx(2 / 7) and m["swaps_to_vram"] == 1
    assert (m["agree_hit"], m["agree_tot"]) == (5, 7) and m["route_agree"] == pytest.approx(5 / 7)
    assert m["kl_count"] == 3 and m["route_kl"] == pytest.approx(0.75 / 3)
    assert m["tok_s"] == pytest.approx(2 / 0.010)
    assert m["fetch_ms"] == pytest.approx(3.0) and m["compute_ms"] == pytest.approx(2.0)
    assert m["ms_per_token"] == {"fetch": pytest.approx(3.0), "compute": pytest.approx(2.0)}
    assert m["bytes_read"] == 300 and m["ram_slots"] == 4  # the latest store counters
    shown = meters_json(m)
    assert shown["ram_hit"] == pytest.approx(100 * 4 / 6) and shown["route_kl"] == m["route_kl"]
    assert shown["ram_hits"] == 4


def test_timings_of_one_phase_only():
    prefill = TokenEvent(0, 1, "prefill", [route(0, [1, 2], 0, 2)], {"fetch": 50.0, "total": 100.0})
    fold = MeterFold(timing_phase="decode")
    for event in [prefill, *two_tokens()]:
        fold.add(event)
    m = fold.summary()
    assert m["tokens"] == 3 and m["ram_misses"] == 4  # every token counts for the cache
    assert m["fetch_ms"] == pytest.approx(3.0) and m["tok_s"] == pytest.approx(200.0)


def test_meters_without_samples_are_none():
    m = MeterFold().summary()
    for key in ("ram_hit", "vram_hit", "tok_s", "fetch_ms", "compute_ms", "swap", "swaps_to_vram", "route_agree",
                "route_kl"):
        assert m[key] is None, key
    fold = MeterFold()
    fold.add(TokenEvent(0, 1, "decode", [route(0, [1, 2], 1, 1, measured=False)]))
    m = fold.summary()
    assert m["ram_hit"] == 0.5
    assert m["swap"] is None and m["route_agree"] is None and m["route_kl"] is None  # routing meters were off
    assert m["vram_hit"] is None  # no GPU tier
    assert m["tok_s"] is None  # an event without timings
    assert METER_BY_KEY["swap"].show(m["swap"]) == MISSING
    assert meters_json(m)["swap"] is None


def test_one_catalogue_for_table_and_panel():
    assert all(c in CATALOGUE for c in COLUMNS) and all(m in CATALOGUE for m in METERS)
    assert len({m.key for m in CATALOGUE}) == len(CATALOGUE)
    rate = METER_BY_KEY["ram_hit"]
    assert rate.show(0.768) == "76.8%" and rate.show(0.768, "panel") == " 76.8%"
    assert METER_BY_KEY["route_kl"].show(1.85) == "1.85" and METER_BY_KEY["route_kl"].show(1.85, "panel") == " 1.850"


def test_oracle_band_keeps_a_bounded_window():
    W = 16
    rng = np.random.default_rng(5)
    band = OracleBand(window=W)
    tokens = []
    for t in range(10 * W):
        layers = [rng.choice(8, size=2, replace=False).astype(np.int32) for _ in range(2)]
        tokens.append(layers)
        band.add(TokenEvent(t, 0, "decode", [route(i, ids.tolist(), 0, 2) for i, ids in enumerate(layers)],
                            store={"ram_slots": 3}))
        assert len(band) <= W
    assert len(band) == W and band.slots == 3
    last = tokens[-W:]
    expected = belady_hit_rate([np.stack([t[j] for t in last]) for j in range(2)], 3)
    assert band.hit_rate() == pytest.approx(expected)
    assert band.refresh() == band.latest == pytest.approx(expected)
    assert OracleBand().hit_rate() is None


def test_oracle_band_thread_updates_latest():
    band = OracleBand(window=8, interval=0.01)
    band.start()
    try:
        band.add(TokenEvent(0, 0, "decode", [route(0, [1, 2], 0, 2)], store={"ram_slots": 2}))
        for _ in range(500):
            if band.latest is not None:
                break
            time.sleep(0.01)
        assert band.latest == 0.0  # one token: nothing can hit
    finally:
        band.close()
