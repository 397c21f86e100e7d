"""Numba kernels for the dense part of a decoder layer.

All kernels release the GIL (`nogil`) so the terminal app stays live while
the engine works, and are cached on disk. Weights are float32, bf16 kept
as uint16, or int8/int4 (`engine.qlinear.QuantMatrix`, from `convert
--dense-bits`); the matrix-vector products are the bandwidth-tuned ones of
`qmatvec`, shared with the experts. Accumulation is in float32, which matches transformers' float32
path to well under 1e-4 relative.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from tierlab.engine.kernels.fastexp import FAST_EXACT, sigmoid_f32, silu_f32
from tierlab.engine.kernels.float_tiles import matmat_tiles, usable_dense
from tierlab.engine.kernels.qmatmat import matmat_bf16
from tierlab.engine.checkpoint import to_f32
from tierlab.engine.kernels.qmatvec import (_I32, _I64, _V16F, _as_f32, _counted_loop, _load_vec, _row_view_ok,
                                            matvec_bf16, matvec_fp32, matvec_stack)
from tierlab.engine.qlinear import QuantMatrix, RowStack, qlinear

def matvec(w, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Dispatch on the storage dtype; x is float32[cols]."""
    if not isinstance(w, np.ndarray):
        y = linear(w, x)
        if out is None:
            return y
        out[:] = y
        return out
    if out is None:
        out = np.empty(w.shape[0], dtype=np.float32)
    if w.dtype == np.uint16:
        matvec_bf16(w, x, out)
    else:
        matvec_fp32(w, x, out)
    return out


@njit(nogil=True, cache=True)
def _gather_rows(table, ids, out):
    """out[t] = row ids[t] of a float32 or bf16 (uint16) table, as float32; False, with
    nothing read, where an id is outside the table."""
    for t in range(ids.shape[0]):
        if ids[t] < 0 or ids[t] >= table.shape[0]:
            return False
    for t in range(ids.shape[0]):
        row = table[ids[t]]
        for c in range(out.shape[1]):
            out[t, c] = _as_f32(row[c])
    return True


