"""A prompt's few-token experts in one launch pair: each token decode's bits, whatever the batch."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from tierlab.engine.kernels import experts_tokens as ET
from tierlab.engine.kernels.qmatmat import expert_batch
from tierlab.engine.kernels.experts_tokens import experts_tokens
from tierlab.engine.kernels.qmatvec import EXPERT_FORWARD, expert_forward_tokens

from test_qmatmat import _blob

KINDS = ["fp32", "bf16", "int8", "int4"]


def _batch(token_rows: list[list[int]], rng) -> tuple[list[list[int]], int]:
    """Output rows for each expert's tokens, shuffled over the whole batch (as a prompt's are)."""
    order = rng.permutation(sum(map(len, token_rows))).tolist()
    out_rows, at = [], 0
    for rows in token_rows:
        out_rows.append(order[at:at + len(rows)])
        at += len(rows)
    return out_rows, at


@pytest.mark.parametrize("kind", KINDS)
# (74, 41): rows left over in both halves (an odd gate|up row, two down rows) and columns past 16-lane steps
@pytest.mark.parametrize("hidden, inter", [(128, 64), (192, 128), (74, 41)])
def test_each_token_gets_the_one_token_kernels_bits(kind, hidden, inter):
    """Several experts with single, repeated and overlapping tokens (and one with none): every
    output row bit for bit what `expert_forward_tokens` and decode's kernel give that token."""
    if kind in ("int8", "int4") and (hidden % 64 or inter % 64):
        pytest.skip("quantised experts need whole groups of 64 columns")
    rng = np.random.default_rng(hidden + inter)
    blobs = [_blob(kind, hidden, inter, rng) for _ in range(5)]
    x = rng.standard_normal((9, hidden)).astype(np.float32)
    token_rows = [[0, 3, 5], [7], list(range(9)), [], [2, 2, 8, 1]]
    out_rows, n = _batch(token_rows, rng)
    out = np.full((n, hidden), np.nan, dtype=np.float32)
    experts_tokens(kind, blobs, hidden, inter, x, token_rows, out, out_rows)
    for blob, rows, dest in zip(blobs, token_rows, out_rows):
        if not rows:
            continue
        np.testing.assert_array_equal(out[dest], expert_forward_tokens(kind, blob, hidden, inter, x[rows]))
        y = np.zeros(hidden, dtype=np.float32)
        EXPERT_FORWARD[kind](blob, hidden, inter, x[rows[-1]], y, 1.0)
        np.testing.assert_array_equal(out[dest[-1]], y)


@pytest.mark.parametrize("kind", ["bf16", "int4"])
def test_the_same_bits_with_any_thread_count_and_dealing(kind):
    """A work item writes only its own rows: one thread, two, and items dealt for 1-5 threads agree."""
    hidden, inter = 128, 64
    rng = np.random.default_rng(3)
    blobs = [_blob(kind, hidden, inter, rng) for _ in range(4)]
    x = rng.standard_normal((11, hidden)).astype(np.float32)
    token_rows = [[0, 3, 5], [7, 8, 9, 10, 1], list(range(11)), [6]]
    out_rows, n = _batch(token_rows, rng)
    results = []
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            out = np.full((n, hidden), np.nan, dtype=np.float32)
            experts_tokens(kind, blobs, hidden, inter, x, token_rows, out, out_rows)
            results.append(out)
    finally:
        numba.set_num_threads(before)
    out = np.empty((n, hidden), dtype=np.float32)
    nbytes, bases, starts, tokens, dest = expert_batch("test", kind, blobs, hidden, inter, x, token_rows, out, out_rows)
    marker, bits = ET._MARKERS[kind], ET._BITS[kind]
    for deal in range(1, 6):
        h = np.empty((n, inter), np.float32)
        out = np.full((n, hidden), np.nan, dtype=np.float32)
        ET.experts_tokens_gate_up(marker, bases, nbytes, hidden, inter, x, *ET._prepared(x, bits), tokens, starts, h,
                                  deal)
        ET.experts_tokens_down(marker, bases, nbytes, hidden, inter, h, *ET._prepared(h, bits), starts, out, dest, deal)
        results.append(out)
    for out in results[1:]:
        np.testing.assert_array_equal(out, results[0])


def test_refuses_a_short_blob_and_rows_out_of_range():
    hidden, inter = 128, 64
    blob = _blob("int4", hidden, inter, np.random.default_rng(0))
    x = np.zeros((3, hidden), dtype=np.float32)
    out = np.empty((3, hidden), dtype=np.float32)
    with pytest.raises(ValueError, match="needs"):
        experts_tokens("int4", [blob[:-1]], hidden, inter, x, [[0]], out, [[0]])
    with pytest.raises(ValueError, match="out of range"):
        experts_tokens("int4", [blob], hidden, inter, x, [[3]], out, [[0]])
    with pytest.raises(ValueError, match="out of range"):
        experts_tokens("int4", [blob], hidden, inter, x, [[0]], out, [[3]])

