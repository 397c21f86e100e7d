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

# OpenMP wait policy (passive, with a short spin): set in tierlab/__init__.py,
# which runs before this module is imported, i.e. before numba's pool starts.

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

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


# --- software prefetch of the next rows -----------------------------------------------------
# A row of an expert matrix is 1-4 KiB, so the hardware prefetcher, which
# stops at every 4 KiB page and needs a few misses to ramp up, leaves each
# new row to start cold. From DRAM the int8/int4 kernels then ran at half
# their cache-hot speed. Each parallel step therefore asks for the rows it
# will work on next while it computes the current ones (fp32 and bf16: the
# whole next rows at the start of a step). The int8/int4 loops instead prefetch
# one line per group as they go, further ahead (below): a burst of a whole row's
# lines at once fills the core's line-fill buffers and stalls its own loads.

_PREFETCH_LINE = 64
# The int8/int4 group loops prefetch as they go, one line per group and row, this
# many bytes ahead (rounded up to whole steps): 1-thread int4 from DRAM 15 -> 17
# Gweights/s on 1 KiB rows and 7-10 -> 12.6-13.3 on 256-byte rows, where one step
# ahead is too close to hide DRAM latency (docs/benchmarks.md).
_AHEAD_BYTES = 4096


@intrinsic
def _prefetch_row(typingctx, arr, r):
    """Prefetch row r of a 2-D C-contiguous array into the cache (no-op when r is out of range)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 2 and arr.layout == "C" and isinstance(r, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        rows = builder.extract_value(a.shape, 0)
        row_bytes = builder.extract_value(a.strides, 0)
        r64 = context.cast(builder, args[1], signature.args[1], types.int64)
        in_range = builder.and_(builder.icmp_signed(">=", r64, ir.Constant(_I64, 0)),
                                builder.icmp_signed("<", r64, rows))
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
        with builder.if_then(in_range):
            base = builder.gep(builder.bitcast(a.data, _I8.as_pointer()), [builder.mul(r64, row_bytes)])
            with cgutils.for_range_slice(builder, ir.Constant(_I64, 0), row_bytes, ir.Constant(_I64, _PREFETCH_LINE)) as (off, _):
                builder.call(prefetch, [builder.gep(base, [off]), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(arr, r), codegen


# --- explicit-vector group loops for int4 and int8 -----------------------------------------
# LLVM's vectoriser reduces each 64-group to a scalar before scaling it (five
# shuffles and adds per group and row). Written out by hand, each row keeps a
# 16-lane accumulator across all groups: per group, the products are summed
# into 16 lanes with FMAs and then one FMA adds them times the group's scale.
# int4 per core: 10.9 -> ~15 Gweights/s. Rows are passed as 1-D C-contiguous
# views; two rows share every load of x.

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V16F = ir.VectorType(_F32, 16)
_FAST = ("fast",)


def _row_view_ok(t, dtype) -> bool:
    return isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C" and t.dtype == dtype


def _splat(builder, value, vtype):
    undef = ir.Constant(vtype, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, vtype.count), [0] * vtype.count))


def _load_vec(builder, base, index, vtype, align):
    """Load vtype from &base[index]."""
    return builder.load(builder.bitcast(builder.gep(base, [index]), vtype.as_pointer()), align=align)


def _pieces16(builder, vec):
    """Split a <16k x float> into k <16 x float> (free after legalisation)."""
    undef = ir.Constant(vec.type, ir.Undefined)
    n = vec.type.count // 16
    return [builder.shuffle_vector(vec, undef, ir.Constant(ir.VectorType(_I32, 16), list(range(16 * i, 16 * i + 16))))
            for i in range(n)]


def _dot_pieces(builder, ws, xs):
    """sum_k ws[k] * xs[k] as one chain of FMAs (16 lanes)."""
    acc = builder.fmul(ws[0], xs[0], flags=_FAST)
    for w, x in zip(ws[1:], xs[1:]):
        acc = builder.fadd(builder.fmul(w, x, flags=_FAST), acc, flags=_FAST)
    return acc


def _avx512_host() -> bool:
    """True when numba compiles for this machine's CPU and it has AVX-512F."""
    from numba.core import config
    from llvmlite import binding

    if config.CPU_NAME or config.CPU_FEATURES:  # a portable or cross-target build: stay generic
        return False
    if os.environ.get("TIERLAB_INT4_TABLE", "1") == "0":  # the convert path, for A/B benchmarks
        return False
    try:
        return bool(binding.get_host_cpu_features().get("avx512f"))
    except RuntimeError:
        return False


