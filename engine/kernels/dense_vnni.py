"""A prompt's int4 and int8 projections by the experts' integer tiles (AVX-512 VNNI).

Why: with `convert --dense-bits 4|8` a prompt's DeltaNet and attention
projections went through `qmatmat.matmat_quant`, which widens every row to
float32 and dots it four rows by four tokens with a tree of shuffles at the
end of each pass; at long prompts that is compute-bound, and the int4 + dense
int4 slice prefilled 4096 tokens more slowly than the same slice with bf16
projections (whose float tiles have no widening and no tree). Here a dense
int4 or int8 matrix runs through `experts_vnni`'s work items: 32 rows as two
tiles of 16 (lane l holds row l, as bytes), each token's x prepared once into
its three 7-bit digits, `vpdpbusd` 64 bytes at a time, and a group's scale
applied once per group, token and 16 rows.

Tokens are taken in `qmatmat.token_blocks`: a block's prepared digits (3
bytes a column a token: 1.5 MiB for 256 tokens of 2048 columns) stay in L2/L3
while every work item goes over them, and each item's tiles are built once
per block.

Exactness: the same integer sums and group scaling as the experts' tiles,
within 1e-5 relative of a float64 reference of the dequantised weights
(tests/test_dense_vnni.py); a token's results depend only on its own x, not
on the other tokens of the prompt or where the blocks fall. Not bit-identical
to the float path or to decode's matvec (neither was a prompt's projection).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tierlab.engine.kernels.experts_vnni import _BLOCK, _TILE, _TILES, _item_sums, prepared
from tierlab.engine.kernels.qmatmat import matmat_quant, rows_past_items, token_blocks
from tierlab.engine.kernels.qmatvec import _VNNI

_OPTS = dict(nogil=True, cache=True, fastmath=True)
_ITEM = _TILES * _TILE  # rows of a work item


def usable(rows: int, cols: int) -> bool:
    """True where this path runs: VNNI, whole 128-column blocks and at least one 32-row item
    (the rows after the last whole item, such as a fused router block's shared-expert gate,
    go to `qmatmat.matmat_quant`)."""
    return _VNNI and rows >= _ITEM and cols % _BLOCK == 0 and cols > 0


@njit(**dict(_OPTS, parallel=True))
def _block_items(q, s, digits, corr, unit, tokens, t0, out):
    """out[t0 + i, r] = row r of the int4 / int8 matrix (q, s) . the prepared token i, for the
    rows of the whole 32-row work items; numba's prange gives each thread a contiguous share,
    so the rows it most likely takes next (the following item) are prefetched while it
    computes."""
    n_items = q.shape[0] // _ITEM
    n_tokens = tokens.shape[0]
    blocks = s.shape[1] * 64 // _BLOCK
    for it in prange(n_items):
        r0 = it * _ITEM
        nxt = r0 + _ITEM if it + 1 < n_items else r0
        res = _item_sums(q, s, r0, q, s, r0 + _TILE, blocks, digits, corr, unit, tokens, 0, n_tokens, q, nxt, q,
                         nxt + _TILE, _TILE if nxt != r0 else 0)
        for t in range(n_tokens):
            for i in range(_ITEM):
                out[t0 + t, r0 + i] = res[t, i]


def matmat_integer(q: np.ndarray, s: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out [T, rows] = x [T, cols] @ dequant(q, s).T for int8 q [rows, cols] or planar-nibble int4
    q (uint8 [rows, cols / 2]) and scales s (float32 [rows, cols / 64]) where `usable`."""
    rows, cols = q.shape[0], s.shape[1] * 64
    bits = {np.dtype(np.uint8): 4, np.dtype(np.int8): 8}.get(q.dtype)
    if not usable(rows, cols) or bits is None or q.shape[1] * 8 != cols * bits or not q.flags.c_contiguous \
            or s.dtype != np.float32 or s.shape[0] != rows or not s.flags.c_contiguous:
        raise ValueError(f"matmat_integer needs C-contiguous int4 or int8 parts of 32 rows or more and whole "
                         f"128-column blocks on a VNNI CPU, got {q.dtype}{q.shape} and {s.dtype}{s.shape}")
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous or x.shape[1] != cols:
        raise ValueError(f"matmat_integer needs x float32[T, {cols}] (C order), got {x.dtype}{x.shape}")
    if out.shape != (x.shape[0], rows) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"matmat_integer needs out float32[{x.shape[0]}, {rows}] (C order)")
    whole = rows - rows % _ITEM
    for t0, t1 in token_blocks(x.shape[0]):
        block = np.arange(t0, t1, dtype=np.int64)
        digits, corr, unit = prepared(x, block, bits)
        _block_items(q, s, digits, corr, unit, block - t0, t0, out)
        rows_past_items(matmat_quant, (q, s), x[t0:t1], out[t0:t1], whole)