def embed_rows(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The embedding rows of int64 `ids` as float32 [T, H], bf16 widened exactly. One
    compiled call: numpy's gather, widening and copy were four operations and their
    temporaries, about 45 us of a decoded token right after the lm_head's stream
    (docs/benchmarks.md, "The embedding row in one call"). Other tables (float16) and
    ids outside the table take numpy's way (its IndexError)."""
    if table.dtype in (np.uint16, np.float32) and table.ndim == 2 and table.flags.c_contiguous:
        out = np.empty((ids.shape[0], table.shape[1]), dtype=np.float32)
        if _gather_rows(table, ids, out):
            return out
    return to_f32(table[ids]).reshape(ids.shape[0], table.shape[1]).copy()


def widen(w: np.ndarray) -> np.ndarray:
    if w.dtype == np.uint16:
        return (w.astype(np.uint32) << 16).view(np.float32)
    return w


def linear(w, x: np.ndarray) -> np.ndarray:
    """y = x @ w.T for one token (matvec kernels) or several (bf16: float_tiles' tiles where the
    widths allow, else qmatmat's row-widening kernels, as for int8/int4; BLAS for float32)."""
    if isinstance(w, QuantMatrix):
        return qlinear(w, x)
    if isinstance(w, RowStack):
        if w.one_launch is not None and (x.ndim == 1 or x.shape[0] == 1):
            out = np.empty(w.shape[0], dtype=np.float32)
            matvec_stack(*w.one_launch, x.reshape(-1), out)  # made float32 there
            return out if x.ndim == 1 else out[None, :]
        return np.concatenate([linear(p, x) for p in w.parts], axis=-1)
    if x.ndim == 1:
        return matvec(w, x)
    if x.shape[0] == 1:
        return matvec(w, x[0])[None, :]
    if w.dtype == np.uint16:
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if usable_dense(*w.shape) and w.flags.c_contiguous:
            matmat_tiles(w, x, out)  # float32 tiles, one row to a lane (AVX-512)
        else:
            matmat_bf16(w, x, out)
        return out
    return np.ascontiguousarray(x @ w.T, dtype=np.float32)


@njit(nogil=True, fastmath=False, cache=True)
def rms_norm(x, w, eps, out):
    """Row-wise RMSNorm of x [T, D], scaled by w (a zero-centred norm's w arrives as 1 + w)."""
    t_count, d = x.shape
    for t in range(t_count):
        ss = 0.0
        for i in range(d):
            ss += np.float64(x[t, i]) * x[t, i]
        inv = np.float32(1.0 / math.sqrt(ss / d + eps))
        for i in range(d):
            out[t, i] = (x[t, i] * inv) * w[i]


@njit(nogil=True, fastmath=False, cache=True)
def add_rms_norm(x, y, w, eps, out):
    """x += y (float32, element by element, as NumPy's `x += y`), then out = `rms_norm` of the
    new x: a decoded layer's residual add and its next norm in one call."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] = x[t, i] + y[t, i]
    rms_norm(x, w, eps, out)


_NO_NORM = np.empty(0, np.float32)
_NO_ROWS = np.empty((1, 0), np.float32)


def residual_norms(norms: tuple | None, x: np.ndarray, post: np.ndarray | None = None) -> tuple:
    """A decode step's residual operands: (True, input norm, post norm, eps, the input norm's
    output, the post norm's output (`post`, or a new array), x [1, H] as given) with
    norms = (input norm, post norm, eps), where x is the residual stream; else (False,
    stand-ins..., x as the normed input [1, H])."""
    if norms is None:
        return False, _NO_NORM, _NO_NORM, 0.0, _NO_ROWS, _NO_ROWS, np.ascontiguousarray(x, dtype=np.float32).reshape(1, -1)
    in_norm, post_norm, eps = norms
    post = np.empty(x.shape, np.float32) if post is None else post
    return True, in_norm, post_norm, float(eps), np.empty(x.shape, np.float32), post, x


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x2 = x.reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    rms_norm(x2, w, eps, out)
    return out.reshape(x.shape)


@njit(nogil=True, fastmath=False, cache=True)
def rope_inplace(x, positions, inv_freq, rotary_dim):
    """Rotate-half RoPE on the first rotary_dim dims of x [T, heads, head_dim]."""
    t_count, heads, _ = x.shape
    half = rotary_dim // 2
    for t in range(t_count):
        pos = np.float32(positions[t])
        for i in range(half):
            ang = np.float32(pos * inv_freq[i])
            c = np.float32(math.cos(ang))
            s = np.float32(math.sin(ang))
            for h in range(heads):
                a = x[t, h, i]
                b = x[t, h, i + half]
                x[t, h, i] = a * c - b * s
                x[t, h, i + half] = b * c + a * s


@intrinsic
def _dot_fixed(typingctx, a, b):
    """sum a[i] * b[i] for float32 vectors whose length is a multiple of 16, in one fixed order:
    16 lanes of products summed down the vector, then the lanes by halves (8+8, 4+4, 2+2, 1+1).
    Plain IEEE operations, no fast-math flags: LLVM may not reorder them, so the sum has the
    same bits however the caller is inlined, vectorised or loaded from numba's cache."""
    if not (_row_view_ok(a, types.float32) and _row_view_ok(b, types.float32)):
        return None

    def codegen(context, builder, signature, args):
        a_arr, b_arr = (context.make_array(signature.args[i])(context, builder, args[i]) for i in range(2))
        steps = builder.sdiv(builder.extract_value(a_arr.shape, 0), ir.Constant(_I64, 16))

        def body(i, carried):
            at = builder.mul(i, ir.Constant(_I64, 16))
            prod = builder.fmul(_load_vec(builder, a_arr.data, at, _V16F, 4), _load_vec(builder, b_arr.data, at, _V16F, 4))
            return [builder.fadd(carried[0], prod)]

        (acc,) = _counted_loop(builder, steps, [ir.Constant(_V16F, [0.0] * 16)], body)
        width = 16
        while width > 1:
            half = width // 2
            undef = ir.Constant(acc.type, ir.Undefined)
            lo = builder.shuffle_vector(acc, undef, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
            hi = builder.shuffle_vector(acc, undef, ir.Constant(ir.VectorType(_I32, half), list(range(half, width))))
            acc = builder.fadd(lo, hi)
            width = half
        return builder.extract_element(acc, ir.Constant(_I32, 0))

    return types.float32(a, b), codegen


@njit(nogil=True, fastmath=False, cache=True)
def _dot_in_order(a, b):
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


@njit(nogil=True, fastmath=FAST_EXACT, cache=True, error_model="numpy")
def _attend(q, keys, values, length, scale, scores, out):
    """One query head of one token over keys/values 0..length-1: out = softmax(scale q.k) . v.
    Every sum in a fixed order (`_dot_fixed`, no reassociation), so that a pair's result is the
    same bits in a prompt and in decode, and in a process that compiled this kernel and one
    that loaded it from numba's cache (the order LLVM picks for a fast-math reduction can
    depend on where the function is inlined)."""
    d = q.shape[0]
    m = np.float32(-np.inf)
    for j in range(length):
        acc = _dot_fixed(q, keys[j]) if d % 16 == 0 else _dot_in_order(q, keys[j])
        acc *= scale
        scores[j] = acc
        if acc > m:
            m = acc
    total = np.float32(0.0)
    for j in range(length):
        e = np.float32(math.exp(scores[j] - m))
        scores[j] = e
        total += e
    inv = np.float32(1.0) / total
    for i in range(d):
        out[i] = 0.0
    for j in range(length):
        p = scores[j] * inv
        for i in range(d):
            out[i] += p * values[j, i]


@njit(nogil=True, fastmath=True, cache=True, parallel=True)
def attention(q, k_cache, v_cache, start, out):
    """Causal GQA attention for T new tokens at positions start..start+T-1.

    q: [T, Hq, d]; k_cache, v_cache: [Hkv, maxT, d] already holding the new
    tokens; out: [T, Hq, d]. Scores are scaled by 1/sqrt(d) and softmaxed in
    float32. Each (head, token) is one task with its own sums (`_attend`), so a
    prompt's token gets the bits it gets in decode; the tasks go head by head, so
    that the threads' shares of a causal prompt are as long as each other.
    """
    t_count, n_heads, d = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    scale = np.float32(1.0 / math.sqrt(d))
    for task in prange(n_heads * t_count):
        h = task // t_count
        t = task % t_count
        kvh = h // group
        scores = np.empty(start + t + 1, dtype=np.float32)
        _attend(q[t, h], k_cache[kvh], v_cache[kvh], start + t + 1, scale, scores, out[t, h])


@njit(nogil=True, fastmath=False, cache=True)
def _sigmoid(v):
    return np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-v)))


