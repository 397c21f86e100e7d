"""A prompt's int4 and int8 projections by integer tiles (`dense_vnni`) against float64, and the
token blocks every prompt projection runs in (`qmatmat.token_blocks`) against one launch.

The integer tests run where the path runs: CPUs with AVX-512 VNNI (elsewhere `qlinear` keeps
`qmatmat.matmat`, which tests/test_qlinear.py covers).
"""

from __future__ import annotations

import numpy as np
import pytest

from tierlab.engine import qlinear as QL
from tierlab.engine.kernels import dense, dense_vnni as DV, qmatmat
from tierlab.engine.qlinear import quantize_matrix

needs_vnni = pytest.mark.skipif(not DV.usable(32, 128), reason="the integer-dot projections need AVX-512 VNNI")


def _prompt(tokens: int, cols: int, rng) -> np.ndarray:
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    x[0] *= 40.0  # a token far larger than the rest: each token and group has its own unit
    if tokens > 2:
        x[2, :64] = 0.0  # a group of zeros: its unit is 0
    return x


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows, cols, tokens", [(32, 128, 2), (96, 256, 13), (64, 384, 40), (160, 512, 300),
                                                   (33, 128, 5), (113, 256, 270)])
def test_integer_tiles_match_float64_and_qlinear_takes_them(bits, rows, cols, tokens, monkeypatch):
    rng = np.random.default_rng(rows + cols + tokens)
    m = quantize_matrix(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, bits)
    x = _prompt(tokens, cols, rng)
    out = np.full((tokens, rows), np.nan, dtype=np.float32)
    DV.matmat_integer(m.q, m.scales, x, out)
    exact = x.astype(np.float64) @ m.dequantize().astype(np.float64).T
    for t in range(tokens):
        assert np.abs(out[t] - exact[t]).max() <= 1e-5 * max(np.abs(exact[t]).max(), 1e-30)
    calls = []
    real = DV.matmat_integer
    monkeypatch.setattr(DV, "matmat_integer", lambda *a: calls.append(a[0].shape) or real(*a))
    np.testing.assert_array_equal(QL.qlinear(m, x), out)
    assert calls == [m.q.shape]


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
def test_integer_tokens_do_not_depend_on_their_neighbours_or_the_blocks(bits, monkeypatch):
    rng = np.random.default_rng(7)
    m = quantize_matrix(rng.standard_normal((64, 256)).astype(np.float32) * 0.1, bits)
    x = _prompt(11, 256, rng)
    whole = np.empty((11, 64), np.float32)
    DV.matmat_integer(m.q, m.scales, x, whole)
    monkeypatch.setattr(qmatmat, "TOKEN_BLOCK", 3)  # four launches, the last of two tokens
    blocked = np.empty_like(whole)
    DV.matmat_integer(m.q, m.scales, x, blocked)
    np.testing.assert_array_equal(blocked, whole)
    pair = np.empty((2, 64), np.float32)
    DV.matmat_integer(m.q, m.scales, np.ascontiguousarray(x[5:7]), pair)
    np.testing.assert_array_equal(pair, whole[5:7])


def test_integer_refusals():
    assert not DV.usable(16, 128) and not DV.usable(32, 192) and not DV.usable(0, 128)
    if not DV.usable(32, 128):
        return
    m = quantize_matrix(np.zeros((32, 128), np.float32), 4)
    with pytest.raises(ValueError, match="x float32"):
        DV.matmat_integer(m.q, m.scales, np.zeros((2, 64), np.float32), np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="out float32"):
        DV.matmat_integer(m.q, m.scales, np.zeros((2, 128), np.float32), np.zeros((2, 31), np.float32))
    m16 = quantize_matrix(np.zeros((16, 128), np.float32), 4)
    with pytest.raises(ValueError, match="32 rows or more"):
        DV.matmat_integer(m16.q, m16.scales, np.zeros((2, 128), np.float32), np.zeros((2, 16), np.float32))
    with pytest.raises(ValueError, match="int4 or int8 parts"):  # float weights are not integer parts
        DV.matmat_integer(np.zeros((32, 128), np.float32), m.scales, np.zeros((2, 128), np.float32),
                          np.zeros((2, 32), np.float32))


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_token_blocks_change_no_bits(kind, monkeypatch):
    """Every prompt projection kernel, run in blocks of 4 tokens (the last of 1), gives the bits
    of one launch over all 13."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((97, 256)).astype(np.float32) * 0.1  # three whole items and a row
    x = _prompt(13, 256, rng)
    if kind == "bf16":
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        run = [lambda: dense.linear(bits, x), lambda: qmatmat.matmat("bf16", (bits,), x)]
    else:
        m = quantize_matrix(w, 8 if kind == "int8" else 4)
        run = [lambda: QL.qlinear(m, x), lambda: qmatmat.matmat(kind, (m.q, m.scales), x)]
    whole = [f() for f in run]
    monkeypatch.setattr(qmatmat, "TOKEN_BLOCK", 4)
    for f, ref in zip(run, whole):
        np.testing.assert_array_equal(f(), ref)
    assert qmatmat.token_blocks(13) == [(0, 4), (4, 8), (8, 12), (12, 13)]
