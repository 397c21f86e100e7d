"""numba matvec and fused SwiGLU expert kernels for fp32, bf16, int8 and int4 weights.

Why this shape: decode is one token at a time, so every expert is a
matrix-vector product bound by memory bandwidth (or by the cost of widening
small integers to float). The loops are written so that LLVM vectorises them:
- widening goes through tiny LLVM intrinsics (uint8 nibble -> float32,
  int8 -> float32, bf16 -> float32) so no value is promoted to int64 on the way;
- int4 uses planar nibbles (low nibbles are elements 0..31 of a 64-group, high
  nibbles 32..63), so both halves read x contiguously;
- each group accumulates in float32 and is scaled once; the constant -8 offset
  of the nibbles is folded into a per-group sum of x computed once per call.

Blob layouts (uint8 buffers, one expert each):
- fp32 / bf16 ("raw"): [gate I*H | up I*H | down H*I] elements, row-major,
  PyTorch Linear convention (out x in); bf16 is stored as uint16.
- int8 / int4: the tierlab container blob, see engine/quant.py and
  docs/formats.md.

Public names: ``matvec_fp32/bf16/int8/int4`` (out[:] = W @ x) and
``expert_forward_fp32/bf16/int8/int4(blob, hidden, inter, x, y, w)``
(y += w * down(silu(gate x) * (up x))). All release the GIL.
"""

from __future__ import annotations

import os

# A spinning OpenMP worker on a shared 2-core machine steals the core the
# other worker needs, and a 100-microsecond kernel can take 8 ms. Passive
# waiting costs a few microseconds per launch instead. Must be set before
# numba starts its OpenMP pool (first parallel call), so it is set at import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

GROUP = 64
_ROW_BLOCK = 32  # rows per parallel task (amortises the per-task scratch)

_SERIAL = dict(nogil=True, cache=True, fastmath=True)
_PARALLEL = dict(nogil=True, cache=True, fastmath=True, parallel=True)

_F32 = ir.FloatType()


# --- widening intrinsics: keep the vectoriser in 8/16/32-bit lanes -------------------------


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


@intrinsic
def _bf16_f32(typingctx, b):
    """Exact bf16 (as uint16) -> float32: the bf16 bits are the high half of the float."""

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), _F32)

    return types.float32(types.uint16), codegen


# --- row dot products (inlined by LLVM into the parallel loops) ---------------------------


@njit(**_SERIAL)
def _dot_fp32(w, r, x):
    acc = np.float32(0.0)
    for c in range(x.shape[0]):
        acc += w[r, c] * x[c]
    return acc


@njit(**_SERIAL)
def _dot2_fp32(a, b, r, x):
    sa = np.float32(0.0)
    sb = np.float32(0.0)
    for c in range(x.shape[0]):
        sa += a[r, c] * x[c]
        sb += b[r, c] * x[c]
    return sa, sb


@njit(**_SERIAL)
def _dot_bf16(w, r, x):
    acc = np.float32(0.0)
    for c in range(x.shape[0]):
        acc += _bf16_f32(w[r, c]) * x[c]
    return acc


@njit(**_SERIAL)
def _dot2_bf16(a, b, r, x):
    sa = np.float32(0.0)
    sb = np.float32(0.0)
    for c in range(x.shape[0]):
        xc = x[c]
        sa += _bf16_f32(a[r, c]) * xc
        sb += _bf16_f32(b[r, c]) * xc
    return sa, sb


@njit(**_SERIAL)
def _dot_int8(q, s, r, x):
    acc = np.float32(0.0)
    for g in range(s.shape[1]):
        part = np.float32(0.0)
        x0 = g * GROUP
        for j in range(GROUP):
            part += _i8_f32(q[r, x0 + j]) * x[x0 + j]
        acc += s[r, g] * part
    return acc


@njit(**_SERIAL)
def _dot2_int8(qa, sa, qb, sb, r, x):
    acc_a = np.float32(0.0)
    acc_b = np.float32(0.0)
    for g in range(sa.shape[1]):
        pa = np.float32(0.0)
        pb = np.float32(0.0)
        x0 = g * GROUP
        for j in range(GROUP):
            xj = x[x0 + j]
            pa += _i8_f32(qa[r, x0 + j]) * xj
            pb += _i8_f32(qb[r, x0 + j]) * xj
        acc_a += sa[r, g] * pa
        acc_b += sb[r, g] * pb
    return acc_a, acc_b


