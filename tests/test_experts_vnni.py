"""A prompt's int4 and int8 experts by integer dot products (`experts_vnni`) against decode and float64.

These run where the path runs: CPUs with AVX-512 VNNI (elsewhere `experts_matmat` keeps the
float path, which tests/test_qmatmat.py covers).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from tierlab.engine import quant as Q
from tierlab.engine.blob_layout import blob_nbytes
from tierlab.engine.kernels import experts_vnni as V
from tierlab.engine.kernels.qmatmat import experts_matmat
from tierlab.engine.kernels.qmatvec import EXPERT_FORWARD

pytestmark = pytest.mark.skipif(not V.usable("int4", 128, 128), reason="the integer-dot experts need AVX-512 VNNI")

SHAPES = [(128, 128), (256, 384)]  # hidden, inter: whole 128-column blocks
KINDS = ["int4", "int8"]
BITS = {"int4": 4, "int8": 8}


def _mats(hidden: int, inter: int, rng) -> tuple[np.ndarray, ...]:
    return tuple(rng.standard_normal(s).astype(np.float32) * 0.2
                 for s in ((inter, hidden), (inter, hidden), (hidden, inter)))


def _blob(kind: str, hidden: int, inter: int, rng) -> np.ndarray:
    return Q.build_blob(*_mats(hidden, inter, rng), BITS[kind])


def _float64_expert(kind: str, blob: np.ndarray, hidden: int, inter: int, x: np.ndarray) -> np.ndarray:
    """down(silu(gate x) * (up x)) in float64 on the blob's dequantised weights."""
    gate, up, down = (np.asarray(m, np.float64) for m in Q.blob_matrices(blob, BITS[kind], hidden, inter))
    x = x.astype(np.float64)
    g, u = x @ gate.T, x @ up.T
    return (g / (1.0 + np.exp(-g)) * u) @ down.T


def _one_token(kind: str, blob: np.ndarray, hidden: int, inter: int, x: np.ndarray) -> np.ndarray:
    y = np.zeros((x.shape[0], hidden), dtype=np.float32)
    for t in range(x.shape[0]):
        EXPERT_FORWARD[kind](blob, hidden, inter, x[t], y[t], 1.0)
    return y


def _batch(kind: str, hidden: int, inter: int, seed: int):
    rng = np.random.default_rng(seed)
    blobs = [_blob(kind, hidden, inter, rng) for _ in range(4)]
    x = rng.standard_normal((9, hidden)).astype(np.float32)
    x[4] *= 50.0  # a token far larger than the rest: each token and group has its own unit
    x[6, :64] = 0.0  # a group of zeros: its unit is 0
    token_rows = [[0, 3, 5], [7], list(range(9)), [2, 2, 8, 1, 4, 6]]
    order = rng.permutation(sum(len(r) for r in token_rows)).tolist()
    out_rows, at = [], 0
    for rows in token_rows:
        out_rows.append(order[at:at + len(rows)])
        at += len(rows)
    return blobs, x, token_rows, out_rows, at


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden, inter", SHAPES)
def test_integer_dot_experts_match_decode_and_float64(kind, hidden, inter):
    """Odd, single and repeated tokens, a huge token and a zero group, each output row where the
    caller asks: every row within 1e-5 relative of decode's kernel and of float64."""
    blobs, x, token_rows, out_rows, n = _batch(kind, hidden, inter, hidden + inter)
    out = np.full((n, hidden), np.nan, dtype=np.float32)
    V.experts_integer(kind, blobs, hidden, inter, x, token_rows, out, out_rows)
    for blob, rows, dest in zip(blobs, token_rows, out_rows):
        for t, d in zip(rows, dest):
            want = _one_token(kind, blob, hidden, inter, x[t:t + 1])[0]
            exact = _float64_expert(kind, blob, hidden, inter, x[t:t + 1])[0]
            assert np.abs(out[d] - want).max() <= 1e-5 * np.abs(want).max()
            assert np.abs(out[d] - exact).max() <= 1e-5 * np.abs(exact).max()


@pytest.mark.parametrize("kind", KINDS)
def test_experts_matmat_takes_the_integer_dots_where_usable(kind):
    """`experts_matmat` gives int4 and int8 experts of whole blocks these kernels' bits."""
    hidden, inter = SHAPES[1]
    blobs, x, token_rows, out_rows, n = _batch(kind, hidden, inter, 5)
    direct = np.full((n, hidden), np.nan, dtype=np.float32)
    V.experts_integer(kind, blobs, hidden, inter, x, token_rows, direct, out_rows)
    through = np.full((n, hidden), np.nan, dtype=np.float32)
    experts_matmat(kind, blobs, hidden, inter, x, token_rows, through, out_rows)
    np.testing.assert_array_equal(through, direct)