# int4 widening by table lookup (AVX-512 `vpermps`): the permute reads only the
# low 4 bits of each 32-bit index, so a byte zero-extended to 32 bits indexes
# its low nibble directly and, shifted right by 4, its high nibble; the
# 16-entry table holds q - 8 as float32. Per 64 weights that is 2 zero-extends,
# 2 shifts and 4 permutes instead of masks, lane extracts, 4 zero-extends and
# 4 int->float converts, and the -8 needs no correction afterwards.
_PERMUTE_NIBBLES = _avx512_host()
_V16I = ir.VectorType(ir.IntType(32), 16)


def _nibbles_by_table(builder, q, g):
    """The 64 weights (q - 8, float32) of group g as four <16 x float> pieces in element order."""
    permute = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16F, [_V16F, _V16I]), "llvm.x86.avx512.permvar.sf.512")
    table = ir.Constant(_V16F, [float(v - 8) for v in range(16)])
    los, his = [], []
    for half in range(2):  # bytes 0-15 and 16-31 of the group
        start = builder.add(builder.mul(g, ir.Constant(_I64, 32)), ir.Constant(_I64, 16 * half))
        wide = builder.zext(_load_vec(builder, q, start, ir.VectorType(_I8, 16), 1), _V16I)
        los.append(builder.call(permute, [table, wide]))
        his.append(builder.call(permute, [table, builder.lshr(wide, ir.Constant(_V16I, [4] * 16))]))
    return los + his  # elements 0-15, 16-31 (low nibbles) | 32-47, 48-63 (high nibbles)


