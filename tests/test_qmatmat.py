"""Several tokens at once: prompt projections against float64, grouped experts against decode."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from tierlab.engine import quant as Q
from tierlab.engine.kernels import qmatmat
from tierlab.engine.kernels.qmatmat import _TOKENS_PER_PASS, expert_matmat, experts_matmat, matmat
from tierlab.engine.kernels.qmatvec import EXPERT_FORWARD, expert_forward_tokens


def _weights(kind: str, rows: int, cols: int, rng) -> tuple[tuple, np.ndarray]:
    """(kernel operands, the float64 matrix they stand for)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "bf16":
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        return (bits,), (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    nbits = 8 if kind == "int8" else 4
    q, s = Q.quantize(w, nbits)
    packed = Q.pack_weights(q, nbits).reshape(rows, -1)
    return (packed if nbits == 4 else packed.view(np.int8), s), Q.dequantize(q, s)


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 2, 7])
def test_matmat_matches_float64(kind, tokens):
    rng = np.random.default_rng(tokens)
    rows, cols = 37, 256  # a partial last block of rows
    parts, ref_w = _weights(kind, rows, cols, rng)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    got = matmat(kind, parts, x)
    ref = x.astype(np.float64) @ ref_w.T
    assert got.shape == (tokens, rows)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("tokens", [1, 5])
def test_bf16_matmat_of_columns_not_a_multiple_of_16(tokens):
    """Rows whose length no 16-lane pass divides (a bf16 matrix may have any width) take the
    two-token pass: still within 1e-5 of float64."""
    rng = np.random.default_rng(10 + tokens)
    parts, ref_w = _weights("bf16", 21, 72, rng)
    x = rng.standard_normal((tokens, 72)).astype(np.float32)
    ref = x.astype(np.float64) @ ref_w.T
    assert np.abs(matmat("bf16", parts, x) - ref).max() <= 1e-5 * np.abs(ref).max()