@pytest.mark.parametrize("kind", KINDS)
def test_an_experts_rows_do_not_depend_on_its_batch_the_threads_or_the_deal(kind):
    """The same bits alone or among other experts, with one thread or two, and with the work
    items dealt for 1-5 threads: an item writes only its own outputs, in a fixed order."""
    hidden, inter = SHAPES[0]
    blobs, x, token_rows, out_rows, n = _batch(kind, hidden, inter, 11)
    dest = [list(range(sum(map(len, token_rows[:e])), sum(map(len, token_rows[:e + 1])))) for e in range(4)]
    full = np.full((n, hidden), np.nan, dtype=np.float32)
    V.experts_integer(kind, blobs, hidden, inter, x, token_rows, full, dest)
    for e in range(4):
        alone = np.full((len(token_rows[e]), hidden), np.nan, dtype=np.float32)
        V.experts_integer(kind, [blobs[e]], hidden, inter, x, [token_rows[e]], alone,
                          [list(range(len(token_rows[e])))])
        np.testing.assert_array_equal(alone, full[dest[e]])
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = np.full((n, hidden), np.nan, dtype=np.float32)
        V.experts_integer(kind, blobs, hidden, inter, x, token_rows, one, dest)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(one, full)
    rows = np.array([r for rs in token_rows for r in rs], np.int64)
    starts = np.cumsum([0] + [len(r) for r in token_rows]).astype(np.int64)
    bases = np.array([b.ctypes.data for b in blobs], np.intp)
    nbytes = blob_nbytes(kind, hidden, inter)
    marker, bits = V._MARKERS[kind], BITS[kind]
    digits, corr, unit = V.prepared(x, np.arange(x.shape[0], dtype=np.int64), bits)
    pairs = np.arange(n, dtype=np.int64)
    for deal in range(1, 6):
        h = np.empty((n, inter), np.float32)
        V.gate_up_dots(marker, bases, nbytes, hidden, inter, digits, corr, unit, rows, starts, h, deal)
        hd, hc, hu = V.prepared(h, pairs, bits)
        out = np.full((n, hidden), np.nan, dtype=np.float32)
        V.down_dots(marker, bases, nbytes, hidden, inter, hd, hc, hu, pairs, starts, out, pairs, deal)
        np.testing.assert_array_equal(out, full)


def test_usable_only_for_integers_of_whole_blocks():
    assert V.usable("int4", 2048, 512) and V.usable("int8", 2048, 512)
    assert not V.usable("bf16", 2048, 512) and not V.usable("fp32", 2048, 512)
    assert not V.usable("int4", 2048, 64) and not V.usable("int8", 2048, 64)
    assert not V.usable("int4", 192, 128)


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_through_the_engine_agrees_with_the_exact_kernels(kind, tmp_path, monkeypatch):
    """An int4 / int8 container of whole-block widths (hidden 128, experts 128 wide, 4 experts,
    top-2): a 48-token prompt's experts (about 24 tokens each) run by the integer dots, and
    every position's logits are within float32 noise of PREFILL_EXACT's (decode's one-token
    kernels, held to transformers by tests/test_engine_oracle.py), with the same greedy tokens."""
    import oracle_models as om
    from tierlab.engine.container import convert
    from tierlab.engine.knobs import Knobs
    from tierlab.engine.model import load_engine

    config = om.qwen3_config(n_experts=4, top_k=2, layers=2, hidden=128)
    config.moe_intermediate_size = 128
    folder = om.save(om.build_model(config, seed=3), tmp_path / "hf")
    container = tmp_path / kind
    convert(folder, container, bits=BITS[kind])
    calls = []
    real = V.experts_integer
    monkeypatch.setattr(V, "experts_integer", lambda *a: calls.append(len(a[1])) or real(*a))
    prompt = [int(t) for t in np.random.default_rng(0).integers(2, 256, 48)]
    fast = load_engine(container, knobs=Knobs.from_env({}), with_tokenizer=False).prefill(prompt, all_logits=True)
    assert calls  # the integer dots ran
    exact = load_engine(container, knobs=Knobs.from_env(PREFILL_EXACT="1"),
                        with_tokenizer=False).prefill(prompt, all_logits=True)
    assert np.abs(fast - exact).max() <= 1e-5 * np.abs(exact).max()
    assert np.array_equal(fast.argmax(1), exact.argmax(1))