@njit(nogil=True, fastmath=False, cache=True)
def _softplus(v):
    if v > 20.0:
        return v
    return np.float32(math.log1p(math.exp(v)))


@njit(nogil=True, fastmath=True, cache=True, parallel=True)
def gated_deltanet(mixed, conv_state, taps, z, b, a, a_log, dt_bias, norm_w, eps,
                   state, k_heads, v_heads, dk, dv, out):
    """Gated DeltaNet over T tokens, updating conv and recurrent state in place.

    mixed: [T, C] the in_proj_qkv outputs (rows q | k | v), C = 2*k_heads*dk + v_heads*dv
    conv_state: [K-1, C] the previous K-1 inputs (zeros at the start)
    taps: [K, C] depthwise causal kernel tap by tap, last tap = current token
    z: [T, v_heads*dv]; b, a: [T, v_heads]
    state: [v_heads, dk, dv] float32 recurrent state
    out: [T, v_heads*dv] gated-normed output before out_proj

    A token is one launch: each key head's work item convolves its q and k channels and
    the channels of the value heads that share it, normalises its q and k, then runs those
    value heads. The items' channels are disjoint and together all of them, so the conv,
    the norms and the heads give the bits they give one after another (the exact prompt
    path, `deltanet_token_inputs`), with no serial step and one thread launch instead of two
    (docs/benchmarks.md, "The DeltaNet recurrence: SiLUs vectorised, one launch a token").
    """
    t_count, channels = mixed.shape
    key_dim = k_heads * dk
    ratio = v_heads // k_heads
    conv_out = np.empty(channels, dtype=np.float32)
    q = np.empty((k_heads, dk), dtype=np.float32)
    k = np.empty((k_heads, dk), dtype=np.float32)
    for t in range(t_count):
        for hk in prange(k_heads):
            v0 = 2 * key_dim + hk * ratio * dv
            deltanet_conv(t, hk * dk, (hk + 1) * dk, mixed, conv_state, taps, conv_out)
            deltanet_conv(t, key_dim + hk * dk, key_dim + (hk + 1) * dk, mixed, conv_state, taps, conv_out)
            deltanet_conv(t, v0, v0 + ratio * dv, mixed, conv_state, taps, conv_out)
            deltanet_qk_head(conv_out, hk, dk, key_dim, q, k)
            for hv in range(hk * ratio, (hk + 1) * ratio):
                deltanet_head(hv, hk, t, conv_out, q, k, z, b, a, a_log, dt_bias, norm_w, eps, state,
                              2 * key_dim + hv * dv, dv, out)


