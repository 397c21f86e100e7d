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

Public names (plain Python entry points; the compiled passes under them
release the GIL, so a loader thread keeps running while an expert computes):
``matvec_fp32/bf16/int8/int4`` (out[:] = W @ x, C-contiguous operands) and
``expert_forward_fp32/bf16/int8/int4(blob, hidden, inter, x, y, w)``
(y += w * down(silu(gate x) * (up x)); x, y float32[H]; the blob may be
longer than one expert, e.g. a RAM slot). ``EXPERT_FORWARD`` maps kind -> function.
Measured speeds and what each trick bought: docs/benchmarks.md, "Kernels".
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


@intrinsic
def _wide_vectors(typingctx):
    """Let LLVM use 512-bit registers in the calling function.

    LLVM's default tuning for recent Intel cores prefers 256-bit vectors; for
    these widen-and-FMA loops 512-bit ones are ~1.4x faster (int4: 6.5 -> 9-12
    Gweights/s per core). The function attributes are ignored on CPUs
    without AVX-512, where LLVM keeps the widest vectors the CPU has.
    """

    def codegen(context, builder, signature, args):
        attrs = builder.function.attributes
        # llvmlite only accepts a fixed list of attribute names; string attributes
        # are valid LLVM IR, so they are added to the underlying set directly.
        set.add(attrs, '"prefer-vector-width"="512"')
        set.add(attrs, '"min-legal-vector-width"="512"')
        return context.get_dummy_value()

    return types.none(), codegen


# --- row dot products (LLVM inlines them into the parallel loops) --------------------------
# Each kind has a one-row and a two-row dot. Two rows share every load of x,
# which is what makes the int4 and bf16 loops fast (~1.3-1.8x over one row);
# the two rows may come from different matrices (gate row i with up row i).


@njit(**_SERIAL)
def _dot_fp32(w, r, x):
    _wide_vectors()
    acc = np.float32(0.0)
    for c in range(x.shape[0]):
        acc += w[r, c] * x[c]
    return acc


@njit(**_SERIAL)
def _dot2_fp32(a, ra, b, rb, x):
    _wide_vectors()
    sa = np.float32(0.0)
    sb = np.float32(0.0)
    for c in range(x.shape[0]):
        xc = x[c]
        sa += a[ra, c] * xc
        sb += b[rb, c] * xc
    return sa, sb


@njit(**_SERIAL)
def _dot_bf16(w, r, x):
    _wide_vectors()
    acc = np.float32(0.0)
    for c in range(x.shape[0]):
        acc += _bf16_f32(w[r, c]) * x[c]
    return acc


@njit(**_SERIAL)
def _dot2_bf16(a, ra, b, rb, x):
    _wide_vectors()
    sa = np.float32(0.0)
    sb = np.float32(0.0)
    for c in range(x.shape[0]):
        xc = x[c]
        sa += _bf16_f32(a[ra, c]) * xc
        sb += _bf16_f32(b[rb, c]) * xc
    return sa, sb


@njit(**_SERIAL)
def _dot_int8(q, s, r, x):
    _wide_vectors()
    acc = np.float32(0.0)
    for g in range(s.shape[1]):
        part = np.float32(0.0)
        x0 = g * GROUP
        for j in range(GROUP):
            part += _i8_f32(q[r, x0 + j]) * x[x0 + j]
        acc += s[r, g] * part
    return acc


@njit(**_SERIAL)
def _dot2_int8(qa, sa, ra, qb, sb, rb, x):
    _wide_vectors()
    acc_a = np.float32(0.0)
    acc_b = np.float32(0.0)
    for g in range(sa.shape[1]):
        pa = np.float32(0.0)
        pb = np.float32(0.0)
        x0 = g * GROUP
        for j in range(GROUP):
            xj = x[x0 + j]
            pa += _i8_f32(qa[ra, x0 + j]) * xj
            pb += _i8_f32(qb[rb, x0 + j]) * xj
        acc_a += sa[ra, g] * pa
        acc_b += sb[rb, g] * pb
    return acc_a, acc_b


@njit(**_SERIAL)
def _dot_int4(q, s, r, x, xsum8):
    """Row r of a planar-nibble int4 matrix dotted with x.

    The nibbles are used unsigned (0..15); the -8 offset comes back once per
    group as scale * 8 * sum(x in group) = scale * xsum8[g].
    """
    _wide_vectors()
    half = GROUP // 2
    acc = np.float32(0.0)
    for g in range(s.shape[1]):
        part = np.float32(0.0)
        b0 = g * half
        x0 = g * GROUP
        for j in range(half):
            b = q[r, b0 + j]
            part += _lo_nibble_f32(b) * x[x0 + j] + _hi_nibble_f32(b) * x[x0 + half + j]
        acc += s[r, g] * (part - xsum8[g])
    return acc


