"""A prompt's blocked attention against the token-by-token kernel and a float64 softmax attention."""

from __future__ import annotations

import numpy as np
import pytest

from tierlab.engine.kernels.attention_prompt import attention_prompt
from tierlab.engine.kernels.dense import attention


def _case(tokens: int, start: int, n_heads: int, n_kv: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    cap = start + tokens + 3  # the cache holds room past the prompt, as a grown KV cache does
    k = np.zeros((n_kv, cap, d), np.float32)
    v = np.zeros((n_kv, cap, d), np.float32)
    k[:, :start + tokens] = rng.standard_normal((n_kv, start + tokens, d)) * 2.0
    v[:, :start + tokens] = rng.standard_normal((n_kv, start + tokens, d))
    q = (rng.standard_normal((tokens, n_heads, d)) * 2.0).astype(np.float32)
    return q, k, v


def _float64_attention(q, k, v, start):
    t_count, n_heads, d = q.shape
    group = n_heads // k.shape[0]
    out = np.empty(q.shape)
    for t in range(t_count):
        for h in range(n_heads):
            keys = k[h // group, :start + t + 1].astype(np.float64)
            s = keys @ q[t, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[h // group, :start + t + 1].astype(np.float64)
    return out


@pytest.mark.parametrize("tokens, start, n_heads, n_kv, d", [
    (9, 0, 4, 2, 16),    # two query heads per key-value head: four-row blocks half filled
    (12, 5, 6, 2, 8),    # a prompt after earlier tokens, three heads per group
    (7, 0, 16, 2, 32),   # eight heads per group, as the real models have
    (2, 0, 2, 1, 4),
])
def test_prompt_attention_matches_float64_and_the_token_by_token_kernel(tokens, start, n_heads, n_kv, d):
    q, k, v = _case(tokens, start, n_heads, n_kv, d)
    got = np.full(q.shape, np.nan, np.float32)
    attention_prompt(q, k, v, start, got)
    ref = np.empty_like(q)
    attention(q, k, v, start, ref)
    np.testing.assert_allclose(got, _float64_attention(q, k, v, start), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_each_token_sees_only_the_keys_before_it():
    """Changing the last position's key and value changes only the last token's output."""
    q, k, v = _case(6, 0, 4, 2, 8, seed=2)
    before = np.empty_like(q)
    attention_prompt(q, k, v, 0, before)
    k[:, 5] += 3.0
    v[:, 5] -= 1.0
    after = np.empty_like(q)
    attention_prompt(q, k, v, 0, after)
    np.testing.assert_array_equal(after[:5], before[:5])
    assert np.abs(after[5] - before[5]).max() > 1e-3