@njit(**_SERIAL)
def _dot_int4(q, s, r, x, xsum8, lanes):
    """Row r of an int4 matrix dotted with x.

    lanes (float32[32]) is scratch: a per-lane accumulator of scale * (lo*x + hi*x)
    avoids a horizontal reduction per group. The -8 nibble offset comes back as
    sum_g scale_g * 8 * sum(x in g) = sum_g scale_g * xsum8[g].
    """
    half = GROUP // 2
    for j in range(half):
        lanes[j] = 0.0
    offset = np.float32(0.0)
    for g in range(s.shape[1]):
        sc = s[r, g]
        offset += sc * xsum8[g]
        b0 = g * half
        x0 = g * GROUP
        for j in range(half):
            b = q[r, b0 + j]
            lanes[j] += sc * (_lo_nibble_f32(b) * x[x0 + j] + _hi_nibble_f32(b) * x[x0 + half + j])
    acc = np.float32(0.0)
    for j in range(half):
        acc += lanes[j]
    return acc - offset


@njit(**_SERIAL)
def _group_sums8(x):
    """8 * sum of x over each group of 64 (the folded nibble offset)."""
    n = x.shape[0] // GROUP
    out = np.empty(n, np.float32)
    for g in range(n):
        t = np.float32(0.0)
        for j in range(GROUP):
            t += x[g * GROUP + j]
        out[g] = np.float32(8.0) * t
    return out


# --- matvecs: out[:] = W @ x ----------------------------------------------------------------


@njit(**_PARALLEL)
def matvec_fp32(w, x, out):
    """out[:] = w @ x for float32 w [rows, cols]."""
    for r in prange(w.shape[0]):
        out[r] = _dot_fp32(w, r, x)


@njit(**_PARALLEL)
def matvec_bf16(w, x, out):
    """out[:] = w @ x for bf16 w stored as uint16 [rows, cols]."""
    for r in prange(w.shape[0]):
        out[r] = _dot_bf16(w, r, x)


@njit(**_PARALLEL)
def matvec_int8(q, scales, x, out):
    """out[:] = dequant(q, scales) @ x; q int8 [rows, cols], scales float32 [rows, cols/64]."""
    for r in prange(q.shape[0]):
        out[r] = _dot_int8(q, scales, r, x)


