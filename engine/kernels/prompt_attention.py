"""A prompt's causal attention in tiles: four query heads against four keys a pass.

Why: the token-by-token kernel (`dense.attention`) dots one query head with one
key at a time and sums each dot across its 16 lanes, and adds each weighted
value row into the output in memory: about a quarter of the FMA peak (2.7 ms
for one 16-head layer at 128 tokens, 42 ms at 512). Here the heads that share
a key/value head go four at a time: their scores come from the matrix
kernels' pass of four rows by four tokens (`qmatmat._dot4x4_into`, the keys
as its rows and the heads as its tokens: one tree of shuffles for sixteen
sums), and their weighted sum of the value rows keeps four heads by 64
columns in registers across all keys (`_weighted_rows_into`): every value
vector loaded once feeds four FMAs.

A token's output depends only on its query, its position and the cache, not
on how the prompt was cut or on which tokens share a launch. It is not bit for
bit what decode computes (different sums), so PREFILL_EXACT keeps the
token-by-token kernel; both are within float32 rounding of each other
(tests/test_prompt_attention.py) and of transformers (the oracle tests).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from tierlab.engine.kernels.fastexp import FAST_EXACT, exp_f32
from tierlab.engine.kernels.qmatmat import _dot4x1_into, _dot4x2_into_lanes, _dot4x3_into, _dot4x4_into, _f32_matrix
from tierlab.engine.kernels.qmatvec import _fma, _I64, _V16F, _counted_loop, _load_vec, _prefetch, _splat

_F32 = ir.FloatType()


def _weighted_rows_codegen(chunks, ranged=False, ahead=0):
    """Codegen of acc[s, c0:c0 + 16 * chunks] = sum_j p[s, j] * v[j, c0:c0 + 16 * chunks] for the
    four heads s, keys j = 0..n-1 in order: 4 * chunks 16-lane sums carried across the keys.

    `ranged` (decode's passes over a long cache): the arguments are (p, v, j0, j1, c0, acc) and
    the sums go on from acc's values over keys j0..j1-1, so that pieces taken in order give
    the one chain of FMAs a single pass gives; else (p, v, n, c0, acc), from zero. With
    `ahead`, each key's step also prefetches the same columns of the value row `ahead` keys
    on (at most v's last row)."""

    def codegen(context, builder, signature, args):
        count = 6 if ranged else 5
        p_arr, v_arr, acc_arr = (context.make_array(signature.args[i])(context, builder, args[i])
                                 for i in (0, 1, count - 1))
        ints = [context.cast(builder, args[i], signature.args[i], types.int64) for i in range(2, count - 1)]
        j0, j1, c0 = ints if ranged else (ir.Constant(_I64, 0), *ints)

        def row(arr, r):
            start = builder.gep(builder.bitcast(arr.data, ir.IntType(8).as_pointer()),
                                [builder.mul(r, builder.extract_value(arr.strides, 0))])
            return builder.bitcast(start, arr.data.type)

        def columns(i):
            return builder.add(c0, ir.Constant(_I64, 16 * i))

        p_rows = [row(p_arr, ir.Constant(_I64, s)) for s in range(4)]
        last = builder.sub(builder.extract_value(v_arr.shape, 0), ir.Constant(_I64, 1))

        def body(i, accs):
            j = builder.add(j0, i)
            if ahead:
                later = builder.add(j, ir.Constant(_I64, ahead))
                later_row = row(v_arr, builder.select(builder.icmp_signed("<", later, last), later, last))
                for c in range(chunks):
                    _prefetch(builder, later_row, builder.mul(columns(c), ir.Constant(_I64, 4)))
            v_row = row(v_arr, j)
            vv = [_load_vec(builder, v_row, columns(c), _V16F, 4) for c in range(chunks)]
            out = []
            for s in range(4):
                ps = _splat(builder, builder.load(builder.gep(p_rows[s], [j])), _V16F)
                out += [_fma(builder, ps, vv[c], accs[s * chunks + c]) for c in range(chunks)]
            return out

        def acc_vector(s, c):
            return builder.bitcast(builder.gep(row(acc_arr, ir.Constant(_I64, s)), [columns(c)]), _V16F.as_pointer())

        if ranged:
            start = [builder.load(acc_vector(s, c), align=4) for s in range(4) for c in range(chunks)]
        else:
            start = [ir.Constant(_V16F, [0.0] * 16)] * (4 * chunks)
        accs = _counted_loop(builder, builder.sub(j1, j0), start, body)
        for s in range(4):
            for c in range(chunks):
                builder.store(accs[s * chunks + c], acc_vector(s, c), align=4)
        return context.get_dummy_value()

    return codegen


def _weighted_rows(chunks, p, v, n, c0, acc):
    if not (_f32_matrix(p) and _f32_matrix(v) and _f32_matrix(acc)):
        return None
    return types.none(p, v, n, c0, acc), _weighted_rows_codegen(chunks)


@intrinsic
def _weighted_rows4(typingctx, p, v, n, c0, acc):
    """acc[s, c0:c0+64] = sum over keys j < n of p[s, j] * v[j, c0:c0+64], s = 0..3."""
    return _weighted_rows(4, p, v, n, c0, acc)


@intrinsic
def _weighted_rows3(typingctx, p, v, n, c0, acc):
    """`_weighted_rows4` for 48 columns."""
    return _weighted_rows(3, p, v, n, c0, acc)


@intrinsic
def _weighted_rows2(typingctx, p, v, n, c0, acc):
    """`_weighted_rows4` for 32 columns."""
    return _weighted_rows(2, p, v, n, c0, acc)


@intrinsic
def _weighted_rows1(typingctx, p, v, n, c0, acc):
    """`_weighted_rows4` for 16 columns."""
    return _weighted_rows(1, p, v, n, c0, acc)


_OPTS = dict(nogil=True, cache=True, fastmath=True)


@njit(**_OPTS)
def _weighted_rows_into(p, v, n, acc):
    """acc [4, d] = p [4, >= n] times v's rows 0..n-1, 64 columns a pass (d a multiple of 16)."""
    d = acc.shape[1]
    for c0 in range(0, d, 64):
        left = d - c0
        if left >= 64:
            _weighted_rows4(p, v, n, c0, acc)
        elif left == 48:
            _weighted_rows3(p, v, n, c0, acc)
        elif left == 32:
            _weighted_rows2(p, v, n, c0, acc)
        else:
            _weighted_rows1(p, v, n, c0, acc)


@njit(**_OPTS)
def _scores_into(keys, pad, qt, h0, heads, length, scores):
    """scores[b, s, k] = head h0+s of qt [Hq, d] . key 4b+k of keys [maxT, d], for keys < length
    rounded up to four (a block past the cache's rows is read from `pad`, zeros past its end)."""
    scores[:(length + 3) // 4] = 0.0  # the passes add into it; blocks past length go unread
    rows = keys.shape[0]
    for b in range((length + 3) // 4):
        j = 4 * b
        if j + 4 <= rows:
            block = keys[j:j + 4]
        else:
            pad[:] = 0.0
            pad[:rows - j] = keys[j:rows]
            block = pad
        acc = scores[b]
        if heads >= 4:
            _dot4x4_into(block, qt, h0, h0 + 1, h0 + 2, h0 + 3, acc, 0)
        elif heads == 3:
            _dot4x3_into(block, qt, h0, h0 + 1, h0 + 2, acc, 0)
        elif heads == 2:
            _dot4x2_into_lanes(block, qt, h0, h0 + 1, acc, 0)
        else:
            _dot4x1_into(block, qt, h0, acc, 0)


@njit(nogil=True, cache=True, fastmath=FAST_EXACT, error_model="numpy")
def _softmax_rows(scores, heads, length, scale, probs):
    """probs[s, :length] = softmax(scale * scores of head s) for s < heads; zero rows after.
    (`exp_f32`, not math.exp: the C library's scalar expf would keep the loop scalar; and the
    exponentials in a loop of their own, apart from their sum, which LLVM does not vectorise.)
    No reassociation (FAST_EXACT): the sum of a row runs in key order, so its bits cannot depend
    on the order LLVM gives a reduction where this is inlined, which differed between a process
    that compiled a kernel and one that loaded it from numba's cache (docs/engine.md)."""
    for s in range(4):
        if s >= heads:
            probs[s, :length] = 0.0
            continue
        for b in range((length + 3) // 4):
            for k in range(4):
                probs[s, 4 * b + k] = scores[b, s, k] * scale
        m = np.float32(-np.inf)
        for j in range(length):
            m = max(m, probs[s, j])
        for j in range(length):
            probs[s, j] = exp_f32(probs[s, j] - m)
        total = np.float32(0.0)
        for j in range(length):
            total += probs[s, j]
        inv = np.float32(1.0) / total
        for j in range(length):
            probs[s, j] *= inv


@njit(**_OPTS)
def _attend_heads(q, k_cache, v_cache, t, pos, kvh, h0, heads, scale, scores, probs, pad, acc, out):
    """Output of heads h0..h0+heads-1 (all reading key/value head kvh) for token t at position pos."""
    length = pos + 1
    _scores_into(k_cache[kvh], pad, q[t], h0, heads, length, scores)
    _softmax_rows(scores, heads, length, scale, probs)
    _weighted_rows_into(probs, v_cache[kvh], length, acc)
    for s in range(heads):
        for i in range(acc.shape[1]):
            out[t, h0 + s, i] = acc[s, i]


@njit(**dict(_OPTS, parallel=True))
def attention_tiles(q, k_cache, v_cache, start, out):
    """Causal GQA attention for T new tokens at positions start..start+T-1, as `dense.attention`
    (q [T, Hq, d]; k_cache, v_cache [Hkv, maxT, d] already holding the new tokens; out
    [T, Hq, d]), head_dim a multiple of 16. Each step takes one block of up to four heads of one
    key/value head for tokens t and T-1-t, so that every step has about the same keys to read."""
    t_count, n_heads, d = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    per_kv = (group + 3) // 4
    scale = np.float32(1.0 / math.sqrt(d))
    half = (t_count + 1) // 2
    longest = start + t_count
    for step in prange(n_kv * per_kv * half):
        blk = step // half
        pair = step % half
        kvh = blk // per_kv
        h0 = kvh * group + 4 * (blk % per_kv)
        heads = min(4, kvh * group + group - h0)
        scores = np.empty(((longest + 3) // 4, 4, 4), dtype=np.float32)
        probs = np.empty((4, (longest + 3) // 4 * 4), dtype=np.float32)
        pad = np.empty((4, d), dtype=np.float32)
        acc = np.empty((4, d), dtype=np.float32)
        _attend_heads(q, k_cache, v_cache, pair, start + pair, kvh, h0, heads, scale, scores, probs, pad, acc, out)
        other = t_count - 1 - pair
        if other != pair:
            _attend_heads(q, k_cache, v_cache, other, start + other, kvh, h0, heads, scale, scores, probs, pad, acc, out)
