"""Causal attention in tiles: four query heads against four keys a pass, a key read once for
several tokens and heads; the operations a prompt's and a decoded token's attention share.

Why: the token-by-token kernel (`dense.attention`) dots one query head with one
key at a time and sums each dot across its 16 lanes, and adds each weighted
value row into the output in memory: about a quarter of the FMA peak. Here the
heads that share a key/value head go four at a time: their scores come from the
matrix kernels' pass of four rows by four tokens (`qmatmat._dot4x4_into`, the
keys as its rows and the heads as its tokens: one tree of shuffles for sixteen
sums), and their weighted sum of the value rows keeps four heads by 64 columns
in registers across a piece of keys (`_weighted_range4`): every value vector
loaded once feeds four FMAs. A prompt's work item is one key/value head and a
block of TOKENS_PER_TASK consecutive tokens: each block of four keys is dotted
with all of their heads while it sits in L1, and each piece of value rows is
used by all of them while it sits in L2, so that a long prompt reads its cache
from L3 once per block of tokens instead of once per token and head block.

A token's output depends only on its query, its position and the cache, not on
how the prompt was cut, on which tokens share a work item or on the thread
count: each (head, key) score is the same pass, each softmax the same function
of its row, each output element one chain of FMAs over the keys in order. So
decode (`decode_attention`, which splits a token's work across the threads in
other ways) gets the bits a prompt's token gets; both within float32 rounding
of the token-by-token kernel (tests/test_prompt_attention.py) and of
transformers (the oracle tests).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from tierlab.engine.kernels.fastexp import FAST_EXACT, exp_f32
from tierlab.engine.kernels.qmatmat import _dot4xn, _f32_matrix
from tierlab.engine.kernels.qmatvec import _fma, _I64, _V16F, _counted_loop, _load_vec, _prefetch, _splat

_F32 = ir.FloatType()

STRIPE = 64
"""Columns of the value rows a weighted sum carries in registers (`_weighted_range4`'s width)."""

KEYS_PER_PIECE = 64
"""Keys of the value rows that every stripe, token and head block takes in turn (64 KiB at
head_dim 256: in L2), so that a value row is read from memory once for all of them."""

KEY_ROWS_AHEAD = 16
"""How far ahead the scores prefetch the keys (into L2, as the matvecs do): without it the keys'
pass read a 4096-position cache 25% slower; of 8, 16 and 32 rows ahead, 16 was best
(docs/benchmarks.md, "Decode attention"). Each step of a block's dot asks for its 64 bytes of
the four rows that far on, spread over the FMAs: asked for a block at a time (64 lines at once)
the pass read its keys from DRAM at about 20 GB/s, spread at about 38 (docs/benchmarks.md,
"Decode attention: the rows asked for in order"). The value rows are asked for a piece
ahead (`_weighted_values`)."""


def _weighted_range_codegen(chunks):
    """Codegen of acc[s, c0:c0 + 16 * chunks] += sum_j p[s, j] * v[j, c0:c0 + 16 * chunks] for the
    four heads s, keys j = j0..j1-1 in order, arguments (p, v, j0, j1, c0, acc, pf_row, pf_first,
    pf_end): 4 * chunks 16-lane sums carried across the keys from acc's values, so that pieces of
    keys taken in order give one chain of FMAs. Each key's step also prefetches as many 64-byte
    lines of v as it reads, walking v's columns pf_first..pf_end-1 row after row from row
    pf_row (at most v's last row): the caller points the walk at rows it takes later, so that
    they are asked for in the order they lie in memory (`_weighted_values`)."""

    def codegen(context, builder, signature, args):
        p_arr, v_arr, acc_arr = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 5))
        j0, j1, c0, pf_row, pf_first, pf_end = (context.cast(builder, args[i], signature.args[i], types.int64)
                                                for i in (2, 3, 4, 6, 7, 8))

        def row(arr, r):
            start = builder.gep(builder.bitcast(arr.data, ir.IntType(8).as_pointer()),
                                [builder.mul(r, builder.extract_value(arr.strides, 0))])
            return builder.bitcast(start, arr.data.type)

        def columns(i):
            return builder.add(c0, ir.Constant(_I64, 16 * i))

        p_rows = [row(p_arr, ir.Constant(_I64, s)) for s in range(4)]
        last = builder.sub(builder.extract_value(v_arr.shape, 0), ir.Constant(_I64, 1))
        width = ir.Constant(_I64, 16 * chunks)

        def body(i, carried):
            accs, pf_r, pf_c = carried[:-2], carried[-2], carried[-1]
            j = builder.add(j0, i)
            ahead = row(v_arr, builder.select(builder.icmp_signed("<", pf_r, last), pf_r, last))
            for c in range(chunks):
                column = builder.add(pf_c, ir.Constant(_I64, 16 * c))
                _prefetch(builder, ahead, builder.mul(column, ir.Constant(_I64, 4)))
            pf_c = builder.add(pf_c, width)
            wrap = builder.icmp_signed(">=", pf_c, pf_end)
            pf_r = builder.select(wrap, builder.add(pf_r, ir.Constant(_I64, 1)), pf_r)
            pf_c = builder.select(wrap, pf_first, pf_c)
            v_row = row(v_arr, j)
            vv = [_load_vec(builder, v_row, columns(c), _V16F, 4) for c in range(chunks)]
            out = []
            for s in range(4):
                ps = _splat(builder, builder.load(builder.gep(p_rows[s], [j])), _V16F)
                out += [_fma(builder, ps, vv[c], accs[s * chunks + c]) for c in range(chunks)]
            return out + [pf_r, pf_c]

        def acc_vector(s, c):
            return builder.bitcast(builder.gep(row(acc_arr, ir.Constant(_I64, s)), [columns(c)]), _V16F.as_pointer())

        start = [builder.load(acc_vector(s, c), align=4) for s in range(4) for c in range(chunks)]
        accs = _counted_loop(builder, builder.sub(j1, j0), start + [pf_row, pf_first], body)[:-2]
        for s in range(4):
            for c in range(chunks):
                builder.store(accs[s * chunks + c], acc_vector(s, c), align=4)
        return context.get_dummy_value()

    return codegen


