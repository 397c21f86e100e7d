"""Decode's attention: one new token's query heads against the KV cache, each key and value read once.

Why: the token-by-token kernel (`dense.attention`) ran one task per query head, so the
eight query heads of a Qwen3.6 key/value head each read that head's keys and values
again, one dot and one horizontal sum per key: 1.8 ms for one layer at 4096 positions
(16 query / 2 KV heads of 256), about 9 GB/s of distinct cache. The prompt's tiles
(`prompt_attention.attention_tiles`) with one token run four tasks that each read a whole
key/value head. Here one token's attention runs as three parallel passes over the cache:

1. scores, by ranges of keys: each block of four keys is dotted with every block of four
   query heads of its key/value head while it sits in L1;
2. the softmax, one task per block of four heads;
3. the weighted sum of the value rows, by stripes of 64 columns.

Every pass uses the tiles' own operations on the same blocks (`_dot4x4_into` and its
narrower forms, `_softmax_rows`, `_weighted_rows4`), and each output element is one chain
of FMAs over the keys in order whichever stripe computes it, so a decoded token gets the
bits a prompt's token gets at its position (tests/test_decode_attention.py): decode and
prompt attention agree bit for bit, with or without PREFILL_EXACT.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from tierlab.engine.kernels.prompt_attention import _f32_matrix, _softmax_rows, _weighted_rows_codegen
from tierlab.engine.kernels.qmatmat import _dot4xn, _prefetch_lines

KEY_BLOCKS_PER_TASK = 64
"""Blocks of four keys in one scores task (256 keys: 256 KiB of keys at head_dim 256), so that a
long cache gives every thread many tasks and a short one few launches' worth of work."""

STRIPE = 64
"""Columns of the value rows in one task of the weighted sum (`_weighted_rows4`'s width)."""

KEYS_PER_PIECE = 64
"""Keys of a value stripe that every head block takes in turn (16 KiB at 64 columns: in L1),
so that a stripe is read from memory once for all the query heads of its key/value head."""

KEY_ROWS_AHEAD = 16
VALUE_ROWS_AHEAD = 32
"""How far ahead the passes prefetch the cache's rows (into L2, as the matvecs do): without it
the keys' pass read a 4096-position cache 25% slower; of 8, 16 and 32 rows ahead for keys and
16 or 32 for values, these were best (docs/benchmarks.md, "Decode attention")."""


def _weighted_range(chunks, p, v, j0, j1, c0, acc):
    if not (_f32_matrix(p) and _f32_matrix(v) and _f32_matrix(acc)):
        return None
    return types.none(p, v, j0, j1, c0, acc), _weighted_rows_codegen(chunks, ranged=True, ahead=VALUE_ROWS_AHEAD)


@intrinsic
def _weighted_range4(typingctx, p, v, j0, j1, c0, acc):
    """acc[s, c0:c0+64] += p[s, j] * v[j, c0:c0+64] for keys j = j0..j1-1 in order, s = 0..3
    (`prompt_attention._weighted_rows4` in pieces), prefetching VALUE_ROWS_AHEAD rows on."""
    return _weighted_range(4, p, v, j0, j1, c0, acc)


@intrinsic
def _weighted_range3(typingctx, p, v, j0, j1, c0, acc):
    """`_weighted_range4` for 48 columns."""
    return _weighted_range(3, p, v, j0, j1, c0, acc)


@intrinsic
def _weighted_range2(typingctx, p, v, j0, j1, c0, acc):
    """`_weighted_range4` for 32 columns."""
    return _weighted_range(2, p, v, j0, j1, c0, acc)


@intrinsic
def _weighted_range1(typingctx, p, v, j0, j1, c0, acc):
    """`_weighted_range4` for 16 columns."""
    return _weighted_range(1, p, v, j0, j1, c0, acc)


@intrinsic
def _keys_by_4_heads(typingctx, keys, r0, q, ha, hb, hc, hd, acc, at):
    """acc[at + s, k] += key r0+k of keys . head h_s of q, s = 0..3: `qmatmat._dot4x4_into` on rows
    r0..r0+3 of the whole key matrix (the same sums)."""
    return _dot4xn(4, keys, q, acc, (keys, r0, q, ha, hb, hc, hd, acc, at), first_row=True)


@intrinsic
def _keys_by_3_heads(typingctx, keys, r0, q, ha, hb, hc, acc, at):
    """`_keys_by_4_heads` for three heads (`_dot4x3_into`)."""
    return _dot4xn(3, keys, q, acc, (keys, r0, q, ha, hb, hc, acc, at), first_row=True)


@intrinsic
def _keys_by_2_heads(typingctx, keys, r0, q, ha, hb, acc, at):
    """`_keys_by_4_heads` for two heads (`_dot4x2_into_lanes`)."""
    return _dot4xn(2, keys, q, acc, (keys, r0, q, ha, hb, acc, at), first_row=True)


