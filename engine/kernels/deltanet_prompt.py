"""Gated DeltaNet over a prompt: the fast kernel (by column blocks of the state) and the exact one.

Why two: the decode kernel (`dense.gated_deltanet`) walks the tokens in order
and splits each token's value heads over the threads, so every token streams
the whole recurrent state (v_heads x dk x dv floats, 2 MiB at Qwen3.6's
width) through the caches and waits for the threads once.

`gated_deltanet_prompt` (the default for a prompt) uses that each column j of
a head's state S [dk, dv] follows the delta rule on its own: with
sk = S^T k and sq = S^T q, column j needs only sk[j], sq[j], v[j] and the
head's k, q, beta and decay. So a head's state is cut into blocks of
`STATE_COLUMNS` columns (16 KiB, held transposed so that each column is one
contiguous row), and each block runs through all the prompt's tokens on one
thread with its state in L1; the update of S for token t and the products
S^T k and S^T q that token t + 1 needs are one pass over the block. A whole
block is held row by row with its 32 columns across the lanes of two vectors
(`_columns_step`), so that pass is FMAs only, each column's sums in its own
lane (the scalar `_run_columns`, a column per row, takes a block narrower than
32, e.g. the last of a head whose width 32 does not divide). The conv, the L2
norms and the gated RMSNorm run over all tokens at once, in parallel, their
SiLU through `fastexp` so that the loops vectorise.
Same arithmetic as the recurrence, summed in another order: within float32
rounding of the exact kernel, not bit-identical to decode.

`gated_deltanet_prompt_exact` (PREFILL_EXACT=1) runs the decode kernel's own
arithmetic (`deltanet_token_inputs`, `deltanet_head`), token by token in the
same order, one value head per thread, so its outputs and the final state are
bit-identical to feeding the tokens one at a time.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from tierlab.engine.kernels.dense import deltanet_gates, deltanet_head, deltanet_token_inputs, gated_rmsnorm
from tierlab.engine.kernels.fastexp import silu_f32
from tierlab.engine.kernels.qmatmat import _f32_matrix
from tierlab.engine.kernels.qmatvec import _fma, _I64, _V16F, _counted_loop, _load_vec, _row_view_ok, _splat

STATE_COLUMNS = 32  # columns of a head's state per block: 32 x dk=128 floats = 16 KiB, in L1 with room
_CONV_CHANNELS = 256  # channels per parallel step of the prompt's conv

_OPTS = dict(nogil=True, fastmath=True, cache=True)
# the fast path's kernels: no ZeroDivisionError branches, so that their loops vectorise (fastexp)
_FAST_OPTS = dict(_OPTS, error_model="numpy")


@njit(**dict(_OPTS, parallel=True))
def gated_deltanet_prompt_exact(mixed, conv_state, taps, z, b, a, a_log, dt_bias, norm_w, eps,
                                state, k_heads, v_heads, dk, dv, out):
    """`dense.gated_deltanet` for T tokens (same arguments, same bits), heads outermost."""
    t_count, channels = mixed.shape
    key_dim = k_heads * dk
    ratio = v_heads // k_heads
    conv_out = np.empty((t_count, channels), dtype=np.float32)
    q = np.empty((t_count, k_heads, dk), dtype=np.float32)
    k = np.empty((t_count, k_heads, dk), dtype=np.float32)
    for t in range(t_count):
        deltanet_token_inputs(t, mixed, conv_state, taps, k_heads, dk, conv_out[t], q[t], k[t])
    for hv in prange(v_heads):
        for t in range(t_count):
            deltanet_head(hv, hv // ratio, t, conv_out[t], q[t], k[t], z, b, a, a_log, dt_bias, norm_w, eps,
                          state, 2 * key_dim + hv * dv, dv, out)


@njit(**dict(_FAST_OPTS, parallel=True))
def prompt_conv(mixed, conv_state, taps, conv_out):
    """conv_out [T, C] = SiLU(depthwise causal conv) of every token, conv_state moved on by T inputs."""
    t_count, channels = mixed.shape
    ksize = taps.shape[0]
    hist = ksize - 1
    for blk in prange((channels + _CONV_CHANNELS - 1) // _CONV_CHANNELS):
        c0 = blk * _CONV_CHANNELS
        c1 = min(channels, c0 + _CONV_CHANNELS)
        window = np.empty((hist + t_count, c1 - c0), dtype=np.float32)  # the state's inputs, then the prompt's
        for j in range(hist):
            window[j] = conv_state[j, c0:c1]
        for t in range(t_count):
            window[hist + t] = mixed[t, c0:c1]
        acc = np.empty(c1 - c0, dtype=np.float32)
        for t in range(t_count):
            acc[:] = 0.0
            for j in range(ksize):
                wj = taps[j, c0:c1]
                xj = window[t + j]
                for c in range(c1 - c0):
                    acc[c] += wj[c] * xj[c]
            for c in range(c1 - c0):
                conv_out[t, c0 + c] = silu_f32(acc[c])
        for j in range(hist):
            conv_state[j, c0:c1] = window[t_count + j]


@njit(**dict(_FAST_OPTS, parallel=True))
def prompt_qk(conv_out, k_heads, dk, q, k):
    """q, k [T, k_heads, dk]: L2-normalised per key head (q also scaled by 1/sqrt(dk))."""
    key_dim = k_heads * dk
    q_scale = np.float32(1.0 / math.sqrt(dk))
    for t in prange(conv_out.shape[0]):
        for hk in range(k_heads):
            sq = np.float32(0.0)
            sk = np.float32(0.0)
            for i in range(dk):
                qv = conv_out[t, hk * dk + i]
                kv = conv_out[t, key_dim + hk * dk + i]
                sq += qv * qv
                sk += kv * kv
            iq = np.float32(1.0 / math.sqrt(sq + 1e-6)) * q_scale
            ik = np.float32(1.0 / math.sqrt(sk + 1e-6))
            for i in range(dk):
                q[t, hk, i] = conv_out[t, hk * dk + i] * iq
                k[t, hk, i] = conv_out[t, key_dim + hk * dk + i] * ik


@njit(**_OPTS)
def _run_columns(hv, hk, j0, j1, conv_out, q, k, gates, kq, vbase, state, o):
    """Columns j0..j1 of head hv's state through every token: o[t, j] for those columns."""
    t_count = q.shape[0]
    dk = q.shape[2]
    n = j1 - j0
    st = np.empty((n, dk), dtype=np.float32)  # the block, transposed: st[jj] is column j0 + jj
    for i in range(dk):
        for jj in range(n):
            st[jj, i] = state[hv, i, j0 + jj]
    sk = np.empty(n, dtype=np.float32)
    sq = np.empty(n, dtype=np.float32)
    k0 = k[0, hk]
    q0 = q[0, hk]
    for jj in range(n):
        row = st[jj]
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        for i in range(dk):
            a1 += row[i] * k0[i]
            a2 += row[i] * q0[i]
        sk[jj] = a1
        sq[jj] = a2
    for t in range(t_count):
        beta = gates[t, hv, 0]
        decay = gates[t, hv, 1]
        kqt = kq[t, hk]
        kt = k[t, hk]
        nxt = min(t + 1, t_count - 1)
        kn = k[nxt, hk]
        qn = q[nxt, hk]
        for jj in range(n):
            delta = beta * (conv_out[t, vbase + j0 + jj] - decay * sk[jj])
            o[t, j0 + jj] = decay * sq[jj] + delta * kqt
            row = st[jj]
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            for i in range(dk):
                s = decay * row[i] + delta * kt[i]
                row[i] = s
                a1 += s * kn[i]
                a2 += s * qn[i]
            sk[jj] = a1
            sq[jj] = a2
    for i in range(dk):
        for jj in range(n):
            state[hv, i, j0 + jj] = st[jj, i]