def _pair_group_loop(context, builder, signature, args, bits):
    """Emit the loop over groups for two rows; returns the (float32, float32) tuple."""
    arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:-1], args[:-1])]
    qa, sa, qb, sb, x = (a.data for a in arrays[:5])
    xsum8 = arrays[5].data if bits == 4 else None
    ahead = args[-1]
    n_groups = builder.extract_value(arrays[1].shape, 0)
    zero_v, zero_f = ir.Constant(_V16F, [0.0] * 16), ir.Constant(_F32, 0.0)

    entry = builder.block
    loop = builder.append_basic_block("groups")
    done = builder.append_basic_block("groups.done")
    builder.cbranch(builder.icmp_signed(">", n_groups, ir.Constant(_I64, 0)), loop, done)

    builder.position_at_end(loop)
    g = builder.phi(_I64)
    accs = [builder.phi(_V16F), builder.phi(_V16F)]
    offs = [builder.phi(_F32), builder.phi(_F32)]
    g.add_incoming(ir.Constant(_I64, 0), entry)
    for phi, init in zip(accs + offs, [zero_v, zero_v, zero_f, zero_f]):
        phi.add_incoming(init, entry)

    x0 = builder.mul(g, ir.Constant(_I64, GROUP))
    # prefetch, group by group, the same place `ahead` bytes on (in the rows a later step reads)
    group_bytes = ir.Constant(_I64, GROUP * bits // 8)
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
    for q in (qa, qb):
        at = builder.add(builder.mul(g, group_bytes), ahead)
        ptr = builder.gep(builder.bitcast(q, _I8.as_pointer()), [at])
        builder.call(prefetch, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
    x_pieces = [_load_vec(builder, x, builder.add(x0, ir.Constant(_I64, 16 * k)), _V16F, 4) for k in range(4)]
    new_accs, new_offs = [], []
    for q, s, acc, off in ((qa, sa, accs[0], offs[0]), (qb, sb, accs[1], offs[1])):
        scale = builder.load(builder.gep(s, [g]))
        if bits == 4 and _PERMUTE_NIBBLES:
            ws = _nibbles_by_table(builder, q, g)
            new_offs.append(off)  # the table gives q - 8 itself: no offset to take back
        elif bits == 4:
            raw = _load_vec(builder, q, builder.mul(g, ir.Constant(_I64, 32)), ir.VectorType(_I8, 32), 1)
            lo = builder.uitofp(builder.and_(raw, ir.Constant(raw.type, [15] * 32)), ir.VectorType(_F32, 32))
            hi = builder.uitofp(builder.lshr(raw, ir.Constant(raw.type, [4] * 32)), ir.VectorType(_F32, 32))
            ws = _pieces16(builder, lo) + _pieces16(builder, hi)  # elements 0-15, 16-31 | 32-47, 48-63
            xsum = builder.load(builder.gep(xsum8, [g]))
            new_offs.append(builder.fadd(builder.fmul(scale, xsum, flags=_FAST), off, flags=_FAST))
        else:
            raw = _load_vec(builder, q, x0, ir.VectorType(_I8, 64), 1)
            ws = _pieces16(builder, builder.sitofp(raw, ir.VectorType(_F32, 64)))
            new_offs.append(off)
        part = _dot_pieces(builder, ws, x_pieces)
        new_accs.append(builder.fadd(builder.fmul(part, _splat(builder, scale, _V16F), flags=_FAST), acc, flags=_FAST))
    g_next = builder.add(g, ir.Constant(_I64, 1))
    body_end = builder.block
    for phi, value in zip([g] + accs + offs, [g_next] + new_accs + new_offs):
        phi.add_incoming(value, body_end)
    builder.cbranch(builder.icmp_signed("<", g_next, n_groups), loop, done)

    builder.position_at_end(done)
    finals = []
    for acc_new, init, ty in zip(new_accs + new_offs, [zero_v, zero_v, zero_f, zero_f], [_V16F, _V16F, _F32, _F32]):
        phi = builder.phi(ty)
        phi.add_incoming(init, entry)
        phi.add_incoming(acc_new, body_end)
        finals.append(phi)
    reduce_fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_F32, [_F32, _V16F]), "llvm.vector.reduce.fadd.v16f32")
    results = []
    for acc, off in ((finals[0], finals[2]), (finals[1], finals[3])):
        total = builder.call(reduce_fn, [ir.Constant(_F32, -0.0), acc], fastmath=_FAST)
        results.append(builder.fsub(total, off, flags=_FAST))
    return context.make_tuple(builder, signature.return_type, results)


@intrinsic
def _int4_pair_dot(typingctx, qa, sa, qb, sb, x, xsum8, ahead):
    """(row_a . x, row_b . x) for planar-nibble int4 rows (uint8 views) and their scales;
    `ahead`: bytes from each row to the row the next step reads (prefetched as we go)."""
    if not (_row_view_ok(qa, types.uint8) and _row_view_ok(qb, types.uint8)
            and all(_row_view_ok(t, types.float32) for t in (sa, sb, x, xsum8))
            and isinstance(ahead, types.Integer)):
        return None
    sig = types.UniTuple(types.float32, 2)(qa, sa, qb, sb, x, xsum8, types.int64)
    return sig, lambda context, builder, signature, args: _pair_group_loop(context, builder, signature, args, 4)


@intrinsic
def _int8_pair_dot(typingctx, qa, sa, qb, sb, x, ahead):
    """(row_a . x, row_b . x) for int8 rows and their scales; `ahead` as for int4."""
    if not (_row_view_ok(qa, types.int8) and _row_view_ok(qb, types.int8)
            and all(_row_view_ok(t, types.float32) for t in (sa, sb, x)) and isinstance(ahead, types.Integer)):
        return None
    sig = types.UniTuple(types.float32, 2)(qa, sa, qb, sb, x, types.int64)
    return sig, lambda context, builder, signature, args: _pair_group_loop(context, builder, signature, args, 8)


