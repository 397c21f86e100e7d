"""A prompt's bf16 / fp32 experts and bf16 projections by float32 tiles (`float_tiles`) against float64.

These run where the path runs: CPUs with AVX-512 (elsewhere `experts_matmat` and `linear`
keep the float path, which tests/test_qmatmat.py covers).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from tierlab.engine.blob_layout import blob_nbytes
from tierlab.engine.kernels import dense
from tierlab.engine.kernels import float_tiles as F
from tierlab.engine.kernels.qmatmat import experts_matmat

pytestmark = pytest.mark.skipif(not F.usable("bf16", 128, 128), reason="the float tiles need AVX-512")

SHAPES = [(128, 128), (256, 384)]  # hidden, inter: whole 128-column blocks


def _bf16_bits(m: np.ndarray) -> np.ndarray:
    return (m.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _blob(kind: str, hidden: int, inter: int, rng) -> np.ndarray:
    mats = [rng.standard_normal(s).astype(np.float32) * 0.2 for s in ((inter, hidden), (inter, hidden), (hidden, inter))]
    raw = np.concatenate([(_bf16_bits(m) if kind == "bf16" else m).reshape(-1) for m in mats])
    blob = raw.view(np.uint8)
    assert blob.size == blob_nbytes(kind, hidden, inter)
    return blob


def _matrices(blob: np.ndarray, kind: str, hidden: int, inter: int) -> list[np.ndarray]:
    if kind == "bf16":
        flat = (blob.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        flat = blob.view(np.float32)
    n = hidden * inter
    return [flat[:n].reshape(inter, hidden).astype(np.float64), flat[n:2 * n].reshape(inter, hidden).astype(np.float64),
            flat[2 * n:].reshape(hidden, inter).astype(np.float64)]


def _float64_expert(blob, kind, hidden, inter, x) -> np.ndarray:
    gate, up, down = _matrices(blob, kind, hidden, inter)
    x = x.astype(np.float64)
    g, u = x @ gate.T, x @ up.T
    return (g / (1.0 + np.exp(-g)) * u) @ down.T


def _batch(kind: str, hidden: int, inter: int, seed: int):
    """Five experts: 3 tokens, 1, every one of 19 (two full passes of 8 and 3), a repeated
    token among 9, and 8 exactly; a token 50x the rest; output rows in a shuffled order."""
    rng = np.random.default_rng(seed)
    blobs = [_blob(kind, hidden, inter, rng) for _ in range(5)]
    x = rng.standard_normal((19, hidden)).astype(np.float32)
    x[4] *= 50.0
    token_rows = [[0, 3, 5], [7], list(range(19)), [2, 2, 8, 1, 4, 6, 11, 13, 17], list(range(8, 16))]
    n = sum(len(r) for r in token_rows)
    order = rng.permutation(n).tolist()
    out_rows, at = [], 0
    for rows in token_rows:
        out_rows.append(order[at:at + len(rows)])
        at += len(rows)
    return blobs, x, token_rows, out_rows, n


@pytest.mark.parametrize("kind", ["bf16", "fp32"])
@pytest.mark.parametrize("hidden, inter", SHAPES)
def test_tiled_experts_match_float64(kind, hidden, inter):
    """Every output row where the caller asks, within 1e-5 relative of float64 on the same weights."""
    blobs, x, token_rows, out_rows, n = _batch(kind, hidden, inter, hidden + inter)
    out = np.full((n, hidden), np.nan, dtype=np.float32)
    F.experts_tiles(kind, blobs, hidden, inter, x, token_rows, out, out_rows)
    for blob, rows, dest in zip(blobs, token_rows, out_rows):
        for t, d in zip(rows, dest):
            exact = _float64_expert(blob, kind, hidden, inter, x[t:t + 1])[0]
            assert np.abs(out[d] - exact).max() <= 1e-5 * np.abs(exact).max()


@pytest.mark.parametrize("kind", ["bf16", "fp32"])
def test_experts_matmat_takes_the_tiles_where_usable(kind):
    hidden, inter = SHAPES[1]
    blobs, x, token_rows, out_rows, n = _batch(kind, hidden, inter, 5)
    direct = np.full((n, hidden), np.nan, dtype=np.float32)
    F.experts_tiles(kind, blobs, hidden, inter, x, token_rows, direct, out_rows)
    through = np.full((n, hidden), np.nan, dtype=np.float32)
    experts_matmat(kind, blobs, hidden, inter, x, token_rows, through, out_rows)
    np.testing.assert_array_equal(through, direct)


def test_an_experts_rows_do_not_depend_on_its_batch_its_pass_the_threads_or_the_deal():
    """The same bits alone or among other experts, a token alone or in a pass of eight, with one
    thread or two, and with the work items dealt for 1-5 threads."""
    hidden, inter = SHAPES[0]
    kind = "bf16"
    blobs, x, token_rows, out_rows, n = _batch(kind, hidden, inter, 11)
    dest = [list(range(sum(map(len, token_rows[:e])), sum(map(len, token_rows[:e + 1])))) for e in range(5)]
    full = np.full((n, hidden), np.nan, dtype=np.float32)
    F.experts_tiles(kind, blobs, hidden, inter, x, token_rows, full, dest)
    for e in range(5):
        alone = np.full((len(token_rows[e]), hidden), np.nan, dtype=np.float32)
        F.experts_tiles(kind, [blobs[e]], hidden, inter, x, [token_rows[e]], alone, [list(range(len(token_rows[e])))])
        np.testing.assert_array_equal(alone, full[dest[e]])
    single = np.full((1, hidden), np.nan, dtype=np.float32)  # token 9 of expert 2, alone
    F.experts_tiles(kind, [blobs[2]], hidden, inter, x, [[9]], single, [[0]])
    np.testing.assert_array_equal(single[0], full[dest[2][9]])
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = np.full((n, hidden), np.nan, dtype=np.float32)
        F.experts_tiles(kind, blobs, hidden, inter, x, token_rows, one, dest)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(one, full)
    rows = np.array([r for rs in token_rows for r in rs], np.int64)
    starts = np.cumsum([0] + [len(r) for r in token_rows]).astype(np.int64)
    bases = np.array([b.ctypes.data for b in blobs], np.intp)
    nbytes = blob_nbytes(kind, hidden, inter)
    marker = np.empty(0, np.uint16)
    pairs = np.arange(n, dtype=np.int64)
    for deal in range(1, 6):
        h = np.empty((n, inter), np.float32)
        F.gate_up_tiles(marker, bases, nbytes, hidden, inter, x, rows, starts, h, deal)
        out = np.full((n, hidden), np.nan, dtype=np.float32)
        F.down_tiles(marker, bases, nbytes, hidden, inter, h, pairs, starts, out, pairs, deal)
        np.testing.assert_array_equal(out, full)


@pytest.mark.parametrize("rows, cols, tokens", [(32, 128, 1), (96, 256, 13), (64, 384, 40), (33, 128, 3),
                                                   (1089, 256, 6)])
def test_tiled_projection_matches_float64_and_linear_takes_it(rows, cols, tokens, monkeypatch):
    rng = np.random.default_rng(rows + cols)
    w = _bf16_bits(rng.standard_normal((rows, cols)) * 0.1)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    x[0] *= 30.0
    out = np.full((tokens, rows), np.nan, dtype=np.float32)
    F.matmat_tiles(w, x, out)
    exact = x.astype(np.float64) @ (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64).T
    for t in range(tokens):
        assert np.abs(out[t] - exact[t]).max() <= 1e-5 * np.abs(exact[t]).max()
    calls = []
    real = dense.matmat_tiles
    monkeypatch.setattr(dense, "matmat_tiles", lambda *a: calls.append(a[0].shape) or real(*a))
    if tokens > 1:
        np.testing.assert_array_equal(dense.linear(w, x), out)
        assert calls == [w.shape]


def test_usable_bounds_and_refusals():
    assert F.usable("bf16", 2048, 512) and F.usable("fp32", 2048, 512)
    assert not F.usable("int8", 2048, 512) and not F.usable("int4", 2048, 512)
    assert not F.usable("bf16", 2048, 64)  # the shipped models' experts keep the float path
    assert not F.usable("bf16", 192, 128)
    assert F.usable_dense(12288, 2048) and F.usable_dense(1089, 2048)  # a router block: tiles and a row
    assert not F.usable_dense(16, 2048) and not F.usable_dense(64, 2000)
    w = np.zeros((16, 128), np.uint16)
    with pytest.raises(ValueError, match="32 rows or more"):
        F.matmat_tiles(w, np.zeros((2, 128), np.float32), np.zeros((2, 16), np.float32))
    w = np.zeros((32, 128), np.uint16)
    with pytest.raises(ValueError, match="x float32"):
        F.matmat_tiles(w, np.zeros((2, 64), np.float32), np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="out float32"):
        F.matmat_tiles(w, np.zeros((2, 128), np.float32), np.zeros((2, 31), np.float32))


def test_a_bf16_prompt_through_the_engine_agrees_with_the_exact_kernels(tmp_path, monkeypatch):
    """A bf16 checkpoint of whole-block widths (hidden 128, experts 128 wide, 4 experts, top-2):
    a 48-token prompt's projections and experts (about 24 tokens each) run by the tiles, and
    every position's logits are within float32 noise of PREFILL_EXACT's (decode's one-token
    kernels for the experts), with the same greedy tokens."""
    import oracle_models as om
    import torch
    from tierlab.engine.knobs import Knobs
    from tierlab.engine.model import load_engine

    config = om.qwen3_config(n_experts=4, top_k=2, layers=2, hidden=128)
    config.moe_intermediate_size = 128
    folder = om.save(om.build_model(config, seed=3).to(torch.bfloat16), tmp_path / "hf")
    calls = []
    real = F.experts_tiles
    monkeypatch.setattr(F, "experts_tiles", lambda *a: calls.append(a[0]) or real(*a))
    prompt = [int(t) for t in np.random.default_rng(0).integers(2, 256, 48)]
    fast = load_engine(folder, knobs=Knobs.from_env({}), with_tokenizer=False).prefill(prompt, all_logits=True)
    assert calls and set(calls) == {"bf16"}  # the tiles ran
    exact = load_engine(folder, knobs=Knobs.from_env(PREFILL_EXACT="1"),
                        with_tokenizer=False).prefill(prompt, all_logits=True)
    assert np.abs(fast - exact).max() <= 1e-5 * np.abs(exact).max()
    assert np.array_equal(fast.argmax(1), exact.argmax(1))