@intrinsic
def _columns_step(typingctx, st, delta, kt, kn, qn, decay, sums):
    """One token through a block of STATE_COLUMNS state columns held row by row (st [dk, 32]:
    st[i] is row i of the block, two 16-lane vectors): st = decay * st + k_t (x) delta, then
    sums[0] = st^T k_next and sums[1] = st^T q_next, each column's sum in row order in its own
    lane. Why: with the columns across the lanes, the update and both products are one pass
    of FMAs over the block with no horizontal sums (a column per row pass, as `_run_columns`
    does, ends every column's two products in two 16-lane reductions)."""
    if not (_f32_matrix(st) and _f32_matrix(sums) and isinstance(decay, types.Float)
            and all(_row_view_ok(v, types.float32) for v in (delta, kt, kn, qn))):
        return None

    def codegen(context, builder, signature, args):
        st_a, delta_a, kt_a, kn_a, qn_a = (context.make_array(signature.args[i])(context, builder, args[i])
                                           for i in range(5))
        sums_a = context.make_array(signature.args[6])(context, builder, args[6])
        dec = _splat(builder, context.cast(builder, args[5], signature.args[5], types.float32), _V16F)
        d = [_load_vec(builder, delta_a.data, ir.Constant(_I64, 16 * v), _V16F, 4) for v in range(2)]
        zero = ir.Constant(_V16F, [0.0] * 16)

        def scalar(arr, i):
            return builder.load(builder.gep(arr.data, [i]))

        def body(i, accs):
            row = builder.mul(i, ir.Constant(_I64, 32))
            ki, kni, qni = (_splat(builder, scalar(a, i), _V16F) for a in (kt_a, kn_a, qn_a))
            out = []
            for v in range(2):
                at = builder.add(row, ir.Constant(_I64, 16 * v))
                ptr = builder.bitcast(builder.gep(st_a.data, [at]), _V16F.as_pointer())
                s = _fma(builder, d[v], ki, builder.fmul(dec, builder.load(ptr, align=4)))
                builder.store(s, ptr, align=4)
                out.append(_fma(builder, s, kni, accs[2 * v]))
                out.append(_fma(builder, s, qni, accs[2 * v + 1]))
            return out

        dk = builder.extract_value(st_a.shape, 0)
        accs = _counted_loop(builder, dk, [zero] * 4, body)
        for v in range(2):
            for which in range(2):
                at = ir.Constant(_I64, 32 * which + 16 * v)
                builder.store(accs[2 * v + which], builder.bitcast(builder.gep(sums_a.data, [at]), _V16F.as_pointer()),
                              align=4)
        return context.get_dummy_value()

    return types.none(st, delta, kt, kn, qn, decay, sums), codegen


