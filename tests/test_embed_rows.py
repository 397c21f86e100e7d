"""The embedding rows in one compiled call: numpy's gather and exact bf16 widening, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from tierlab.engine.checkpoint import to_f32
from tierlab.engine.kernels.dense import embed_rows


def numpy_rows(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The way the engine gathered them before: numpy's indexing, then `to_f32`."""
    return to_f32(table[ids]).reshape(ids.shape[0], table.shape[1]).copy()


@pytest.mark.parametrize("dtype", [np.uint16, np.float32, np.float16])
@pytest.mark.parametrize("ids", [[5], [0, 99, 5, 5, 42], [-1], [-100, 3]])
def test_rows_are_numpys_bit_for_bit(dtype, ids):
    rng = np.random.default_rng(0)
    if dtype == np.uint16:  # bf16 bits of normal numbers, subnormals, zeros and infinities alike
        table = rng.integers(0, 1 << 16, size=(100, 96), dtype=np.uint16)
    else:
        table = rng.standard_normal((100, 96)).astype(dtype)
    ids = np.asarray(ids, dtype=np.int64)
    got, want = embed_rows(table, ids), numpy_rows(table, ids)
    assert got.dtype == np.float32 and got.shape == (ids.size, 96) and got.flags.c_contiguous
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_an_id_past_the_table_is_numpys_index_error():
    table = np.zeros((10, 8), dtype=np.uint16)
    with pytest.raises(IndexError):
        embed_rows(table, np.array([3, 10], dtype=np.int64))
