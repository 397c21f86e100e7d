"""numba matvec and fused SwiGLU expert kernels for fp32, bf16, int8 and int4 weights.

Why this shape: decode is one token at a time, so every expert is a
matrix-vector product bound by memory bandwidth (or by the arithmetic per
weight). The row loops are emitted as explicit LLVM vectors (16 float32 or
int32 lanes):
- each iteration reads 64 bytes of four rows, which share every load of x,
  and prefetches the rows a later step reads;
- fp32 and bf16 multiply-add in float32 (bf16 widened by a shift);
- int8 and int4 use integer dot products (AVX-512 VNNI) against x written
  once per call as integer digits; on CPUs with AVX2 but no VNNI int4 uses
  the same digits with AVX2's byte and word multiply-adds and int8 is widened
  to float32; int4 uses planar nibbles (low nibbles are elements 0..31 of a
  64-group, high nibbles 32..63), so both halves line up with x;
- on CPUs without AVX-512 the row loops use 8-lane vectors, so that four
  rows' accumulators fit in sixteen registers;
- each group is scaled once per row, and the constant offsets (the nibbles'
  -8, int8's +128) come back once per group.

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
``experts_forward(kind, store, slots, hidden, inter, x, out, out_rows)`` runs a
token's experts of one layer, each a slot of a RAM store, in two parallel
launches for all of them, bit for bit what ``EXPERT_FORWARD`` gives each.
Measured speeds and what each trick bought: docs/benchmarks.md, "Kernels".
"""

from __future__ import annotations

import os

# numba's thread pool and how its workers wait: chosen in tierlab/__init__.py
# (engine/threading_layer.py), which runs before this module is imported, i.e.
# before numba's pool starts.

import numpy as np
import numba
from llvmlite import ir
from numba.np.ufunc import parallel as _numba_parallel
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from tierlab.engine.blob_layout import GROUP, blob_nbytes

_SERIAL = dict(nogil=True, cache=True, fastmath=True)
_PARALLEL = dict(nogil=True, cache=True, fastmath=True, parallel=True)

_F32 = ir.FloatType()


# --- small intrinsics ----------------------------------------------------------------------


@intrinsic
def bf16_f32(typingctx, b):
    """Exact bf16 (as uint16) -> float32: the bf16 bits are the high half of the float."""

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), _F32)

    return types.float32(types.uint16), codegen


@intrinsic
def wide_vectors(typingctx):
    """Let LLVM use 512-bit registers in the calling function.

    LLVM's default tuning for recent Intel cores prefers 256-bit vectors; these
    widen-and-FMA loops do twice the work per instruction with 512-bit ones
    (docs/benchmarks.md, Kernels). The function attributes are ignored on CPUs
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


# --- software prefetch of the rows ahead -----------------------------------------------------
# A row of an expert matrix is 256 bytes to 8 KiB, so the hardware prefetcher,
# which stops at every 4 KiB page and needs a few misses to ramp up, leaves
# each new row to start cold, and from DRAM the loads of a cold row stall the
# loop. Every row loop below therefore prefetches as it goes, one line per 64
# bytes it reads, the same place in the rows a later step reads, this many
# bytes ahead (rounded up to whole steps): on short rows one step ahead is too
# close to hide DRAM latency. Prefetching a whole row at the start of a step
# instead fills the core's line-fill buffers in a burst and stalls its own
# loads. Figures: docs/benchmarks.md, Kernels ("Row loops").
_AHEAD_BYTES = 2048


# --- explicit-vector group loops for int4 and int8 -----------------------------------------
# LLVM's vectoriser reduces each 64-group to a scalar before scaling it (five
# shuffles and adds per group and row). Written out by hand, each row keeps a
# 16-lane accumulator across all groups: per group, the products are summed
# into 16 lanes with FMAs and then one FMA adds them times the group's scale,
# with no horizontal sum per group (docs/benchmarks.md, Kernels). Each call of
# a row intrinsic below works on four rows of two 2-D matrices (rows r0, r1 of
# the first, r2, r3 of the second), which share every load of x; the rows are
# found by pointer arithmetic.

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V16F = ir.VectorType(_F32, 16)


def _row_view_ok(t, dtype) -> bool:
    return isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C" and t.dtype == dtype


def _splat(builder, value, vtype):
    undef = ir.Constant(vtype, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, vtype.count), [0] * vtype.count))


def _vector_of(builder, values, lanes):
    """The lanes `lanes` (indices, in order) of the vector `values`, as a vector."""
    undef = ir.Constant(values.type, ir.Undefined)
    return builder.shuffle_vector(values, undef, ir.Constant(ir.VectorType(_I32, len(lanes)), list(lanes)))


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
    acc = builder.fmul(ws[0], xs[0])
    for w, x in zip(ws[1:], xs[1:]):
        acc = _fma(builder, w, x, acc)
    return acc


def _host_has(*features: str) -> bool:
    """True when numba compiles for this machine's CPU and it has all `features`."""
    from numba.core import config
    from llvmlite import binding

    if config.CPU_NAME or config.CPU_FEATURES:  # a portable or cross-target build: stay generic
        return False
    try:
        host = binding.get_host_cpu_features()
    except RuntimeError:
        return False
    return all(host.get(f) for f in features)


# Integer dot products (AVX-512 VNNI, `vpdpbusd`: 64 u8 x s8 products summed
# four by four into 16 int32 lanes, in one instruction). x is written once per
# call as an integer X = x / u per group (u = max|x| / (126 * 128^2), the
# unit) and split into three signed base-128 digits, X = d0 128^2 + d1 128 + d2;
# the weights stay as they are (int4 nibbles 0..15, int8 bytes + 128 as u8),
# the digits are dotted one after the other into one int32 accumulator shifted
# by 7 bits between them, and the constant offset (8 or 128 times the sum of X)
# is subtracted as an integer. The only rounding is x to X: under 0.75 u (half
# a step, plus float32's rounding of x / u before it is rounded to a step) =
# 3.6e-7 of the group's largest |x|, far inside the 1e-5 the kernels are
# tested to (a group whose largest |x| is below 2.4e-32 counts as zero). Per
# 64 int4 weights that is about 8 vector operations instead of 13, and each
# 16 lanes of the result need one int->float conversion.
# Wraparound makes the int32 arithmetic exact whenever the final sum fits,
# which |q - 8| <= 8 (|q| <= 127) and |X| <= 126 * 128^2 guarantee.
# `TIERLAB_VNNI=0` compiles the float path instead, also in place of the AVX2
# integer path below (give it its own
# NUMBA_CACHE_DIR: numba's disk cache does not know the switch).
_VNNI = os.environ.get("TIERLAB_VNNI", "1") != "0" and _host_has("avx512f", "avx512bw", "avx512vnni")
_DIGIT_BITS = 7
_UNIT_STEPS = 126.0 * 128.0 * 128.0
_SMALLEST_UNIT = np.finfo(np.float32).tiny  # a smaller (subnormal) unit loses bits, 1/unit overflows
_V16I = ir.VectorType(_I32, 16)

# CPUs without AVX-512 have sixteen 256-bit registers: the 16-lane loops above need
# about 32 of them for four rows' accumulators and x and spill on every step, so there
# the float and raw row loops are written with 8-lane vectors instead (below,
# "8-lane row loops").
_WIDE = _host_has("avx512f")
_V64B = ir.VectorType(_I8, 64)


# AVX2 without VNNI: int4 by integer dot products all the same. `vpmaddubsw` (32 u8 x s8
# products summed two by two into 16 int16 lanes) followed by `vpmaddwd` (pairs summed
# into 8 int32 lanes) gives, lane by lane, the four-byte sums that `vpdpbusd` gives,
# from the same prepared x (digits, unit, corr; see above), so the integer sums are the
# VNNI path's exactly. `vpmaddwd` multiplies digit d's pairs by 128^(2-d) as it sums
# them, which is the VNNI path's shift by 7 bits between digits without the shifts
# (the same int32 sums, wraparound included). The int16 lanes cannot saturate: a nibble
# is at most 15 and a digit at most 126 in magnitude, so the low and the high nibbles'
# products of one digit add to at most 4 * 15 * 126 = 7560. int8 bytes (up to 255 as
# u8) times the top digit could saturate, so int8 keeps the float path there. Per 64
# int4 weights and row that is about 21 vector operations instead of the float path's
# 28, and the weights are never converted to float.
_AVX2_INT4 = os.environ.get("TIERLAB_VNNI", "1") != "0" and not _VNNI and _host_has("avx2")
_V32B = ir.VectorType(_I8, 32)
_V16S = ir.VectorType(ir.IntType(16), 16)
_V8I = ir.VectorType(_I32, 8)
INT_PATH = "vnni" if _VNNI else ("avx2-int4" if _AVX2_INT4 else "float")  # how int8/int4 compute here


@njit(**_SERIAL)
def _integer_dots(bits):
    """True when x is prepared as digits for integer dot products with `bits`-bit weights."""
    return _VNNI or (_AVX2_INT4 and bits == 4)


@njit(**_SERIAL)
def _operands_per_block(bits):
    """u8 operands a 64-byte block of one row gives: int4 low and high nibbles; int8 the bytes."""
    return 2 if bits == 4 else 1