@njit(nogil=True, fastmath=True, cache=True)
def deltanet_token_inputs(t, mixed, conv_state, taps, k_heads, dk, conv_out, q, k):
    """Token t's conv output (depthwise causal conv then SiLU; conv_state moves on by one input)
    and its L2-normalised q (scaled by 1/sqrt(dk)) and k per key head, on one thread."""
    deltanet_conv(t, 0, mixed.shape[1], mixed, conv_state, taps, conv_out)
    deltanet_qk(conv_out, k_heads, dk, q, k)


@njit(nogil=True, fastmath=FAST_EXACT, cache=True, error_model="numpy")
def deltanet_conv(t, c0, c1, mixed, conv_state, taps, conv_out):
    """Channels c0..c1-1 of token t's conv output (depthwise causal conv then SiLU); their
    conv_state moves on by one input. Channels are independent, so threads may share them.

    Each channel sums its taps in order, oldest input first, as a prompt's conv does; the
    channels run tap by tap across the lanes and the SiLU is `fastexp.silu_f32`, so both
    loops vectorise (numba's `math.exp` is the C library's scalar expf). FAST_EXACT keeps the
    written order of the sums in the loops' vector and scalar copies alike."""
    ksize = taps.shape[0]
    n = c1 - c0
    acc = np.zeros(n, dtype=np.float32)
    for j in range(ksize - 1):  # slices indexed from 0: no wraparound branch to stop the vectoriser
        tap, held = taps[j, c0:c1], conv_state[j, c0:c1]
        for i in range(n):
            acc[i] += tap[i] * held[i]
    tap, now, result = taps[ksize - 1, c0:c1], mixed[t, c0:c1], conv_out[c0:c1]
    for i in range(n):
        result[i] = silu_f32(acc[i] + tap[i] * now[i])
    for j in range(ksize - 2):
        conv_state[j, c0:c1] = conv_state[j + 1, c0:c1]
    if ksize > 1:
        conv_state[ksize - 2, c0:c1] = now


@njit(nogil=True, fastmath=True, cache=True)
def deltanet_qk(conv_out, k_heads, dk, q, k):
    """The L2-normalised q (scaled by 1/sqrt(dk)) and k of each key head, from the conv output."""
    for hk in range(k_heads):
        deltanet_qk_head(conv_out, hk, dk, k_heads * dk, q, k)


@njit(nogil=True, fastmath=FAST_EXACT, cache=True, error_model="numpy")
def deltanet_qk_head(conv_out, hk, dk, key_dim, q, k):
    """Key head hk's L2-normalised q (scaled by 1/sqrt(dk)) and k. FAST_EXACT: the sums of
    squares in written order, whichever loop this is compiled into."""
    q_scale = np.float32(1.0 / math.sqrt(dk))
    sq = np.float32(0.0)
    sk = np.float32(0.0)
    for i in range(dk):
        qv = conv_out[hk * dk + i]
        kv = conv_out[key_dim + hk * dk + i]
        sq += qv * qv
        sk += kv * kv
    iq = np.float32(1.0 / math.sqrt(sq + 1e-6)) * q_scale
    ik = np.float32(1.0 / math.sqrt(sk + 1e-6))
    for i in range(dk):
        q[hk, i] = conv_out[hk * dk + i] * iq
        k[hk, i] = conv_out[key_dim + hk * dk + i] * ik


