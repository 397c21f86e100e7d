"""A matvec's rows are split among the threads as one contiguous share per thread
(`qmatvec._pass`, SET and ADD): whatever the thread count, including more work items
than rows and rows left over after the four-row steps, every row gets the same bits,
and those bits are the float64 reference's within the kernels' bound."""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest

from tierlab.engine import quant as Q
from tierlab.engine.kernels import qmatvec as K

SHAPES = [(1, 64), (3, 128), (4, 64), (7, 192), (37, 256), (64, 128)]


def _operands(kind: str, rows: int, cols: int, rng: np.random.Generator):
    """The kernel's weight operands (qa, sa) and the float64 matrix they stand for."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "fp32":
        return w, w, w.astype(np.float64)
    if kind == "bf16":
        b = w.astype(ml_dtypes.bfloat16)
        return b.view(np.uint16), b.view(np.uint16), b.astype(np.float64)
    bits = 4 if kind == "int4" else 8
    q, s = Q.quantize(w, bits)
    packed = Q.pack_int4(q) if bits == 4 else q.astype(np.int8)
    return packed, s, Q.dequantize(q, s).astype(np.float64)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_every_thread_count_gives_the_same_bits(kind, rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    qa, sa, ref_w = _operands(kind, rows, cols, rng)
    x = rng.standard_normal(cols).astype(np.float32)
    base = rng.standard_normal(rows).astype(np.float32)
    results = {}
    for threads in (1, 2, 3, 5, 9):  # more work items than the pool's threads or the rows: still exact
        for mode, w in ((K.SET, 1.0), (K.ADD, 0.75)):
            out = base.copy()
            K._pass(qa, sa, qa, sa, x, out, mode, w, threads)
            results.setdefault(mode, []).append(out)
    for mode, outs in results.items():
        for out in outs[1:]:
            np.testing.assert_array_equal(out, outs[0])
    ref = ref_w @ x.astype(np.float64)
    scale = max(np.abs(ref).max(), 1e-30)
    assert np.abs(results[K.SET][0] - ref).max() / scale <= 1e-5
    added = base.astype(np.float64) + 0.75 * ref
    assert np.abs(results[K.ADD][0] - added).max() / max(np.abs(added).max(), 1e-30) <= 1e-5


def test_the_public_matvec_matches_one_thread():
    """`matvec_int4` as the engine calls it, on the pool's threads and on one thread."""
    rng = np.random.default_rng(7)
    qa, sa, _ = _operands("int4", 203, 512, rng)
    x = rng.standard_normal(512).astype(np.float32)
    pooled, single = np.empty(203, np.float32), np.empty(203, np.float32)
    K.matvec_int4(qa, sa, x, pooled)
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert K._thread_count() == 1
        K.matvec_int4(qa, sa, x, single)
    finally:
        numba.set_num_threads(before)
    assert K._thread_count() == before
    np.testing.assert_array_equal(pooled, single)
