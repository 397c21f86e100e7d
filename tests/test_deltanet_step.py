"""A DeltaNet layer's decode step in one compiled call (`deltanet_step`) gives the bits of
its three kernels called one by one from Python, as the layer called them before: the
output, the conv state and the recurrent state, for every kind of projection weights."""

from __future__ import annotations

import numpy as np
import pytest

from tierlab.engine.kernels.deltanet_step import deltanet_step
from tierlab.engine.kernels.dense import gated_deltanet, linear, rmsnorm
from tierlab.engine.qlinear import RowStack, pass_operands
from weight_kinds import KINDS, random_weights

K_HEADS, V_HEADS, DK, DV, HIDDEN = 2, 4, 64, 64, 256
C = 2 * K_HEADS * DK + V_HEADS * DV
SPLITS = (C, C + V_HEADS * DV, C + V_HEADS * DV + V_HEADS)
ROWS_IN = SPLITS[2] + V_HEADS


@pytest.mark.parametrize("kind", KINDS)
def test_one_call_gives_the_three_calls_bits(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    w_in, w_out = random_weights(kind, ROWS_IN, HIDDEN, rng), random_weights(kind, HIDDEN, V_HEADS * DV, rng)
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


@pytest.mark.parametrize("kind", KINDS)
def test_residual_mode_gives_the_layers_calls_bits(kind):
    """With norms, the input norm, the step, the residual add and the post norm in one call
    give the bits of `Engine._mixer_half`'s general path, and the residual stream's."""
    rng = np.random.default_rng(KINDS.index(kind) + 30)
    w_in, w_out = random_weights(kind, ROWS_IN, HIDDEN, rng), random_weights(kind, HIDDEN, V_HEADS * DV, rng)
    f = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    taps, a_log = f(4, C, s=0.5), np.log(rng.random(V_HEADS) * 8 + 0.5).astype(np.float32)
    dt_bias, norm_w = f(V_HEADS, s=0.5), f(DV, s=0.2)
    in_norm, post_norm = 1.0 + f(HIDDEN, s=0.1), 1.0 + f(HIDDEN, s=0.1)
    conv, state = f(3, C, s=0.1), f(V_HEADS, DK, DV, s=0.1)
    conv_ref, state_ref = conv.copy(), state.copy()
    args = (SPLITS, taps, a_log, dt_bias, norm_w, 1e-6)
    for token in range(3):
        x = f(1, HIDDEN)
        x_ref = x.copy()
        h = rmsnorm(x_ref, in_norm, 1e-6)
        x_ref += deltanet_step(pass_operands(w_in), pass_operands(w_out), SPLITS, h[0], conv_ref, *args[1:],
                               state_ref, (K_HEADS, V_HEADS, DK, DV))
        expected = rmsnorm(x_ref, post_norm, 1e-6)
        got = deltanet_step(pass_operands(w_in), pass_operands(w_out), SPLITS, x, conv, *args[1:], state,
                            (K_HEADS, V_HEADS, DK, DV), norms=(in_norm, post_norm, 1e-6))
        assert got.shape == (1, HIDDEN) and got.tobytes() == expected.tobytes(), token
        assert x.tobytes() == x_ref.tobytes(), token
        assert conv.tobytes() == conv_ref.tobytes() and state.tobytes() == state_ref.tobytes(), token


def test_mixed_kinds_take_the_three_calls():
    rng = np.random.default_rng(5)
    stack = RowStack([random_weights("int4", 64, HIDDEN, rng), random_weights("bf16", 8, HIDDEN, rng)])
    assert pass_operands(stack) is None
    assert pass_operands(np.zeros((4, 64), np.float32)[:, ::2]) is None  # not contiguous
    q = random_weights("int8", 8, HIDDEN, rng)
    assert pass_operands(q)[0] is q.q and pass_operands(q)[1] is q.scales