# --- row dot products (LLVM inlines them into the parallel loops) --------------------------
# Each kind has a one-row and a two-row dot. Two rows share every load of x,
# which is what makes the int4 and bf16 loops fast (~1.3-1.8x over one row);
# the two rows may come from different matrices (gate row i with up row i).


def _as_f32(v):
    """A weight as float32: itself (fp32), or its bf16 bits widened (uint16)."""


@overload(_as_f32)
def _as_f32_impl(v):
    if v == types.float32:
        return lambda v: v
    return lambda v: _bf16_f32(v)


@njit(**_SERIAL)
def _dot_raw(w, r, x):
    """Row r of an fp32 or bf16 matrix dotted with x."""
    _wide_vectors()
    acc = np.float32(0.0)
    for c in range(x.shape[0]):
        acc += _as_f32(w[r, c]) * x[c]
    return acc


@njit(**_SERIAL)
def _dot2_raw(a, ra, b, rb, x):
    """Two fp32 or bf16 rows against one x."""
    _wide_vectors()
    sa = np.float32(0.0)
    sb = np.float32(0.0)
    for c in range(x.shape[0]):
        xc = x[c]
        sa += _as_f32(a[ra, c]) * xc
        sb += _as_f32(b[rb, c]) * xc
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
def _ahead_bytes(q, ra, rb):
    """How far ahead the int8/int4 group loops prefetch: the same place in the rows of the
    step at least _AHEAD_BYTES of this row's matrix later (a step takes rows 2p, 2p+1 of one
    matrix, or row p of two matrices when ra == rb)."""
    row = np.int64(q.strides[0])
    steps = max(np.int64(1), (np.int64(_AHEAD_BYTES) + row - 1) // row)
    return row * steps * (1 if ra == rb else 2)


@njit(**_SERIAL)
def _dot2_int8(qa, sa, ra, qb, sb, rb, x):
    _wide_vectors()
    return _int8_pair_dot(qa[ra], sa[ra], qb[rb], sb[rb], x, _ahead_bytes(qa, ra, rb))


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
    """Two int4 rows against one x (see _dot_int4 for the folded -8)."""
    _wide_vectors()
    return _int4_pair_dot(qa[ra], sa[ra], qb[rb], sb[rb], x, xsum8, _ahead_bytes(qa, ra, rb))


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
def _prefetch_next(mode, a, b, p):
    """Prefetch the rows of step p + 1 (see _prefetch_row); fp32 and bf16 passes.

    One step ahead measured best for bf16 (~1.2x from DRAM); two and four
    steps were no better.
    """
    i = np.int64(p) + 1
    if mode == GATE_UP:
        _prefetch_row(a, i)
        _prefetch_row(b, i)
    else:
        _prefetch_row(a, 2 * i)
        _prefetch_row(a, 2 * i + 1)


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
def _pass_raw(a, b, x, out, mode, w):
    """fp32 (float32) or bf16 (uint16) weights."""
    _wide_vectors()
    wf = np.float32(w)
    for p in prange(_steps(mode, a.shape[0])):
        _prefetch_next(mode, a, b, p)
        ra, rb = _pair_rows(mode, p)
        va, vb = _dot2_raw(a, ra, b, rb, x)
        _store(mode, out, ra, va, rb, vb, wf)
    if mode != GATE_UP and a.shape[0] % 2:
        r = a.shape[0] - 1
        v = _dot_raw(a, r, x)
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


# --- the same row passes over several tokens ------------------------------------------------
# A prompt's tokens routed to one expert: each step's rows are read once and
# dotted with every token by the very dot functions above, so each token gets
# what the one-token pass gives it, whichever tokens share the call. Modes SET
# and GATE_UP (out and x are [T, n]).


@njit(**_PARALLEL)
def _tokens_raw(a, b, x, out, mode):
    """fp32 (float32) or bf16 (uint16) weights."""
    _wide_vectors()
    for p in prange(_steps(mode, a.shape[0])):
        _prefetch_next(mode, a, b, p)
        ra, rb = _pair_rows(mode, p)
        for t in range(x.shape[0]):
            va, vb = _dot2_raw(a, ra, b, rb, x[t])
            _store(mode, out[t], ra, va, rb, vb, np.float32(1.0))
    if mode != GATE_UP and a.shape[0] % 2:
        r = a.shape[0] - 1
        for t in range(x.shape[0]):
            out[t, r] = _dot_raw(a, r, x[t])


@njit(**_PARALLEL)
def _tokens_int8(qa, sa, qb, sb, x, out, mode):
    _wide_vectors()
    for p in prange(_steps(mode, qa.shape[0])):
        ra, rb = _pair_rows(mode, p)
        for t in range(x.shape[0]):
            va, vb = _dot2_int8(qa, sa, ra, qb, sb, rb, x[t])
            _store(mode, out[t], ra, va, rb, vb, np.float32(1.0))
    if mode != GATE_UP and qa.shape[0] % 2:
        r = qa.shape[0] - 1
        for t in range(x.shape[0]):
            out[t, r] = _dot_int8(qa, sa, r, x[t])


@njit(**_PARALLEL)
def _tokens_int4(qa, sa, qb, sb, x, out, mode):
    _wide_vectors()
    xsum8 = np.empty((x.shape[0], sa.shape[1]), dtype=np.float32)
    for t in range(x.shape[0]):
        xsum8[t] = _group_sums8(x[t])
    for p in prange(_steps(mode, qa.shape[0])):
        ra, rb = _pair_rows(mode, p)
        for t in range(x.shape[0]):
            va, vb = _dot2_int4(qa, sa, ra, qb, sb, rb, x[t], xsum8[t])
            _store(mode, out[t], ra, va, rb, vb, np.float32(1.0))
    if mode != GATE_UP and qa.shape[0] % 2:
        r = qa.shape[0] - 1
        for t in range(x.shape[0]):
            out[t, r] = _dot_int4(qa, sa, r, x[t], xsum8[t])


# --- public entry points --------------------------------------------------------------------
# Plain Python on purpose: a numba function that calls another is re-optimised
# with the callee inlined, so njit wrappers here tripled the cold compile time
# (to ~40 s) for a saving of a few microseconds per call.


def _f32(x: np.ndarray) -> np.ndarray:
    """x as C-contiguous float32 (no copy when it already is)."""
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_matvec(rows: int, cols: int, x: np.ndarray, out: np.ndarray) -> None:
    """Shape errors would be out-of-bounds reads in the kernels: refuse them here."""
    if x.shape != (cols,) or out.shape != (rows,):
        raise ValueError(f"matvec of a {rows}x{cols} matrix needs x[{cols}] and out[{rows}], got {x.shape} and {out.shape}")


def _check_expert(blob: np.ndarray, nbytes: int, hidden: int, x: np.ndarray, y: np.ndarray) -> None:
    if blob.nbytes < nbytes or x.shape != (hidden,) or y.shape != (hidden,) or y.dtype != np.float32:
        raise ValueError(f"expert needs a blob of >= {nbytes} bytes, x[{hidden}] and float32 y[{hidden}]; "
                         f"got {blob.nbytes} bytes, x{x.shape}, y{y.shape} {y.dtype}")


def matvec_fp32(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = w @ x for float32 w [rows, cols] (C-contiguous)."""
    _check_matvec(w.shape[0], w.shape[1], x, out)
    _pass_raw(w, w, _f32(x), out, SET, 1.0)


def matvec_bf16(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = w @ x for bf16 w stored as uint16 [rows, cols]."""
    _check_matvec(w.shape[0], w.shape[1], x, out)
    _pass_raw(w, w, _f32(x), out, SET, 1.0)


def matvec_int8(q: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = dequant(q, scales) @ x; q int8 [rows, cols], scales float32 [rows, cols/64]."""
    _check_matvec(q.shape[0], scales.shape[1] * GROUP, x, out)
    _pass_int8(q, scales, q, scales, _f32(x), out, SET, 1.0)


def matvec_int4(q: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = dequant(q, scales) @ x; q planar-nibble uint8 [rows, cols/2], scales [rows, cols/64]."""
    _check_matvec(q.shape[0], scales.shape[1] * GROUP, x, out)
    _pass_int4(q, scales, q, scales, _f32(x), out, SET, 1.0)


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


def _expert_forward_raw(kind: str, blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray,
                        w: float) -> None:
    _check_expert(blob, raw_blob_nbytes(kind, hidden, inter), hidden, x, y)
    gate, up, down = raw_matrices(blob, kind, hidden, inter)
    h = np.empty(inter, np.float32)
    _pass_raw(gate, up, _f32(x), h, GATE_UP, 1.0)
    _pass_raw(down, down, h, y, ADD, float(w))


def _expert_forward_quant(bits: int, blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray,
                          w: float) -> None:
    _check_expert(blob, quant_blob_nbytes(bits, hidden, inter), hidden, x, y)
    qg, sg, qu, su, qd, sd = quant_matrices(blob, bits, hidden, inter)
    h = np.empty(inter, np.float32)
    passes = _pass_int8 if bits == 8 else _pass_int4
    passes(qg, sg, qu, su, _f32(x), h, GATE_UP, 1.0)
    passes(qd, sd, qd, sd, h, y, ADD, float(w))


def expert_forward_fp32(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * down(silu(gate x) * (up x)) for a raw float32 blob [gate | up | down]."""
    _expert_forward_raw("fp32", blob, hidden, inter, x, y, w)


def expert_forward_bf16(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * expert(x) for a raw bf16 (uint16) blob [gate | up | down]."""
    _expert_forward_raw("bf16", blob, hidden, inter, x, y, w)


def expert_forward_int8(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * expert(x) for an int8 container blob."""
    _expert_forward_quant(8, blob, hidden, inter, x, y, w)


def expert_forward_int4(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * expert(x) for an int4 container blob."""
    _expert_forward_quant(4, blob, hidden, inter, x, y, w)


def expert_forward_tokens(kind: str, blob: np.ndarray, hidden: int, inter: int, x: np.ndarray) -> np.ndarray:
    """down(silu(gate x_t) * (up x_t)) for each row x_t of x [n, hidden] -> [n, hidden].

    Each token's result is the one `EXPERT_FORWARD[kind]` gives it (added to a
    zero y with weight 1), and does not depend on the other tokens; the blob's
    rows are read once for all of them.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != hidden:
        raise ValueError(f"expert_forward_tokens needs x[n, {hidden}], got {x.shape}")
    n = x.shape[0]
    h = np.empty((n, inter), np.float32)
    y = np.empty((n, hidden), np.float32)
    if kind in ("fp32", "bf16"):
        _check_expert(blob, raw_blob_nbytes(kind, hidden, inter), hidden, x[0], y[0])
        gate, up, down = raw_matrices(blob, kind, hidden, inter)
        _tokens_raw(gate, up, x, h, GATE_UP)
        _tokens_raw(down, down, h, y, SET)
    else:
        bits = 8 if kind == "int8" else 4
        _check_expert(blob, quant_blob_nbytes(bits, hidden, inter), hidden, x[0], y[0])
        qg, sg, qu, su, qd, sd = quant_matrices(blob, bits, hidden, inter)
        tokens = _tokens_int8 if bits == 8 else _tokens_int4
        tokens(qg, sg, qu, su, x, h, GATE_UP)
        tokens(qd, sd, qd, sd, h, y, SET)
    return y


EXPERT_FORWARD = {
    "fp32": expert_forward_fp32,
    "bf16": expert_forward_bf16,
    "int8": expert_forward_int8,
    "int4": expert_forward_int4,
}

def raw_blob_nbytes(kind: str, hidden: int, inter: int) -> int:
    """Bytes of one raw fp32/bf16 expert blob [gate | up | down]."""
    return 3 * hidden * inter * {"fp32": 4, "bf16": 2}[kind]


def quant_blob_nbytes(bits: int, hidden: int, inter: int) -> int:
    """Bytes of one int8/int4 container blob (see engine/quant.BlobLayout)."""
    n = hidden * inter
    return 3 * (n * bits // 8 + n // GROUP * 4)
