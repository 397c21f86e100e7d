"""A RowStack's token product in one launch gives every row the bits its own part's matvec gives it."""

import numpy as np
import pytest

from tierlab.engine.kernels import qmatvec
from tierlab.engine.kernels.dense import linear
from tierlab.engine.qlinear import RowStack, quantize_matrix


def _bf16(rng, rows, cols):
    return (rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _plain(kind, rng, rows, cols):
    return _bf16(rng, rows, cols) if kind == "bf16" else rng.standard_normal((rows, cols), dtype=np.float32)


def _own_matvec(part, x):
    """The part's product by its own kernel (as a RowStack computed it before)."""
    out = np.empty(part.shape[0], np.float32)
    if isinstance(part, np.ndarray):
        (qmatvec.matvec_bf16 if part.dtype == np.uint16 else qmatvec.matvec_fp32)(part, x, out)
    else:
        (qmatvec.matvec_int4 if part.bits == 4 else qmatvec.matvec_int8)(part.q, part.scales, x, out)
    return out


@pytest.mark.parametrize("plain", ["bf16", "fp32"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [(64, 256, 1), (5, 38, 0), (3, 4, 6), (0, 9, 2), (8, 1, 0)])
def test_one_launch_gives_each_row_its_own_parts_bits(plain, bits, rows):
    rng = np.random.default_rng(sum(rows) + bits)
    cols = 192
    ra, rb, rc = rows
    parts = [_plain(plain, rng, ra, cols), quantize_matrix(rng.standard_normal((rb, cols), dtype=np.float32), bits)]
    if rc:
        parts.append(_plain(plain, rng, rc, cols))
    stack = RowStack(parts)
    assert stack.one_launch is not None
    x = rng.standard_normal(cols, dtype=np.float32)
    want = np.concatenate([_own_matvec(p, x) if p.shape[0] else np.empty(0, np.float32) for p in parts])
    got = linear(stack, x)
    assert got.shape == (ra + rb + rc,)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(linear(stack, x[None, :]), want[None, :])  # a [1, H] token too


def test_parts_that_do_not_fit_one_launch_keep_a_launch_each():
    rng = np.random.default_rng(0)
    q = quantize_matrix(rng.standard_normal((8, 128), dtype=np.float32), 4)
    bf, f32 = _bf16(rng, 4, 128), rng.standard_normal((4, 128), dtype=np.float32)
    assert qmatvec.stack_parts([bf, q, f32]) is None  # plain parts of two kinds
    assert qmatvec.stack_parts([q, bf]) is None  # quantised first
    assert qmatvec.stack_parts([bf, q, bf, q]) is None
    assert qmatvec.stack_parts([bf[:, ::2], q]) is None  # not contiguous (and other columns)
    mixed = RowStack([bf, q, f32])
    x = rng.standard_normal(128, dtype=np.float32)
    np.testing.assert_array_equal(linear(mixed, x), np.concatenate([_own_matvec(p, x) for p in mixed.parts]))


def test_a_wrong_x_is_refused_not_read_out_of_bounds():
    rng = np.random.default_rng(1)
    stack = RowStack([_bf16(rng, 4, 128), quantize_matrix(rng.standard_normal((8, 128), dtype=np.float32), 4)])
    with pytest.raises(ValueError):
        qmatvec.matvec_stack(*stack.one_launch, np.zeros(64, np.float32), np.empty(12, np.float32))
