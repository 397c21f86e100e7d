"""Decode's attention: one new token's query heads against the KV cache, each key and value read once.

Why: the token-by-token kernel (`dense.attention`) ran one task per query head, so the
eight query heads of a Qwen3.6 key/value head each read that head's keys and values
again, one dot and one horizontal sum per key: 1.8 ms for one layer at 4096 positions
(16 query / 2 KV heads of 256), about 9 GB/s of distinct cache. The prompt's tiles
(`prompt_attention.attention_tiles`) with one token run four tasks that each read a whole
key/value head. Here one token's attention over a long cache, with more threads than
key/value heads, runs as three parallel passes:

1. scores, by ranges of keys: each block of four keys is dotted with every block of four
   query heads of its key/value head while it sits in L1;
2. the softmax, one task per block of four heads;
3. the weighted sum of the value rows, a task per key/value head (or part of its columns),
   a piece of keys at a time through every 64-column stripe and head block.

A cache of up to KEY_BLOCKS_PER_TASK blocks of keys takes one launch instead, a task per
key/value head (the prompt's work item with one token), and so does any cache when the
threads are no more than the key/value heads: each thread then has a head's keys and values
to itself, and the three launches and the scores handed between threads cost more than they
give (at 4096 positions on two threads 10-20% slower; docs/benchmarks.md, "Decode attention:
the rows asked for in order"). Every pass uses the prompt tiles'
own functions (`prompt_attention`), and each output element is one chain of FMAs over the
keys in order whichever task computes it, so a decoded token gets the bits a prompt's token
gets at its position (tests/test_decode_attention.py): decode and prompt attention agree
bit for bit, with or without PREFILL_EXACT.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from tierlab.engine.kernels.prompt_attention import (STRIPE, _attend_tokens, _scores_of_keys, _softmax_of,
                                                     _weighted_values)

KEY_BLOCKS_PER_TASK = 64
"""Blocks of four keys in one scores task (256 keys: 256 KiB of keys at head_dim 256), so that a
long cache gives every thread many tasks and a short one few launches' worth of work."""


@njit(nogil=True, cache=True, fastmath=True, parallel=True)
def attention_decode(q, k_cache, v_cache, pos, out, threads):
    """Causal GQA attention of one token at position `pos`: q [Hq, d]; k_cache, v_cache
    [Hkv, maxT, d] already holding its key and value; out [Hq, d]; d a multiple of 16;
    `threads`: the pool's thread count (`qmatvec._thread_count`; the split of the last pass).
    Scores scaled by 1/sqrt(d) and softmaxed in float32, as `attention_tiles` does them.
    A cache of up to one scores task's keys, or any cache on no more threads than key/value
    heads, takes one launch, a task per key/value head (three launches cost more than such a
    cache's reads, or than splitting a head across threads gives); otherwise the three passes."""
    n_heads, d = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    per_kv = (group + 3) // 4  # blocks of (up to) four query heads per key/value head
    scale = np.float32(1.0 / math.sqrt(d))
    q3 = q.reshape((1, n_heads, d))
    out3 = out.reshape((1, n_heads, d))
    key_blocks = (pos + 1 + 3) // 4
    if key_blocks <= KEY_BLOCKS_PER_TASK or threads <= n_kv:
        for kvh in prange(n_kv):
            _attend_tokens(q3, 0, 1, pos, k_cache, v_cache, kvh, group, per_kv, scale, out3)
        return

    head_blocks = n_kv * per_kv
    # each head block's scores as the tiles keep them ([key block, head, key]): rows 4b..4b+3 for block b
    scores = np.zeros((1, head_blocks, 4 * key_blocks, 4), dtype=np.float32)
    ranges = (key_blocks + KEY_BLOCKS_PER_TASK - 1) // KEY_BLOCKS_PER_TASK
    for task in prange(n_kv * ranges):
        kvh = task // ranges
        first = (task % ranges) * KEY_BLOCKS_PER_TASK
        pad = np.zeros((4, d), dtype=np.float32)
        _scores_of_keys(q3, 0, 1, pos, k_cache[kvh], kvh, group, per_kv, first,
                        min(key_blocks, first + KEY_BLOCKS_PER_TASK), scores, kvh * per_kv, pad)
    probs = np.empty((1, head_blocks, 4, 4 * key_blocks), dtype=np.float32)
    for blk in prange(head_blocks):
        _softmax_of(scores, 0, blk, group, per_kv, pos + 1, scale, probs)
    # a task per key/value head, or per part of its stripes where there are more threads than heads
    stripes = (d + STRIPE - 1) // STRIPE
    split = min(stripes, max(1, threads // n_kv))
    for task in prange(n_kv * split):
        kvh = task // split
        part = task % split
        _weighted_values(probs, v_cache[kvh], 0, 1, pos, kvh, group, per_kv, kvh * per_kv, part * stripes // split,
                         (part + 1) * stripes // split, out3)
