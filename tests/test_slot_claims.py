"""The store's compiled path for a token whose experts are all resident changes nothing but speed.

`ExpertStore.compute` and `compute_weighted` take `_compute_resident` (engine/kernels/moe_step.py) when every
chosen expert is ready in a RAM slot. Here two stores over the same checkpoint run the same
random tokens, one with that path and one made to take the general one (acquire, one launch
pair, release): outputs, hit and miss counts, shadow counts, LRU stamps, use counts and
residency must agree after every token.
"""

from __future__ import annotations

import numpy as np
import pytest


def _state(store) -> tuple:
    st = store._layers[0]
    stats = store.stats()
    return (store._clock, int(stats.hits[0]), int(stats.misses[0]), st["last"].tolist(), st["busy"].tolist(),
            st["expert"].tolist(), st["slot_of"].tolist())


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("slots,k", [(8, 3), (5, 3), (4, 2)])
def test_resident_path_matches_the_general_path(oracle_models, monkeypatch, slots, k, weighted):
    """`compute`, and `compute_weighted` (the weighted sum and the shared term in the same compiled call)."""
    from tierlab.engine.checkpoint import Checkpoint
    from tierlab.engine.config import load_config
    from tierlab.engine.expert_source import RawExpertSource
    from tierlab.engine.expert_store import ExpertStore

    folder = oracle_models["qwen3_moe"][1]
    source = RawExpertSource(Checkpoint(folder, load_config(folder)))
    fast = ExpertStore(source, 1, 8, slots, [True], notice=print)
    general = ExpertStore(source, 1, 8, slots, [True], notice=print)
    monkeypatch.setattr(general, "_compute_resident", lambda *a, **kw: False)
    taken = []
    real = fast._compute_resident
    monkeypatch.setattr(fast, "_compute_resident", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    rng = np.random.default_rng(slots * 10 + k)
    hidden = source.hidden
    try:
        for _ in range(80):
            chosen = rng.choice(8, k, replace=False).astype(np.int64)
            stock = rng.choice(8, k, replace=False).astype(np.int32)  # the router's own top-K, maybe elsewhere
            x = rng.standard_normal(hidden).astype(np.float32)
            weights = rng.random(k).astype(np.float32)
            term = rng.standard_normal(hidden).astype(np.float32)  # the shared expert's, added last
            results = []
            for store in (fast, general):
                outputs = np.zeros((k, hidden), dtype=np.float32)
                timers = {"fetch": 0.0, "compute": 0.0, "tier": 0.0}
                if weighted:  # y starts from a residual, as a layer's output would not: every bit counts
                    outputs = x[::-1].copy()
                    hits, misses, on_gpu, shadow = store.compute_weighted(0, chosen, weights, x, outputs, timers,
                                                                          stock=stock, term=term)
                else:
                    hits, misses, on_gpu, shadow = store.compute(0, chosen, x, outputs, timers, stock=stock)
                results.append((outputs, hits, misses, on_gpu, shadow, _state(store)))
            (out_a, *rest_a), (out_b, *rest_b) = results
            assert np.array_equal(out_a.view(np.uint32), out_b.view(np.uint32))
            assert rest_a == rest_b
        assert taken, "no token took the resident path"
        assert all(b == 0 for b in fast._layers[0]["busy"].tolist())
    finally:
        fast.close()
        general.close()


def test_claim_resident_refuses_and_changes_nothing():
    """An expert not ready (absent, loading, a PILOT read awaiting its use, twice, or -1)
    leaves every array as it was."""
    from tierlab.engine.kernels.slot_claims import claim_resident, release_slots

    slot_of = np.array([0, 1, -1, 2], dtype=np.int64)
    loading = np.array([False, False, True])
    pf_pass = np.array([-1, -1, -1], dtype=np.int64)
    busy = np.zeros(3, dtype=np.int64)
    last = np.array([5, 6, 7], dtype=np.int64)
    out = np.empty(2, dtype=np.int64)
    none, shadow = np.empty(0, dtype=np.int64), np.empty(2, dtype=np.int64)
    for experts in ([0, 2], [0, 3], [1, 1], [-1, 0], [0, 4]):
        assert claim_resident(slot_of, loading, pf_pass, busy, last, np.array(experts, dtype=np.int64), 9, out, none, shadow) == -1
        assert busy.tolist() == [0, 0, 0] and last.tolist() == [5, 6, 7]
    pf_pass[1] = 3
    assert claim_resident(slot_of, loading, pf_pass, busy, last, np.array([0, 1], dtype=np.int64), 9, out, none, shadow) == -1
    pf_pass[1] = -1
    stock = np.array([3, 2, -1, 1], dtype=np.int64)  # 3 and 1 held (3 not chosen), 2 on disk, -1 no expert
    assert claim_resident(slot_of, loading, pf_pass, busy, last, np.array([1, 0], dtype=np.int64), 9, out, stock,
                          shadow) == 11
    assert out.tolist() == [1, 0] and busy.tolist() == [1, 1, 0] and last.tolist() == [11, 10, 7]
    assert shadow.tolist() == [2, 1]
    release_slots(busy, out)
    release_slots(busy, out)  # never below zero
    assert busy.tolist() == [0, 0, 0]
