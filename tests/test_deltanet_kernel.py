"""The Gated DeltaNet kernel gives the same bits wherever its arrays lie in memory.

LLVM guards each vectorised loop with a check that its arrays do not overlap
and falls back to a scalar copy of the loop when two of them lie within a
vector's width of each other; the heap places a layer's buffers side by side
more or less often depending on what other threads allocate, so a loop whose
two versions round differently makes the logits timing-dependent.
"""

from __future__ import annotations

import numpy as np
import pytest

from tierlab.engine.kernels.deltanet_prompt import STATE_COLUMNS, gated_deltanet_prompt, gated_deltanet_prompt_exact
from tierlab.engine.kernels.dense import gated_deltanet

K_HEADS, V_HEADS, DK, DV = 2, 4, 16, 16
CHANNELS = 2 * K_HEADS * DK + V_HEADS * DV


def _inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    return {"mixed": f(1, CHANNELS), "conv": f(3, CHANNELS, s=0.1), "taps": f(4, CHANNELS, s=0.5),
            "z": f(1, V_HEADS * DV, s=3.0), "b": f(1, V_HEADS), "a": f(1, V_HEADS),
            "a_log": np.log(rng.random(V_HEADS) * 8 + 0.5).astype(np.float32), "dt_bias": f(V_HEADS, s=0.5),
            "norm_w": f(DV, s=0.2), "state": f(V_HEADS, DK, DV, s=0.1)}


def _run(inp: dict, z: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    state = inp["state"].copy()
    gated_deltanet(inp["mixed"], inp["conv"].copy(), inp["taps"], z, inp["b"], inp["a"], inp["a_log"],
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


def _prompt_inputs(tokens: int, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    inp = _inputs(seed)
    f = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    inp.update(mixed=f(tokens, CHANNELS), z=f(tokens, V_HEADS * DV, s=3.0), b=f(tokens, V_HEADS), a=f(tokens, V_HEADS))
    return inp


def _call(kernel, inp: dict, rows: slice, conv: np.ndarray, state: np.ndarray) -> np.ndarray:
    n = len(range(*rows.indices(inp["mixed"].shape[0])))
    out = np.empty((n, V_HEADS * DV), np.float32)
    kernel(np.ascontiguousarray(inp["mixed"][rows]), conv, inp["taps"], np.ascontiguousarray(inp["z"][rows]),
           np.ascontiguousarray(inp["b"][rows]), np.ascontiguousarray(inp["a"][rows]), inp["a_log"], inp["dt_bias"],
           inp["norm_w"], np.float32(1e-6), state, K_HEADS, V_HEADS, DK, DV, out)
    return out


def test_prompt_kernel_is_bit_identical_to_token_by_token_decode():
    """A prompt's heads-outermost kernel gives every token, and the state after the last one,
    exactly what feeding the tokens one at a time through the decode kernel gives."""
    inp = _prompt_inputs(13)
    conv_p, state_p = inp["conv"].copy(), inp["state"].copy()
    got = _call(gated_deltanet_prompt_exact, inp, slice(0, 13), conv_p, state_p)
    conv_d, state_d = inp["conv"].copy(), inp["state"].copy()
    for t in range(13):
        one = _call(gated_deltanet, inp, slice(t, t + 1), conv_d, state_d)
        np.testing.assert_array_equal(got[t], one[0])
    np.testing.assert_array_equal(state_p, state_d)
    np.testing.assert_array_equal(conv_p, conv_d)


@pytest.mark.parametrize("kernel", [gated_deltanet_prompt, gated_deltanet_prompt_exact], ids=["fast", "exact"])
def test_prompt_kernel_matches_a_float64_delta_rule(kernel):
    """The recurrence itself, written out in float64 numpy: conv + SiLU, L2-normalised q and k,
    S = decay * S + k (beta (v - decay S^T k))^T, o = S^T q, gated RMSNorm."""
    inp = _prompt_inputs(9, seed=3)
    conv, state = inp["conv"].copy(), inp["state"].copy()
    got = _call(kernel, inp, slice(0, 9), conv, state)
    f8 = lambda v: np.asarray(v, np.float64)  # noqa: E731
    hist = np.concatenate([f8(inp["conv"]), f8(inp["mixed"])])
    S = f8(inp["state"]).copy()
    key = K_HEADS * DK
    for t in range(9):
        pre = (hist[t:t + 4] * f8(inp["taps"])).sum(0)
        x = pre / (1 + np.exp(-pre))
        q = x[:key].reshape(K_HEADS, DK)
        k = x[key:2 * key].reshape(K_HEADS, DK)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(DK)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        v = x[2 * key:].reshape(V_HEADS, DV)
        for h in range(V_HEADS):
            hk = h // (V_HEADS // K_HEADS)
            beta = 1 / (1 + np.exp(-f8(inp["b"][t, h])))
            a = f8(inp["a"][t, h]) + f8(inp["dt_bias"][h])
            decay = np.exp(-np.exp(f8(inp["a_log"][h])) * np.log1p(np.exp(a)))
            delta = beta * (v[h] - decay * S[h].T @ k[hk])
            S[h] = decay * S[h] + np.outer(k[hk], delta)
            o = S[h].T @ q[hk]
            zt = f8(inp["z"][t, h * DV:(h + 1) * DV])
            ref = f8(inp["norm_w"]) * o / np.sqrt((o * o).mean() + 1e-6) * zt / (1 + np.exp(-zt))
            np.testing.assert_allclose(got[t, h * DV:(h + 1) * DV], ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, S, rtol=1e-4, atol=1e-6)


def test_fast_prompt_kernel_agrees_with_the_exact_one_across_state_blocks_and_calls():
    """Value heads wider than one block of state columns (two full blocks and a partial one),
    a prompt fed in two calls: every output and the final conv and recurrent state agree with
    the exact kernel within float32 rounding."""
    kh, vh, dk, dv, tokens = 2, 4, 24, 2 * STATE_COLUMNS + 8, 21
    channels = 2 * kh * dk + vh * dv
    rng = np.random.default_rng(5)
    f = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    mixed, z, b, a = f(tokens, channels), f(tokens, vh * dv, s=3.0), f(tokens, vh), f(tokens, vh)
    conv0, taps, state0 = f(3, channels, s=0.1), f(4, channels, s=0.5), f(vh, dk, dv, s=0.1)
    a_log, dt_bias, norm_w = np.log(rng.random(vh) * 8 + 0.5).astype(np.float32), f(vh, s=0.5), f(dv, s=0.2)

    def run(kernel, cuts):
        conv, state = conv0.copy(), state0.copy()
        outs = []
        for lo, hi in cuts:
            out = np.empty((hi - lo, vh * dv), np.float32)
            c = lambda v: np.ascontiguousarray(v[lo:hi])  # noqa: E731
            kernel(c(mixed), conv, taps, c(z), c(b), c(a), a_log, dt_bias, norm_w, np.float32(1e-6), state,
                   kh, vh, dk, dv, out)
            outs.append(out)
        return np.concatenate(outs), conv, state

    exact, conv_e, state_e = run(gated_deltanet_prompt_exact, [(0, tokens)])
    for cuts in ([(0, tokens)], [(0, 2), (2, tokens)], [(0, 1), (1, 13), (13, tokens)]):
        got, conv, state = run(gated_deltanet_prompt, cuts)
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state, state_e, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(conv, conv_e)