def _counted_loop(builder, count, inits, body):
    """Emit `for i in range(count)` carrying the values `inits`; body(i, values) -> new values.
    Returns the values after the loop (the inits when count <= 0)."""
    entry = builder.block
    loop = builder.append_basic_block("loop")
    done = builder.append_basic_block("loop.done")
    builder.cbranch(builder.icmp_signed(">", count, ir.Constant(_I64, 0)), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(_I64)
    carried = [builder.phi(v.type) for v in inits]
    i.add_incoming(ir.Constant(_I64, 0), entry)
    for phi, v in zip(carried, inits):
        phi.add_incoming(v, entry)
    new = body(i, carried)
    i_next = builder.add(i, ir.Constant(_I64, 1))
    end = builder.block
    i.add_incoming(i_next, end)
    for phi, v in zip(carried, new):
        phi.add_incoming(v, end)
    builder.cbranch(builder.icmp_signed("<", i_next, count), loop, done)
    builder.position_at_end(done)
    finals = []
    for v, n in zip(inits, new):
        phi = builder.phi(v.type)
        phi.add_incoming(v, entry)
        phi.add_incoming(n, end)
        finals.append(phi)
    return finals


# The prefetches' target: L2 (`prefetcht1`, LLVM locality 2) on every CPU. On AMD Zen
# cores a `prefetcht0` (into L1) of every line left bf16, int8 and fp32 rows reading
# from DRAM at half the rate or less, most at 2048x512; on a Xeon with AMX (which LLVM
# names "rocketlake" in its VM) L2 read int4 and int8 rows 5-9% faster than L1 and
# decoded int4 + dense int4 5% faster (docs/benchmarks.md, Kernels).
_PREFETCH_LOCALITY = 2


def _prefetch(builder, ptr, offset):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
    at = builder.gep(builder.bitcast(ptr, _I8.as_pointer()), [offset])
    builder.call(fn, [at, ir.Constant(_I32, 0), ir.Constant(_I32, _PREFETCH_LOCALITY), ir.Constant(_I32, 1)])


@intrinsic
def _prefetch_head(typingctx, a, r0, nbytes):
    """Prefetch `nbytes` of a 2-D array from the start of row r0, a line at a time (the
    head of a thread's rows, while it prepares x: see `_pass`)."""
    if not (isinstance(a, types.Array) and a.ndim == 2 and isinstance(r0, types.Integer)
            and isinstance(nbytes, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        start = _row_start(context, builder, arr, args[1], signature.args[1])
        n = context.cast(builder, args[2], signature.args[2], types.int64)
        lines = builder.sdiv(builder.add(n, ir.Constant(_I64, 63)), ir.Constant(_I64, 64))

        def body(i, carried):
            _prefetch(builder, start, builder.mul(i, ir.Constant(_I64, 64)))
            return carried

        _counted_loop(builder, lines, [ir.Constant(_I64, 0)], body)
        return context.get_dummy_value()

    return types.none(a, r0, nbytes), codegen


def _halving_sum(builder, vec):
    """The sum of a float vector's lanes in one fixed order (halves added until one lane)."""
    while vec.type.count > 1:
        half = vec.type.count // 2
        vec = builder.fadd(_vector_of(builder, vec, range(half)), _vector_of(builder, vec, range(half, 2 * half)))
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def _fma(builder, a, b, c):
    """a * b + c, rounded once in every compile of the kernel."""
    name = f"llvm.fma.v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(fn, [a, b, c])


def _vnni_block(builder, q, s, block, digits, unit, corr, bits, half):
    """16 float lanes of one row's 64-byte block (int4: groups 2b, 2b+1; int8: group b) and
    what each lane is multiplied by (its scale times its unit), to be added to the row's
    accumulator with one FMA; `half`: the block is an int4 row's odd last group (32 bytes)."""
    dot = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16I, [_V16I, _V16I, _V16I]), "llvm.x86.avx512.vpdpbusd.512")
    start = builder.mul(block, ir.Constant(_I64, 64))
    if half:  # 32 bytes, zero-extended: the missing group's lanes come out 0
        raw = _load_vec(builder, q, start, ir.VectorType(_I8, 32), 1)
        raw = builder.shuffle_vector(raw, ir.Constant(raw.type, None), ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
    else:
        raw = _load_vec(builder, q, start, _V64B, 1)
    if bits == 4:
        operands = [builder.and_(raw, ir.Constant(_V64B, [15] * 64)), builder.lshr(raw, ir.Constant(_V64B, [4] * 64))]
    else:
        operands = [builder.xor(raw, ir.Constant(_V64B, [0x80] * 64))]
    operands = [builder.bitcast(op, _V16I) for op in operands]
    acc = ir.Constant(_V16I, [0] * 16)
    for d in range(3):
        if d:
            acc = builder.shl(acc, ir.Constant(_V16I, [_DIGIT_BITS] * 16))
        for k, op in enumerate(operands):
            at = builder.add(builder.mul(block, ir.Constant(_I64, 64 * 3 * len(operands))),
                             ir.Constant(_I64, 64 * (d * len(operands) + k)))
            digit = builder.bitcast(_load_vec(builder, digits, at, _V64B, 1), _V16I)
            acc = builder.call(dot, [acc, op, digit])
    lanes = builder.mul(block, ir.Constant(_I64, 16))
    acc = builder.sub(acc, _load_vec(builder, corr, lanes, _V16I, 4))
    if bits == 4 and not half:  # lanes 0-7 belong to group 2b, 8-15 to group 2b+1
        pair = _load_vec(builder, s, builder.mul(block, ir.Constant(_I64, 2)), ir.VectorType(_F32, 2), 4)
        scale = builder.shuffle_vector(pair, ir.Constant(pair.type, None), ir.Constant(ir.VectorType(_I32, 16), [0] * 8 + [1] * 8))
    else:
        group = builder.mul(block, ir.Constant(_I64, 2)) if bits == 4 else block
        scale = _splat(builder, builder.load(builder.gep(s, [group])), _V16F)
    weight = builder.fmul(scale, _load_vec(builder, unit, lanes, _V16F, 4))
    return builder.sitofp(acc, _V16F), weight


def _row_start(context, builder, arr, index, index_type):
    """Pointer to row `index` of a 2-D array struct: plain arithmetic, so that the passes
    hand the intrinsics whole matrices and row numbers instead of a numba row view (an
    array struct, and its reference count, per row and step)."""
    r = context.cast(builder, index, index_type, types.int64)
    row_bytes = builder.extract_value(arr.strides, 0)
    start = builder.gep(builder.bitcast(arr.data, _I8.as_pointer()), [builder.mul(r, row_bytes)])
    return builder.bitcast(start, arr.data.type)


def _four_rows(context, builder, signature, args, k):
    """For args (m_1, ..., m_k, r0, r1, r2, r3, ...), where the first k/2 matrices give rows
    r0 and r1 and the others rows r2 and r3 (weights a, scales a, weights b, scales b; or
    a, b): for each of the first k/2 matrices, the four row pointers; and all k structs."""
    arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in range(k)]
    half = k // 2
    rows = [[] for _ in range(half)]
    for j in range(4):
        first = 0 if j < 2 else half
        for m in range(half):
            rows[m].append(_row_start(context, builder, arrays[first + m], args[k + j], signature.args[k + j]))
    return rows, arrays


# A row's scales are a stream of their own (float32 per 64-weight group: 8 bytes per 64-byte
# block of int4 rows, 4 of int8) that the hardware prefetcher alone did not keep ahead of: with
# the scales of the rows `ahead` prefetched too, a line per 64 bytes of them, two threads
# read int4 4096x2048 and int8 512x2048 rows 17-20% faster from DRAM on the Zen 4, the
# other expert shapes 0-8% (docs/benchmarks.md, Kernels: "The scales prefetched too").
_SCALE_BYTES = {4: 8, 8: 4}


def _vnni_rows_loop(context, builder, signature, args, bits):
    """Four rows by VNNI (see above); returns the 4-tuple of float32 dots."""
    (qs, ss), arrays = _four_rows(context, builder, signature, args, 4)
    n_groups = builder.extract_value(arrays[1].shape, 1)
    digits, unit, corr = (context.make_array(t)(context, builder, v).data
                          for t, v in zip(signature.args[9:12], args[9:12]))
    ahead = args[-1]
    blocks = builder.sdiv(n_groups, ir.Constant(_I64, 2)) if bits == 4 else n_groups
    zero = ir.Constant(_V16F, [0.0] * 16)
    # the rows' scales ahead too, at the first block of each 64 bytes of them (see
    # _SCALE_BYTES): `ahead` bytes of weight rows are ahead * scale_bytes / 64 of their scales
    scale_bytes = ir.Constant(_I64, _SCALE_BYTES[bits])
    line_mask = ir.Constant(_I64, 64 // _SCALE_BYTES[bits] - 1)
    scales_ahead = builder.sdiv(builder.mul(ahead, scale_bytes), ir.Constant(_I64, 64))

    def sweep(rows):
        def body(b, accs):
            out = []
            for (q, s), acc in zip(rows, accs):
                _prefetch(builder, q, builder.add(builder.mul(b, ir.Constant(_I64, 64)), ahead))
                out.append(_fma(builder, *_vnni_block(builder, q, s, b, digits, unit, corr, bits, False), acc))
            line_start = builder.icmp_signed("==", builder.and_(b, line_mask), ir.Constant(_I64, 0))
            with builder.if_then(line_start):
                for q, s in rows:
                    _prefetch(builder, s, builder.add(builder.mul(b, scale_bytes), scales_ahead))
            return out

        accs = _counted_loop(builder, blocks, [zero] * len(rows), body)
        if bits == 4:  # an odd last group
            odd = builder.icmp_signed("!=", builder.srem(n_groups, ir.Constant(_I64, 2)), ir.Constant(_I64, 0))
            before = builder.block
            with builder.if_then(odd):
                tails = [_fma(builder, *_vnni_block(builder, q, s, blocks, digits, unit, corr, bits, True), acc)
                         for (q, s), acc in zip(rows, accs)]
                inside = builder.block
            merged = []
            for acc, tail in zip(accs, tails):
                phi = builder.phi(_V16F)
                phi.add_incoming(acc, before)
                phi.add_incoming(tail, inside)
                merged.append(phi)
            accs = merged
        return [_halving_sum(builder, acc) for acc in accs]

    return context.make_tuple(builder, signature.return_type, sweep(list(zip(qs, ss))))


def _float_rows_loop(context, builder, signature, args, bits):
    """N rows widened to float32 (CPUs without VNNI); returns the N-tuple of float32 dots.

    int4 nibbles are used unsigned; the -8 comes back once per group as
    scale * 8 * sum(x in group), from `unit` (= 8 * group sums of x here)."""
    (qs, ss), arrays = _four_rows(context, builder, signature, args, 4)
    n_groups = builder.extract_value(arrays[1].shape, 1)
    x, _digits, xsum8 = (context.make_array(t)(context, builder, v).data
                         for t, v in zip(signature.args[8:11], args[8:11]))
    ahead = args[-1]
    n = len(qs)
    zero_v, zero_f = ir.Constant(_V16F, [0.0] * 16), ir.Constant(_F32, 0.0)
    group_bytes = ir.Constant(_I64, GROUP * bits // 8)

    def body(g, carried):
        x0 = builder.mul(g, ir.Constant(_I64, GROUP))
        x_pieces = [_load_vec(builder, x, builder.add(x0, ir.Constant(_I64, 16 * k)), _V16F, 4) for k in range(4)]
        accs, offs = [], []
        for q, s, acc, off in zip(qs, ss, carried[:n], carried[n:]):
            _prefetch(builder, q, builder.add(builder.mul(g, group_bytes), ahead))
            scale = builder.load(builder.gep(s, [g]))
            if bits == 4:
                raw = _load_vec(builder, q, builder.mul(g, ir.Constant(_I64, 32)), ir.VectorType(_I8, 32), 1)
                lo = builder.uitofp(builder.and_(raw, ir.Constant(raw.type, [15] * 32)), ir.VectorType(_F32, 32))
                hi = builder.uitofp(builder.lshr(raw, ir.Constant(raw.type, [4] * 32)), ir.VectorType(_F32, 32))
                ws = _pieces16(builder, lo) + _pieces16(builder, hi)  # elements 0-15, 16-31 | 32-47, 48-63
                xsum = builder.load(builder.gep(xsum8, [g]))
                off = _fma(builder, scale, xsum, off)
            else:
                raw = _load_vec(builder, q, x0, ir.VectorType(_I8, 64), 1)
                ws = _pieces16(builder, builder.sitofp(raw, ir.VectorType(_F32, 64)))
            part = _dot_pieces(builder, ws, x_pieces)
            accs.append(_fma(builder, part, _splat(builder, scale, _V16F), acc))
            offs.append(off)
        return accs + offs

    finals = _counted_loop(builder, n_groups, [zero_v] * n + [zero_f] * n, body)
    results = [builder.fsub(_halving_sum(builder, acc), off) for acc, off in zip(finals[:n], finals[n:])]
    return context.make_tuple(builder, signature.return_type, results)


def _matrix_ok(t, dtype) -> bool:
    return isinstance(t, types.Array) and t.ndim == 2 and t.layout == "C" and t.dtype == dtype


@intrinsic
def _rows_dot(typingctx, a, sa, b, sb, r0, r1, r2, r3, x, digits, unit, corr, ahead):
    """(row . x for rows r0, r1 of a and r2, r3 of b), 2-D weights of one kind: fp32, bf16
    (uint16), int8, or int4 (planar-nibble uint8) with their scales sa, sb (ignored for
    fp32 and bf16, whose columns past the last whole 64 bytes _columns_left adds);
    (digits, unit, corr): x as _prepare_x gives it; `ahead`: bytes from each row to the
    place a later step reads (prefetched as the loop goes)."""
    kind = a.dtype if isinstance(a, types.Array) else None
    if not (kind in (types.float32, types.uint16, types.uint8, types.int8)
            and _matrix_ok(a, kind) and _matrix_ok(b, kind)
            and all(isinstance(r, types.Integer) for r in (r0, r1, r2, r3, ahead))
            and all(_row_view_ok(t, types.float32) for t in (x, unit))
            and _row_view_ok(digits, types.int8) and _row_view_ok(corr, types.int32)):
        return None
    sig = types.UniTuple(types.float32, 4)(a, sa, b, sb, r0, r1, r2, r3, x, digits, unit, corr, types.int64)
    if kind in (types.float32, types.uint16):
        return sig, (_raw_rows_loop if _WIDE else _narrow_raw_rows_loop)
    if not (_matrix_ok(sa, types.float32) and _matrix_ok(sb, types.float32)):
        return None
    bits = 4 if kind == types.uint8 else 8
    if _VNNI:
        emit = _vnni_rows_loop
    elif _AVX2_INT4 and bits == 4:
        emit = _avx2_int4_rows_loop
    else:
        emit = _float_rows_loop if _WIDE else _narrow_float_rows_loop
    return sig, lambda context, builder, signature, args: emit(context, builder, signature, args, bits)


def _raw_rows_loop(context, builder, signature, args):
    """Four fp32 or bf16 rows, 64 bytes of each per iteration, prefetching `ahead` bytes on
    (the columns past the last whole 64 bytes are left to _columns_left)."""
    (rows, _no_scales), (a, *_rest) = _four_rows(context, builder, signature, args, 4)
    x = context.make_array(signature.args[8])(context, builder, args[8]).data
    ahead = args[-1]
    bf16 = signature.args[0].dtype == types.uint16
    per_line = 32 if bf16 else 16  # weights in 64 bytes
    pieces = per_line // 16
    lines = builder.sdiv(builder.extract_value(a.shape, 1), ir.Constant(_I64, per_line))
    zero = ir.Constant(_V16F, [0.0] * 16)

    def body(i, accs):
        start = builder.mul(i, ir.Constant(_I64, per_line))
        xs = [_load_vec(builder, x, builder.add(start, ir.Constant(_I64, 16 * k)), _V16F, 4) for k in range(pieces)]
        out = []
        for r, row in enumerate(rows):
            _prefetch(builder, row, builder.add(builder.mul(i, ir.Constant(_I64, 64)), ahead))
            if bf16:  # the bf16 bits are the high half of the float32
                raw = _load_vec(builder, row, start, ir.VectorType(ir.IntType(16), 32), 2)
                wide = builder.shl(builder.zext(raw, ir.VectorType(_I32, 32)), ir.Constant(ir.VectorType(_I32, 32), [16] * 32))
                ws = _pieces16(builder, builder.bitcast(wide, ir.VectorType(_F32, 32)))
            else:
                ws = [_load_vec(builder, row, start, _V16F, 4)]
            for k in range(pieces):
                out.append(_fma(builder, ws[k], xs[k], accs[r * pieces + k]))
        return out

    accs = _counted_loop(builder, lines, [zero] * (len(rows) * pieces), body)
    sums = []
    for r in range(len(rows)):
        total = accs[r * pieces]
        for k in range(1, pieces):
            total = builder.fadd(total, accs[r * pieces + k])
        sums.append(_halving_sum(builder, total))
    return context.make_tuple(builder, signature.return_type, sums)


# --- 8-lane row loops (CPUs without AVX-512) -----------------------------------------------
# The same sums as the 16-lane loops, emitted piece by piece: each 8-float piece
# of x is loaded, used by every row of the sweep and dropped, each row keeps one
# 8-lane accumulator (bf16: two), and the weights are widened straight from
# memory (`vpmovzxbd`/`vpmovsxbd`/`vpmovzxwd` from 8 bytes or 8 halves), so the
# live values fit in sixteen registers and nothing is shuffled across lanes.

_NARROW = 8
_V8F = ir.VectorType(_F32, _NARROW)
# rows per loop over the groups: four in both; the AVX2 int4 loop then keeps some of
# x's six digit vectors of a group on the stack, which still beats two rows per loop,
# where each digit vector is loaded twice as often (docs/benchmarks.md, Kernels)
_FLOAT_SWEEP, _INT4_SWEEP = 4, 4


def _fma_acc(builder, w, x, acc):
    """acc + w * x (acc None: w * x)."""
    return builder.fmul(w, x) if acc is None else _fma(builder, w, x, acc)


def _widened8(builder, base, index, itype, signed):
    """8 integers of type itype from &base[index], widened to int32."""
    raw = _load_vec(builder, base, index, ir.VectorType(itype, _NARROW), 1)
    wide = ir.VectorType(_I32, _NARROW)
    return builder.sext(raw, wide) if signed else builder.zext(raw, wide)


def _narrow_float_rows_loop(context, builder, signature, args, bits):
    """Four rows widened to float32 with 8-lane vectors, `_FLOAT_SWEEP` rows per loop over
    the groups; the same sums as _float_rows_loop (int4 nibbles unsigned, the -8 back once
    per group from `unit` = 8 * group sums of x)."""
    (qs, ss), arrays = _four_rows(context, builder, signature, args, 4)
    n_groups = builder.extract_value(arrays[1].shape, 1)
    x, _digits, xsum8 = (context.make_array(t)(context, builder, v).data
                         for t, v in zip(signature.args[8:11], args[8:11]))
    ahead = args[-1]
    zero_v, zero_f = ir.Constant(_V8F, [0.0] * _NARROW), ir.Constant(_F32, 0.0)
    group_bytes = ir.Constant(_I64, GROUP * bits // 8)
    i8 = ir.IntType(8)

    def sweep(rows):
        n = len(rows)

        def body(g, carried):
            x0 = builder.mul(g, ir.Constant(_I64, GROUP))
            q0 = builder.mul(g, group_bytes)
            parts = [None] * n
            for q, _s in rows:
                _prefetch(builder, q, builder.add(q0, ahead))
            if bits == 4:  # byte j holds element j (low nibble) and j + 32 (high nibble)
                for b in range(0, GROUP // 2, _NARROW):
                    x_lo = _load_vec(builder, x, builder.add(x0, ir.Constant(_I64, b)), _V8F, 4)
                    x_hi = _load_vec(builder, x, builder.add(x0, ir.Constant(_I64, b + 32)), _V8F, 4)
                    for k, (q, _s) in enumerate(rows):
                        raw = _widened8(builder, q, builder.add(q0, ir.Constant(_I64, b)), i8, False)
                        lo = builder.uitofp(builder.and_(raw, ir.Constant(raw.type, [15] * _NARROW)), _V8F)
                        hi = builder.uitofp(builder.lshr(raw, ir.Constant(raw.type, [4] * _NARROW)), _V8F)
                        parts[k] = _fma_acc(builder, hi, x_hi, _fma_acc(builder, lo, x_lo, parts[k]))
            else:
                for b in range(0, GROUP, _NARROW):
                    xb = _load_vec(builder, x, builder.add(x0, ir.Constant(_I64, b)), _V8F, 4)
                    for k, (q, _s) in enumerate(rows):
                        raw = _widened8(builder, q, builder.add(q0, ir.Constant(_I64, b)), i8, True)
                        parts[k] = _fma_acc(builder, builder.sitofp(raw, _V8F), xb, parts[k])
            accs, offs = [], []
            for (q, s), part, acc, off in zip(rows, parts, carried[:n], carried[n:]):
                scale = builder.load(builder.gep(s, [g]))
                if bits == 4:
                    xsum = builder.load(builder.gep(xsum8, [g]))
                    off = _fma(builder, scale, xsum, off)
                accs.append(_fma(builder, part, _splat(builder, scale, _V8F), acc))
                offs.append(off)
            return accs + offs

        finals = _counted_loop(builder, n_groups, [zero_v] * n + [zero_f] * n, body)
        return [builder.fsub(_halving_sum(builder, acc), off) for acc, off in zip(finals[:n], finals[n:])]

    pairs = list(zip(qs, ss))
    results = []
    for start in range(0, 4, _FLOAT_SWEEP):
        results += sweep(pairs[start:start + _FLOAT_SWEEP])
    return context.make_tuple(builder, signature.return_type, results)


def _avx2_int4_rows_loop(context, builder, signature, args, bits):
    """Four int4 rows by AVX2 integer dot products (see above _AVX2_INT4), one 32-byte
    group per row and step, `_INT4_SWEEP` rows per loop over the groups; returns the
    4-tuple of float32 dots."""
    (qs, ss), arrays = _four_rows(context, builder, signature, args, 4)
    n_groups = builder.extract_value(arrays[1].shape, 1)
    digits, unit, corr = (context.make_array(t)(context, builder, v).data
                          for t, v in zip(signature.args[9:12], args[9:12]))
    ahead = args[-1]
    ubsw = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16S, [_V32B, _V32B]), "llvm.x86.avx2.pmadd.ub.sw")
    wd = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V8I, [_V16S, _V16S]), "llvm.x86.avx2.pmadd.wd")
    # vpmaddwd against 128^(2-d) instead of ones weights digit d's pair sums as it adds them
    digit_weights = [ir.Constant(_V16S, [1 << (_DIGIT_BITS * (2 - d))] * 16) for d in range(3)]
    zero = ir.Constant(_V8F, [0.0] * _NARROW)

    def group(rows, accs, block, half):
        """accs + the rows' group 2 block + half (half a constant 0 or 1: its digits, units
        and offsets lie at constant distances from the block's)."""
        # digits of this group: block * 384 + d * 128 + operand * 64 + 32 * half
        d0 = builder.add(builder.mul(block, ir.Constant(_I64, 384)), ir.Constant(_I64, 32 * half))
        lanes = builder.add(builder.mul(block, ir.Constant(_I64, 16)), ir.Constant(_I64, 8 * half))
        g = builder.add(builder.mul(block, ir.Constant(_I64, 2)), ir.Constant(_I64, half))
        xd = [[_load_vec(builder, digits, builder.add(d0, ir.Constant(_I64, 128 * d + 64 * op)), _V32B, 1)
               for op in range(2)] for d in range(3)]
        u = _load_vec(builder, unit, lanes, _V8F, 4)
        c = _load_vec(builder, corr, lanes, _V8I, 4)
        start = builder.mul(g, ir.Constant(_I64, 32))
        out = []
        for (q, s), acc in zip(rows, accs):
            _prefetch(builder, q, builder.add(start, ahead))
            raw = _load_vec(builder, q, start, _V32B, 1)
            ops = [builder.and_(raw, ir.Constant(_V32B, [15] * 32)), builder.lshr(raw, ir.Constant(_V32B, [4] * 32))]
            total = None
            for d in range(3):  # the pairs' sums times 128^2, 128 and 1, summed: no shifts
                pairs = builder.add(builder.call(ubsw, [ops[0], xd[d][0]]), builder.call(ubsw, [ops[1], xd[d][1]]))
                part = builder.call(wd, [pairs, digit_weights[d]])
                total = part if total is None else builder.add(total, part)
            total = builder.sub(total, c)
            weight = builder.fmul(u, _splat(builder, builder.load(builder.gep(s, [g])), _V8F))
            out.append(_fma(builder, builder.sitofp(total, _V8F), weight, acc))
        return out

    def sweep(rows):
        blocks = builder.sdiv(n_groups, ir.Constant(_I64, 2))
        accs = _counted_loop(builder, blocks, [zero] * len(rows),
                             lambda b, accs: group(rows, group(rows, accs, b, 0), b, 1))
        odd = builder.icmp_signed("!=", builder.srem(n_groups, ir.Constant(_I64, 2)), ir.Constant(_I64, 0))
        before = builder.block
        with builder.if_then(odd):  # the odd last group
            tails = group(rows, accs, blocks, 0)
            inside = builder.block
        merged = []
        for acc, tail in zip(accs, tails):
            phi = builder.phi(_V8F)
            phi.add_incoming(acc, before)
            phi.add_incoming(tail, inside)
            merged.append(phi)
        return [_halving_sum(builder, acc) for acc in merged]

    pairs = list(zip(qs, ss))
    results = []
    for start in range(0, 4, _INT4_SWEEP):
        results += sweep(pairs[start:start + _INT4_SWEEP])
    return context.make_tuple(builder, signature.return_type, results)


def _narrow_raw_rows_loop(context, builder, signature, args):
    """Four fp32 or bf16 rows with 8-lane vectors, 64 bytes of each per iteration, all four
    in one loop (the columns past the last whole 64 bytes are left to _columns_left)."""
    (rows, _no_scales), (a, *_rest) = _four_rows(context, builder, signature, args, 4)
    x = context.make_array(signature.args[8])(context, builder, args[8]).data
    ahead = args[-1]
    bf16 = signature.args[0].dtype == types.uint16
    per_line = 32 if bf16 else 16  # weights in 64 bytes
    pieces = per_line // _NARROW
    n_acc = 2  # accumulators per row: two chains of multiply-adds
    lines = builder.sdiv(builder.extract_value(a.shape, 1), ir.Constant(_I64, per_line))
    zero = ir.Constant(_V8F, [0.0] * _NARROW)
    shift = ir.Constant(ir.VectorType(_I32, _NARROW), [16] * _NARROW)

    def body(i, accs):
        start = builder.mul(i, ir.Constant(_I64, per_line))
        out = list(accs)
        for row in rows:
            _prefetch(builder, row, builder.add(builder.mul(i, ir.Constant(_I64, 64)), ahead))
        for k in range(pieces):
            at = builder.add(start, ir.Constant(_I64, _NARROW * k))
            xk = _load_vec(builder, x, at, _V8F, 4)
            for r, row in enumerate(rows):
                if bf16:  # the bf16 bits are the high half of the float32
                    wide = builder.shl(_widened8(builder, row, at, ir.IntType(16), False), shift)
                    w = builder.bitcast(wide, _V8F)
                else:
                    w = _load_vec(builder, row, at, _V8F, 4)
                j = r * n_acc + k % n_acc
                out[j] = _fma_acc(builder, w, xk, out[j])
        return out

    accs = _counted_loop(builder, lines, [zero] * (len(rows) * n_acc), body)
    sums = []
    for r in range(len(rows)):
        total = accs[r * n_acc]
        for k in range(1, n_acc):
            total = builder.fadd(total, accs[r * n_acc + k])
        sums.append(_halving_sum(builder, total))
    return context.make_tuple(builder, signature.return_type, sums)


# --- helpers of the row passes -------------------------------------------------------------
# Rows that share the loads of x are what makes the loops fast: each load of x
# feeds several rows' multiply-adds (docs/benchmarks.md, Kernels); in GATE_UP
# the rows come from two matrices (gate rows i, i+1 with up rows i, i+1).


def _as_f32(v):
    """A weight as float32: itself (fp32), or its bf16 bits widened (uint16)."""


@overload(_as_f32)
def _as_f32_impl(v):
    if v == types.float32:
        return lambda v: v
    return lambda v: bf16_f32(v)


def _columns_left(a, b, r0, r1, r2, r3, x, v0, v1, v2, v3):
    """(v0..v3) plus the columns past the last whole 64 bytes of each row (fp32 and bf16;
    int8 and int4 rows are whole groups of 64, so their sums come back as they are)."""


@overload(_columns_left)
def _columns_left_impl(a, b, r0, r1, r2, r3, x, v0, v1, v2, v3):
    if a.dtype not in (types.float32, types.uint16):
        return lambda a, b, r0, r1, r2, r3, x, v0, v1, v2, v3: (v0, v1, v2, v3)

    def add_columns(a, b, r0, r1, r2, r3, x, v0, v1, v2, v3):
        n = x.shape[0]
        for c in range(n - n % (64 // a.itemsize), n):
            xc = x[c]
            v0 += _as_f32(a[r0, c]) * xc
            v1 += _as_f32(a[r1, c]) * xc
            v2 += _as_f32(b[r2, c]) * xc
            v3 += _as_f32(b[r3, c]) * xc
        return v0, v1, v2, v3

    return add_columns


def _bits_of(q):
    """4 for planar-nibble (uint8) weights, 8 for int8, 0 for fp32 and bf16 (x as it is)."""


@overload(_bits_of)
def _bits_of_impl(q):
    bits = {types.uint8: 4, types.int8: 8}.get(q.dtype, 0)
    return lambda q: bits


# --- x written as digits, one 64-group at a time in vector registers ------------------------
# Written as numba loops the preparation stayed scalar (the digit stores may alias the
# integers they come from, as far as LLVM knows), 1.3 us for a 2048-element x: a twentieth
# of a 512x2048 int4 call from DRAM, with the memory idle. Here each group is vectors
# from load to the last store, in two passes over the groups: the units, then the digits
# and offsets (docs/benchmarks.md, Kernels).


def _signed_digit(builder, v, vtype):
    """The base-128 digit of v in [-64, 64): ((v + 64) & 127) - 64."""
    const = lambda c: ir.Constant(vtype, [c] * vtype.count)  # noqa: E731
    return builder.sub(builder.and_(builder.add(v, const(64)), const(127)), const(64))


def _group_lane0(builder, g, bits):
    """(block, first lane) of group g in `unit` and `corr`: int4 pairs groups in a block's
    lanes 0-7 and 8-15, int8 gives a group a block of its own."""
    if bits == 4:
        block, odd = builder.sdiv(g, ir.Constant(_I64, 2)), builder.srem(g, ir.Constant(_I64, 2))
        return block, odd, builder.add(builder.mul(block, ir.Constant(_I64, 16)), builder.mul(odd, ir.Constant(_I64, 8)))
    return g, None, builder.mul(g, ir.Constant(_I64, 16))


def _emit_group_unit(context, builder, signature, args, bits):
    """u of group g (its largest |x| / (126 * 128^2)) into `unit`'s lanes of the group.

    Its own loop before the digits': each group's chain (a reduction, two divisions) is
    long, and short independent iterations let the core run several groups at once."""
    x, unit = (context.make_array(t)(context, builder, v).data for t, v in zip(signature.args[::2], args[::2]))
    g = context.cast(builder, args[1], signature.args[1], types.int64)
    v64f, v64i = ir.VectorType(_F32, GROUP), ir.VectorType(_I32, GROUP)
    values = _load_vec(builder, x, builder.mul(g, ir.Constant(_I64, GROUP)), v64f, 4)
    # the largest |x| compared as integers (the float bits without the sign), as a float again
    magnitude = builder.and_(builder.bitcast(values, v64i), ir.Constant(v64i, [0x7FFFFFFF] * GROUP))
    umax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [v64i]), "llvm.vector.reduce.umax.v64i32")
    top = builder.bitcast(builder.call(umax, [magnitude]), _F32)
    # divided in float64 and rounded to float32; below the smallest normal float32 the group counts as zero
    f64 = ir.DoubleType()
    u = builder.fptrunc(builder.fdiv(builder.fpext(top, f64), ir.Constant(f64, _UNIT_STEPS)), _F32)
    u = builder.select(builder.fcmp_ordered("<", u, ir.Constant(_F32, float(_SMALLEST_UNIT))), ir.Constant(_F32, 0.0), u)
    lanes = 8 if bits == 4 else 16
    lane_f = ir.VectorType(_F32, lanes)
    lane0 = _group_lane0(builder, g, bits)[2]
    builder.store(_splat(builder, u, lane_f), builder.bitcast(builder.gep(unit, [lane0]), lane_f.as_pointer()), align=4)
    return context.get_dummy_value()


def _emit_group_digits(context, builder, signature, args, bits):
    """Group g of x, its u in `unit`: X = round-half-away(x / u) split into the digits d0, d1,
    d2 at their places in `digits`, and 8 * (int4) or 128 * (int8) the lane sums of X in
    `corr`'s lanes of the group, exactly as the note above _VNNI says."""
    x, digits, unit, corr = (context.make_array(t)(context, builder, v).data
                             for t, v in zip((signature.args[0], *signature.args[2:5]), (args[0], *args[2:5])))
    g = context.cast(builder, args[1], signature.args[1], types.int64)
    v64f, v64i = ir.VectorType(_F32, GROUP), ir.VectorType(_I32, GROUP)
    block, odd, lane0 = _group_lane0(builder, g, bits)
    u = builder.load(builder.gep(unit, [lane0]))
    positive = builder.fcmp_ordered(">", u, ir.Constant(_F32, 0.0))
    inv = builder.select(positive, builder.fdiv(ir.Constant(_F32, 1.0), u), ir.Constant(_F32, 0.0))
    values = _load_vec(builder, x, builder.mul(g, ir.Constant(_I64, GROUP)), v64f, 4)
    scaled = builder.fmul(values, _splat(builder, inv, v64f))  # no fast flags: not fused with the rounding below
    half = ir.Constant(v64f, [0.5] * GROUP)
    rounded = builder.select(builder.fcmp_ordered(">=", scaled, ir.Constant(v64f, [0.0] * GROUP)),
                             builder.fadd(scaled, half), builder.fsub(scaled, half))
    big = builder.fptosi(rounded, v64i)
    d2 = _signed_digit(builder, big, v64i)
    seven = ir.Constant(v64i, [_DIGIT_BITS] * GROUP)
    rest = builder.ashr(builder.sub(big, d2), seven)
    d1 = _signed_digit(builder, rest, v64i)
    d0 = builder.ashr(builder.sub(rest, d1), seven)
    as_bytes = [builder.trunc(d, ir.VectorType(_I8, GROUP)) for d in (d0, d1, d2)]
    if bits == 4:  # block g // 2: per digit, 64 bytes of low nibbles' x then 64 of high ones'; group g % 2 the second 32 of each
        base = builder.add(builder.mul(block, ir.Constant(_I64, 3 * 128)), builder.mul(odd, ir.Constant(_I64, 32)))
        for d, b in enumerate(as_bytes):
            for op in range(2):  # low nibbles: elements 0-31, high nibbles: 32-63
                at = builder.add(base, ir.Constant(_I64, d * 128 + op * 64))
                piece = _vector_of(builder, b, range(32 * op, 32 * op + 32))
                builder.store(piece, builder.bitcast(builder.gep(digits, [at]), piece.type.as_pointer()), align=1)
        pair = builder.add(_vector_of(builder, big, range(32)), _vector_of(builder, big, range(32, 64)))
        lanes, factor = 8, 8
    else:  # block g: per digit, the 64 bytes in order
        for d, b in enumerate(as_bytes):
            at = builder.add(builder.mul(g, ir.Constant(_I64, 3 * 64)), ir.Constant(_I64, d * 64))
            builder.store(b, builder.bitcast(builder.gep(digits, [at]), b.type.as_pointer()), align=1)
        pair, lanes, factor = big, 16, 128
    # lane l sums elements 4l..4l+3 (of both halves for int4): the four-byte sums vpdpbusd makes
    sums = _vector_of(builder, pair, range(0, 4 * lanes, 4))
    for k in range(1, 4):
        sums = builder.add(sums, _vector_of(builder, pair, range(k, 4 * lanes, 4)))
    lane_i = ir.VectorType(_I32, lanes)
    sums = builder.mul(sums, ir.Constant(lane_i, [factor] * lanes))
    builder.store(sums, builder.bitcast(builder.gep(corr, [lane0]), lane_i.as_pointer()), align=4)
    return context.get_dummy_value()


def _group_preparers(bits):
    """The two intrinsics that prepare group g of x for `bits`-bit weights: (unit, digits)."""
    @intrinsic
    def group_unit(typingctx, x, g, unit):
        if not (_row_view_ok(x, types.float32) and isinstance(g, types.Integer) and _row_view_ok(unit, types.float32)):
            return None
        return types.none(x, g, unit), (
            lambda context, builder, signature, args: _emit_group_unit(context, builder, signature, args, bits))

    @intrinsic
    def group_digits(typingctx, x, g, digits, unit, corr):
        if not (_row_view_ok(x, types.float32) and isinstance(g, types.Integer) and _row_view_ok(digits, types.int8)
                and _row_view_ok(unit, types.float32) and _row_view_ok(corr, types.int32)):
            return None
        return types.none(x, g, digits, unit, corr), (
            lambda context, builder, signature, args: _emit_group_digits(context, builder, signature, args, bits))

    return group_unit, group_digits


_group_unit4, _group_digits4 = _group_preparers(4)
_group_unit8, _group_digits8 = _group_preparers(8)


@njit(**_SERIAL)
def _prepared_sizes(cols, bits):
    """Lengths of the (digits, unit, corr) arrays that x [cols] is prepared into."""
    n_groups = cols // GROUP
    if bits == 0:  # fp32 and bf16 weights read x as it is
        return 0, 0, 0
    if not _integer_dots(bits):  # the float path needs only 8 * the group sums of x (int4), in `unit`
        return 0, (n_groups if bits == 4 else 0), 0
    blocks = (n_groups + 1) // 2 if bits == 4 else n_groups
    return blocks * 3 * 64 * _operands_per_block(bits), blocks * 16, blocks * 16


@njit(**_SERIAL)
def _prepare_into(x, bits, digits, unit, corr):
    """Write x in the form the row intrinsics read (see the VNNI note above _VNNI).

    VNNI: per 64-byte block of a row, `digits` holds 3 digits x operands x 64
    bytes lined up with the weight bytes they multiply, `unit` the 16 lanes' units
    and `corr` the 16 lanes' integer offsets, a group at a time in vector registers
    (`_emit_group_unit`, then `_emit_group_digits`). Float path: `unit` = 8 * group sums (int4).
    """
    wide_vectors()
    n_groups = x.shape[0] // GROUP
    if bits == 0:
        return
    if not _integer_dots(bits):
        if bits == 4:
            for g in range(n_groups):
                t = np.float32(0.0)
                for j in range(GROUP):
                    t += x[g * GROUP + j]
                unit[g] = np.float32(8.0) * t
        return
    if bits == 4:
        if n_groups % 2:  # the odd last group's partner: nothing
            last = (n_groups // 2) * 16
            unit[last + 8: last + 16] = 0.0
            corr[last + 8: last + 16] = 0
            digits[(n_groups // 2) * 3 * 128:] = 0
        for g in range(n_groups):
            _group_unit4(x, g, unit)
        for g in range(n_groups):
            _group_digits4(x, g, digits, unit, corr)
    else:
        for g in range(n_groups):
            _group_unit8(x, g, unit)
        for g in range(n_groups):
            _group_digits8(x, g, digits, unit, corr)


@njit(**_SERIAL)
def _prepare_x(x, bits):
    """x prepared for one pass of the row intrinsics: (digits, unit, corr)."""
    n_digits, n_unit, n_corr = _prepared_sizes(x.shape[0], bits)
    digits = np.empty(n_digits, np.int8)
    unit = np.empty(n_unit, np.float32)
    corr = np.empty(n_corr, np.int32)
    _prepare_into(x, bits, digits, unit, corr)
    return digits, unit, corr


@njit(**_SERIAL)
def _ahead_bytes(q, mode):
    """How far ahead the row loops prefetch: the same place in the rows of a step at least
    _AHEAD_BYTES of rows later (a step reads rows 4p..4p+3 of one matrix, or rows 2p, 2p+1
    of two matrices in GATE_UP mode)."""
    row = np.int64(q.strides[0])
    steps = max(np.int64(1), (np.int64(_AHEAD_BYTES) + row - 1) // row)
    return row * steps * (2 if mode == GATE_UP else 4)


@njit(**_SERIAL)
def _stream_ahead(q):
    """How far ahead each of a SET/ADD thread's _STREAMS streams prefetches: the same place
    in that stream's rows at least _AHEAD_BYTES later (a step advances each stream by
    4 // _STREAMS rows, a 4-row step's distance split between the streams; see `_pass`)."""
    return _ahead_bytes(q, SET) // _STREAMS


# --- row passes: one parallel function serves the matvec and both expert halves ------------
# Modes: SET out[r] = row r . x; ADD out[r] += w * (row r . x); GATE_UP out[i] =
# silu(a_i . x) * (b_i . x). One parallel function for every use and weight layout
# (compiled once per layout) keeps numba's cold compile short, which CI pays on
# every run (docs/benchmarks.md, Kernels: cold compile).

SET, ADD, GATE_UP = 0, 1, 2


@njit(**_SERIAL)
def _silu_mul(g, u):
    return g / (np.float32(1.0) + np.exp(-g)) * u


# Each pass has one parallel loop for GATE_UP and one for SET/ADD, chosen before the loop:
# a mode decided inside the loop (which rows, which store) branches in every step and
# slows the pass (docs/benchmarks.md, Kernels). Four rows per step share every load of x: for
# SET/ADD rows 4p..4p+3 of one matrix, for GATE_UP gate rows 2p, 2p+1 with up rows 2p, 2p+1.


@njit(**_SERIAL)
def _store_rows(out, r0, r1, r2, r3, v0, v1, v2, v3, w, add):
    """out[r_i] = v_i, or += w * v_i."""
    if add:
        out[r0] += w * v0
        out[r1] += w * v1
        out[r2] += w * v2
        out[r3] += w * v3
    else:
        out[r0] = v0
        out[r1] = v1
        out[r2] = v2
        out[r3] = v3


@njit(**_SERIAL)
def _store4(out, r, v0, v1, v2, v3, w, add):
    """out[r..r+3] = v, or += w * v."""
    _store_rows(out, r, r + 1, r + 2, r + 3, v0, v1, v2, v3, w, add)


@njit(**_SERIAL)
def _stream_rows(first, span, per, i):
    """The four rows of step i of a thread's share that starts at row `first`, read as
    _STREAMS streams of `span` rows each advancing `per` rows a step."""
    if per == 4:
        r = first + 4 * i
        return r, r + 1, r + 2, r + 3
    if per == 2:
        a = first + 2 * i
        b = first + span + 2 * i
        return a, a + 1, b, b + 1
    r = first + i
    return r, r + span, r + 2 * span, r + 3 * span


@njit(**_SERIAL)
def _store_one(mode, out, r, va, vb, w):
    """A row left over after the steps: va = row r of the first matrix . x, vb = of the second."""
    if mode == GATE_UP:
        out[r] = _silu_mul(va, vb)
    elif mode == ADD:
        out[r] += w * va
    else:
        out[r] = va


@njit(**_SERIAL)
def _first_left_over(mode, rows):
    """The first row the four-row (GATE_UP: two-row) steps leave to be done one at a time."""
    return rows - rows % (2 if mode == GATE_UP else 4)


@njit(**_SERIAL)
def _thread_steps(steps, t, threads):
    """Thread t's contiguous share [s0, s1) of `steps`, as prange's static split gives it."""
    return steps * t // threads, steps * (t + 1) // threads


# A SET/ADD pass runs one work item per thread over a contiguous share of the steps: the
# thread first prefetches the head of its rows (up to _HEAD_BYTES, quantised weights only),
# then prepares its own copy of x while those lines arrive, then dots its rows. Preparing x
# once before the parallel loop kept both threads waiting for it with nothing in flight;
# each thread's first rows then started from DRAM with the prefetches not yet ahead
# (docs/benchmarks.md, Kernels: "x prepared by each thread"). The rows' results are the
# same bits whichever thread computes them.
_HEAD_BYTES = 8192
# A SET/ADD thread reads its share as two streams in step (each step two rows from the
# first half, two from the second) instead of one. On a Xeon with AMX two threads read int4
# 512x2048 from DRAM 7-14% faster and int8 2048x512 7-16% (the other shapes, bf16 and fp32
# level), and int4 + dense int4 decoded 2% faster, its DeltaNet phase shorter in every
# alternated pair; on the Zen 4 int4 read 6-12% faster and decode was level. Each row's
# dot is the same, so the same bits (docs/benchmarks.md, "Two streams a thread").
_STREAMS = 2


@njit(**_PARALLEL)
def _pass(qa, sa, qb, sb, x, out, mode, w, threads):
    """Weights of any kind (see _rows_dot; fp32 and bf16 pass their weights as scales);
    `threads`: numba's thread count, from the caller (read inside, it would keep the
    function out of numba's disk cache)."""
    wide_vectors()
    wf = np.float32(w)
    bits = _bits_of(qa)
    ahead = _ahead_bytes(qa, mode)
    if mode == GATE_UP:
        digits, unit, corr = _prepare_x(x, bits)
        for p in prange(qa.shape[0] // 2):
            r = 2 * p
            g0, g1, u0, u1 = _columns_left(
                qa, qb, r, r + 1, r, r + 1, x, *_rows_dot(qa, sa, qb, sb, r, r + 1, r, r + 1, x, digits, unit, corr, ahead))
            out[r] = _silu_mul(g0, u0)
            out[r + 1] = _silu_mul(g1, u1)
    else:
        steps = qa.shape[0] // 4
        per = 4 // _STREAMS  # rows a stream advances each step
        row_bytes = qa.strides[0]
        ahead = _stream_ahead(qa)
        for t in prange(threads):
            s0, s1 = _thread_steps(steps, t, threads)
            n = s1 - s0
            if n > 0:
                span = n * per  # rows of each of the thread's streams
                first = 4 * s0
                if bits:
                    for j in range(_STREAMS):
                        _prefetch_head(qa, first + j * span, min(_HEAD_BYTES // _STREAMS, span * row_bytes))
                dt, ut, ct = _prepare_x(x, bits)
                # the last steps prefetch nothing past the streams: those lines are the next
                # stream's (already read), another thread's, or past the matrix
                stop_prefetch = n - ahead // (per * row_bytes)
                for i in range(n):
                    step_ahead = ahead if i < stop_prefetch else 0
                    r0, r1, r2, r3 = _stream_rows(first, span, per, i)
                    v0, v1, v2, v3 = _columns_left(
                        qa, qa, r0, r1, r2, r3, x,
                        *_rows_dot(qa, sa, qa, sa, r0, r1, r2, r3, x, dt, ut, ct, step_ahead))
                    _store_rows(out, r0, r1, r2, r3, v0, v1, v2, v3, wf, mode == ADD)
        if _first_left_over(mode, qa.shape[0]) == qa.shape[0]:
            return
        digits, unit, corr = _prepare_x(x, bits)
    for r in range(_first_left_over(mode, qa.shape[0]), qa.shape[0]):
        va, _, vb, _ = _columns_left(qa, qb, r, r, r, r, x,
                                     *_rows_dot(qa, sa, qb, sb, r, r, r, r, x, digits, unit, corr, ahead))
        _store_one(mode, out, r, va, vb, wf)


@njit(**_SERIAL)
def _set_step(a, sa, r, x, digits, unit, corr, ahead, out):
    """out[r..r+3] = rows r..r+3 of a . x: one step of a SET pass, as _pass computes it."""
    v0, v1, v2, v3 = _columns_left(a, a, r, r + 1, r + 2, r + 3, x,
                                   *_rows_dot(a, sa, a, sa, r, r + 1, r + 2, r + 3, x, digits, unit, corr, ahead))
    _store4(out, r, v0, v1, v2, v3, np.float32(1.0), False)


@njit(**_SERIAL)
def _set_rows_left(a, sa, x, digits, unit, corr, ahead, out):
    """out[r] = row r of a . x for the rows the four-row steps leave over, as _pass does."""
    for r in range(_first_left_over(SET, a.shape[0]), a.shape[0]):
        out[r] = _columns_left(a, a, r, r, r, r, x, *_rows_dot(a, sa, a, sa, r, r, r, r, x, digits, unit, corr, ahead))[0]


@njit(**_PARALLEL)
def _stack_pass(wa, qb, sb, wc, x, out):
    """out = [wa @ x | dequant(qb, sb) @ x | wc @ x] in one launch.

    Why: a RowStack (the bf16 router and shared-expert gate beside the quantised shared
    expert, which all multiply the same x) took a launch per part, and at decode's small
    matrices a launch costs as much as reading the rows. Each row gets the dot _pass gives
    it (four-row steps from each matrix's row 0, the same rows left over), so the bits are
    those of one _pass per part. The plain steps (wa, then wc: fp32 or bf16, one kind) are
    spread evenly among the quantised ones, so prange's static split gives each thread its
    share of both."""
    wide_vectors()
    ra, rb = wa.shape[0], qb.shape[0]
    out_b, out_c = out[ra:ra + rb], out[ra + rb:]
    plain_digits, plain_unit, plain_corr = _prepare_x(x, 0)
    digits, unit, corr = _prepare_x(x, _bits_of(qb))
    # an empty part's strides may be 0 (numpy 2), which _ahead_bytes divides by
    ahead_a = _ahead_bytes(wa, SET) if ra > 0 else 0
    ahead_b = _ahead_bytes(qb, SET) if rb > 0 else 0
    ahead_c = _ahead_bytes(wc, SET) if wc.shape[0] > 0 else 0
    na, nb, nc = ra // 4, rb // 4, wc.shape[0] // 4
    n_plain = na + nc
    total = n_plain + nb
    stride = max(1, total // n_plain) if n_plain > 0 else total + 1
    for p in prange(total):
        q = p // stride
        if p % stride == 0 and q < n_plain:
            if q < na:
                _set_step(wa, wa, 4 * q, x, plain_digits, plain_unit, plain_corr, ahead_a, out)
            else:
                _set_step(wc, wc, 4 * (q - na), x, plain_digits, plain_unit, plain_corr, ahead_c, out_c)
        else:
            _set_step(qb, sb, 4 * (p - min(q + 1, n_plain)), x, digits, unit, corr, ahead_b, out_b)
    _set_rows_left(wa, wa, x, plain_digits, plain_unit, plain_corr, ahead_a, out)
    _set_rows_left(qb, sb, x, digits, unit, corr, ahead_b, out_b)
    _set_rows_left(wc, wc, x, plain_digits, plain_unit, plain_corr, ahead_c, out_c)


# --- the same row passes over several tokens ------------------------------------------------
# A prompt's tokens routed to one expert: each step's rows are read once and
# dotted with every token by the very dot functions above, so each token gets
# what the one-token pass gives it, whichever tokens share the call. Modes SET
# and GATE_UP (out and x are [T, n]).


@njit(**_PARALLEL)
def _tokens(qa, sa, qb, sb, x, out, mode):
    """Weights of any kind, as _pass."""
    wide_vectors()
    one = np.float32(1.0)
    bits = _bits_of(qa)
    n_digits, n_unit, n_corr = _prepared_sizes(x.shape[1], bits)
    digits = np.empty((x.shape[0], n_digits), np.int8)
    unit = np.empty((x.shape[0], n_unit), np.float32)
    corr = np.empty((x.shape[0], n_corr), np.int32)
    for t in range(x.shape[0]):
        _prepare_into(x[t], bits, digits[t], unit[t], corr[t])
    ahead = _ahead_bytes(qa, mode)
    if mode == GATE_UP:
        for p in prange(qa.shape[0] // 2):
            r = 2 * p
            for t in range(x.shape[0]):
                xt, dt, ut, ct = x[t], digits[t], unit[t], corr[t]
                g0, g1, u0, u1 = _columns_left(
                    qa, qb, r, r + 1, r, r + 1, xt, *_rows_dot(qa, sa, qb, sb, r, r + 1, r, r + 1, xt, dt, ut, ct, ahead))
                out[t, r] = _silu_mul(g0, u0)
                out[t, r + 1] = _silu_mul(g1, u1)
    else:
        for p in prange(qa.shape[0] // 4):
            r = 4 * p
            for t in range(x.shape[0]):
                xt, dt, ut, ct = x[t], digits[t], unit[t], corr[t]
                v0, v1, v2, v3 = _columns_left(
                    qa, qa, r, r + 1, r + 2, r + 3, xt, *_rows_dot(qa, sa, qa, sa, r, r + 1, r + 2, r + 3, xt, dt, ut, ct, ahead))
                _store4(out[t], r, v0, v1, v2, v3, one, False)
    for r in range(_first_left_over(mode, qa.shape[0]), qa.shape[0]):
        for t in range(x.shape[0]):
            va, _, vb, _ = _columns_left(qa, qb, r, r, r, r, x[t],
                                         *_rows_dot(qa, sa, qb, sb, r, r, r, r, x[t], digits[t], unit[t], corr[t], ahead))
            _store_one(mode, out[t], r, va, vb, one)


# --- the same row passes over several experts ----------------------------------------------
# A decoded token's routed experts in one layer all read the same x: one parallel
# launch runs gate_up for all of them, a second runs down for all of them, instead
# of two launches per expert. The experts are rows of one RAM store (the store's
# slots), viewed inside the pass; every row is dotted by the very dot functions
# _pass uses, with the same four-row (GATE_UP: two-row) steps, so each expert gets
# what its own two launches give it. A parallel step covers a chunk of steps of
# one expert, so that its views are made once per chunk.

_STEPS_PER_CHUNK = 16  # the prompt's few-token kernel (experts_tokens)
# A decoded token's launches take about four chunks per thread: on the Zen 4, with 16-step
# chunks (16 KiB of down each) the down launch of eight int4 experts took 144-168 us from
# DRAM, 5-31% more than one 16384x512 matvec of the same bytes; with four a thread (one
# an expert at two threads) 126-147, level with it or up to 10% more (docs/benchmarks.md,
# "Fewer, longer work items", `tools/experts_launch_vs_flat.py`).
_ITEMS_PER_THREAD = 4


@njit(**_SERIAL)
def _chunk_steps(steps, n, threads):
    """(steps of one expert per parallel work item in `_experts`, work items per expert):
    the launch's n * steps steps in about `_ITEMS_PER_THREAD` items per thread, each within
    one expert."""
    per_expert = max(1, (_ITEMS_PER_THREAD * max(1, threads) + n - 1) // n)
    per = max(1, (steps + per_expert - 1) // per_expert)
    return per, (steps + per - 1) // per


def expert_views(row, marker, hidden, inter):
    """(gate, gate scales, up, up scales, down, down scales) of the blob at the start of
    `row` (uint8), for weights of marker's dtype; as `_expert_parts` gives them."""


@overload(expert_views)
def _expert_views_impl(row, marker, hidden, inter):
    kind = marker.dtype
    if kind in (types.float32, types.uint16):
        dtype = np.float32 if kind == types.float32 else np.uint16
        size = 4 if kind == types.float32 else 2

        def raw(row, marker, hidden, inter):
            n = hidden * inter
            flat = row[: 3 * n * size].view(dtype)
            gate = flat[:n].reshape((inter, hidden))
            up = flat[n: 2 * n].reshape((inter, hidden))
            down = flat[2 * n:].reshape((hidden, inter))
            return gate, gate, up, up, down, down

        return raw
    bits = 4 if kind == types.uint8 else 8
    dtype = np.uint8 if bits == 4 else np.int8

    def quant(row, marker, hidden, inter):
        n = hidden * inter
        qbytes = n * bits // 8
        m = n // GROUP
        q = row[: 3 * qbytes].view(dtype)
        s = row[3 * qbytes: 3 * qbytes + 3 * m * 4].view(np.float32)
        per_row_in, per_row_out = hidden * bits // 8, inter * bits // 8
        return (q[:qbytes].reshape((inter, per_row_in)), s[:m].reshape((inter, hidden // GROUP)),
                q[qbytes: 2 * qbytes].reshape((inter, per_row_in)), s[m: 2 * m].reshape((inter, hidden // GROUP)),
                q[2 * qbytes:].reshape((hidden, per_row_out)), s[2 * m:].reshape((hidden, inter // GROUP)))

    return quant


@njit(**_PARALLEL)
def _experts(store, slots, marker, hidden, inter, x, h, out, out_rows, mode, w, threads):
    """mode GATE_UP: h[k] = silu(gate_k x) * (up_k x); mode ADD: out[out_rows[k]] += w *
    (down_k h[k]); expert k is the blob in store[slots[k]], x float32[hidden], h [K, inter];
    `threads`: numba's thread count, for the work items' size."""
    wide_vectors()
    wf = np.float32(w)
    n = slots.shape[0]
    bits = _bits_of(marker)
    if mode == GATE_UP:
        digits, unit, corr = _prepare_x(x, bits)
        qa = expert_views(store[slots[0]], marker, hidden, inter)[0]
        ahead = _ahead_bytes(qa, GATE_UP)
        steps = inter // 2
        per, chunks = _chunk_steps(steps, n, threads)
        for p in prange(n * chunks):
            k = p // chunks
            c = p % chunks
            qg, sg, qu, su, _qd, _sd = expert_views(store[slots[k]], marker, hidden, inter)
            hk = h[k]
            for step in range(c * per, min(steps, (c + 1) * per)):
                r = 2 * step
                g0, g1, u0, u1 = _columns_left(
                    qg, qu, r, r + 1, r, r + 1, x,
                    *_rows_dot(qg, sg, qu, su, r, r + 1, r, r + 1, x, digits, unit, corr, ahead))
                hk[r] = _silu_mul(g0, u0)
                hk[r + 1] = _silu_mul(g1, u1)
        for k in range(n):
            qg, sg, qu, su, _qd, _sd = expert_views(store[slots[k]], marker, hidden, inter)
            for r in range(_first_left_over(GATE_UP, inter), inter):
                va, _, vb, _ = _columns_left(qg, qu, r, r, r, r, x,
                                             *_rows_dot(qg, sg, qu, su, r, r, r, r, x, digits, unit, corr, ahead))
                _store_one(GATE_UP, h[k], r, va, vb, wf)
    else:
        n_digits, n_unit, n_corr = _prepared_sizes(inter, bits)
        digits = np.empty((n, n_digits), np.int8)
        unit = np.empty((n, n_unit), np.float32)
        corr = np.empty((n, n_corr), np.int32)
        for k in range(n):
            _prepare_into(h[k], bits, digits[k], unit[k], corr[k])
        qa = expert_views(store[slots[0]], marker, hidden, inter)[4]
        ahead = _ahead_bytes(qa, ADD)
        steps = hidden // 4
        per, chunks = _chunk_steps(steps, n, threads)
        # a work item's rows read as _STREAMS streams in step, as a matvec thread's share
        # (`_pass`); the last steps prefetch nothing past their stream
        stream_per = 4 // _STREAMS
        row_bytes = qa.strides[0]
        stream_ahead = _stream_ahead(qa)
        for p in prange(n * chunks):
            k = p // chunks
            c = p % chunks
            qd, sd = expert_views(store[slots[k]], marker, hidden, inter)[4:]
            hk, dk, uk, ck, yk = h[k], digits[k], unit[k], corr[k], out[out_rows[k]]
            s0 = c * per
            m = min(steps, s0 + per) - s0
            span = m * stream_per
            stop_prefetch = m - stream_ahead // (stream_per * row_bytes)
            for i in range(m):
                step_ahead = stream_ahead if i < stop_prefetch else 0
                r0, r1, r2, r3 = _stream_rows(4 * s0, span, stream_per, i)
                v0, v1, v2, v3 = _columns_left(
                    qd, qd, r0, r1, r2, r3, hk,
                    *_rows_dot(qd, sd, qd, sd, r0, r1, r2, r3, hk, dk, uk, ck, step_ahead))
                _store_rows(yk, r0, r1, r2, r3, v0, v1, v2, v3, wf, True)
        for k in range(n):
            qd, sd = expert_views(store[slots[k]], marker, hidden, inter)[4:]
            for r in range(_first_left_over(ADD, hidden), hidden):
                va, _, vb, _ = _columns_left(qd, qd, r, r, r, r, h[k],
                                             *_rows_dot(qd, sd, qd, sd, r, r, r, r, h[k], digits[k], unit[k], corr[k], ahead))
                _store_one(ADD, out[out_rows[k]], r, va, vb, wf)


# --- public entry points --------------------------------------------------------------------
# Plain Python on purpose: a numba function that calls another is re-optimised
# with the callee inlined, so njit wrappers here would multiply the cold compile
# time (docs/benchmarks.md, Kernels: cold compile) to save microseconds per call.
# The matvecs are the exception: `_checked_matvec` costs 1.6-1.9 s of cold compile
# a weight kind (once; then numba's disk cache) for about 1 us a call.


def _thread_count() -> int:
    """numba's thread count for the calling thread, for `_pass`. numba.get_num_threads()
    costs 0.6 us a call (it makes sure the pool runs, every time); once the pool runs,
    the getter it wraps costs 0.08 us."""
    fast = getattr(_numba_parallel, "_get_num_threads", None)
    count = fast() if fast is not None else 0
    return count if count > 0 else numba.get_num_threads()


def _f32(x: np.ndarray) -> np.ndarray:
    """x as C-contiguous float32 (no copy when it already is)."""
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_matvec(rows: int, cols: int, x: np.ndarray, out: np.ndarray) -> None:
    """Shape errors would be out-of-bounds reads in the kernels: refuse them here."""
    if x.shape != (cols,) or out.shape != (rows,):
        raise ValueError(f"matvec of a {rows}x{cols} matrix needs x[{cols}] and out[{rows}], got {x.shape} and {out.shape}")


@njit(**_SERIAL)
def _checked_matvec(qa, sa, x, out, threads):
    """out = qa @ x in one SET pass (sa: qa's scales; qa itself for fp32 and bf16), after the
    checks that keep the pass inside its operands; False, with nothing written, where they
    fail. Checked here rather than in Python, a call from Python pays one dispatch and
    little else: about 1 us less of a 29 us 512x2048 int4 call from DRAM, where the
    Python right after a streaming call runs several times slower than alone
    (docs/benchmarks.md, Kernels: "The matvecs' checks compiled")."""
    rows, cols = out.shape[0], x.shape[0]
    bits = _bits_of(qa)
    width = cols // 2 if bits == 4 else cols
    if qa.shape[0] != rows or qa.shape[1] != width or sa.shape[0] != rows:
        return False
    if bits and sa.shape[1] * GROUP != cols:
        return False
    _pass(qa, sa, qa, sa, x, out, SET, 1.0, threads)
    return True


def _refuse_matvec(qa: np.ndarray, sa: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """Raise the error for operands `_checked_matvec` refused (or an x that is not 1-D)."""
    cols = sa.shape[1] * GROUP if qa.dtype in (np.int8, np.uint8) else qa.shape[1]
    _check_matvec(qa.shape[0], cols, x, out)
    raise ValueError(f"matvec operands do not describe one C-contiguous matrix the kernels take: weights "
                     f"{qa.shape} {qa.dtype}, scales {sa.shape} {sa.dtype}, out {out.dtype}")


def _check_expert(blob: np.ndarray, nbytes: int, hidden: int, x: np.ndarray, y: np.ndarray) -> None:
    if blob.nbytes < nbytes or x.shape != (hidden,) or y.shape != (hidden,) or y.dtype != np.float32:
        raise ValueError(f"expert needs a blob of >= {nbytes} bytes, x[{hidden}] and float32 y[{hidden}]; "
                         f"got {blob.nbytes} bytes, x{x.shape}, y{y.shape} {y.dtype}")


# The matvecs' bodies are written out in full, not shared through a helper: one more
# Python frame cost 0.5-0.9 us a 512x2048 int4 call from DRAM (docs/benchmarks.md,
# Kernels: "The matvecs' checks compiled").

def matvec_plain(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = w @ x for float32 w, or bf16 w stored as uint16, [rows, cols] (C-contiguous)."""
    x = _f32(x)
    try:
        done = x.ndim == 1 and _checked_matvec(w, w, x, out, _thread_count())
    except numba.core.errors.TypingError:  # a layout or dtype no pass is written for
        done = False
    if not done:
        _refuse_matvec(w, w, x, out)


def matvec_quantised(q: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[:] = dequant(q, scales) @ x; q int8 [rows, cols] or planar-nibble uint8
    [rows, cols/2], scales float32 [rows, cols/64]."""
    x = _f32(x)
    try:
        done = x.ndim == 1 and _checked_matvec(q, scales, x, out, _thread_count())
    except numba.core.errors.TypingError:  # a layout or dtype no pass is written for
        done = False
    if not done:
        _refuse_matvec(q, scales, x, out)


matvec_fp32 = matvec_bf16 = matvec_plain
matvec_int8 = matvec_int4 = matvec_quantised


def stack_parts(parts: list) -> tuple | None:
    """(wa, q, scales, wc) for `matvec_stack` when a RowStack's parts fit its one launch:
    plain, quantised, and optionally plain again, the plain ones float32 or bf16 (uint16)
    of one kind, all C-contiguous 2-D with the same columns; None otherwise."""
    if len(parts) not in (2, 3) or not all(isinstance(p, np.ndarray) for p in parts[::2]):
        return None
    wa, quant = parts[0], parts[1]
    wc = parts[2] if len(parts) == 3 else np.empty((0, wa.shape[1]), wa.dtype)
    q, scales = getattr(quant, "q", None), getattr(quant, "scales", None)
    if q is None or scales is None or q.dtype not in (np.int8, np.uint8):
        return None
    cols = wa.shape[1] if wa.ndim == 2 else -1
    ok = (wa.dtype == wc.dtype and wa.dtype in (np.uint16, np.float32) and wc.ndim == 2 and q.ndim == 2
          and scales.ndim == 2 and scales.dtype == np.float32 and wc.shape[1] == cols
          and scales.shape[1] * GROUP == cols and scales.shape[0] == q.shape[0]
          and q.shape[1] * (2 if q.dtype == np.uint8 else 1) == cols
          and all(a.flags.c_contiguous for a in (wa, wc, q, scales)))
    return (wa, q, scales, wc) if ok else None


def matvec_stack(wa: np.ndarray, q: np.ndarray, scales: np.ndarray, wc: np.ndarray, x: np.ndarray,
                 out: np.ndarray) -> None:
    """out[:] = [wa @ x | dequant(q, scales) @ x | wc @ x] in one launch, for parts that
    `stack_parts` accepted; each part's rows as its own matvec gives them."""
    _check_matvec(wa.shape[0] + q.shape[0] + wc.shape[0], wa.shape[1], x, out)
    _stack_pass(wa, q, scales, wc, _f32(x), out)


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


def _expert_parts(kind: str, blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray) -> tuple:
    """(gate, gate scales, up, up scales, down, down scales) of a blob, for `_pass` / `_tokens`,
    after checking the blob's size and x, y (one token's rows); fp32/bf16 weights stand in
    for their own scales."""
    if kind in ("fp32", "bf16"):
        _check_expert(blob, blob_nbytes(kind, hidden, inter), hidden, x, y)
        gate, up, down = raw_matrices(blob, kind, hidden, inter)
        return gate, gate, up, up, down, down
    bits = 8 if kind == "int8" else 4
    _check_expert(blob, blob_nbytes(kind, hidden, inter), hidden, x, y)
    return quant_matrices(blob, bits, hidden, inter)


def _expert_forward(kind: str, blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray,
                    w: float) -> None:
    qg, sg, qu, su, qd, sd = _expert_parts(kind, blob, hidden, inter, x, y)
    h = np.empty(inter, np.float32)
    threads = _thread_count()
    _pass(qg, sg, qu, su, _f32(x), h, GATE_UP, 1.0, threads)
    _pass(qd, sd, qd, sd, h, y, ADD, float(w), threads)


def expert_forward_fp32(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * down(silu(gate x) * (up x)) for a raw float32 blob [gate | up | down]."""
    _expert_forward("fp32", blob, hidden, inter, x, y, w)


def expert_forward_bf16(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * expert(x) for a raw bf16 (uint16) blob [gate | up | down]."""
    _expert_forward("bf16", blob, hidden, inter, x, y, w)


def expert_forward_int8(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * expert(x) for an int8 container blob."""
    _expert_forward("int8", blob, hidden, inter, x, y, w)


def expert_forward_int4(blob: np.ndarray, hidden: int, inter: int, x: np.ndarray, y: np.ndarray, w: float) -> None:
    """y += w * expert(x) for an int4 container blob."""
    _expert_forward("int4", blob, hidden, inter, x, y, w)


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
    qg, sg, qu, su, qd, sd = _expert_parts(kind, blob, hidden, inter, x[0], y[0])
    _tokens(qg, sg, qu, su, x, h, GATE_UP)
    _tokens(qd, sd, qd, sd, h, y, SET)
    return y


# an empty array of each kind's weight dtype: tells `_experts` how to view the blobs
_WEIGHT_MARKER = {"fp32": np.empty(0, np.float32), "bf16": np.empty(0, np.uint16),
                  "int8": np.empty(0, np.int8), "int4": np.empty(0, np.uint8)}


def experts_forward(kind: str, store: np.ndarray, slots: np.ndarray, hidden: int, inter: int, x: np.ndarray,
                    out: np.ndarray, out_rows: np.ndarray) -> None:
    """out[out_rows[k]] += expert(x) for the expert blob in each store[slots[k]], in two parallel
    launches for all of them (gate_up, then down).

    store: uint8 [n_slots, >= one blob] (a layer's RAM slots); slots, out_rows: int64 [K];
    out: float32 [rows, hidden]. Each expert's result is bit for bit the one
    `EXPERT_FORWARD[kind](store[slots[k]], hidden, inter, x, out[out_rows[k]], 1.0)` gives.
    """
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    out_rows = np.ascontiguousarray(out_rows, dtype=np.int64)
    n = slots.shape[0]
    if n == 0:
        return
    nbytes = blob_nbytes(kind, hidden, inter)
    slot_list, row_list = slots.tolist(), out_rows.tolist()  # checked as lists: numpy's min/max cost microseconds
    if (store.ndim != 2 or store.dtype != np.uint8 or not store.flags.c_contiguous or store.shape[1] < nbytes
            or out.ndim != 2 or out.shape[1] != hidden or out.dtype != np.float32 or not out.flags.c_contiguous
            or x.shape != (hidden,) or out_rows.shape != (n,)
            or min(slot_list) < 0 or max(slot_list) >= store.shape[0] or min(row_list) < 0 or max(row_list) >= out.shape[0]
            or len(set(row_list)) != n):  # two experts adding to one row at once would race
        raise ValueError(f"experts_forward needs a C uint8 store [slots, >= {nbytes}], x[{hidden}], C float32 "
                         f"out[rows, {hidden}], slots in range and distinct out_rows in range; got store{store.shape} {store.dtype}, "
                         f"x{x.shape}, out{out.shape} {out.dtype}, slots {slots}, out_rows {out_rows}")
    h = np.empty((n, inter), np.float32)
    marker = _WEIGHT_MARKER[kind]
    x = _f32(x)
    threads = _thread_count()
    _experts(store, slots, marker, hidden, inter, x, h, out, out_rows, GATE_UP, 1.0, threads)
    _experts(store, slots, marker, hidden, inter, x, h, out, out_rows, ADD, 1.0, threads)


EXPERT_FORWARD = {
    "fp32": expert_forward_fp32,
    "bf16": expert_forward_bf16,
    "int8": expert_forward_int8,
    "int4": expert_forward_int4,
}

