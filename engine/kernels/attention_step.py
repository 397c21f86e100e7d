"""One attention layer's decode step in one compiled call: the q/k/v projection, the q/k
norms, RoPE, the KV cache's new entries, attention, the output gate and o_proj.

Why: in decode these were some twenty calls from Python (slices, copies, two norms,
two rotations, the cache writes), each paying cache misses on the interpreter's state
after the projection's megabytes of weights had streamed through the caches
(docs/benchmarks.md, "What a call costs right after a streaming one"). Here the same
kernels run from compiled code on the same operands and the copies are exact, so a
step's bits are those of the calls one by one (tests/test_attention_step.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tierlab.engine.kernels.decode_attention import attention_decode
from tierlab.engine.kernels.dense import add_rms_norm, attention, residual_norms, rms_norm, rope_inplace, sigmoid_gate
from tierlab.engine.kernels.moe_step import timed_router_block
from tierlab.engine.kernels.qmatvec import SET, _pass, _thread_count


@njit(nogil=True, cache=True)
def _attention_kernels(wi, si, wo, so, x2, gated, heads, kv_heads, head_dim, q_norm, k_norm, eps, inv_freq,
                       rotary_dim, k_cache, v_cache, start, threads, y, out, residual, in_norm, post_norm, layer_eps,
                       xn, h_post):
    d = head_dim
    if residual:  # x2 is the residual stream: its input norm first
        rms_norm(x2, in_norm, layer_eps, xn)
        x = xn[0]
    else:
        x = x2[0]
    _pass(wi, si, wi, si, x, y, SET, 1.0, threads)
    q = np.empty((heads, d), np.float32)
    gate = np.empty((1, heads * d), np.float32)
    per_head = 2 * d if gated else d  # gated: per head, query(d) | gate(d)
    for h in range(heads):
        for i in range(d):
            q[h, i] = y[h * per_head + i]
            if gated:
                gate[0, h * d + i] = y[h * per_head + d + i]
    k_start = heads * per_head
    v_start = k_start + kv_heads * d
    k = np.empty((kv_heads, d), np.float32)
    for i in range(kv_heads * d):
        k[i // d, i % d] = y[k_start + i]
    qn = np.empty((heads, d), np.float32)
    kn = np.empty((kv_heads, d), np.float32)
    rms_norm(q, q_norm, eps, qn)
    rms_norm(k, k_norm, eps, kn)
    positions = np.full(1, start, np.int64)
    q3 = qn.reshape((1, heads, d))
    k3 = kn.reshape((1, kv_heads, d))
    rope_inplace(q3, positions, inv_freq, rotary_dim)
    rope_inplace(k3, positions, inv_freq, rotary_dim)
    for h in range(kv_heads):
        for i in range(d):
            k_cache[h, start, i] = kn[h, i]
            v_cache[h, start, i] = y[v_start + h * d + i]
    att = np.empty((1, heads, d), np.float32)
    if d % 16 == 0:
        attention_decode(qn, k_cache, v_cache, start, att[0], threads)
    else:  # the token-by-token kernel, as a prompt's attention runs at such head dims
        attention(q3, k_cache, v_cache, start, att)
    o = att.reshape((1, heads * d))
    if gated:
        sigmoid_gate(o, gate)
    _pass(wo, so, wo, so, o[0], out[0], SET, 1.0, threads)
    if residual:
        add_rms_norm(x2, out, post_norm, layer_eps, h_post)


@njit(nogil=True, cache=True)
def _attention_then_router(layer_args, router_args, stamps):
    """The step (with its norms), then the MoE router block on its post norm, timed."""
    _attention_kernels(*layer_args)
    timed_router_block(router_args, stamps)


def attention_step(w_qkv: tuple, w_o: tuple, x: np.ndarray, gated: bool, shape: tuple[int, int, int],
                   q_norm: np.ndarray, k_norm: np.ndarray, eps: float, inv_freq: np.ndarray, rotary_dim: int,
                   k_cache: np.ndarray, v_cache: np.ndarray, start: int, norms: tuple | None = None, router=None,
                   stamps: np.ndarray | None = None) -> np.ndarray:
    """o_proj(attention(...)) for one token x float32[H] at position `start`: float32[1, H].
    w_qkv, w_o from `qlinear.pass_operands`; shape = (heads, kv heads, head dim); the
    caches [kv heads, >= start + 1, head dim] get the token's key and value at `start`.
    With norms = (input norm, post norm, eps), x is the layer's residual stream [1, H], as
    `deltanet_step` takes it (`dense.residual_norms`), and with a `router` its block runs in
    the same call, as there."""
    heads, kv_heads, head_dim = shape
    (wi, si), (wo, so) = w_qkv, w_o
    y = np.empty(wi.shape[0], dtype=np.float32)
    out = np.empty((1, wo.shape[0]), dtype=np.float32)
    residual, in_norm, post_norm, layer_eps, xn, h_post, x2 = residual_norms(norms, x,
                                                                           None if router is None else router.x)
    args = (wi, si, wo, so, x2, gated, heads, kv_heads, head_dim, q_norm, k_norm, float(eps), inv_freq, rotary_dim,
            k_cache, v_cache, start, _thread_count(), y, out, residual, in_norm, post_norm, layer_eps, xn, h_post)
    if router is None:
        _attention_kernels(*args)
    else:
        _attention_then_router(args, router.args, stamps)
    return h_post if residual else out