@intrinsic
def _keys_by_1_head(typingctx, keys, r0, q, ha, acc, at):
    """`_keys_by_4_heads` for one head (`_dot4x1_into`)."""
    return _dot4xn(1, keys, q, acc, (keys, r0, q, ha, acc, at), first_row=True)


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
def _weighted_stripe(probs, values, j0, j1, c0, acc):
    """acc[:, c0:c0 + w] += probs [4, >= j1] times the value rows j0..j1-1, w = min(64, d - c0)."""
    left = acc.shape[1] - c0
    if left >= 64:
        _weighted_range4(probs, values, j0, j1, c0, acc)
    elif left == 48:
        _weighted_range3(probs, values, j0, j1, c0, acc)
    elif left == 32:
        _weighted_range2(probs, values, j0, j1, c0, acc)
    else:
        _weighted_range1(probs, values, j0, j1, c0, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _scores_of_keys(q, keys, kvh, group, per_kv, first, end, scores, pad):
    """scores[kvh's head block hb][4b + s, k] += head s of the block . key 4b + k, for key blocks
    first..end-1 of one key/value head's keys; each block of keys dotted with every head block
    while it sits in L1, the rows KEY_ROWS_AHEAD on prefetched. pad [4, d]: zeros, for the
    cache's last rows when its last block of four runs past them (as the tiles read it)."""
    rows = keys.shape[0]
    d = keys.shape[1]
    for b in range(first, end):
        j = 4 * b
        block, r0 = keys, j
        if j + 4 > rows:
            pad[:rows - j] = keys[j:rows]
            block, r0 = pad, 0
        elif KEY_ROWS_AHEAD and j + KEY_ROWS_AHEAD + 4 <= rows:
            _prefetch_lines(keys, j + KEY_ROWS_AHEAD, 4, 0, 4 * d // 16)
        for hb in range(per_kv):
            h0 = kvh * group + 4 * hb
            _score_block(block, r0, q, h0, min(4, kvh * group + group - h0), scores[kvh * per_kv + hb], j)


@njit(nogil=True, cache=True, fastmath=True)
def _softmax_block(scores, blk, group, per_kv, length, scale, probs):
    """Head block blk's probabilities from its scores (`_softmax_rows`, the tiles' softmax)."""
    h0 = (blk // per_kv) * group + 4 * (blk % per_kv)
    heads = min(4, (blk // per_kv) * group + group - h0)
    _softmax_rows(scores[blk].reshape((scores.shape[1] // 4, 4, 4)), heads, length, scale, probs[blk])


@njit(nogil=True, cache=True, fastmath=True)
def _weighted_values(probs, values, kvh, group, per_kv, length, first, end, out):
    """out[head, c] for one key/value head's query heads and the columns of stripes first..end-1:
    a piece of KEYS_PER_PIECE keys at a time through every stripe and head block (the piece's
    value rows read from memory once), each sum one chain of FMAs over the keys in order."""
    d = values.shape[1]
    acc = np.zeros((per_kv, 4, d), dtype=np.float32)
    for j0 in range(0, length, KEYS_PER_PIECE):
        j1 = min(length, j0 + KEYS_PER_PIECE)
        for stripe in range(first, end):
            for hb in range(per_kv):
                _weighted_stripe(probs[kvh * per_kv + hb], values, j0, j1, stripe * STRIPE, acc[hb])
    for hb in range(per_kv):
        h0 = kvh * group + 4 * hb
        for s in range(min(4, kvh * group + group - h0)):
            for i in range(first * STRIPE, min(d, end * STRIPE)):
                out[h0 + s, i] = acc[hb, s, i]


@njit(nogil=True, cache=True, fastmath=True, parallel=True)
def attention_decode(q, k_cache, v_cache, pos, out, threads):
    """Causal GQA attention of one token at position `pos`: q [Hq, d]; k_cache, v_cache
    [Hkv, maxT, d] already holding its key and value; out [Hq, d]; d a multiple of 16;
    `threads`: the pool's thread count (`qmatvec._thread_count`; the split of the last pass).
    Scores scaled by 1/sqrt(d) and softmaxed in float32, as `attention_tiles` does them.
    A cache of up to one scores task's keys takes one launch, a task per key/value head
    (three launches cost more than such a cache's reads); a longer one the three passes."""
    n_heads, d = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    per_kv = (group + 3) // 4  # blocks of (up to) four query heads per key/value head
    head_blocks = n_kv * per_kv
    length = pos + 1
    key_blocks = (length + 3) // 4
    scale = np.float32(1.0 / math.sqrt(d))
    stripes = (d + STRIPE - 1) // STRIPE
    # each head block's scores as the tiles keep them ([key block, head, key]): rows 4b..4b+3 for block b
    scores = np.zeros((head_blocks, 4 * key_blocks, 4), dtype=np.float32)
    probs = np.empty((head_blocks, 4, key_blocks * 4), dtype=np.float32)

    if key_blocks <= KEY_BLOCKS_PER_TASK:
        for kvh in prange(n_kv):
            pad = np.zeros((4, d), dtype=np.float32)
            _scores_of_keys(q, k_cache[kvh], kvh, group, per_kv, 0, key_blocks, scores, pad)
            for blk in range(kvh * per_kv, (kvh + 1) * per_kv):
                _softmax_block(scores, blk, group, per_kv, length, scale, probs)
            _weighted_values(probs, v_cache[kvh], kvh, group, per_kv, length, 0, stripes, out)
        return

    ranges = (key_blocks + KEY_BLOCKS_PER_TASK - 1) // KEY_BLOCKS_PER_TASK
    for task in prange(n_kv * ranges):
        kvh = task // ranges
        first = (task % ranges) * KEY_BLOCKS_PER_TASK
        pad = np.zeros((4, d), dtype=np.float32)
        _scores_of_keys(q, k_cache[kvh], kvh, group, per_kv, first, min(key_blocks, first + KEY_BLOCKS_PER_TASK),
                        scores, pad)
    for blk in prange(head_blocks):
        _softmax_block(scores, blk, group, per_kv, length, scale, probs)
    # a task per key/value head, or per part of its stripes where there are more threads than heads
    split = min(stripes, max(1, threads // n_kv))
    for task in prange(n_kv * split):
        kvh = task // split
        part = task % split
        _weighted_values(probs, v_cache[kvh], kvh, group, per_kv, length, part * stripes // split,
                         (part + 1) * stripes // split, out)