@njit(**_OPTS)
def _run_column_vectors(hv, hk, j0, conv_out, q, k, gates, kq, vbase, state, o):
    """`_run_columns` for a whole block of STATE_COLUMNS columns, one token a `_columns_step`."""
    t_count = q.shape[0]
    dk = q.shape[2]
    st = np.empty((dk, STATE_COLUMNS), dtype=np.float32)
    for i in range(dk):
        for jj in range(STATE_COLUMNS):
            st[i, jj] = state[hv, i, j0 + jj]
    delta = np.zeros(STATE_COLUMNS, dtype=np.float32)
    sums = np.empty((2, STATE_COLUMNS), dtype=np.float32)
    _columns_step(st, delta, k[0, hk], k[0, hk], q[0, hk], np.float32(1.0), sums)  # S^T k_0, S^T q_0
    for t in range(t_count):
        beta = gates[t, hv, 0]
        decay = gates[t, hv, 1]
        kqt = kq[t, hk]
        nxt = min(t + 1, t_count - 1)
        for jj in range(STATE_COLUMNS):
            dl = beta * (conv_out[t, vbase + j0 + jj] - decay * sums[0, jj])
            delta[jj] = dl
            o[t, j0 + jj] = decay * sums[1, jj] + dl * kqt
        _columns_step(st, delta, k[t, hk], k[nxt, hk], q[nxt, hk], decay, sums)
    for i in range(dk):
        for jj in range(STATE_COLUMNS):
            state[hv, i, j0 + jj] = st[i, jj]


@njit(**dict(_FAST_OPTS, parallel=True))
def gated_deltanet_prompt(mixed, conv_state, taps, z, b, a, a_log, dt_bias, norm_w, eps,
                          state, k_heads, v_heads, dk, dv, out):
    """`dense.gated_deltanet` for T tokens (same arguments, results within float32 rounding),
    each block of a head's state columns through all the tokens on one thread."""
    t_count, channels = mixed.shape
    key_dim = k_heads * dk
    ratio = v_heads // k_heads
    conv_out = np.empty((t_count, channels), dtype=np.float32)
    prompt_conv(mixed, conv_state, taps, conv_out)
    q = np.empty((t_count, k_heads, dk), dtype=np.float32)
    k = np.empty((t_count, k_heads, dk), dtype=np.float32)
    prompt_qk(conv_out, k_heads, dk, q, k)
    gates = np.empty((t_count, v_heads, 2), dtype=np.float32)
    kq = np.empty((t_count, k_heads), dtype=np.float32)
    for t in range(t_count):
        for hv in range(v_heads):
            beta, decay = deltanet_gates(t, hv, b, a, a_log, dt_bias)
            gates[t, hv, 0] = beta
            gates[t, hv, 1] = decay
        for hk in range(k_heads):
            acc = np.float32(0.0)
            for i in range(dk):
                acc += k[t, hk, i] * q[t, hk, i]
            kq[t, hk] = acc
    o = np.empty((v_heads, t_count, dv), dtype=np.float32)
    blocks = (dv + STATE_COLUMNS - 1) // STATE_COLUMNS
    for task in prange(v_heads * blocks):
        hv = task // blocks
        j0 = (task % blocks) * STATE_COLUMNS
        if j0 + STATE_COLUMNS <= dv:
            _run_column_vectors(hv, hv // ratio, j0, conv_out, q, k, gates, kq, 2 * key_dim + hv * dv, state, o[hv])
        else:
            _run_columns(hv, hv // ratio, j0, dv, conv_out, q, k, gates, kq, 2 * key_dim + hv * dv, state, o[hv])
    for t in prange(t_count):
        for hv in range(v_heads):
            gated_rmsnorm(o[hv, t], z, norm_w, eps, t, hv * dv, out)
