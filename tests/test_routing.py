"""The routing contract (docs/routing.md), pinned without a model."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierlab.engine.events import TokenEvent
from tierlab.engine.knobs import KnobValues
from tierlab.engine.meters import MeterFold, meters_json
from tierlab.engine.routing import (
    Router,
    RoutingWarning,
    format_footer,
    prior_select,
    prior_select_numba,
    route_select,
    route_select_numba,
)

E = 16


def falling_probs(n: int = E) -> np.ndarray:
    """Expert e has rank e: probabilities strictly falling with the id."""
    raw = np.linspace(2.0, 1.0, n) ** 3
    return (raw / raw.sum()).astype(np.float32)


def levels(**resident: int) -> np.ndarray:
    """levels(e5=1, e7=2): residency per expert, disk elsewhere."""
    lv = np.zeros(E, dtype=np.int8)
    for name, value in resident.items():
        lv[int(name[1:])] = value
    return lv


ALL = np.ones(E, dtype=bool)


def both(probs, mask, level, K, J, M, P=0.0, alpha=1.0):
    """Run the reference and the numba twin, check they agree, return the reference."""
    ref = route_select(probs, mask, level, K, J, M, P, alpha)
    fast = route_select_numba(probs, mask, level, K, J, M, P, alpha)
    assert ref[0].tolist() == fast[0].tolist()
    assert ref[1].tolist() == fast[1].tolist()
    assert dataclasses.replace(ref[2], kl=0) == dataclasses.replace(fast[2], kl=0)
    assert ref[2].kl == pytest.approx(fast[2].kl, rel=1e-9, abs=1e-12)
    return ref


# --- the contract, case by case -------------------------------------------


def test_nothing_resident_gives_true_topk_full_agreement_and_zero_kl():
    idx, val, stats = both(falling_probs(), ALL, levels(), K=4, J=2, M=12)
    assert idx.tolist() == [0, 1, 2, 3]
    assert stats.swaps == 0 and stats.agree_hit == stats.agree_tot == stats.slots == 4
    assert stats.kl == 0.0
    assert val.tolist() == falling_probs()[:4].tolist()


def test_ram_resident_inside_window_replaces_the_tail():
    idx, _, stats = both(falling_probs(), ALL, levels(e6=1), K=4, J=2, M=8)
    assert idx.tolist() == [0, 1, 6, 2]
    assert (stats.swaps, stats.swaps_vram, stats.agree_hit) == (1, 0, 3)
    assert stats.kl > 0.0


def test_sacred_top_j_is_never_displaced():
    lv = levels(**{f"e{e}": 2 for e in range(2, 12)})
    idx, _, stats = both(falling_probs(), ALL, lv, K=4, J=2, M=12)
    assert idx[:2].tolist() == [0, 1]
    # Ranks 2 and 3 are themselves resident, so nothing needs substituting.
    assert idx.tolist() == [0, 1, 2, 3] and stats.swaps == 0


def test_gpu_residency_beats_ram_and_counts_as_swap_to_vram():
    idx, _, stats = both(falling_probs(), ALL, levels(e5=1, e7=2), K=3, J=2, M=12)
    assert idx.tolist() == [0, 1, 7]
    assert (stats.swaps, stats.swaps_vram) == (1, 1)
    idx, _, stats = both(falling_probs(), ALL, levels(e5=1, e7=2), K=4, J=2, M=12)
    assert idx.tolist() == [0, 1, 7, 5]
    assert (stats.swaps, stats.swaps_vram) == (2, 1)


def test_residency_past_the_window_is_ignored():
    idx, _, stats = both(falling_probs(), ALL, levels(e6=2, e10=1), K=4, J=2, M=6)
    assert idx.tolist() == [0, 1, 2, 3] and stats.swaps == 0


def test_j_zero_lets_residents_take_every_slot_and_j_k_disables_substitution():
    lv = levels(e4=1, e5=1, e6=1, e7=2)
    idx, _, stats = both(falling_probs(), ALL, lv, K=4, J=0, M=8)
    assert idx.tolist() == [7, 4, 5, 6] and stats.swaps == 4 and stats.agree_hit == 0
    idx, _, stats = both(falling_probs(), ALL, lv, K=4, J=4, M=8)
    assert idx.tolist() == [0, 1, 2, 3] and stats.swaps == 0
    idx, _, _ = both(falling_probs(), ALL, lv, K=4, J=9, M=8)  # J clamps to K
    assert idx.tolist() == [0, 1, 2, 3]


def test_top2_model_with_default_j_substitutes_nothing():
    idx, _, stats = both(falling_probs(), ALL, levels(e3=2, e4=1), K=2, J=2, M=12)
    assert idx.tolist() == [0, 1] and stats.swaps == 0


def test_masked_experts_are_never_chosen():
    mask = ALL.copy()
    mask[[0, 5]] = False
    idx, _, _ = both(falling_probs(), mask, levels(e5=2, e6=1), K=4, J=1, M=12)
    assert idx.tolist() == [1, 6, 2, 3]
    assert 0 not in idx and 5 not in idx


def test_alpha_scales_only_substitutes():
    probs = falling_probs()
    idx, val, _ = both(probs, ALL, levels(e6=1), K=4, J=2, M=8, alpha=0.5)
    assert idx.tolist() == [0, 1, 6, 2]
    assert val.tolist() == [probs[0], probs[1], np.float32(float(probs[6]) * 0.5), probs[2]]
    # alpha = 1 (off) and alpha = 0 (out of range, off) leave the mass alone
    for alpha in (1.0, 0.0):
        _, val, _ = both(probs, ALL, levels(e6=1), K=4, J=2, M=8, alpha=alpha)
        assert val[2] == probs[6]


def test_p_window_bounds_by_ranked_mass():
    probs = np.array([0.30, 0.25, 0.15, 0.10] + [0.02] * 10 + [0.0, 0.0], dtype=np.float32)
    lv = levels(e6=1)
    # P=0.5: ranks 0,1 hold 0.55 of the ranked mass -> window 2 (at least Kt=3) -> rank 6 ignored
    idx, _, stats = both(probs, ALL, lv, K=3, J=1, M=12, P=0.5)
    assert idx.tolist() == [0, 1, 2] and stats.swaps == 0
    # P=0.99 reaches past rank 6
    idx, _, stats = both(probs, ALL, lv, K=3, J=1, M=12, P=0.99)
    assert idx.tolist() == [0, 6, 1] and stats.swaps == 1
    # P=0 falls back to the M window
    idx, _, _ = both(probs, ALL, lv, K=3, J=1, M=6, P=0.0)
    assert idx.tolist() == [0, 1, 2]


def test_fewer_eligible_than_k_pads_with_minus_one():
    mask = np.zeros(E, dtype=bool)
    mask[[3, 9]] = True
    idx, val, stats = both(falling_probs(), mask, levels(e9=2), K=4, J=0, M=12)
    assert idx.tolist() == [9, 3, -1, -1]
    assert val[2:].tolist() == [0.0, 0.0]
    assert stats.slots == 2 and stats.swaps == 0  # both eligible experts are the true top-K


def test_nothing_eligible_fills_nothing():
    idx, val, stats = both(falling_probs(), np.zeros(E, dtype=bool), levels(), K=4, J=2, M=12)
    assert idx.tolist() == [-1] * 4 and stats.slots == 0 and stats.kl == 0.0


def test_ties_go_to_the_lower_id():
    probs = np.full(E, 1.0 / E, dtype=np.float32)
    idx, _, _ = both(probs, ALL, levels(), K=4, J=2, M=12)
    assert idx.tolist() == [0, 1, 2, 3]
    idx, _, _ = both(probs, ALL, levels(e9=1, e5=1), K=4, J=2, M=12)
    assert idx.tolist() == [0, 1, 5, 9]


def test_kl_counts_a_dropped_true_expert_at_1e_12():
    probs = np.array([0.5, 0.5] + [0.0] * (E - 2), dtype=np.float32)
    _, _, stats = both(probs, ALL, levels(e2=1), K=2, J=1, M=4)
    # true mass (0.5, 0.5); chosen {0, 2} puts all mass on 0; expert 1 contributes 0.5*log(0.5/1e-12)
    assert stats.kl == pytest.approx(0.5 * np.log(0.5 / 1.0) + 0.5 * np.log(0.5 / 1e-12))


# --- the numba twin on many random rows ------------------------------------


def random_row(rng: np.random.Generator, n: int):
    logits = rng.normal(size=n).astype(np.float32)
    if rng.random() < 0.3:  # coarse logits make ties
        logits = np.round(logits * 2) / 2
    probs = np.exp(logits - logits.max())
    probs = (probs / probs.sum()).astype(np.float32)
    mask = rng.random(n) < (1.0 if rng.random() < 0.5 else 0.8)
    level = rng.choice(np.array([0, 1, 2], dtype=np.int8), size=n, p=[0.6, 0.3, 0.1])
    return logits, probs, mask, level


def test_numba_twin_matches_reference_on_random_rows():
    rng = np.random.default_rng(1234)
    for _ in range(400):
        n = int(rng.integers(1, 40))
        _, probs, mask, level = random_row(rng, n)
        K = int(rng.integers(1, 9))
        J = int(rng.integers(0, K + 2))
        M = int(rng.integers(1, 30))
        P = float(rng.choice([0.0, rng.random(), 1.0]))
        alpha = float(rng.choice([1.0, rng.random(), 0.0]))
        both(probs, mask, level, K, J, M, P, alpha)


def test_prior_numba_twin_matches_reference_on_random_rows():
    rng = np.random.default_rng(99)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        logits, probs, mask, level = random_row(rng, n)
        K = int(rng.integers(1, 9))
        J = int(rng.integers(0, K + 1))
        bias = float(rng.choice([0.0, rng.random() * 3, 100.0]))
        alpha = float(rng.choice([1.0, rng.random()]))
        ref = prior_select(logits, probs, mask, level, K, J, bias, alpha)
        fast = prior_select_numba(logits, probs, mask, level, K, J, bias, alpha)
        assert ref[0].tolist() == fast[0].tolist()
        assert ref[1].tolist() == fast[1].tolist()
        assert ref[2].kl == pytest.approx(fast[2].kl, rel=1e-9, abs=1e-12)


# --- properties -------------------------------------------------------------


@st.composite
def routing_cases(draw):
    n = draw(st.integers(1, 24))
    logits = np.array(draw(st.lists(st.integers(-8, 8), min_size=n, max_size=n)), dtype=np.float32) / 2
    probs = np.exp(logits - logits.max())
    probs = (probs / probs.sum()).astype(np.float32)
    mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    level = np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), dtype=np.int8)
    K = draw(st.integers(1, 8))
    J = draw(st.integers(0, K))
    M = draw(st.integers(1, 20))
    P = draw(st.sampled_from([0.0, 0.3, 0.6, 0.9]))
    alpha = draw(st.sampled_from([1.0, 0.5]))
    return logits, probs, mask, level, K, J, M, P, alpha


def check_invariants(probs, mask, level, K, J, idx, val, stats):
    filled = idx[idx >= 0]
    n_eligible = int(mask.sum())
    assert len(set(filled.tolist())) == len(filled), "idx unique"
    assert len(filled) == min(K, n_eligible)
    assert (idx[len(filled):] == -1).all(), "padding only at the end"
    assert all(mask[e] for e in filled), "all chosen eligible"
    true_order = sorted(np.flatnonzero(mask).tolist(), key=lambda e: (-float(probs[e]), e))
    assert set(true_order[: min(J, n_eligible)]) <= set(filled.tolist()), "top-J kept"
    assert stats.swaps <= K - J
    assert stats.swaps_vram <= stats.swaps
    assert (val >= 0).all() and (val[len(filled):] == 0).all()
    assert stats.agree_hit + stats.swaps == stats.slots == len(filled)
    assert stats.kl >= -1e-9


@settings(max_examples=150, deadline=None)
@given(routing_cases())
def test_route_select_properties(case):
    _, probs, mask, level, K, J, M, P, alpha = case
    idx, val, stats = both(probs, mask, level, K, J, M, P, alpha)
    check_invariants(probs, mask, level, K, J, idx, val, stats)
    if stats.swaps == 0:
        assert stats.kl == pytest.approx(0.0, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(routing_cases(), st.sampled_from([0.0, 0.5, 5.0, 1000.0]))
def test_prior_select_properties(case, bias):
    logits, probs, mask, level, K, J, _, _, alpha = case
    idx, val, stats = prior_select(logits, probs, mask, level, K, J, bias, alpha)
    check_invariants(probs, mask, level, K, J, idx, val, stats)


# --- Cache-Prior ------------------------------------------------------------


def test_prior_with_zero_bias_is_plain_topk():
    logits = np.log(falling_probs())
    idx, _, stats = prior_select(logits, falling_probs(), ALL, levels(e9=2, e4=1), K=4, J=0, bias=0.0, alpha=1.0)
    assert idx.tolist() == [0, 1, 2, 3] and stats.swaps == 0


def test_prior_large_bias_pulls_residents_in_but_keeps_top_j():
    logits = np.log(falling_probs())
    lv = levels(e0=0, e9=2, e12=1, e13=1)
    idx, _, stats = prior_select(logits, falling_probs(), ALL, lv, K=4, J=1, bias=1e3, alpha=1.0)
    assert idx.tolist() == [0, 9, 12, 13]
    assert (stats.swaps, stats.swaps_vram) == (3, 1)


def test_prior_small_bias_only_reorders_near_ties():
    logits = np.array([3.0, 2.0, 1.9, 1.0] + [-5.0] * (E - 4), dtype=np.float32)
    probs = (np.exp(logits) / np.exp(logits).sum()).astype(np.float32)
    idx, _, _ = prior_select(logits, probs, ALL, levels(e3=1, e10=1), K=2, J=1, bias=1.5, alpha=1.0)
    assert idx.tolist() == [0, 3]  # 1.0 + 1.5 beats 2.0; expert 10 (-3.5) does not


def knobs(**changes) -> KnobValues:
    return dataclasses.replace(KnobValues(), **changes)


def softmax(z):
    p = np.exp(z - z.max())
    return (p / p.sum()).astype(np.float32)


def test_router_prior_keeps_a_per_layer_ema_of_the_logit_range():
    router = Router(n_layers=2, n_experts=E, top_k=4, norm_topk_prob=True)
    on = knobs(CACHE_ROUTE=True, ROUTE_MODE="prior", ROUTE_LAMBDA=0.5)
    z1 = np.linspace(0, 4, E).astype(np.float32)  # range 4
    z2 = np.linspace(0, 2, E).astype(np.float32)  # range 2
    router.select(0, z1, softmax(z1), levels(), on)
    assert router.logit_range_ema(0) == pytest.approx(4.0)
    assert np.isnan(router.logit_range_ema(1))
    router.select(0, z2, softmax(z2), levels(), on)
    assert router.logit_range_ema(0) == pytest.approx(4.0 + 0.1 * (2.0 - 4.0))
    router.select(1, z2, softmax(z2), levels(), on)
    assert router.logit_range_ema(1) == pytest.approx(2.0)


def test_router_prior_lambda_zero_is_plain_topk():
    router = Router(n_layers=1, n_experts=E, top_k=4, norm_topk_prob=True)
    z = np.log(falling_probs())
    res = router.select(0, z, falling_probs(), levels(e9=2), knobs(CACHE_ROUTE=True, ROUTE_MODE="prior", ROUTE_LAMBDA=0.0))
    assert res.chosen.tolist() == [0, 1, 2, 3]


# --- Router ------------------------------------------------------------------


def test_router_meters_only_returns_plain_topk():
    router = Router(n_layers=2, n_experts=E, top_k=4, norm_topk_prob=True)
    meters_only = knobs(CACHE_ROUTE=False, ROUTE_AGREE="1", ROUTE_J=0)
    probs = falling_probs()
    fold = MeterFold()
    for layer in range(2):
        res = router.select(layer, np.log(probs), probs, levels(e7=2, e8=1), meters_only)
        assert res.chosen.tolist() == res.true_topk.tolist() == [0, 1, 2, 3]
        assert not res.swapped.any()
        fold.add(TokenEvent(0, 0, "decode", [res]))
    meters = fold.summary()
    assert meters["route_agree"] == 1.0 and meters["route_kl"] == 0.0
    assert meters["swap"] == 0.0 and meters["slots"] == 8


def test_router_result_fields_and_weights():
    probs = falling_probs()
    lever = knobs(CACHE_ROUTE=True, ROUTE_J=2, ROUTE_M=8, ROUTE_ALPHA=0.5)
    res = Router(1, E, 4, norm_topk_prob=True).select(0, None, probs, levels(e6=2), lever)
    assert res.chosen.dtype == np.int32 and res.chosen.tolist() == [0, 1, 6, 2]
    assert res.swapped.tolist() == [False, False, True, False]
    assert res.level.tolist() == [0, 0, 2, 0] and res.level.dtype == np.int8
    assert res.true_topk.tolist() == [0, 1, 2, 3]
    assert res.true_weights.tolist() == probs[:4].tolist()
    assert res.weights.sum() == pytest.approx(1.0, rel=1e-6)
    raw = Router(1, E, 4, norm_topk_prob=False).select(0, None, probs, levels(e6=2), lever)
    assert raw.weights[2] == np.float32(float(probs[6]) * 0.5)
    assert raw.weights[0] == probs[0]


def test_router_cumprob_uses_mass_alone_and_falls_back_to_m_without_p():
    probs = np.array([0.30, 0.25] + [0.03] * 14, dtype=np.float32)
    router = Router(1, E, 2, norm_topk_prob=True)
    lv = levels(e14=1)
    # The mass window reaches rank 14 although M=4 would not.
    res = router.select(0, None, probs, lv, knobs(CACHE_ROUTE=True, ROUTE_MODE="cumprob", ROUTE_J=1, ROUTE_M=4, ROUTE_P=0.99))
    assert res.chosen.tolist() == [0, 14]
    res = router.select(0, None, probs, lv, knobs(CACHE_ROUTE=True, ROUTE_MODE="maxrank", ROUTE_J=1, ROUTE_M=4, ROUTE_P=0.99))
    assert res.chosen.tolist() == [0, 1]  # maxrank's ranking depth stops at max(M, 4K)=8
    res = router.select(0, None, probs, lv, knobs(CACHE_ROUTE=True, ROUTE_MODE="cumprob", ROUTE_J=1, ROUTE_M=4, ROUTE_P=0.0))
    assert res.chosen.tolist() == [0, 1]


def test_router_warns_once_when_fewer_eligible_than_k():
    router = Router(1, E, 4, norm_topk_prob=True)
    mask = np.zeros(E, dtype=bool)
    mask[[2, 5]] = True
    with pytest.warns(RoutingWarning, match="only 2 eligible"):
        res = router.select(0, None, falling_probs(), levels(), knobs(CACHE_ROUTE=True), mask=mask)
    assert res.chosen.tolist() == [2, 5, -1, -1]
    assert res.weights[2:].tolist() == [0.0, 0.0] and res.weights.sum() == pytest.approx(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        router.select(0, None, falling_probs(), levels(), knobs(CACHE_ROUTE=True), mask=mask)


def test_reset_meters():
    router = Router(1, E, 4, norm_topk_prob=True)
    fold = MeterFold()
    fold.add(TokenEvent(0, 0, "decode", [router.select(0, None, falling_probs(), levels(e6=1),
                                                        knobs(CACHE_ROUTE=True, ROUTE_M=8))]))
    assert fold.swaps == 1
    fold.reset()
    assert fold == MeterFold()


# --- footer -------------------------------------------------------------------


def seed_meters() -> dict:
    return MeterFold(decisions=10, slots=1000, swaps=106, swaps_vram=40, agree_hit=894, agree_tot=1000, kl_sum=18.5,
                     kl_count=10).summary()


def test_footer_has_the_seed_shape():
    lines = format_footer(knobs(CACHE_ROUTE=True), seed_meters())
    assert lines == [
        "CACHE_ROUTE J=2 M=12 P=0 alpha=1 | swap 10.6% (106/1000, 40 to VRAM)",
        "route_agree 89.4% | route_kl 1.85",
    ]


def test_footer_meters_only_and_off():
    assert format_footer(knobs(ROUTE_AGREE="1"), MeterFold().summary()) == ["route_agree 100.0% | route_kl 0.00"]
    assert format_footer(knobs(), seed_meters()) == []
    prior = format_footer(knobs(CACHE_ROUTE=True, ROUTE_MODE="prior", ROUTE_LAMBDA=0.3), seed_meters())
    assert prior[0].startswith("CACHE_ROUTE mode=prior lambda=0.3 J=2")


def test_meters_json_keys():
    out = meters_json(seed_meters())
    assert out["swap"] == pytest.approx(10.6)
    assert out["swaps_to_vram"] == 40
    assert out["route_agree"] == pytest.approx(89.4)
    assert out["route_kl"] == pytest.approx(1.85)
    assert out["slots"] == 1000 and out["swaps"] == 106


def test_router_agrees_with_the_reference_on_random_rows():
    rng = np.random.default_rng(7)
    for norm in (True, False):
        router = Router(n_layers=1, n_experts=24, top_k=4, norm_topk_prob=norm)
        for _ in range(150):
            logits, probs, mask, level = random_row(rng, 24)
            mode = str(rng.choice(["maxrank", "cumprob", "prior"]))
            k = knobs(CACHE_ROUTE=True, ROUTE_MODE=mode, ROUTE_J=int(rng.integers(0, 5)), ROUTE_M=int(rng.integers(1, 16)),
                      ROUTE_P=float(rng.choice([0.0, 0.7])), ROUTE_ALPHA=float(rng.choice([1.0, 0.5])), ROUTE_LAMBDA=0.3)
            res = router.select(0, logits, probs, level, k, mask=mask) if mask.sum() >= 4 else None
            if res is None:
                continue
            if mode == "prior":
                bias = k.ROUTE_LAMBDA * router.logit_range_ema(0)
                idx, val, _ = prior_select(logits, probs, mask, level, 4, k.ROUTE_J, bias, k.ROUTE_ALPHA)
            else:
                M = 24 if mode == "cumprob" and 0 < k.ROUTE_P < 1 else k.ROUTE_M
                idx, val, _ = route_select(probs, mask, level, 4, k.ROUTE_J, M, k.ROUTE_P, k.ROUTE_ALPHA)
            assert res.chosen.tolist() == idx.tolist()
            expected = val / val.sum() if norm else val
            np.testing.assert_allclose(res.weights, expected, rtol=1e-6)
            assert res.level.tolist() == level[idx].tolist()
            true = sorted(np.flatnonzero(mask).tolist(), key=lambda e: (-float(probs[e]), e))[:4]
            assert res.true_topk.tolist() == true
            assert res.swapped.tolist() == [e not in true for e in idx]


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 127, 128])
def test_block_sum_is_numpys_float32_sum(n):
    """The plain route's renormalisation adds the top-K weights in numpy's own order."""
    from tierlab.engine.kernels.dense import block_sum

    rng = np.random.default_rng(n)
    for _ in range(200):
        a = (rng.random(n) ** 3).astype(np.float32)
        assert block_sum(a, n) == a.sum()


@pytest.mark.parametrize("n_experts, k, norm", [(8, 2, True), (64, 8, True), (64, 8, False), (256, 8, True),
                                                (128, 16, True), (40, 9, True), (16, 1, False)])
def test_a_prompts_plain_routes_in_one_call_are_plain_topk_token_by_token(n_experts, k, norm):
    """`route_rows` over a prompt's router logits (a strided view of the fused projection's
    output, as the MoE block passes them) gives each token softmax_row's probabilities and
    plain_topk's experts and weights, bit for bit; ties go to the lower id as plain_topk's do."""
    from tierlab.engine.kernels.dense import route_rows, softmax_row
    from tierlab.engine.routing import plain_topk

    rng = np.random.default_rng(n_experts * 31 + k)
    T = 64
    fused = (rng.standard_normal((T, n_experts + 29)) * rng.uniform(0.5, 6.0)).astype(np.float32)
    fused[::5, 3] = fused[::5, 1]  # ties
    logits = fused[:, :n_experts]
    probs = np.empty((T, n_experts), dtype=np.float32)
    chosen, true_topk = np.empty((T, k), dtype=np.int32), np.empty((T, k), dtype=np.int32)
    top_probs, weights = np.empty((T, k), dtype=np.float32), np.empty((T, k), dtype=np.float32)
    route_rows(logits, k, norm, probs, chosen, true_topk, top_probs, weights)
    for t in range(T):
        p = np.empty(n_experts, dtype=np.float32)
        softmax_row(np.ascontiguousarray(logits[t]), p)
        ids = np.argsort(-p, kind="stable")[:k]  # independent of the kernels: ties to the lower id
        w = p[ids]
        if norm:
            w = w / w.sum()
        assert probs[t].tobytes() == p.tobytes()
        assert chosen[t].tolist() == true_topk[t].tolist() == ids.tolist()
        assert top_probs[t].tobytes() == p[ids].tobytes()
        assert weights[t].tobytes() == w.astype(np.float32).tobytes()
        c, pw = plain_topk(p, k, norm)
        assert c.tolist() == ids.tolist() and pw.tobytes() == weights[t].tobytes()
