"""A DeltaNet layer's decode step in one compiled call (`deltanet_step`) gives the bits of
its three kernels called one by one from Python, as the layer called them before: the
output, the conv state and the recurrent state, for every kind of projection weights."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tierlab.engine import quant as Q
from tierlab.engine.kernels.deltanet_step import deltanet_step, pass_operands
from tierlab.engine.kernels.dense import gated_deltanet, linear
from tierlab.engine.qlinear import QuantMatrix, RowStack

K_HEADS, V_HEADS, DK, DV, HIDDEN = 2, 4, 64, 64, 256
C = 2 * K_HEADS * DK + V_HEADS * DV
SPLITS = (C, C + V_HEADS * DV, C + V_HEADS * DV + V_HEADS)
ROWS_IN = SPLITS[2] + V_HEADS


def _weights(kind: str, rows: int, cols: int, rng: np.random.Generator):
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if kind == "fp32":
        return w
    if kind == "bf16":
        return w.astype(ml_dtypes.bfloat16).view(np.uint16)
    bits = 4 if kind == "int4" else 8
    q, s = Q.quantize(w, bits)
    return QuantMatrix(Q.pack_int4(q) if bits == 4 else q.astype(np.int8), s, bits)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
def test_one_call_gives_the_three_calls_bits(kind):
    rng = np.random.default_rng(["fp32", "bf16", "int8", "int4"].index(kind))
    w_in, w_out = _weights(kind, ROWS_IN, HIDDEN, rng), _weights(kind, HIDDEN, V_HEADS * DV, rng)
    f = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    taps, a_log = f(4, C, s=0.5), np.log(rng.random(V_HEADS) * 8 + 0.5).astype(np.float32)
    dt_bias, norm_w = f(V_HEADS, s=0.5), f(DV, s=0.2)
    conv, state = f(3, C, s=0.1), f(V_HEADS, DK, DV, s=0.1)
    conv_ref, state_ref = conv.copy(), state.copy()
    for token in range(3):  # the states carry from one token to the next
        x = f(HIDDEN)
        y = linear(w_in, x[None, :])
        c, zc, bc = SPLITS
        core = np.empty((1, V_HEADS * DV), np.float32)
        gated_deltanet(np.ascontiguousarray(y[:, :c]), conv_ref, taps, np.ascontiguousarray(y[:, c:zc]),
                       np.ascontiguousarray(y[:, zc:bc]), np.ascontiguousarray(y[:, bc:]), a_log, dt_bias, norm_w,
                       np.float32(1e-6), state_ref, K_HEADS, V_HEADS, DK, DV, core)
        expected = linear(w_out, core)
        got = deltanet_step(pass_operands(w_in), pass_operands(w_out), SPLITS, x, conv, taps, a_log, dt_bias,
                            norm_w, 1e-6, state, (K_HEADS, V_HEADS, DK, DV))
        assert got.shape == (1, HIDDEN) and got.dtype == np.float32
        assert got.tobytes() == expected.tobytes(), token
        assert conv.tobytes() == conv_ref.tobytes() and state.tobytes() == state_ref.tobytes(), token
        assert np.abs(expected).max() > 0


def test_mixed_kinds_take_the_three_calls():
    rng = np.random.default_rng(5)
    stack = RowStack([_weights("int4", 64, HIDDEN, rng), _weights("bf16", 8, HIDDEN, rng)])
    assert pass_operands(stack) is None
    assert pass_operands(np.zeros((4, 64), np.float32)[:, ::2]) is None  # not contiguous
    q = _weights("int8", 8, HIDDEN, rng)
    assert pass_operands(q)[0] is q.q and pass_operands(q)[1] is q.scales
