"""Causal attention over a prompt as blocked matrix products, the tokens spread over the threads.

Why: `dense.attention` walks the prompt token by token and head by head on one
thread, one query against one key at a time, so a 512-token prompt's
quadratic part runs at a fraction of one core. Here each step takes one token
and one key-value head: the query heads that share the head (GQA) are copied
side by side, their scores against every visible key are `dot4x2` blocks (four
query rows by two keys, the rows in L1), the softmax runs row by row, and the
output is the same blocks again, the probabilities against the values held
transposed (each value dimension one contiguous row over the positions).
Steps pair token t with token T-1-t so that both threads get the same number
of keys. Same scale and float32 softmax as `dense.attention`; the sums run in
another order (within float32 rounding of it, not bit-identical).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from tierlab.engine.kernels.qmatmat import dot4x2

_OPTS = dict(nogil=True, fastmath=True, cache=True)


@njit(**_OPTS)
def _rows_by_vectors(rows, vecs, width, n, out):
    """out[r, j] = rows[r, :width] . vecs[j, :width] for j < n, four rows by two vectors at a
    time; rows [R, >= width] with R a multiple of 4."""
    for r in range(0, rows.shape[0], 4):
        w4 = rows[r:r + 4]
        for j in range(0, n, 2):
            u = min(j + 1, n - 1)
            a0, a1, a2, a3, b0, b1, b2, b3 = dot4x2(w4, vecs[j, :width], vecs[u, :width])
            out[r, j] = a0
            out[r + 1, j] = a1
            out[r + 2, j] = a2
            out[r + 3, j] = a3
            if u != j:
                out[r, u] = b0
                out[r + 1, u] = b1
                out[r + 2, u] = b2
                out[r + 3, u] = b3


@njit(**dict(_OPTS, parallel=True))
def attention_prompt(q, k_cache, v_cache, start, out):
    """`dense.attention` for T new tokens (same arguments): q [T, Hq, d]; k_cache, v_cache
    [Hkv, maxT, d] already holding the new tokens; out [T, Hq, d]."""
    t_count, n_heads, d = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    rows = (group + 3) // 4 * 4
    length = start + t_count
    scale = np.float32(1.0 / math.sqrt(d))
    values_t = np.empty((n_kv, d, length), dtype=np.float32)  # each head's values, one row per dimension
    for kvh in prange(n_kv):
        for j in range(length):
            for i in range(d):
                values_t[kvh, i, j] = v_cache[kvh, j, i]
    half = (t_count + 1) // 2
    for step in prange(n_kv * half):
        kvh = step // half
        pair = step % half
        qs = np.zeros((rows, d), dtype=np.float32)
        probs = np.zeros((rows, length), dtype=np.float32)
        res = np.empty((rows, d), dtype=np.float32)
        keys = k_cache[kvh]
        for which in range(2):
            t = pair if which == 0 else t_count - 1 - pair
            if which == 1 and t == pair:
                break
            seen = start + t + 1
            for h in range(group):
                for i in range(d):
                    qs[h, i] = q[t, kvh * group + h, i] * scale
            _rows_by_vectors(qs, keys, d, seen, probs)
            for h in range(group):
                m = np.float32(-np.inf)
                for j in range(seen):
                    if probs[h, j] > m:
                        m = probs[h, j]
                total = np.float32(0.0)
                for j in range(seen):
                    e = np.float32(math.exp(probs[h, j] - m))
                    probs[h, j] = e
                    total += e
                inv = np.float32(1.0) / total
                for j in range(seen):
                    probs[h, j] *= inv
            _rows_by_vectors(probs, values_t[kvh], seen, d, res)
            for h in range(group):
                for i in range(d):
                    out[t, kvh * group + h, i] = res[h, i]
