"""fastexp: float32 exp within 2 ulp of expf, SiLU the same bits in a vectorised loop as alone."""

import numpy as np
from numba import njit

from tierlab.engine.kernels.fastexp import FAST_EXACT, exp_f32, silu_f32


@njit(fastmath=FAST_EXACT, error_model="numpy")
def _silu_loop(x, out):
    for i in range(x.shape[0]):
        out[i] = silu_f32(x[i])


@njit
def _exp_each(x, out):
    for i in range(x.shape[0]):
        out[i] = exp_f32(x[i])


def test_exp_within_two_ulp_over_the_float32_range():
    x = np.linspace(-87.0, 88.0, 200_001, dtype=np.float32)
    got = np.empty_like(x)
    _exp_each(x, got)
    ref = np.exp(x.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - ref) / ulp) <= 2.0


def test_exp_clamps_instead_of_overflowing():
    x = np.array([-1e4, -200.0, 200.0, 1e4], dtype=np.float32)
    got = np.empty_like(x)
    _exp_each(x, got)
    assert np.all(np.isfinite(got))
    assert got[0] == got[1] and 0.0 < got[0] < 1e-37  # e^-87
    assert got[2] == got[3] and got[2] > 1e38  # e^88


def test_silu_matches_float64_and_its_vector_lanes_match_a_lone_call():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(4099) * 8).astype(np.float32)  # not a multiple of any vector width
    loop = np.empty_like(x)
    _silu_loop(x, loop)
    ref = x.astype(np.float64) / (1.0 + np.exp(-x.astype(np.float64)))
    assert np.max(np.abs(loop - ref) / np.maximum(np.abs(ref), 1e-30)) < 5e-7
    alone = np.empty(1, dtype=np.float32)
    for i in (0, 1, 15, 16, 4095, 4098):  # vector body and scalar tail alike
        _silu_loop(x[i:i + 1], alone)
        assert alone[0] == loop[i]
