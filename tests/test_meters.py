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


# -- windows ------------------------------------------------------------------------

from tierlab.engine.knobs import KnobValues  # noqa: E402
from tierlab.engine.meters import WindowedMeters, store_deltas, window_title  # noqa: E402


def windowed_trace() -> list[TokenEvent]:
    """A prompt token, then five decode tokens; a knob change before token 3 (seq 1) and a cache
    resize before token 5 (8 -> 4 slots). Every count chosen by hand."""
    def event(i, phase, hits, misses, total_ms, seq, slots, bytes_read, kl=None, measured=False):
        r = route(0, [1, 2], hits, misses, kl=kl, measured=measured, swaps=1 if measured else 0)
        r.shadow_ram_hits, r.shadow_ram_misses = max(hits - 1, 0) if measured else hits, misses + (1 if measured and hits else 0)
        return TokenEvent(i, 100 + i, phase, [r], {"fetch": 1.0, "compute": 2.0, "total": total_ms}, knob_seq=seq,
                          store={"ram_slots": slots, "bytes_read": bytes_read})
    MiB = 2**20
    return [
        event(0, "prefill", 0, 2, 50.0, 0, 8, 2 * MiB),
        event(1, "decode", 1, 1, 40.0, 0, 8, 3 * MiB),  # the first decode token: never timed
        event(2, "decode", 2, 0, 10.0, 0, 8, 3 * MiB),
        event(3, "decode", 2, 0, 10.0, 1, 8, 3 * MiB, kl=0.5, measured=True),
        event(4, "decode", 1, 1, 20.0, 1, 8, 4 * MiB, kl=0.25, measured=True),
        event(5, "decode", 0, 2, 20.0, 1, 4, 6 * MiB),
    ]


def test_windowed_meters_against_a_hand_computed_trace():
    closed = []
    wm = WindowedMeters(recent=2, on_segment=closed.append)
    for event in windowed_trace():
        wm.add(event)
    recent, knob, total = (wm.summary(w) for w in ("recent", "knob", "total"))
    # the last two tokens (4 and 5): hits 1+0, misses 1+2; both decode and timed: 40 ms for 2 tokens
    assert (recent["tokens"], recent["ram_hits"], recent["ram_misses"]) == (2, 1, 3)
    assert recent["ram_hit"] == pytest.approx(1 / 4) and recent["tok_s"] == pytest.approx(2 / 0.040)
    assert recent["bytes_read"] == 3 * 2**20 and recent["disk_mib"] == pytest.approx(1.5)
    assert recent["route_kl"] == pytest.approx(0.25) and recent["swap"] == pytest.approx(1 / 2)
    assert recent["shadow_hits"] == 0 and recent["shadow_misses"] == 4 and recent["shadow_hit"] == 0.0
    # since the knob change: the cache resize before token 5 started a new setting
    assert (knob["tokens"], knob["ram_hits"], knob["ram_misses"]) == (1, 0, 2)
    assert knob["ram_hit"] == 0.0 and knob["ram_slots"] == 4 and knob["disk_mib"] == pytest.approx(2.0)
    assert knob["swap"] is None and knob["route_agree"] is None  # no routing decision measured in it
    # since start: every token for the cache; timings of decode tokens 2..5 only (60 ms for 4)
    assert (total["tokens"], total["ram_hits"], total["ram_misses"]) == (6, 6, 6)
    assert total["tok_s"] == pytest.approx(4 / 0.060) and total["fetch_ms"] == pytest.approx(1.0)
    assert total["disk_mib"] == pytest.approx(6 / 6) and total["route_kl"] == pytest.approx(0.75 / 2)
    # the two closed settings: tokens 0-2 at seq 0, tokens 3-4 at seq 1 (8 slots)
    assert [(s.knob_seq, s.ram_slots, s.first, s.end) for s in closed] == [(0, 8, 0, 3), (1, 8, 3, 5)]
    first, second = closed[0].meters, closed[1].meters
    assert (first["ram_hits"], first["ram_misses"], first["tok_s"]) == (3, 3, pytest.approx(1 / 0.010))
    assert first["swap"] is None and first["disk_mib"] == pytest.approx(1.0)
    assert (second["ram_hits"], second["ram_misses"], second["swaps"]) == (3, 1, 2)
    assert second["route_agree"] == pytest.approx(2 / 4) and second["bytes_read"] == 2**20
    assert second["shadow_hit"] == pytest.approx(1 / 4) and second["ram_hit"] == pytest.approx(3 / 4)
    assert wm.current().first == 5 and wm.current().meters["tokens"] == 1


def test_a_change_empties_the_knob_window_and_the_lever_meters_follow_the_knobs():
    wm = WindowedMeters(recent=4)
    for event in windowed_trace()[:5]:
        wm.add(event)
    lever_on = KnobValues(CACHE_ROUTE=True)
    assert wm.summary("recent", lever_on)["swap"] == pytest.approx(2 / 4)
    wm.changed()  # e.g. Reset (F6): the lever goes off before the next token
    off = KnobValues()
    knob = wm.summary("knob", off)
    assert knob["tokens"] == 0 and all(knob[k] is None for k in ("ram_hit", "shadow_hit", "tok_s", "disk_mib"))
    recent = wm.summary("recent", off)
    assert recent["ram_hit"] is not None
    assert all(recent[k] is None for k in ("swap", "swaps_to_vram", "route_agree", "route_kl"))
    assert wm.summary("recent", KnobValues(ROUTE_AGREE="1"))["route_agree"] == pytest.approx(2 / 4)


def test_the_recent_window_slides_and_resizes():
    wm = WindowedMeters(recent=3)
    trace = windowed_trace()
    for event in trace:
        wm.add(event)
    assert wm.summary("recent")["ram_misses"] == 0 + 1 + 2
    wm.set_recent(1)
    assert wm.summary("recent")["tokens"] == 1 and wm.summary("recent")["ram_misses"] == 2
    assert window_title("recent", 1) == "last 1 tok" and window_title("knob") == "since knob change"
    with pytest.raises(ValueError):
        wm.set_recent(0)
    # a window whose timed tokens have all left it has no tok/s (not 0, whatever float dust is left)
    wm = WindowedMeters(recent=1)
    for ms in (0.1, 0.2, 0.7):
        wm.add(TokenEvent(0, 1, "decode", [route(0, [1, 2], 1, 1)], {"total": ms}))
    wm.add(TokenEvent(1, 2, "prefill", [route(0, [1, 2], 1, 1)], {"total": 5.0}))
    assert wm.summary("recent")["tok_s"] is None and wm.summary("recent")["fetch_ms"] is None
    assert wm.summary("total")["tok_s"] == pytest.approx(2 / 0.0009)


def test_store_counters_become_deltas():
    assert store_deltas({"bytes_read": 10, "ram_slots": 4}, {"bytes_read": 25, "ram_slots": 2}) == {"bytes_read": 15}
    assert store_deltas({"bytes_read": 10}, {"bytes_read": 3}) == {"bytes_read": 3}  # reset meters: all new
