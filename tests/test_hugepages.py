"""Weight buffers on huge pages behave as ordinary numpy arrays."""

from __future__ import annotations

import numpy as np

from tierlab.engine import hugepages


def test_large_buffers_are_writable_contiguous_arrays_that_keep_their_mapping():
    a = hugepages.empty((3, hugepages.MIN_HUGE_BYTES // 4), np.float32)
    assert a.shape == (3, hugepages.MIN_HUGE_BYTES // 4) and a.dtype == np.float32
    assert a.flags["C_CONTIGUOUS"] and a.flags["WRITEABLE"]
    a[:] = 2.5
    row = a[1]
    del a  # the row view keeps the mapping alive
    assert float(row.sum()) == 2.5 * row.size


def test_small_buffers_and_row_concatenation():
    small = hugepages.empty((4, 4), np.uint16)
    assert small.shape == (4, 4) and small.dtype == np.uint16
    parts = [np.arange(6, dtype=np.int8).reshape(2, 3), np.full((1, 3), -1, np.int8)]
    np.testing.assert_array_equal(hugepages.concat_rows(parts), np.concatenate(parts))
    big = [np.ones((hugepages.MIN_HUGE_BYTES // 8, 2), np.float32), np.zeros((5, 2), np.float32)]
    np.testing.assert_array_equal(hugepages.concat_rows(big), np.concatenate(big))
