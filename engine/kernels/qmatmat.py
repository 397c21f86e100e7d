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

from tierlab.engine.blob_layout import GROUP, blob_nbytes
from tierlab.engine.kernels.qmatvec import bf16_f32, quant_matrices, raw_matrices, wide_vectors

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
def _dot4x2(rows4, x, t0, t1):
    """Four rows (rows4 [4, cols]) dotted with x[t0] and x[t1] in one pass: six loads feed eight
    FMAs. A token alone goes in as t0 = t1, so each token's sums come out of the same
    instructions whoever it is paired with."""
    wide_vectors()
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    b0 = np.float32(0.0)
    b1 = np.float32(0.0)
    b2 = np.float32(0.0)
    b3 = np.float32(0.0)
    for c in range(rows4.shape[1]):
        xa = x[t0, c]
        xb = x[t1, c]
        w0 = rows4[0, c]
        w1 = rows4[1, c]
        w2 = rows4[2, c]
        w3 = rows4[3, c]
        a0 += w0 * xa
        a1 += w1 * xa
        a2 += w2 * xa
        a3 += w3 * xa
        b0 += w0 * xb
        b1 += w1 * xb
        b2 += w2 * xb
        b3 += w3 * xb
    return a0, a1, a2, a3, b0, b1, b2, b3


@njit(**_OPTS)
def _store_rows(rows_f32, r0, n, x, out):
    """out[t, r0:r0+n] for every token: four rows and two tokens at a time, a last partial group
    of rows one by one."""
    if n == 4:
        T = x.shape[0]
        for t in range(0, T, 2):
            u = min(t + 1, T - 1)
            a0, a1, a2, a3, b0, b1, b2, b3 = _dot4x2(rows_f32, x, t, u)
            out[t, r0] = a0
            out[t, r0 + 1] = a1
            out[t, r0 + 2] = a2
            out[t, r0 + 3] = a3
            if u != t:
                out[u, r0] = b0
                out[u, r0 + 1] = b1
                out[u, r0 + 2] = b2
                out[u, r0 + 3] = b3
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


def _gate_up_down(kind: str, blob: np.ndarray, hidden: int, inter: int) -> tuple[tuple, tuple]:
    """(gate|up as one [2*inter, hidden] matrix, down [hidden, inter]) of a blob, as `matmat`
    parts: the blob stores up's rows right after gate's, and their scales likewise."""
    if blob.dtype != np.uint8 or blob.ndim != 1 or blob.size < blob_nbytes(kind, hidden, inter):
        raise ValueError(f"a {kind} expert blob of {hidden}x{inter} needs {blob_nbytes(kind, hidden, inter)} bytes, "
                         f"got {blob.size}")
    if kind in ("fp32", "bf16"):
        gate, up, down = raw_matrices(blob, kind, hidden, inter)
        return (_rows_after(gate, up),), (down,)
    qg, sg, qu, su, qd, sd = quant_matrices(blob, 8 if kind == "int8" else 4, hidden, inter)
    return (_rows_after(qg, qu), _rows_after(sg, su)), (qd, sd)


def _rows_after(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """first and second as one matrix, without a copy when second's rows follow first's in memory."""
    if (first.flags.c_contiguous and second.flags.c_contiguous
            and second.__array_interface__["data"][0] == first.__array_interface__["data"][0] + first.nbytes):
        return np.lib.stride_tricks.as_strided(first, (first.shape[0] + second.shape[0], first.shape[1]))
    return np.concatenate([first, second])


def _product(kind: str, parts: tuple, x: np.ndarray) -> np.ndarray:
    """x times one matrix of an expert: float32 through BLAS, the rest through `matmat`."""
    if kind == "fp32":
        return np.ascontiguousarray(x @ parts[0].T, dtype=np.float32)
    return matmat(kind, parts, x)


def expert_matmat(kind: str, blob: np.ndarray, hidden: int, inter: int, x: np.ndarray) -> np.ndarray:
    """down(silu(gate x_t) * (up x_t)) for each row x_t of x [n, hidden] -> [n, hidden].

    Why: the tokens routed to one expert are a small matrix; widening each weight row once for
    all of them (and gate with up in one pass) does the prompt's expert work as matrix-matrix
    products. Within 1e-5 relative of the one-token kernels, not bit-identical to them.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != hidden:
        raise ValueError(f"expert_matmat needs x[n, {hidden}], got {x.shape}")
    gate_up, down = _gate_up_down(kind, blob, hidden, inter)
    gu = _product(kind, gate_up, x)
    g, u = gu[:, :inter], gu[:, inter:]
    h = np.ascontiguousarray(g / (np.float32(1.0) + np.exp(-g)) * u, dtype=np.float32)
    return _product(kind, down, h)
