"""The Gated DeltaNet kernel gives the same bits wherever its arrays lie in memory.

LLVM guards each vectorised loop with a check that its arrays do not overlap
and falls back to a scalar copy of the loop when two of them lie within a
vector's width of each other; the heap places a layer's buffers side by side
more or less often depending on what other threads allocate, so a loop whose
two versions round differently makes the logits timing-dependent.
"""

from __future__ import annotations

import numpy as np

from tierlab.engine.kernels.dense import gated_deltanet

K_HEADS, V_HEADS, DK, DV = 2, 4, 16, 16
CHANNELS = 2 * K_HEADS * DK + V_HEADS * DV


def _inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    return {"mixed": f(1, CHANNELS), "conv": f(3, CHANNELS, s=0.1), "conv_w": f(CHANNELS, 4, s=0.5),
            "z": f(1, V_HEADS * DV, s=3.0), "b": f(1, V_HEADS), "a": f(1, V_HEADS),
            "a_log": np.log(rng.random(V_HEADS) * 8 + 0.5).astype(np.float32), "dt_bias": f(V_HEADS, s=0.5),
            "norm_w": f(DV, s=0.2), "state": f(V_HEADS, DK, DV, s=0.1)}


def _run(inp: dict, z: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    state = inp["state"].copy()
    gated_deltanet(inp["mixed"], inp["conv"].copy(), inp["conv_w"], z, inp["b"], inp["a"], inp["a_log"],
                   inp["dt_bias"], inp["norm_w"], np.float32(1e-6), state, K_HEADS, V_HEADS, DK, DV, out)
    return out.copy(), state


def test_output_does_not_depend_on_where_out_lies_next_to_z():
    inp = _inputs()
    apart, state_apart = _run(inp, inp["z"], np.empty((1, V_HEADS * DV), np.float32))
    n = V_HEADS * DV
    for gap in range(0, 12):  # out right after z in one buffer, as the heap may place them
        buf = np.zeros(2 * n + gap, np.float32)
        z = buf[:n].reshape(1, n)
        z[...] = inp["z"]
        out, state = _run(inp, z, buf[n + gap:].reshape(1, n))
        assert np.array_equal(state, state_apart)
        assert np.array_equal(out, apart), gap