@njit(**_SERIAL)
def _dot2_int4(qa, sa, ra, qb, sb, rb, x, xsum8):
    """Two int4 rows against one x (see _dot_int4)."""
    _wide_vectors()
    half = GROUP // 2
    acc_a = np.float32(0.0)
    acc_b = np.float32(0.0)
    for g in range(sa.shape[1]):
        pa = np.float32(0.0)
        pb = np.float32(0.0)
        b0 = g * half
        x0 = g * GROUP
        for j in range(half):
            xl = x[x0 + j]
            xh = x[x0 + half + j]
            a = qa[ra, b0 + j]
            b = qb[rb, b0 + j]
            pa += _lo_nibble_f32(a) * xl + _hi_nibble_f32(a) * xh
            pb += _lo_nibble_f32(b) * xl + _hi_nibble_f32(b) * xh
        acc_a += sa[ra, g] * (pa - xsum8[g])
        acc_b += sb[rb, g] * (pb - xsum8[g])
    return acc_a, acc_b


@njit(**_SERIAL)
def _group_sums8(x):
    """8 * sum of x over each group of 64 (the folded nibble offset)."""
    _wide_vectors()
    n = x.shape[0] // GROUP
    out = np.empty(n, np.float32)
    for g in range(n):
        t = np.float32(0.0)
        for j in range(GROUP):
            t += x[g * GROUP + j]
        out[g] = np.float32(8.0) * t
    return out


# --- row passes: one parallel loop per kind serves the matvec and both expert halves -------
# Modes: SET out[r] = row r . x; ADD out[r] += w * (row r . x); GATE_UP out[i] =
# silu(a_i . x) * (b_i . x). One parallel function per kind (rather than one per
# use) keeps numba's cold compile short, which CI pays on every run.

SET, ADD, GATE_UP = 0, 1, 2


@njit(**_SERIAL)
def _silu_mul(g, u):
    return g / (np.float32(1.0) + np.exp(-g)) * u


@njit(**_SERIAL)
def _pair_rows(mode, p):
    """The two rows step p works on: (p, p) of two matrices for GATE_UP, else (2p, 2p+1)."""
    i = np.int64(p)  # prange indices may be unsigned; keep both branches int64
    if mode == GATE_UP:
        return i, i
    return 2 * i, 2 * i + 1


@njit(**_SERIAL)
def _store(mode, out, ra, a, rb, b, w):
    if mode == GATE_UP:
        out[ra] = _silu_mul(a, b)
    elif mode == ADD:
        out[ra] += w * a
        out[rb] += w * b
    else:
        out[ra] = a
        out[rb] = b


@njit(**_SERIAL)
def _store_last(mode, out, r, v, w):
    """The odd last row of a SET/ADD pass."""
    if mode == ADD:
        out[r] += w * v
    else:
        out[r] = v


@njit(**_SERIAL)
def _steps(mode, rows):
    return rows if mode == GATE_UP else rows // 2


@njit(**_PARALLEL)
def _pass_fp32(a, b, x, out, mode, w):
    _wide_vectors()
    wf = np.float32(w)
    for p in prange(_steps(mode, a.shape[0])):
        ra, rb = _pair_rows(mode, p)
        va, vb = _dot2_fp32(a, ra, b, rb, x)
        _store(mode, out, ra, va, rb, vb, wf)
    if mode != GATE_UP and a.shape[0] % 2:
        r = a.shape[0] - 1
        v = _dot_fp32(a, r, x)
        _store_last(mode, out, r, v, wf)


@njit(**_PARALLEL)
def _pass_bf16(a, b, x, out, mode, w):
    _wide_vectors()
    wf = np.float32(w)
    for p in prange(_steps(mode, a.shape[0])):
        ra, rb = _pair_rows(mode, p)
        va, vb = _dot2_bf16(a, ra, b, rb, x)
        _store(mode, out, ra, va, rb, vb, wf)
    if mode != GATE_UP and a.shape[0] % 2:
        r = a.shape[0] - 1
        v = _dot_bf16(a, r, x)
        _store_last(mode, out, r, v, wf)


@njit(**_PARALLEL)
def _pass_int8(qa, sa, qb, sb, x, out, mode, w):
    _wide_vectors()
    wf = np.float32(w)
    for p in prange(_steps(mode, qa.shape[0])):
        ra, rb = _pair_rows(mode, p)
        va, vb = _dot2_int8(qa, sa, ra, qb, sb, rb, x)
        _store(mode, out, ra, va, rb, vb, wf)
    if mode != GATE_UP and qa.shape[0] % 2:
        r = qa.shape[0] - 1
        v = _dot_int8(qa, sa, r, x)
        _store_last(mode, out, r, v, wf)


@njit(**_PARALLEL)
def _pass_int4(qa, sa, qb, sb, x, out, mode, w):
    _wide_vectors()
    wf = np.float32(w)
    xsum8 = _group_sums8(x)
    for p in prange(_steps(mode, qa.shape[0])):
        ra, rb = _pair_rows(mode, p)
        va, vb = _dot2_int4(qa, sa, ra, qb, sb, rb, x, xsum8)
        _store(mode, out, ra, va, rb, vb, wf)
    if mode != GATE_UP and qa.shape[0] % 2:
        r = qa.shape[0] - 1
        v = _dot_int4(qa, sa, r, x, xsum8)
        _store_last(mode, out, r, v, wf)


