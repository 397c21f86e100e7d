"""x written as base-128 digits for the integer dot products, against a NumPy reading of the layout.

Why: every int4 and int8 matvec reads x through these digits, units and offsets
(engine/kernels/qmatvec.py, the note above _VNNI); the preparation is emitted
as vector code a group at a time, so it is checked here element by element,
not only through the matvecs' tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from tierlab.engine.kernels import qmatvec as K

pytestmark = pytest.mark.skipif(not K._integer_dots(4), reason="this CPU computes int4 with floats: x is not prepared")

STEPS = 126 * 128 * 128


def _integers(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(X, u per group): X = x / u rounded half away from zero, u = the group's largest |x| / STEPS."""
    groups = x.reshape(-1, 64)
    top = np.abs(groups).max(axis=1)
    u = (top.astype(np.float64) / STEPS).astype(np.float32)
    u[u < np.finfo(np.float32).tiny] = 0
    inv = np.zeros_like(u)
    inv[u > 0] = np.float32(1) / u[u > 0]
    v = groups * inv[:, None]  # float32 products
    half = np.float32(0.5)
    X = np.where(v >= 0, v + half, v - half).astype(np.int32)  # truncation toward zero
    return X, u


def _digits(X: np.ndarray) -> list[np.ndarray]:
    d2 = ((X + 64) & 127) - 64
    rest = (X - d2) >> 7
    d1 = ((rest + 64) & 127) - 64
    return [(rest - d1) >> 7, d1, d2]


def _expected(x: np.ndarray, bits: int):
    X, u = _integers(x)
    n = X.shape[0]
    d = _digits(X)
    if bits == 8:
        digits = np.stack(d, axis=1).astype(np.int8).ravel()  # per group: d0 x 64, d1 x 64, d2 x 64
        unit = np.repeat(u, 16)
        corr = 128 * X.reshape(n, 16, 4).sum(axis=2, dtype=np.int64)
        return digits, unit, corr.astype(np.int32).ravel()
    blocks = (n + 1) // 2
    digits = np.zeros((blocks, 3, 2, 64), np.int8)  # block, digit, low / high nibbles' x, 32 bytes per group
    unit = np.zeros((blocks, 16), np.float32)
    corr = np.zeros((blocks, 16), np.int64)
    for g in range(n):
        b, h = divmod(g, 2)
        for k in range(3):
            digits[b, k, 0, 32 * h: 32 * h + 32] = d[k][g, :32]
            digits[b, k, 1, 32 * h: 32 * h + 32] = d[k][g, 32:]
        unit[b, 8 * h: 8 * h + 8] = u[g]
        corr[b, 8 * h: 8 * h + 8] = 8 * (X[g, :32] + X[g, 32:]).reshape(8, 4).sum(axis=1)
    return digits.ravel(), unit.ravel(), corr.astype(np.int32).ravel()


def _cases(rng):
    yield "normal", rng.standard_normal(64 * 9, dtype=np.float32)
    yield "one group", rng.standard_normal(64, dtype=np.float32)
    wide = rng.standard_normal(64 * 6, dtype=np.float32) * np.float32(10) ** rng.integers(-30, 30, 64 * 6).astype(np.float32)
    yield "magnitudes 1e-30..1e30", wide
    zeros = rng.standard_normal(64 * 5, dtype=np.float32)
    zeros[64:128] = 0  # a zero group
    zeros[192:256] = np.float32(1e-39)  # a group below the smallest normal unit: counted as zero
    zeros[300] = -0.0
    yield "zero and subnormal groups", zeros
    yield "ties", np.round(rng.standard_normal(64 * 4) * 8).astype(np.float32) / 8


@pytest.mark.parametrize("bits", [4, 8])
def test_prepared_digits_units_and_offsets_are_the_layout(bits):
    rng = np.random.default_rng(bits)
    for label, x in _cases(rng):
        digits, unit, corr = K._prepare_x(x, bits)
        want_digits, want_unit, want_corr = _expected(x, bits)
        np.testing.assert_array_equal(unit.view(np.int32), want_unit.view(np.int32), err_msg=label)
        np.testing.assert_array_equal(corr, want_corr, err_msg=label)
        np.testing.assert_array_equal(digits, want_digits, err_msg=label)


def test_the_digits_give_back_x_to_within_a_unit():
    x = np.random.default_rng(3).standard_normal(64 * 7, dtype=np.float32) * np.float32(3)
    digits, unit, _corr = K._prepare_x(x, 8)
    d = digits.reshape(7, 3, 64).astype(np.int64)
    X = d[:, 0] * 128 * 128 + d[:, 1] * 128 + d[:, 2]
    assert np.abs(d[:, 1:]).max() <= 64 and np.abs(d[:, 0]).max() <= 126 and np.abs(X).max() <= STEPS
    u = unit.reshape(7, 16)[:, :1].astype(np.float64)
    err = np.abs(X * u - x.reshape(7, 64))
    # half a step, plus x * (1 / u) rounded to float32 before it is rounded to a step: near
    # the top of the range (2^20..2^21 steps) float32 is 1/8 of a step apart
    assert (err <= 0.75 * u).all()
    assert np.abs(X).max(axis=1).min() == STEPS  # each group's largest |x| lands on the top step