def _weighted_range(chunks, p, v, j0, j1, c0, acc, pf_row, pf_first, pf_end):
    if not (_f32_matrix(p) and _f32_matrix(v) and _f32_matrix(acc)):
        return None
    return types.none(p, v, j0, j1, c0, acc, pf_row, pf_first, pf_end), _weighted_range_codegen(chunks)


@intrinsic
def _weighted_range4(typingctx, p, v, j0, j1, c0, acc, pf_row, pf_first, pf_end):
    """acc[s, c0:c0+64] += p[s, j] * v[j, c0:c0+64] for keys j = j0..j1-1 in order, s = 0..3
    (prefetching as `_weighted_range_codegen` says)."""
    return _weighted_range(4, p, v, j0, j1, c0, acc, pf_row, pf_first, pf_end)


@intrinsic
def _weighted_range3(typingctx, p, v, j0, j1, c0, acc, pf_row, pf_first, pf_end):
    """`_weighted_range4` for 48 columns."""
    return _weighted_range(3, p, v, j0, j1, c0, acc, pf_row, pf_first, pf_end)


@intrinsic
def _weighted_range2(typingctx, p, v, j0, j1, c0, acc, pf_row, pf_first, pf_end):
    """`_weighted_range4` for 32 columns."""
    return _weighted_range(2, p, v, j0, j1, c0, acc, pf_row, pf_first, pf_end)


@intrinsic
def _weighted_range1(typingctx, p, v, j0, j1, c0, acc, pf_row, pf_first, pf_end):
    """`_weighted_range4` for 16 columns."""
    return _weighted_range(1, p, v, j0, j1, c0, acc, pf_row, pf_first, pf_end)


@intrinsic
def _keys_by_4_heads(typingctx, keys, r0, q, ha, hb, hc, hd, acc, at):
    """acc[at + s, k] += key r0+k of keys . head h_s of q, s = 0..3: `qmatmat._dot4x4_into` on rows
    r0..r0+3 of the whole key matrix (the same sums)."""
    return _dot4xn(4, keys, q, acc, (keys, r0, q, ha, hb, hc, hd, acc, at), first_row=True, ahead_rows=KEY_ROWS_AHEAD)


@intrinsic
def _keys_by_3_heads(typingctx, keys, r0, q, ha, hb, hc, acc, at):
    """`_keys_by_4_heads` for three heads (`_dot4x3_into`)."""
    return _dot4xn(3, keys, q, acc, (keys, r0, q, ha, hb, hc, acc, at), first_row=True, ahead_rows=KEY_ROWS_AHEAD)


@intrinsic
def _keys_by_2_heads(typingctx, keys, r0, q, ha, hb, acc, at):
    """`_keys_by_4_heads` for two heads (`_dot4x2_into_lanes`)."""
    return _dot4xn(2, keys, q, acc, (keys, r0, q, ha, hb, acc, at), first_row=True, ahead_rows=KEY_ROWS_AHEAD)


@intrinsic
def _keys_by_1_head(typingctx, keys, r0, q, ha, acc, at):
    """`_keys_by_4_heads` for one head (`_dot4x1_into`)."""
    return _dot4xn(1, keys, q, acc, (keys, r0, q, ha, acc, at), first_row=True, ahead_rows=KEY_ROWS_AHEAD)