# --- public entry points --------------------------------------------------------------------
# Plain Python on purpose: a numba function that calls another is re-optimised
# with the callee inlined, so njit wrappers here tripled the cold compile time
# (to ~40 s) for a saving of a few microseconds per call.


def matvec_fp32(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = w @ x for float32 w [rows, cols] (C-contiguous)."""
    _pass_fp32(w, w, x, out, SET, 1.0)


def matvec_bf16(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = w @ x for bf16 w stored as uint16 [rows, cols]."""
    _pass_bf16(w, w, x, out, SET, 1.0)


def matvec_int8(q: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = dequant(q, scales) @ x; q int8 [rows, cols], scales float32 [rows, cols/64]."""
    _pass_int8(q, scales, q, scales, x, out, SET, 1.0)


def matvec_int4(q: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = dequant(q, scales) @ x; q planar-nibble uint8 [rows, cols/2], scales [rows, cols/64]."""
    _pass_int4(q, scales, q, scales, x, out, SET, 1.0)


def raw_matrices(blob: np.ndarray, kind: str, hidden: int, inter: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of gate [I,H], up [I,H], down [H,I] in a raw fp32/bf16 blob."""
    n = hidden * inter
    flat = blob[: 3 * n * (4 if kind == "fp32" else 2)].view(np.float32 if kind == "fp32" else np.uint16)
    return flat[:n].reshape(inter, hidden), flat[n : 2 * n].reshape(inter, hidden), flat[2 * n :].reshape(hidden, inter)


def quant_matrices(blob: np.ndarray, bits: int, hidden: int, inter: int) -> tuple[np.ndarray, ...]:
    """(q_gate, s_gate, q_up, s_up, q_down, s_down) views in a container blob.

    q is int8 [rows, cols] for 8 bits, planar-nibble uint8 [rows, cols/2] for 4.
    """
    n = hidden * inter
    qbytes = n * bits // 8
    sbytes = n // GROUP * 4
    q = blob[: 3 * qbytes] if bits == 4 else blob[: 3 * qbytes].view(np.int8)
    per_row_in, per_row_out = hidden * bits // 8, inter * bits // 8
    s = blob[3 * qbytes : 3 * (qbytes + sbytes)].view(np.float32)
    m = n // GROUP
    return (
        q[:qbytes].reshape(inter, per_row_in), s[:m].reshape(inter, hidden // GROUP),
        q[qbytes : 2 * qbytes].reshape(inter, per_row_in), s[m : 2 * m].reshape(inter, hidden // GROUP),
        q[2 * qbytes :].reshape(hidden, per_row_out), s[2 * m :].reshape(hidden, inter // GROUP),
    )


def expert_forward_fp32(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * down(silu(gate x) * (up x)) for a raw float32 blob [gate | up | down]."""
    gate, up, down = raw_matrices(blob, "fp32", hidden, inter)
    h = np.empty(inter, np.float32)
    _pass_fp32(gate, up, x, h, GATE_UP, 1.0)
    _pass_fp32(down, down, h, y, ADD, float(w))


def expert_forward_bf16(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * expert(x) for a raw bf16 (uint16) blob [gate | up | down]."""
    gate, up, down = raw_matrices(blob, "bf16", hidden, inter)
    h = np.empty(inter, np.float32)
    _pass_bf16(gate, up, x, h, GATE_UP, 1.0)
    _pass_bf16(down, down, h, y, ADD, float(w))


def expert_forward_int8(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * expert(x) for an int8 container blob."""
    qg, sg, qu, su, qd, sd = quant_matrices(blob, 8, hidden, inter)
    h = np.empty(inter, np.float32)
    _pass_int8(qg, sg, qu, su, x, h, GATE_UP, 1.0)
    _pass_int8(qd, sd, qd, sd, h, y, ADD, float(w))


def expert_forward_int4(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * expert(x) for an int4 container blob."""
    qg, sg, qu, su, qd, sd = quant_matrices(blob, 4, hidden, inter)
    h = np.empty(inter, np.float32)
    _pass_int4(qg, sg, qu, su, x, h, GATE_UP, 1.0)
    _pass_int4(qd, sd, qd, sd, h, y, ADD, float(w))


EXPERT_FORWARD = {
    "fp32": expert_forward_fp32,
    "bf16": expert_forward_bf16,
    "int8": expert_forward_int8,
    "int4": expert_forward_int4,
}

def raw_blob_nbytes(kind: str, hidden: int, inter: int) -> int:
    """Bytes of one raw fp32/bf16 expert blob [gate | up | down]."""
    return 3 * hidden * inter * {"fp32": 4, "bf16": 2}[kind]
