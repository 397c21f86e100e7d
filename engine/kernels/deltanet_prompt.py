"""Gated DeltaNet over a prompt: each value head runs through all the tokens on one thread.

Why: the decode kernel (`dense.gated_deltanet`) walks the tokens in order and
splits each token's value heads over the threads, so every token streams the
whole recurrent state (v_heads x dk x dv floats, 2 MiB at Qwen3.6's width)
through the caches and waits for the threads once. A prompt's conv outputs and
normalised q, k depend only on the inputs, so they are computed first for all
tokens; then each value head's delta-rule recurrence runs over every token with
its own state block (64 KiB) staying in the core's cache, and the threads meet
once per layer.

The arithmetic is the decode kernel's own (`deltanet_token_inputs`,
`deltanet_head`), token by token in the same order, so the outputs and the
final state are bit-identical to feeding the tokens one at a time.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tierlab.engine.kernels.dense import deltanet_head, deltanet_token_inputs


@njit(nogil=True, fastmath=True, cache=True, parallel=True)
def gated_deltanet_prompt(mixed, conv_state, conv_w, z, b, a, a_log, dt_bias, norm_w, eps,
                          state, k_heads, v_heads, dk, dv, out):
    """`dense.gated_deltanet` for T tokens (same arguments, same results), heads outermost."""
    t_count, channels = mixed.shape
    key_dim = k_heads * dk
    ratio = v_heads // k_heads
    conv_out = np.empty((t_count, channels), dtype=np.float32)
    q = np.empty((t_count, k_heads, dk), dtype=np.float32)
    k = np.empty((t_count, k_heads, dk), dtype=np.float32)
    for t in range(t_count):
        deltanet_token_inputs(t, mixed, conv_state, conv_w, k_heads, dk, conv_out[t], q[t], k[t])
    for hv in prange(v_heads):
        for t in range(t_count):
            deltanet_head(hv, hv // ratio, t, conv_out[t], q[t], k[t], z, b, a, a_log, dt_bias, norm_w, eps,
                          state, 2 * key_dim + hv * dv, dv, out)
