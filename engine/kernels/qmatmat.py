"""Matrix-matrix products for several tokens: a prompt's dense projections and grouped experts.

Why: a prompt multiplies every weight matrix by many tokens. Row by row,
each kernel widens one weight row to float32 once (bf16 bits, or int8/int4
times its group scale) into a scratch row that stays in L1, then dots it with
every token. The weights are read once per prompt instead of once per token,
and the widening, which is most of a quantised matvec's work, is paid once
per row. Used for the dense projections of a prompt (`linear` with T > 1).
(A prompt's experts use `qmatvec.expert_forward_tokens` instead: an expert
serves a few tokens, too few to pay for widening its rows.)

All out[t, r] = row_r . x[t] in float32, within 1e-5 relative of a float64
reference of the same (dequantised) weights; not bit-identical to the
matvecs of `qmatvec` (which scale each group's sum, not each weight).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from tierlab.engine.blob_layout import GROUP
from tierlab.engine.kernels.qmatvec import bf16_f32, wide_vectors

_F32 = ir.FloatType()


# --- widening on the byte itself, so that the vectoriser stays in 8/16/32-bit lanes ---------


@intrinsic
def _lo_nibble_f32(typingctx, b):
    """float32(b & 15) computed on the byte itself."""

    def codegen(context, builder, signature, args):
        return builder.uitofp(builder.and_(args[0], ir.Constant(ir.IntType(8), 15)), _F32)

    return types.float32(types.uint8), codegen


@intrinsic
def _hi_nibble_f32(typingctx, b):
    """float32(b >> 4) computed on the byte itself."""

    def codegen(context, builder, signature, args):
        return builder.uitofp(builder.lshr(args[0], ir.Constant(ir.IntType(8), 4)), _F32)

    return types.float32(types.uint8), codegen


@intrinsic
def _i8_f32(typingctx, b):
    """float32 of a signed byte."""

    def codegen(context, builder, signature, args):
        return builder.sitofp(args[0], _F32)

    return types.float32(types.int8), codegen


_ROW_BLOCK = 16  # rows per parallel step: enough steps for two threads, few launches' worth of overhead

_OPTS = dict(nogil=True, cache=True, fastmath=True)


@njit(**_OPTS)
def _dot_rows(w, x, t):
    wide_vectors()
    acc = np.float32(0.0)
    for c in range(w.shape[0]):
        acc += w[c] * x[t, c]
    return acc


@njit(**_OPTS)
def _dot4(rows4, x, t):
    """Four rows (rows4 [4, cols]) dotted with x[t] in one pass: each load of x feeds four FMAs."""
    wide_vectors()
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for c in range(rows4.shape[1]):
        xc = x[t, c]
        a0 += rows4[0, c] * xc
        a1 += rows4[1, c] * xc
        a2 += rows4[2, c] * xc
        a3 += rows4[3, c] * xc
    return a0, a1, a2, a3


@njit(**_OPTS)
def _store_rows(rows_f32, r0, n, x, out):
    """out[t, r0:r0+n] for every token: four rows at a time, a last partial group one by one."""
    if n == 4:
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = _dot4(rows_f32, x, t)
            out[t, r0] = a0
            out[t, r0 + 1] = a1
            out[t, r0 + 2] = a2
            out[t, r0 + 3] = a3
    else:
        for k in range(n):
            for t in range(x.shape[0]):
                out[t, r0 + k] = _dot_rows(rows_f32[k], x, t)


@njit(**_OPTS)
def _widen_bf16(w, r, row):
    wide_vectors()
    for c in range(row.shape[0]):
        row[c] = bf16_f32(w[r, c])


@njit(**_OPTS)
def _widen_int8(q, s, r, row):
    wide_vectors()
    for g in range(s.shape[1]):
        scale = s[r, g]
        for j in range(GROUP):
            row[g * GROUP + j] = _i8_f32(q[r, g * GROUP + j]) * scale


@njit(**_OPTS)
def _widen_int4(q, s, r, row):
    wide_vectors()
    half = GROUP // 2
    for g in range(s.shape[1]):
        scale = s[r, g]
        for j in range(half):
            b = q[r, g * half + j]
            row[g * GROUP + j] = (_lo_nibble_f32(b) - np.float32(8.0)) * scale
            row[g * GROUP + half + j] = (_hi_nibble_f32(b) - np.float32(8.0)) * scale


# Each parallel step takes 16 rows, four at a time: the four rows are widened
# into a float32 scratch [4, cols] (32 KiB at 2048 columns, in L1) and dotted
# with every token together. A row's result depends only on its row index
# (full group of four, or the matrix's last partial group), never on T.


@njit(**dict(_OPTS, parallel=True))
def matmat_bf16(w, x, out):
    """out[t, r] = w[r, :] . x[t, :] for a bf16 (uint16) w [rows, cols]."""
    rows, cols = w.shape
    for b in prange((rows + _ROW_BLOCK - 1) // _ROW_BLOCK):
        scratch = np.empty((4, cols), dtype=np.float32)
        for r0 in range(b * _ROW_BLOCK, min(rows, (b + 1) * _ROW_BLOCK), 4):
            n = min(4, rows - r0)
            for k in range(n):
                _widen_bf16(w, r0 + k, scratch[k])
            _store_rows(scratch, r0, n, x, out)


def _widen_quant(q, s, r, row):
    """_widen_int8 (int8 q) or _widen_int4 (uint8 planar nibbles), chosen when numba compiles."""


@overload(_widen_quant)
def _widen_quant_impl(q, s, r, row):
    if q.dtype == types.int8:
        return lambda q, s, r, row: _widen_int8(q, s, r, row)
    return lambda q, s, r, row: _widen_int4(q, s, r, row)


@njit(**dict(_OPTS, parallel=True))
def dequantize_rows(q, s, out):
    """out [rows, cols] = the float32 weights q * scale of an int8 or int4 matrix (exact products)."""
    for r in prange(q.shape[0]):
        _widen_quant(q, s, r, out[r])


@njit(**dict(_OPTS, parallel=True))
def matmat_quant(q, s, x, out):
    """out[t, r] = dequant(q, s)[r, :] . x[t, :] for int8 q [rows, cols] or planar-nibble
    int4 q (uint8 [rows, cols/2]), scales [rows, cols/64]."""
    rows = q.shape[0]
    cols = s.shape[1] * GROUP
    for b in prange((rows + _ROW_BLOCK - 1) // _ROW_BLOCK):
        scratch = np.empty((4, cols), dtype=np.float32)
        for r0 in range(b * _ROW_BLOCK, min(rows, (b + 1) * _ROW_BLOCK), 4):
            n = min(4, rows - r0)
            for k in range(n):
                _widen_quant(q, s, r0 + k, scratch[k])
            _store_rows(scratch, r0, n, x, out)


def matmat(kind: str, parts: tuple, x: np.ndarray) -> np.ndarray:
    """x [T, cols] times the matrix in `parts` (bf16: (w,), int8/int4: (q, scales)) -> [T, rows].

    (float32 matrices go to BLAS, which is faster for them.)
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = parts[0].shape[0]
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    if kind == "bf16":
        matmat_bf16(parts[0], x, out)
    elif kind in ("int8", "int4"):
        matmat_quant(parts[0], parts[1], x, out)
    else:
        raise ValueError(f"unknown weight kind {kind!r}")
    return out
