"""A token's experts are summed by one kernel call: the same bits as one axpy per slot, in rank order."""

from __future__ import annotations

import numpy as np

from tierlab.engine.kernels.dense import add_weighted, add_weighted_rows, axpy


def test_add_weighted_is_axpy_per_filled_slot_in_rank_order():
    rng = np.random.default_rng(3)
    for hidden in (7, 128, 2048):
        outputs = (rng.standard_normal((8, hidden)) * rng.choice([1e-3, 1.0, 40.0], (8, 1))).astype(np.float32)
        weights = rng.random(8).astype(np.float32)
        chosen = np.array([5, 0, 63, -1, 9, 2, -1, 7], dtype=np.int32)  # -1: a slot left empty
        y = rng.standard_normal(hidden).astype(np.float32)
        expected = y.copy()
        for s in range(8):
            if chosen[s] >= 0:
                axpy(expected, np.float32(weights[s]), outputs[s])
        add_weighted(y, chosen, weights, outputs)
        assert np.array_equal(y, expected)


def test_add_weighted_rows_is_add_weighted_per_token():
    """A prompt's experts summed in one call per layer: each token's row the bits of its own call."""
    rng = np.random.default_rng(5)
    T, K, H = 6, 8, 130
    outputs = (rng.standard_normal((T, K, H)) * rng.choice([1e-3, 1.0, 40.0], (T, K, 1))).astype(np.float32)
    weights = rng.random((T, K)).astype(np.float32)
    chosen = rng.integers(-1, 64, (T, K)).astype(np.int32)  # some slots left empty
    y = rng.standard_normal((T, H)).astype(np.float32)
    expected = y.copy()
    for t in range(T):
        add_weighted(expected[t], chosen[t], weights[t], outputs[t])
    add_weighted_rows(y, chosen, weights, outputs)
    assert np.array_equal(y, expected)