@njit(nogil=True, fastmath=True, cache=True)
def deltanet_head(hv, hk, t, conv_out, q, k, z, b, a, a_log, dt_bias, norm_w, eps, state, vbase, dv, out):
    """One value head of one token: the delta-rule update of S [dk, dv] and the gated-normed output.

    With S' = decay * S + k (x) delta, the output S'^T q is computed as
    decay * (S^T q) + delta * (k . q), so S is read once for S^T k and S^T q
    and once more to be updated (instead of being updated twice).
    """
    dk = k.shape[1]
    beta, decay = deltanet_gates(t, hv, b, a, a_log, dt_bias)
    sk = np.zeros(dv, dtype=np.float32)
    sq = np.zeros(dv, dtype=np.float32)
    kq = np.float32(0.0)
    for i in range(dk):
        ki = k[hk, i]
        qi = q[hk, i]
        kq += ki * qi
        for j in range(dv):
            s = state[hv, i, j]
            sk[j] += s * ki
            sq[j] += s * qi
    delta = np.empty(dv, dtype=np.float32)
    o = np.empty(dv, dtype=np.float32)
    for j in range(dv):
        delta[j] = beta * (conv_out[vbase + j] - decay * sk[j])
        o[j] = decay * sq[j] + delta[j] * kq
    for i in range(dk):
        ki = k[hk, i]
        for j in range(dv):
            state[hv, i, j] = decay * state[hv, i, j] + ki * delta[j]
    gated_rmsnorm(o, z, norm_w, eps, t, hv * dv, out)


@njit(nogil=True, fastmath=True, cache=True)
def deltanet_gates(t, hv, b, a, a_log, dt_bias):
    """(beta, decay) of value head hv at token t: the delta rule's step size and its forget gate."""
    beta = _sigmoid(b[t, hv])
    g = -np.float32(math.exp(a_log[hv])) * _softplus(a[t, hv] + dt_bias[hv])
    return beta, np.float32(math.exp(g))


@njit(nogil=True, fastmath=True, cache=True, error_model="numpy")
def gated_rmsnorm(o, z, norm_w, eps, t, base, out):
    """out[t, base:base+dv] = RMSNorm(o) (plain weight) * silu(z[t, base:base+dv]) for one head's o [dv].

    The SiLU is `fastexp.silu_f32` and numba's division checks are off (error_model
    "numpy"), so the loop vectorises; with the C library's scalar expf a token's value
    heads took 18% longer (docs/benchmarks.md, "The DeltaNet recurrence: SiLUs
    vectorised, one launch a token"). Decode, the exact prompt path and the fast one all
    normalise through this function."""
    dv = o.shape[0]
    ss = np.float32(0.0)
    for j in range(dv):
        ss += o[j] * o[j]
    inv = np.float32(1.0 / math.sqrt(ss / dv + eps))
    for j in range(dv):
        out[t, base + j] = norm_w[j] * (o[j] * inv) * silu_f32(z[t, base + j])


@njit(nogil=True, fastmath=FAST_EXACT, cache=True, error_model="numpy")
def shared_expert_inputs(fused, start, size, h, gate):
    """The shared expert's hidden rows and output gates from the router block's rows
    fused [T, E + 2S + 1] (router logits | g | u | gate logit), start = E, size = S:
    h[t] = silu(g) * u, gate[t] = sigmoid(gate logit). One call where NumPy took a
    dozen (each a few microseconds in a decoded token)."""
    for t in range(fused.shape[0]):
        g = fused[t, start:start + size]
        u = fused[t, start + size:start + 2 * size]
        ht = h[t]
        for i in range(size):
            ht[i] = silu_f32(g[i]) * u[i]
        gate[t] = sigmoid_f32(fused[t, start + 2 * size])


@njit(nogil=True, fastmath=FAST_EXACT, cache=True, error_model="numpy")
def sigmoid_gate(out, gate):
    """out *= sigmoid(gate), both [T, n] (gated attention's output gate): one call where
    NumPy took four."""
    for t in range(out.shape[0]):
        ot, gt = out[t], gate[t]
        for i in range(ot.shape[0]):
            ot[i] = ot[i] * sigmoid_f32(gt[i])


