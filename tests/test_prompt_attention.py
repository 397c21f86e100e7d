"""The prompt's tiled attention: decode's attention within float32 rounding, a token's bits
independent of how the prompt was cut and of the thread count."""

import numba
import numpy as np
import pytest

from test_attention_kernel import _reference
from tierlab.engine.kernels.dense import attention
from tierlab.engine.kernels.prompt_attention import attention_tiles


def _case(rng, t_count, start, n_heads, n_kv, d, capacity):
    q = rng.standard_normal((t_count, n_heads, d), dtype=np.float32)
    k = rng.standard_normal((n_kv, capacity, d), dtype=np.float32)
    v = rng.standard_normal((n_kv, capacity, d), dtype=np.float32)
    return q, k, v


# (T, start, query heads, kv heads, head_dim, cache rows): every head-block size 1-4 (groups of
# 1, 2, 3, 5, 8), head_dims that take each column pass (16, 48, 64 + 32, 256), and caches whose
# last block of four keys runs past their rows (start + T = rows, rows not a multiple of 4)
SHAPES = [
    (7, 0, 4, 2, 16, 8),
    (33, 5, 2, 1, 64, 38),
    (9, 3, 12, 4, 48, 13),
    (20, 0, 10, 2, 96, 22),
    (6, 11, 8, 8, 32, 17),
    (40, 0, 16, 2, 256, 41),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_tiles_match_the_token_kernel_and_float64(shape):
    t_count, start = shape[0], shape[1]
    q, k, v = _case(np.random.default_rng(sum(shape)), *shape)
    tiled = np.full(q.shape, np.nan, dtype=np.float32)
    token = np.empty(q.shape, dtype=np.float32)
    attention_tiles(q, k, v, start, tiled)
    attention(q, k, v, start, token)
    ref = _reference(q, k, v, start)
    scale = np.abs(ref).max()
    assert np.isfinite(tiled).all()
    assert np.abs(tiled - ref).max() <= 1e-5 * scale
    assert np.abs(tiled - token).max() <= 1e-5 * scale


def test_a_tokens_bits_do_not_depend_on_the_cut_or_the_threads():
    """A prompt in one launch, in two, or token by token, on one thread or all: the same bits
    for every token (its output depends on its query, position and the cache only)."""
    q, k, v = _case(np.random.default_rng(7), 29, 0, 8, 2, 64, 29)
    whole = np.empty(q.shape, dtype=np.float32)
    attention_tiles(q, k, v, 0, whole)
    cut = np.empty(q.shape, dtype=np.float32)
    attention_tiles(np.ascontiguousarray(q[:12]), k, v, 0, cut[:12])
    attention_tiles(np.ascontiguousarray(q[12:]), k, v, 12, cut[12:])
    assert np.array_equal(whole, cut)
    single = np.empty(q.shape, dtype=np.float32)
    for t in range(q.shape[0]):
        attention_tiles(np.ascontiguousarray(q[t:t + 1]), k, v, t, single[t:t + 1])
    assert np.array_equal(whole, single)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = np.empty(q.shape, dtype=np.float32)
        attention_tiles(q, k, v, 0, one)
    finally:
        numba.set_num_threads(threads)
    assert np.array_equal(whole, one)


def test_keys_past_the_position_change_nothing():
    """Cache rows after a token's position (a longer sequence rewound, or rows not yet
    written) are read in the last block of four but never weigh in."""
    q, k, v = _case(np.random.default_rng(3), 10, 0, 4, 1, 32, 16)
    first = np.empty(q.shape, dtype=np.float32)
    attention_tiles(q, k, v, 0, first)
    k[:, 10:] = 1e30
    v[:, 10:] = np.nan
    second = np.empty(q.shape, dtype=np.float32)
    attention_tiles(q, k, v, 0, second)
    assert np.array_equal(first, second)


CHILD = """
import sys
import numpy as np
from tierlab.engine.kernels.prompt_attention import attention_tiles
rng = np.random.default_rng(5)
q = rng.standard_normal((21, 8, 80), dtype=np.float32)
k = rng.standard_normal((2, 23, 80), dtype=np.float32)
v = rng.standard_normal((2, 23, 80), dtype=np.float32)
out = np.empty_like(q)
attention_tiles(q, k, v, 2, out)
np.save(sys.argv[1], out)
"""


def test_a_process_that_compiles_and_one_that_loads_give_the_same_bits(tmp_path):
    """Blocks of four heads and both column passes (80 = 64 + 16), in a process with an empty
    kernel cache and in one loading what it wrote, against this process's own result
    (tests/test_cached_kernels_bits.py does the same for a whole prompt of the shipped model,
    whose two heads go as one block of two)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TIERLAB_NUMBA_CACHE_DIR"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    outs = []
    for name in ("compiled", "loaded"):
        path = tmp_path / f"{name}.npy"
        done = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        outs.append(np.load(path, allow_pickle=False))
    rng = np.random.default_rng(5)
    q = rng.standard_normal((21, 8, 80), dtype=np.float32)
    k = rng.standard_normal((2, 23, 80), dtype=np.float32)
    v = rng.standard_normal((2, 23, 80), dtype=np.float32)
    here = np.empty_like(q)
    attention_tiles(q, k, v, 2, here)
    assert np.isfinite(here).all()
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], here)
