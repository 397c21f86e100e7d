"""dense.attention: a prompt's tokens get the bits a token-by-token decode gets, and the right values."""

import numpy as np

from tierlab.engine.kernels.dense import attention


def _reference(q, k, v, start):
    t_count, heads, d = q.shape
    group = heads // k.shape[0]
    out = np.empty(q.shape, dtype=np.float64)
    for t in range(t_count):
        n = start + t + 1
        for h in range(heads):
            s = (k[h // group, :n].astype(np.float64) @ q[t, h].astype(np.float64)) / np.sqrt(d)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[h // group, :n].astype(np.float64)
    return out


def test_prompt_equals_decode_token_by_token_and_float64():
    rng = np.random.default_rng(11)
    heads, kv, d, start, t_count = 6, 2, 32, 5, 13
    k = rng.standard_normal((kv, 40, d), dtype=np.float32)
    v = rng.standard_normal((kv, 40, d), dtype=np.float32)
    q = rng.standard_normal((t_count, heads, d), dtype=np.float32)
    prompt = np.empty_like(q)
    attention(q, k, v, start, prompt)
    for t in range(t_count):
        one = np.empty((1, heads, d), dtype=np.float32)
        attention(q[t:t + 1].copy(), k, v, start + t, one)
        assert np.array_equal(one[0], prompt[t])
    np.testing.assert_allclose(prompt, _reference(q, k, v, start), rtol=1e-5, atol=1e-5)