@njit(nogil=True, cache=True, fastmath=True)
def _score_block(keys, r0, q, h0, heads, acc, at):
    """acc[at + s, k] += head h0+s of q . key r0+k of keys, for a head block's s < heads."""
    if heads >= 4:
        _keys_by_4_heads(keys, r0, q, h0, h0 + 1, h0 + 2, h0 + 3, acc, at)
    elif heads == 3:
        _keys_by_3_heads(keys, r0, q, h0, h0 + 1, h0 + 2, acc, at)
    elif heads == 2:
        _keys_by_2_heads(keys, r0, q, h0, h0 + 1, acc, at)
    else:
        _keys_by_1_head(keys, r0, q, h0, acc, at)


@njit(nogil=True, cache=True, fastmath=True)
def _weighted_stripe(probs, values, j0, j1, c0, acc, pf_row, pf_first, pf_end):
    """acc[:, c0:c0 + w] += probs [4, >= j1] times the value rows j0..j1-1, w = min(64, d - c0),
    prefetching columns pf_first..pf_end-1 of the rows from pf_row on, as many lines a key as it
    reads."""
    left = acc.shape[1] - c0
    if left >= 64:
        _weighted_range4(probs, values, j0, j1, c0, acc, pf_row, pf_first, pf_end)
    elif left == 48:
        _weighted_range3(probs, values, j0, j1, c0, acc, pf_row, pf_first, pf_end)
    elif left == 32:
        _weighted_range2(probs, values, j0, j1, c0, acc, pf_row, pf_first, pf_end)
    else:
        _weighted_range1(probs, values, j0, j1, c0, acc, pf_row, pf_first, pf_end)


_SUM_LANES = 16
"""Running sums (and maxima) a softmax row keeps, key j going to sum j % 16 for the whole blocks
of 16 keys, the sums then added in lane order and the last keys after them: sixteen chains
instead of one (the sum of a 4096-key row was 4096 dependent additions), in an order fixed
in the code, so a compiled and a cached kernel still agree."""


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
        whole = length - length % _SUM_LANES
        lanes = np.full(_SUM_LANES, -np.inf, dtype=np.float32)
        for j0 in range(0, whole, _SUM_LANES):
            for lane in range(_SUM_LANES):
                lanes[lane] = max(lanes[lane], probs[s, j0 + lane])
        m = np.float32(-np.inf)
        for lane in range(_SUM_LANES):
            m = max(m, lanes[lane])
        for j in range(whole, length):
            m = max(m, probs[s, j])
        for j in range(length):
            probs[s, j] = exp_f32(probs[s, j] - m)
        lanes[:] = 0.0
        for j0 in range(0, whole, _SUM_LANES):
            for lane in range(_SUM_LANES):
                lanes[lane] += probs[s, j0 + lane]
        total = np.float32(0.0)
        for lane in range(_SUM_LANES):
            total += lanes[lane]
        for j in range(whole, length):
            total += probs[s, j]
        inv = np.float32(1.0) / total
        for j in range(length):
            probs[s, j] *= inv


TOKENS_PER_TASK = 4
"""Consecutive tokens in a prompt's work item: each key and value row read from L3 once for the
item's 4 x (query heads of its key/value head) rows, not once per token and block of four heads
as before; level in speed, the passes being mostly FMA-bound (docs/benchmarks.md, "Decode
attention"), but one work item serves prompts and decode alike."""

_OPTS = dict(nogil=True, cache=True, fastmath=True)


@njit(**_OPTS)
def _scores_of_keys(q, t0, t1, start, keys, kvh, group, per_kv, first, end, scores, base, pad):
    """scores[i, base + hb][4b + s, k] += head s of head block hb (of key/value head kvh) of token
    t0 + i of q [T, Hq, d] . key 4b + k, for key blocks first..end-1 that reach no further than
    the token's position (start + t0 + i); each block of keys dotted with every token's head
    blocks while it sits in L1, the rows KEY_ROWS_AHEAD on prefetched by the dots. pad [4, d]:
    zeros, for the cache's last rows when its last block of four runs past them."""
    rows = keys.shape[0]
    for b in range(first, end):
        j = 4 * b
        block, r0 = keys, j
        if j + 4 > rows:
            pad[:rows - j] = keys[j:rows]
            block, r0 = pad, 0
        for i in range(t1 - t0):
            if j > start + t0 + i:
                continue
            for hb in range(per_kv):
                h0 = kvh * group + 4 * hb
                _score_block(block, r0, q[t0 + i], h0, min(4, kvh * group + group - h0), scores[i, base + hb], j)