@njit(**_PARALLEL)
def matvec_int4(q, scales, x, out):
    """out[:] = dequant(q, scales) @ x; q planar-nibble uint8 [rows, cols/2], scales [rows, cols/64]."""
    rows = q.shape[0]
    xsum8 = _group_sums8(x)
    nblocks = (rows + _ROW_BLOCK - 1) // _ROW_BLOCK
    for blk in prange(nblocks):
        lanes = np.empty(GROUP // 2, np.float32)
        for r in range(blk * _ROW_BLOCK, min(rows, (blk + 1) * _ROW_BLOCK)):
            out[r] = _dot_int4(q, scales, r, x, xsum8, lanes)


# --- fused SwiGLU experts on a blob ---------------------------------------------------------


@njit(**_SERIAL)
def _silu_mul(g, u):
    return g / (np.float32(1.0) + np.exp(-g)) * u


@njit(**_PARALLEL)
def _swiglu_fp32(gate, up, down, x, y, w):
    inter = gate.shape[0]
    h = np.empty(inter, np.float32)
    for i in prange(inter):
        g, u = _dot2_fp32(gate, up, i, x)
        h[i] = _silu_mul(g, u)
    wf = np.float32(w)
    for r in prange(down.shape[0]):
        y[r] += wf * _dot_fp32(down, r, h)


@njit(**_PARALLEL)
def _swiglu_bf16(gate, up, down, x, y, w):
    inter = gate.shape[0]
    h = np.empty(inter, np.float32)
    for i in prange(inter):
        g, u = _dot2_bf16(gate, up, i, x)
        h[i] = _silu_mul(g, u)
    wf = np.float32(w)
    for r in prange(down.shape[0]):
        y[r] += wf * _dot_bf16(down, r, h)


@njit(**_PARALLEL)
def _swiglu_int8(qg, sg, qu, su, qd, sd, x, y, w):
    inter = qg.shape[0]
    h = np.empty(inter, np.float32)
    for i in prange(inter):
        g, u = _dot2_int8(qg, sg, qu, su, i, x)
        h[i] = _silu_mul(g, u)
    wf = np.float32(w)
    for r in prange(qd.shape[0]):
        y[r] += wf * _dot_int8(qd, sd, r, h)


@njit(**_PARALLEL)
def _swiglu_int4(qg, sg, qu, su, qd, sd, x, y, w):
    inter = qg.shape[0]
    hidden = qd.shape[0]
    h = np.empty(inter, np.float32)
    xsum8 = _group_sums8(x)
    nblocks = (inter + _ROW_BLOCK - 1) // _ROW_BLOCK
    for blk in prange(nblocks):
        lanes = np.empty(GROUP // 2, np.float32)
        for i in range(blk * _ROW_BLOCK, min(inter, (blk + 1) * _ROW_BLOCK)):
            g = _dot_int4(qg, sg, i, x, xsum8, lanes)
            u = _dot_int4(qu, su, i, x, xsum8, lanes)
            h[i] = _silu_mul(g, u)
    hsum8 = _group_sums8(h)
    wf = np.float32(w)
    nblocks = (hidden + _ROW_BLOCK - 1) // _ROW_BLOCK
    for blk in prange(nblocks):
        lanes = np.empty(GROUP // 2, np.float32)
        for r in range(blk * _ROW_BLOCK, min(hidden, (blk + 1) * _ROW_BLOCK)):
            y[r] += wf * _dot_int4(qd, sd, r, h, hsum8, lanes)


@njit(**_SERIAL)
def _raw_views(blob, dtype, hidden, inter):
    flat = blob.view(dtype)
    n = hidden * inter
    gate = flat[0:n].reshape(inter, hidden)
    up = flat[n : 2 * n].reshape(inter, hidden)
    down = flat[2 * n : 3 * n].reshape(hidden, inter)
    return gate, up, down


@njit(**_SERIAL)
def _quant_views(blob, bits, hidden, inter):
    """(q, scales) of gate, up, down inside a container blob (see engine/quant.BlobLayout)."""
    n = hidden * inter
    qbytes = n * bits // 8
    sbytes = n // GROUP * 4
    s0 = 3 * qbytes
    sg = blob[s0 : s0 + sbytes].view(np.float32).reshape(inter, hidden // GROUP)
    su = blob[s0 + sbytes : s0 + 2 * sbytes].view(np.float32).reshape(inter, hidden // GROUP)
    sd = blob[s0 + 2 * sbytes : s0 + 3 * sbytes].view(np.float32).reshape(hidden, inter // GROUP)
    return sg, su, sd


@njit(**_SERIAL)
def _int8_weights(blob, hidden, inter):
    n = hidden * inter
    flat = blob[0 : 3 * n].view(np.int8)
    return flat[0:n].reshape(inter, hidden), flat[n : 2 * n].reshape(inter, hidden), flat[2 * n : 3 * n].reshape(hidden, inter)


@njit(**_SERIAL)
def _int4_weights(blob, hidden, inter):
    n = hidden * inter // 2
    return (
        blob[0:n].reshape(inter, hidden // 2),
        blob[n : 2 * n].reshape(inter, hidden // 2),
        blob[2 * n : 3 * n].reshape(hidden, inter // 2),
    )


@njit(nogil=True, cache=True)
def expert_forward_fp32(blob, hidden, inter, x, y, w):
    """y += w * expert(x) for a raw float32 blob [gate | up | down]."""
    gate, up, down = _raw_views(blob, np.float32, hidden, inter)
    _swiglu_fp32(gate, up, down, x, y, w)


@njit(nogil=True, cache=True)
def expert_forward_bf16(blob, hidden, inter, x, y, w):
    """y += w * expert(x) for a raw bf16 (uint16) blob [gate | up | down]."""
    gate, up, down = _raw_views(blob, np.uint16, hidden, inter)
    _swiglu_bf16(gate, up, down, x, y, w)


@njit(nogil=True, cache=True)
def expert_forward_int8(blob, hidden, inter, x, y, w):
    """y += w * expert(x) for an int8 container blob."""
    qg, qu, qd = _int8_weights(blob, hidden, inter)
    sg, su, sd = _quant_views(blob, 8, hidden, inter)
    _swiglu_int8(qg, sg, qu, su, qd, sd, x, y, w)


@njit(nogil=True, cache=True)
def expert_forward_int4(blob, hidden, inter, x, y, w):
    """y += w * expert(x) for an int4 container blob."""
    qg, qu, qd = _int4_weights(blob, hidden, inter)
    sg, su, sd = _quant_views(blob, 4, hidden, inter)
    _swiglu_int4(qg, sg, qu, su, qd, sd, x, y, w)


EXPERT_FORWARD = {
    "fp32": expert_forward_fp32,
    "bf16": expert_forward_bf16,
    "int8": expert_forward_int8,
    "int4": expert_forward_int4,
}


def raw_blob_nbytes(kind: str, hidden: int, inter: int) -> int:
    """Bytes of one raw fp32/bf16 expert blob [gate | up | down]."""
    return 3 * hidden * inter * {"fp32": 4, "bf16": 2}[kind]