def _blob(kind: str, hidden: int, inter: int, rng) -> np.ndarray:
    gate, up, down = (rng.standard_normal(s).astype(np.float32) * 0.2
                      for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
    if kind in ("int8", "int4"):
        return Q.build_blob(gate, up, down, 8 if kind == "int8" else 4)
    if kind == "bf16":
        return np.concatenate([(m.view(np.uint32) >> 16).astype(np.uint16).reshape(-1) for m in (gate, up, down)]).view(np.uint8)
    return np.concatenate([m.reshape(-1) for m in (gate, up, down)]).view(np.uint8)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("hidden, inter", [(128, 64), (192, 128)])
def test_expert_tokens_are_bit_identical_to_one_token_at_a_time(kind, hidden, inter):
    """The kernel a prompt's grouped experts use gives each token exactly what decode gives it,
    so grouping (which depends on the cache size) never changes a result."""
    rng = np.random.default_rng(5)
    blob = _blob(kind, hidden, inter, rng)
    x = rng.standard_normal((5, hidden)).astype(np.float32)
    got = expert_forward_tokens(kind, blob, hidden, inter, x)
    alone = expert_forward_tokens(kind, blob, hidden, inter, x[2:3])
    np.testing.assert_array_equal(alone[0], got[2])
    for t in range(5):
        y = np.zeros(hidden, dtype=np.float32)
        EXPERT_FORWARD[kind](blob, hidden, inter, x[t], y, 1.0)
        np.testing.assert_array_equal(got[t], y)


def _dequantized(kind: str, blob: np.ndarray, hidden: int, inter: int) -> tuple[np.ndarray, ...]:
    """gate, up, down of a blob as float64, read back through the layout's own views."""
    from tierlab.engine.kernels.qmatvec import quant_matrices, raw_matrices

    if kind in ("fp32", "bf16"):
        mats = raw_matrices(blob, kind, hidden, inter)
        return tuple((m.astype(np.uint32) << 16).view(np.float32).astype(np.float64) if kind == "bf16"
                     else m.astype(np.float64) for m in mats)
    bits = 8 if kind == "int8" else 4
    qg, sg, qu, su, qd, sd = quant_matrices(blob, bits, hidden, inter)
    out = []
    for q, s in ((qg, sg), (qu, su), (qd, sd)):
        rows, cols = q.shape[0], s.shape[1] * 64
        out.append(Q.dequantize(Q.unpack_weights(np.ascontiguousarray(q), rows, cols, bits), s))
    return tuple(out)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_expert_matmat_matches_float64(kind, tokens):
    """A prompt's grouped expert (matrix-matrix products) against numpy in float64."""
    hidden, inter = 192, 128
    rng = np.random.default_rng(11)
    blob = _blob(kind, hidden, inter, rng)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    got = expert_matmat(kind, blob, hidden, inter, x)
    gate, up, down = _dequantized(kind, blob, hidden, inter)
    xd = x.astype(np.float64)
    g, u = xd @ gate.T, xd @ up.T
    ref = (g / (1 + np.exp(-g)) * u) @ down.T
    assert got.shape == (tokens, hidden)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("kind", ["bf16", "int4"])
def test_matmat_gives_a_token_the_same_bits_whatever_the_prompt_length(kind):
    """Tokens go through the kernel two or four at a time: a token's row of the product is the
    same whether its pass is full, it is alone at the end, or the prompt is one token longer."""
    rng = np.random.default_rng(2)
    parts, _ = _weights(kind, 40, 128, rng)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    full = matmat(kind, parts, x)
    for n in (2, 3, 5):
        np.testing.assert_array_equal(matmat(kind, parts, x[:n]), full[:n])


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_matmat_gives_a_token_the_same_bits_in_any_slot_of_a_pass(kind):
    """With four tokens a pass (AVX-512) every slot takes the same additions: a token moved one
    slot (the prompt one token shorter at the front) keeps its bits; with two a pass, two slots."""
    rng = np.random.default_rng(3)
    parts, _ = _weights(kind, 40, 256, rng)
    x = rng.standard_normal((11, 256)).astype(np.float32)
    full = matmat(kind, parts, x)
    for shift in range(1, 4) if _TOKENS_PER_PASS == 4 else (2,):
        np.testing.assert_array_equal(matmat(kind, parts, x[shift:]), full[shift:])


def _one_token(kind: str, blob: np.ndarray, hidden: int, inter: int, x: np.ndarray) -> np.ndarray:
    """Decode's result for each row of x, one token at a time."""
    y = np.zeros((x.shape[0], hidden), dtype=np.float32)
    for t in range(x.shape[0]):
        EXPERT_FORWARD[kind](blob, hidden, inter, x[t], y[t], 1.0)
    return y


@pytest.mark.parametrize("kind, hidden, inter", [(kind, h, i) for kind in ("fp32", "bf16", "int8", "int4")
                                                  for h, i in ((128, 64), (192, 128))]
                         + [("bf16", 72, 40), ("fp32", 72, 40)])  # widths 16 does not divide: two tokens a pass
def test_experts_matmat_matches_the_one_token_kernels(kind, hidden, inter):
    """Several experts in one launch, with odd, single and repeated tokens, each output row
    where the caller asks: every row within 1e-5 relative of decode's kernel."""
    rng = np.random.default_rng(hidden + inter)
    blobs = [_blob(kind, hidden, inter, rng) for _ in range(4)]
    x = rng.standard_normal((9, hidden)).astype(np.float32)
    token_rows = [[0, 3, 5], [7], list(range(9)), [2, 2, 8, 1, 4]]
    order = rng.permutation(sum(len(r) for r in token_rows)).tolist()
    out_rows, at = [], 0
    for rows in token_rows:
        out_rows.append(order[at:at + len(rows)])
        at += len(rows)
    out = np.full((at, hidden), np.nan, dtype=np.float32)
    experts_matmat(kind, blobs, hidden, inter, x, token_rows, out, out_rows)
    for blob, rows, dest in zip(blobs, token_rows, out_rows):
        want = _one_token(kind, blob, hidden, inter, x[rows])
        assert np.abs(out[dest] - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("kind", ["bf16", "int4"])
def test_an_experts_rows_do_not_depend_on_its_batch(kind):
    """An expert's outputs are the same bits alone or among other experts, in any position of
    the batch: which experts a prompt's read batches hold never changes a result."""
    hidden, inter = 128, 64
    rng = np.random.default_rng(4)
    blobs = [_blob(kind, hidden, inter, rng) for _ in range(3)]
    x = rng.standard_normal((7, hidden)).astype(np.float32)
    token_rows = [[1, 2, 3], [0, 4, 5, 6, 1], [6]]
    alone = []
    for blob, rows in zip(blobs, token_rows):
        y = np.empty((len(rows), hidden), dtype=np.float32)
        experts_matmat(kind, [blob], hidden, inter, x, [rows], y, [list(range(len(rows)))])
        alone.append(y)
    out = np.empty((9, hidden), dtype=np.float32)
    order = [2, 0, 1]
    dest, at = {}, 0
    for e in order:
        dest[e] = list(range(at, at + len(token_rows[e])))
        at += len(token_rows[e])
    experts_matmat(kind, [blobs[e] for e in order], hidden, inter, x, [token_rows[e] for e in order], out,
                   [dest[e] for e in order])
    for e in range(3):
        np.testing.assert_array_equal(out[dest[e]], alone[e])


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("run", [1, 2, 3])
def test_dealt_items_cover_every_item_once_and_split_round_robin(threads, run):
    """The experts' launches deal their work items round-robin in runs: over the padded steps
    each item comes exactly once, and each thread's contiguous share of steps holds every
    `threads`-th run of `run` consecutive items (so about its share of each expert)."""
    for n_items in (1, 2, 5, 7, 64, 129, 4096):
        steps = qmatmat._dealt_steps(n_items, threads, run)
        share = steps // threads
        dealt = [qmatmat._dealt(i, n_items, threads, run) for i in range(steps)]
        assert sorted(w for w in dealt if w < n_items) == list(range(n_items))
        assert all((w // run) % threads == i // share for i, w in enumerate(dealt))
        nxt = [qmatmat._dealt_next(i, dealt[i], n_items, threads, run) for i in range(steps) if dealt[i] < n_items]
        assert all(0 <= w < n_items for w in nxt)


@pytest.mark.parametrize("kind", ["bf16", "int4"])
def test_experts_outputs_do_not_depend_on_the_threads_or_how_items_are_dealt(kind):
    """The same bits with one thread and with two, and dealt for 1-5 threads: a work item
    writes only its own outputs, in a fixed order."""
    hidden, inter = 128, 64
    rng = np.random.default_rng(9)
    blobs = [_blob(kind, hidden, inter, rng) for _ in range(5)]
    x = rng.standard_normal((11, hidden)).astype(np.float32)
    token_rows = [[0, 3, 5], [7, 8, 9, 10, 1], list(range(11)), [2, 8, 1, 4, 6, 5], [9, 10, 0, 1, 2]]
    n = sum(map(len, token_rows))
    out_rows, at = [], 0
    for rows in token_rows:
        out_rows.append(list(range(at, at + len(rows))))
        at += len(rows)
    results = []
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            out = np.full((n, hidden), np.nan, dtype=np.float32)
            experts_matmat(kind, blobs, hidden, inter, x, token_rows, out, out_rows)
            results.append(out)
    finally:
        numba.set_num_threads(before)
    nbytes = qmatmat.blob_nbytes(kind, hidden, inter)
    bases = np.array([b.ctypes.data for b in blobs], np.intp)
    starts = np.cumsum([0] + [len(r) for r in token_rows]).astype(np.int64)
    rows = np.array([r for rs in token_rows for r in rs], np.int64)
    width, h_width = qmatmat._chunk_width(hidden), qmatmat._chunk_width(inter)
    xs = np.empty((hidden // width, n, width), np.float32)
    qmatmat.gather_chunked(x, rows, width, xs)
    for deal in range(1, 6):
        hs = np.empty((inter // h_width, n, h_width), np.float32)
        out = np.full((n, hidden), np.nan, dtype=np.float32)
        qmatmat.experts_gate_up(qmatmat._MARKERS[kind], bases, nbytes, hidden, inter, xs, starts, hs, deal)
        qmatmat.experts_down(qmatmat._MARKERS[kind], bases, nbytes, hidden, inter, hs, starts, out,
                             np.arange(n, dtype=np.int64), deal)
        results.append(out)
    for out in results[1:]:
        np.testing.assert_array_equal(out, results[0])


def test_experts_matmat_refuses_a_short_blob_and_rows_out_of_range():
    hidden, inter = 128, 64
    rng = np.random.default_rng(0)
    blob = _blob("int4", hidden, inter, rng)
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    out = np.empty((3, hidden), dtype=np.float32)
    with pytest.raises(ValueError, match="needs"):
        experts_matmat("int4", [blob[:-1]], hidden, inter, x, [[0]], out, [[0]])
    with pytest.raises(ValueError, match="out of range"):
        experts_matmat("int4", [blob], hidden, inter, x, [[3]], out, [[0]])
    with pytest.raises(ValueError, match="out of range"):
        experts_matmat("int4", [blob], hidden, inter, x, [[0]], out, [[3]])