@njit(**_OPTS)
def _softmax_of(scores, i, blk, group, per_kv, length, scale, probs):
    """Token i's probabilities for head block blk (global: key/value head blk // per_kv) from its scores."""
    h0 = (blk // per_kv) * group + 4 * (blk % per_kv)
    heads = min(4, (blk // per_kv) * group + group - h0)
    _softmax_rows(scores[i, blk].reshape((scores.shape[2] // 4, 4, 4)), heads, length, scale, probs[i, blk])


@njit(**_OPTS)
def _weighted_values(probs, values, t0, t1, start, kvh, group, per_kv, base, first, end, out):
    """out[t0 + i, head, c] for key/value head kvh's query heads, tokens t0..t1-1 and the columns
    of stripes first..end-1: a piece of KEYS_PER_PIECE keys at a time through every stripe,
    token and head block (the piece's value rows read from memory once); probs[i, base + hb]."""
    d = values.shape[1]
    n = t1 - t0
    acc = np.zeros((n, per_kv, 4, d), dtype=np.float32)
    # while the stripes go over a piece, the next piece's rows (their columns of these stripes)
    # are asked for in the order they lie, each stripe's pass a share of them
    pf_first, pf_end = first * STRIPE, min(d, end * STRIPE)
    for j0 in range(0, start + t1, KEYS_PER_PIECE):
        for stripe in range(first, end):
            pf_row = j0 + KEYS_PER_PIECE + (stripe - first) * KEYS_PER_PIECE // (end - first)
            for i in range(n):
                j1 = min(start + t0 + i + 1, j0 + KEYS_PER_PIECE)
                for hb in range(per_kv):
                    if j1 > j0:
                        _weighted_stripe(probs[i, base + hb], values, j0, j1, stripe * STRIPE, acc[i, hb], pf_row,
                                         pf_first, pf_end)
    for i in range(n):
        for hb in range(per_kv):
            h0 = kvh * group + 4 * hb
            for s in range(min(4, kvh * group + group - h0)):
                for c in range(first * STRIPE, min(d, end * STRIPE)):
                    out[t0 + i, h0 + s, c] = acc[i, hb, s, c]


@njit(**_OPTS)
def _attend_tokens(q, t0, t1, start, k_cache, v_cache, kvh, group, per_kv, scale, out):
    """Tokens t0..t1-1 of q [T, Hq, d] at positions start + t, all query heads of key/value head kvh."""
    d = q.shape[2]
    n = t1 - t0
    key_blocks = (start + t1 + 3) // 4
    scores = np.zeros((n, per_kv, 4 * key_blocks, 4), dtype=np.float32)
    pad = np.zeros((4, d), dtype=np.float32)
    _scores_of_keys(q, t0, t1, start, k_cache[kvh], kvh, group, per_kv, 0, key_blocks, scores, 0, pad)
    probs = np.empty((n, per_kv, 4, 4 * key_blocks), dtype=np.float32)
    for i in range(n):
        for hb in range(per_kv):
            _softmax_of(scores, i, hb, group, per_kv, start + t0 + i + 1, scale, probs)
    _weighted_values(probs, v_cache[kvh], t0, t1, start, kvh, group, per_kv, 0, 0, (d + STRIPE - 1) // STRIPE, out)


@njit(**dict(_OPTS, parallel=True))
def attention_tiles(q, k_cache, v_cache, start, out):
    """Causal GQA attention for T new tokens at positions start..start+T-1, as `dense.attention`
    (q [T, Hq, d]; k_cache, v_cache [Hkv, maxT, d] already holding the new tokens; out
    [T, Hq, d]), head_dim a multiple of 16. Each step takes one key/value head's query heads for
    the blocks of TOKENS_PER_TASK tokens b and B-1-b, so that every step has about the same keys
    to read."""
    t_count, n_heads, d = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    per_kv = (group + 3) // 4
    scale = np.float32(1.0 / math.sqrt(d))
    blocks = (t_count + TOKENS_PER_TASK - 1) // TOKENS_PER_TASK
    half = (blocks + 1) // 2
    for step in prange(n_kv * half):
        kvh = step // half
        pair = step % half
        t0 = pair * TOKENS_PER_TASK
        _attend_tokens(q, t0, min(t_count, t0 + TOKENS_PER_TASK), start, k_cache, v_cache, kvh, group, per_kv, scale,
                       out)
        other = blocks - 1 - pair
        if other != pair:
            t0 = other * TOKENS_PER_TASK
            _attend_tokens(q, t0, min(t_count, t0 + TOKENS_PER_TASK), start, k_cache, v_cache, kvh, group, per_kv,
                           scale, out)