@njit(nogil=True, fastmath=False, cache=True)
def softmax_row(logits, out):
    m = logits[0]
    for i in range(1, logits.shape[0]):
        if logits[i] > m:
            m = logits[i]
    total = 0.0
    for i in range(logits.shape[0]):
        e = math.exp(np.float64(logits[i]) - m)
        out[i] = e
        total += e
    for i in range(logits.shape[0]):
        out[i] = out[i] / total


@njit(nogil=True, fastmath=False, cache=True)
def topk_desc(values, k, idx_out):
    """Indices of the k largest values, largest first; ties go to the lower index."""
    n = values.shape[0]
    taken = np.zeros(n, dtype=np.bool_)
    for slot in range(k):
        best = -1
        for i in range(n):
            if taken[i]:
                continue
            if best < 0 or values[i] > values[best]:
                best = i
        idx_out[slot] = best
        taken[best] = True


#: the longest run numpy's float32 sum adds in one block (its pairwise summation splits longer ones)
PAIRWISE_BLOCK = 128


@njit(nogil=True, fastmath=False, cache=True)
def block_sum(a, n):
    """numpy's float32 sum of a[:n] for n <= PAIRWISE_BLOCK: eight partial sums added as a
    tree, so a weight normalised here equals numpy's bit for bit."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[0], a[1], a[2], a[3]
    r4, r5, r6, r7 = a[4], a[5], a[6], a[7]
    i = 8
    end = n - n % 8
    while i < end:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[i]
        i += 1
    return res


@njit(nogil=True, fastmath=False, cache=True, error_model="numpy")
def topk_weights(probs, k, norm, chosen, true_topk, top_probs, weights):
    """The stock router's choice from one token's probs: chosen and true_topk its k most probable
    experts (`topk_desc`'s order), top_probs their probabilities and weights those renormalised
    over the k when `norm`, with numpy's float32 sum (k <= PAIRWISE_BLOCK, else the caller
    normalises)."""
    topk_desc(probs, k, chosen)
    for s in range(k):
        true_topk[s] = chosen[s]
        top_probs[s] = probs[chosen[s]]
    if norm:
        total = block_sum(top_probs, k)
        for s in range(k):
            weights[s] = top_probs[s] / total
    else:
        for s in range(k):
            weights[s] = top_probs[s]


@njit(nogil=True, fastmath=False, cache=True, error_model="numpy")
def route_row(logits, k, norm, probs, chosen, true_topk, top_probs, weights):
    """The stock router for one token: probs its softmax (`softmax_row`), then `topk_weights`."""
    softmax_row(logits, probs)
    topk_weights(probs, k, norm, chosen, true_topk, top_probs, weights)


@njit(nogil=True, fastmath=False, cache=True, error_model="numpy")
def route_rows(logits, k, norm, probs, chosen, true_topk, top_probs, weights):
    """`route_row` for every token of logits [T, E] in one call (a prompt's plain routing)."""
    for t in range(logits.shape[0]):
        route_row(logits[t], k, norm, probs[t], chosen[t], true_topk[t], top_probs[t], weights[t])


@njit(nogil=True, fastmath=True, cache=True)
def axpy(y, w, x):
    """y += w * x."""
    for i in range(y.shape[0]):
        y[i] += w * x[i]


@njit(nogil=True, fastmath=True, cache=True)
def add_weighted(y, chosen, weights, outputs):
    """y += weights[s] * outputs[s] for every filled slot s (chosen[s] >= 0), in rank order.

    One call per token and layer for the sum of its experts: each slot adds
    exactly what `axpy` would, in the same order.
    """
    for s in range(chosen.shape[0]):
        if chosen[s] >= 0:
            w = np.float32(weights[s])
            for i in range(y.shape[0]):
                y[i] += w * outputs[s, i]


@njit(nogil=True, fastmath=True, cache=True)
def add_weighted_rows(y, chosen, weights, outputs):
    """`add_weighted` for every token of a prompt: y [T, H], chosen and weights [T, K],
    outputs [T, K, H]. One call per layer instead of one `axpy` per (token, slot) from
    Python (4096 calls per layer in a 512-token prompt); the same bits."""
    for t in range(y.shape[0]):
        add_weighted(y[t], chosen[t], weights[t], outputs[t])
