"""Decode's attention (`decode_attention.attention_decode`): a decoded token gets the bits the
prompt's tiles give the same token, for every head-block size, head dim and cache length, on
any thread count; and the right values."""

import numba
import numpy as np
import pytest

from test_attention_kernel import _reference
from tierlab.engine.kernels.decode_attention import KEY_BLOCKS_PER_TASK, attention_decode
from tierlab.engine.kernels.prompt_attention import KEYS_PER_PIECE, TOKENS_PER_TASK, attention_tiles

LONG = 4 * KEY_BLOCKS_PER_TASK + KEYS_PER_PIECE + 3  # several scores tasks and value pieces, a ragged end

# (positions, query heads, kv heads, head_dim, cache rows): head blocks of 1-4 (groups of 1, 2,
# 3, 5, 8), head dims that end in each stripe width (16, 48, 64 + 32, 64, 256), caches whose
# last block of four keys runs past their rows, and lengths past a scores task and a value piece
SHAPES = [
    (7, 4, 2, 16, 8),
    (38, 2, 1, 64, 38),
    (13, 12, 4, 48, 13),
    (22, 10, 2, 96, 22),
    (17, 8, 8, 32, 17),
    (41, 16, 2, 256, 41),
    (LONG, 16, 2, 256, LONG),
    (LONG, 6, 2, 64, LONG + 61),
]


def _case(rng, t_count, n_heads, n_kv, d, capacity):
    q = rng.standard_normal((t_count, n_heads, d), dtype=np.float32)
    k = rng.standard_normal((n_kv, capacity, d), dtype=np.float32)
    v = rng.standard_normal((n_kv, capacity, d), dtype=np.float32)
    return q, k, v


@pytest.mark.parametrize("shape", SHAPES)
def test_a_decoded_token_gets_the_prompts_bits(shape):
    """Every position of a prompt of `positions` tokens through the tiles, then each one again as
    decode sees it (its own query, the same cache): the same bits, and float64's values."""
    q, k, v = _case(np.random.default_rng(sum(shape)), *shape)
    prompt = np.empty(q.shape, dtype=np.float32)
    attention_tiles(q, k, v, 0, prompt)
    ref = _reference(q, k, v, 0)
    scale = np.abs(ref).max()
    positions = sorted({0, 1, 2, 3, 4, q.shape[0] // 2, q.shape[0] - 2, q.shape[0] - 1})
    # a task per key/value head (threads up to their number), or the three passes (more)
    for told in sorted({1, numba.get_num_threads(), k.shape[0] + 1}):
        for pos in positions:
            one = np.full(q.shape[1:], np.nan, dtype=np.float32)
            attention_decode(np.ascontiguousarray(q[pos]), k, v, pos, one, told)
            assert np.array_equal(one, prompt[pos]), (shape, pos, told)
            assert np.abs(one - ref[pos]).max() <= 1e-5 * scale


def test_the_thread_count_changes_no_bit():
    """The value pass splits by the thread count it is given and the pool runs any number of
    threads: every split gives the same sums (each output element is one chain over the keys)."""
    q, k, v = _case(np.random.default_rng(11), LONG, 16, 2, 256, LONG)
    pos = LONG - 1
    query = np.ascontiguousarray(q[pos])
    first = np.empty(q.shape[1:], dtype=np.float32)
    attention_decode(query, k, v, pos, first, 1)
    threads = numba.get_num_threads()
    try:
        for pool in sorted({1, threads}):
            numba.set_num_threads(pool)
            for told in (2, 3, 8, 64):
                again = np.empty(q.shape[1:], dtype=np.float32)
                attention_decode(query, k, v, pos, again, told)
                assert np.array_equal(again, first), (pool, told)
    finally:
        numba.set_num_threads(threads)


def test_keys_past_the_position_change_nothing():
    """Rows after the token's position (a longer sequence rewound) are read in the last block of
    four and prefetched, never weighed in."""
    q, k, v = _case(np.random.default_rng(3), 10, 8, 2, 64, 300)
    query = np.ascontiguousarray(q[9])
    first = np.empty(q.shape[1:], dtype=np.float32)
    attention_decode(query, k, v, 9, first, 2)
    k[:, 10:] = 1e30
    v[:, 10:] = np.nan
    second = np.empty(q.shape[1:], dtype=np.float32)
    attention_decode(query, k, v, 9, second, 2)
    assert np.array_equal(first, second)


def test_a_prompt_cut_across_its_token_blocks_keeps_its_bits():
    """The tiles take TOKENS_PER_TASK tokens a work item: a prompt cut inside a block (its tokens
    now in other items, beside other tokens) gives every token the same bits as in one launch."""
    q, k, v = _case(np.random.default_rng(13), 3 * TOKENS_PER_TASK + 2, 16, 2, 256, 3 * TOKENS_PER_TASK + 2)
    whole = np.empty(q.shape, dtype=np.float32)
    attention_tiles(q, k, v, 0, whole)
    cut = TOKENS_PER_TASK + 1
    parts = np.empty(q.shape, dtype=np.float32)
    attention_tiles(np.ascontiguousarray(q[:cut]), k, v, 0, parts[:cut])
    attention_tiles(np.ascontiguousarray(q[cut:]), k, v, cut, parts[cut:])
    assert np.array_equal(whole, parts)
