"""Matrix-matrix products for several tokens: a prompt's dense projections and grouped experts.

Why: a prompt multiplies every weight matrix by many tokens. Sixteen rows at
a time, each kernel widens the rows to float32 once (bf16 bits, or int8/int4
times its group scale) straight into chunks of columns, then dots them with
the tokens one tile at a time (about 256 KiB of tokens, kept in L2), four
rows by four tokens per pass (`_dot4x4_into`; by two, `dot4x2`, on CPUs
without AVX-512) and a chunk of columns at a time so that what one pass
reads stays in L1.
The weights are read once per prompt instead of once per token, and the
widening, which is most of a quantised matvec's work, is paid once per row.
Used for the dense projections of a prompt (`linear` with T > 1) and for a
prompt's experts (`experts_matmat`: a batch of experts, each with the tokens
routed to it, in two launches; `expert_matmat`: one expert).

All out[t, r] = row_r . x[t] in float32, within 1e-5 relative of a float64
reference of the same (dequantised) weights; not bit-identical to the
matvecs of `qmatvec` (which scale each group's sum, not each weight).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic, overload

from tierlab.engine.blob_layout import GROUP, blob_nbytes
from tierlab.engine.kernels.fastexp import silu_f32
from tierlab.engine.kernels.qmatvec import (_fma, _I32, _I64, _V16F, _WIDE, _counted_loop, _load_vec, _prefetch,
                                            bf16_f32, expert_views, quant_matrices, raw_matrices, wide_vectors)

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
def dot4x2(w4, xa, xb):
    """Four rows (w4 [4, n]) dotted with two tokens' columns (xa, xb [n]) in one pass: six loads
    feed eight FMAs. A token alone goes in as xa = xb, so its sums come out of the same
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
    for c in range(xa.shape[0]):
        va = xa[c]
        vb = xb[c]
        w0 = w4[0, c]
        w1 = w4[1, c]
        w2 = w4[2, c]
        w3 = w4[3, c]
        a0 += w0 * va
        a1 += w1 * va
        a2 += w2 * va
        a3 += w3 * va
        b0 += w0 * vb
        b1 += w1 * vb
        b2 += w2 * vb
        b3 += w3 * vb
    return a0, a1, a2, a3, b0, b1, b2, b3


@njit(**_OPTS)
def _chunk_width(cols):
    """Columns per chunk: four rows' chunk and two tokens' chunks (24 KiB at 1024) stay in L1."""
    for width in (1024, 512, 256, 128, 64):
        if cols % width == 0:
            return width
    return cols


@njit(**_OPTS)
def _chunked_tokens(x, width):
    """x [T, cols] as [cols / width, T, width]: each chunk of every token side by side."""
    t_count, cols = x.shape
    xs = np.empty((cols // width, t_count, width), dtype=np.float32)
    for t in range(t_count):
        for j in range(cols // width):
            for c in range(width):
                xs[j, t, c] = x[t, j * width + c]
    return xs


@njit(**_OPTS)
def _token_tile(cols):
    """Tokens per tile (even): a tile's columns, about 256 KiB, stay in L2 beside the row block
    while every group of four rows goes over them."""
    tile = (1 << 18) // (4 * cols)
    tile -= tile % 2
    return max(2, tile)


# --- four rows by four tokens a pass (CPUs with AVX-512) ------------------------------------
# dot4x2 leaves every one of its eight sums to a horizontal add of 16 lanes,
# which on rows of 512 columns costs a third as much as the FMAs; here sixteen
# 16-lane accumulators (four rows x four tokens) are summed by one tree of
# shuffles into a single vector, lane 4s + k holding row k . token s, and
# added to the caller's sums in one store: 92% of the FMA peak on one core,
# against dot4x2's 71% (`tools/prompt_kernels.py`, its `pass` line;
# docs/benchmarks.md, "Four tokens a pass"). Every lane goes through
# the same additions, so a token's sums do not depend on its slot or on the
# other tokens of the pass.


def _shuffle16(builder, a, b, lanes):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 16), lanes))


def _tree_sums(builder, vecs):
    """16 vectors -> one whose lane v is the sum of vecs[v]'s 16 lanes: at each level the two
    halves of every run of lanes are added, so each sum takes the same additions in each lane."""
    span = 16
    while len(vecs) > 1:
        half = span // 2
        lo, hi = [], []
        for src in (0, 16):  # lanes of a, then of b
            for run in range(16 // span):
                start = src + run * span
                lo += list(range(start, start + half))
                hi += list(range(start + half, start + span))
        vecs = [builder.fadd(_shuffle16(builder, a, b, lo), _shuffle16(builder, a, b, hi))
                for a, b in zip(vecs[0::2], vecs[1::2])]
        span = half
    return vecs[0]


def _f32_matrix(t) -> bool:
    return isinstance(t, types.Array) and t.ndim == 2 and t.layout == "C" and t.dtype == types.float32


def _dot4xn_codegen(n, first_row=False, ahead_rows=0):
    """Codegen of a pass of four rows by n tokens (n = 1..4): 4 * n 16-lane accumulators, then
    `_tree_sums` over them and zero vectors in the absent tokens' places, so that a token's
    sums take the same FMAs and additions in every variant (a sum only ever adds its own
    vector's lanes, and a zero vector's sums are zeros). The arguments are (w4, x, the n
    token rows, acc, at), or with `first_row` (w, r0, x, ...): rows r0..r0+3 of w, so that a
    caller walking a long matrix passes it whole instead of a view (and its reference count)
    per four rows. `ahead_rows` (with `first_row`): each step also prefetches its 64 bytes of
    the four rows that many rows on (at most w's last row), so that a caller walking w's rows
    in order asks for them a line at a time, spread over the FMAs, not in bursts."""
    shift = 1 if first_row else 0

    def codegen(context, builder, signature, args):
        w_arr, x_arr, acc_arr = (context.make_array(signature.args[i])(context, builder, args[i])
                                 for i in (0, 1 + shift, 2 + n + shift))

        def row(arr, r):
            start = builder.gep(builder.bitcast(arr.data, ir.IntType(8).as_pointer()),
                                [builder.mul(r, builder.extract_value(arr.strides, 0))])
            return builder.bitcast(start, arr.data.type)

        def arg_int(i):
            return context.cast(builder, args[i], signature.args[i], types.int64)

        r0 = arg_int(1) if first_row else ir.Constant(_I64, 0)
        ws = [row(w_arr, builder.add(r0, ir.Constant(_I64, k))) for k in range(4)]
        xs = [row(x_arr, arg_int(2 + shift + s)) for s in range(n)]
        later = []
        if ahead_rows:
            last = builder.sub(builder.extract_value(w_arr.shape, 0), ir.Constant(_I64, 1))
            for k in range(4):
                r = builder.add(r0, ir.Constant(_I64, ahead_rows + k))
                later.append(row(w_arr, builder.select(builder.icmp_signed("<", r, last), r, last)))

        def body(i, accs):
            col = builder.mul(i, ir.Constant(_I64, 16))
            for p in later:
                _prefetch(builder, p, builder.mul(col, ir.Constant(_I64, 4)))
            wv = [_load_vec(builder, p, col, _V16F, 4) for p in ws]
            xv = [_load_vec(builder, p, col, _V16F, 4) for p in xs]
            return [_fma(builder, wv[k], xv[s], accs[4 * s + k])
                    for s in range(n) for k in range(4)]

        steps = builder.sdiv(builder.extract_value(w_arr.shape, 1), ir.Constant(_I64, 16))
        zero = ir.Constant(_V16F, [0.0] * 16)
        accs = _counted_loop(builder, steps, [zero] * (4 * n), body)
        sums = _tree_sums(builder, accs + [zero] * (16 - 4 * n))
        dst = builder.bitcast(row(acc_arr, arg_int(3 + n + shift)), _V16F.as_pointer())
        builder.store(builder.fadd(builder.load(dst, align=4), sums), dst, align=4)
        return context.get_dummy_value()

    return codegen


def _dot4xn(n, w4, x, acc, args, first_row=False, ahead_rows=0):
    """The (signature, codegen) of a pass of four rows by n tokens for these argument types
    (w4, x, the n token rows, acc, at; with `first_row`: w, r0, x, ...), or None when they are
    not float32 C matrices."""
    if not (_f32_matrix(w4) and _f32_matrix(x) and _f32_matrix(acc)):
        return None
    return types.none(*args), _dot4xn_codegen(n, first_row, ahead_rows)


@intrinsic
def _dot4x4_into(typingctx, w4, x, ta, tb, tc, td, acc, at):
    """acc[at + s, k] += row k of w4 [4, n] . row t_s of x [N, n], for the four tokens
    (ta, tb, tc, td); n a multiple of 16, acc [rows, 4]."""
    return _dot4xn(4, w4, x, acc, (w4, x, ta, tb, tc, td, acc, at))


# A pass's last tokens when fewer than four are left: a prompt's expert has any number of tokens,
# and a pass of four repeating the last token spent up to 3/4 of its FMAs on copies (7% of a
# 128-token prompt's grouped experts on the 64-expert slice, whose experts have 17-37 tokens).
# Their sums are bit for bit what `_dot4x4_into` gives the same tokens.


@intrinsic
def _dot4x3_into(typingctx, w4, x, ta, tb, tc, acc, at):
    """`_dot4x4_into` for three tokens (acc rows at..at+2, and += 0 into row at+3)."""
    return _dot4xn(3, w4, x, acc, (w4, x, ta, tb, tc, acc, at))


@intrinsic
def _dot4x2_into_lanes(typingctx, w4, x, ta, tb, acc, at):
    """`_dot4x4_into` for two tokens (acc rows at, at+1, and += 0 into the next two)."""
    return _dot4xn(2, w4, x, acc, (w4, x, ta, tb, acc, at))


@intrinsic
def _dot4x1_into(typingctx, w4, x, ta, acc, at):
    """`_dot4x4_into` for one token (acc row at, and += 0 into the next three)."""
    return _dot4xn(1, w4, x, acc, (w4, x, ta, acc, at))


@intrinsic
def _prefetch_lines(typingctx, m, r0, n_rows, first, count):
    """Prefetch (into L2 on Zen, as the matvecs do) the 64-byte lines first..first+count-1 of
    rows r0..r0+n_rows-1 of the C-ordered 2-D array m, those past the rows' end left out."""
    if not (isinstance(m, types.Array) and m.ndim == 2 and m.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        r0_, n_, first_, count_ = (context.cast(builder, args[i], signature.args[i], types.int64) for i in range(1, 5))
        stride = builder.extract_value(arr.strides, 0)
        base = builder.gep(builder.bitcast(arr.data, ir.IntType(8).as_pointer()), [builder.mul(r0_, stride)])
        lines = builder.sdiv(builder.add(builder.mul(n_, stride), ir.Constant(_I64, 63)), ir.Constant(_I64, 64))
        end = builder.add(first_, count_)
        end = builder.select(builder.icmp_signed("<", end, lines), end, lines)

        def body(i, carried):
            _prefetch(builder, base, builder.trunc(builder.mul(builder.add(first_, i), ir.Constant(_I64, 64)), _I32))
            return carried

        _counted_loop(builder, builder.sub(end, first_), [ir.Constant(_I64, 0)], body)
        return context.get_dummy_value()

    return types.none(m, r0, n_rows, first, count), codegen


#: tokens a pass of `_dot_rows4` takes: 4 by `_dot4x4_into` (AVX-512), else 2 by `dot4x2`
_TOKENS_PER_PASS = 4 if _WIDE else 2


@njit(**_OPTS)
def _dot_rows4(block, xs, t0, t1, acc, pa, ra, pb, rb, pn, step, done):
    """acc[t - t0, k] = row k of `block` (four widened rows, [chunks, 4, width]) . token t of xs
    for tokens t0..t1-1, `_TOKENS_PER_PASS` tokens a pass, chunk by chunk; acc has room for
    3 rows past t1 - t0 (a last pass of fewer than four adds zeros there, dot4x2's repeats
    its last token there). A row's and a token's
    sums depend only on their own values (with dot4x2: and the token's parity; t0 is even),
    never on T or on the other rows.
    After each pass of four tokens, `step` more lines (from line `done` on) of rows ra.. and
    rb.. (pn rows each) of pa and pb (rb < 0: of pa alone) are prefetched (`_prefetch_lines`; step 0: none);
    returns how many lines are then done."""
    acc[:] = 0.0
    last = t1 - 1
    four = _TOKENS_PER_PASS == 4 and block.shape[2] % 16 == 0
    for j in range(block.shape[0]):
        wj = block[j]
        xj = xs[j]
        for t in range(t0, t1, 4):
            if four:
                left = t1 - t
                if left >= 4:
                    _dot4x4_into(wj, xj, t, t + 1, t + 2, t + 3, acc, t - t0)
                elif left == 3:
                    _dot4x3_into(wj, xj, t, t + 1, t + 2, acc, t - t0)
                elif left == 2:
                    _dot4x2_into_lanes(wj, xj, t, t + 1, acc, t - t0)
                else:
                    _dot4x1_into(wj, xj, t, acc, t - t0)
            else:
                _dot4x2_into(wj, xj, t, min(t + 1, last), acc, t - t0)
                if t + 2 < t1:
                    _dot4x2_into(wj, xj, t + 2, min(t + 3, last), acc, t + 2 - t0)
            if step:
                _prefetch_lines(pa, ra, pn, done, step)
                if rb >= 0:  # (rb < 0: pa alone, e.g. bf16 rows without scales)
                    _prefetch_lines(pb, rb, pn, done, step)
                done += step
    return done


@njit(**_OPTS)
def _lines_per_pass(pa, pn, passes):
    """Lines of pn rows of pa to prefetch after each of `passes` passes so that all are asked
    for by the last one (0 when there is nothing to prefetch)."""
    if pn <= 0:
        return 0
    lines = (pn * pa.strides[0] + 63) // 64
    return (lines + passes - 1) // passes


@njit(**_OPTS)
def _dot4x2_into(wj, xj, t, u, acc, at):
    """acc[at, k] += row k . token t, and acc[at + 1, k] += row k . token u unless u == t."""
    a0, a1, a2, a3, b0, b1, b2, b3 = dot4x2(wj, xj[t], xj[u])
    acc[at, 0] += a0
    acc[at, 1] += a1
    acc[at, 2] += a2
    acc[at, 3] += a3
    if u != t:
        acc[at + 1, 0] += b0
        acc[at + 1, 1] += b1
        acc[at + 1, 2] += b2
        acc[at + 1, 3] += b3


@njit(**_OPTS)
def _store_rows(block, xs, t0, t1, r0, n, acc, out, pa, ra, pb, rb, pn, step, done):
    """out[t, r0:r0+n] for tokens t0..t1-1: the four rows of `block` (rows past n are zeros)
    against those tokens (`_dot_rows4`, prefetching as it says); returns its line count."""
    done = _dot_rows4(block, xs, t0, t1, acc, pa, ra, pb, rb, pn, step, done)
    for t in range(t0, t1):
        for k in range(n):
            out[t, r0 + k] = acc[t - t0, k]
    return done


@njit(**_OPTS)
def _store_block(blocks, r_start, n_rows, xs, out, pa, ra, pb, rb, pn):
    """out[:, r_start:r_start+n_rows] from the widened rows of one step (blocks [groups, chunks,
    4, width]), token tile by token tile, so that the tile and the rows stay in L2. During the
    first tile, rows ra..ra+pn-1 of pa and rb..rb+pn-1 of pb (the next step's weights and scales) are
    prefetched, a few lines a pass, as `_dot_groups` does for the experts."""
    t_count, width = xs.shape[1], xs.shape[2]
    tile = _token_tile(xs.shape[0] * width)
    acc = np.empty((tile + 3, 4), dtype=np.float32)
    groups = (n_rows + 3) // 4
    step = _lines_per_pass(pa, pn, groups * xs.shape[0] * ((min(tile, t_count) + 3) // 4))
    done = 0
    for t0 in range(0, t_count, tile):
        t1 = min(t_count, t0 + tile)
        for g in range(groups):
            done = _store_rows(blocks[g], xs, t0, t1, r_start + 4 * g, min(4, n_rows - 4 * g), acc, out,
                               pa, ra, pb, rb, pn, step if t0 == 0 else 0, done)


@njit(**_OPTS)
def _zero_padding(blocks, n_rows):
    """Zeros in the rows of the last group of four that lie past n_rows."""
    if n_rows % 4:
        blocks[n_rows // 4, :, n_rows % 4:, :] = 0.0


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


@njit(**_OPTS)
def _widen_bf16_into(w, r, k, block):
    """Row r of a bf16 w as float32, straight into row k of a four-row group (block [chunks, 4, width])."""
    width = block.shape[2]
    for j in range(block.shape[0]):
        _widen_bf16_span(w[r, j * width:(j + 1) * width], block[j, k])


@njit(**_OPTS)
def _widen_bf16_span(src, dst):
    wide_vectors()
    for c in range(dst.shape[0]):
        dst[c] = bf16_f32(src[c])


@njit(**_OPTS)
def _widen_int8_into(q, s, r, k, block):
    width = block.shape[2]
    per_chunk = width // GROUP
    for j in range(block.shape[0]):
        _widen_int8_span(q[r, j * width:(j + 1) * width], s[r, j * per_chunk:(j + 1) * per_chunk], block[j, k])


@njit(**_OPTS)
def _widen_int8_span(src, scales, dst):
    wide_vectors()
    for g in range(scales.shape[0]):
        scale = scales[g]
        for i in range(GROUP):
            dst[g * GROUP + i] = _i8_f32(src[g * GROUP + i]) * scale


@njit(**_OPTS)
def _widen_int4_into(q, s, r, k, block):
    half = GROUP // 2
    width = block.shape[2]
    per_chunk = width // GROUP
    for j in range(block.shape[0]):
        _widen_int4_span(q[r, j * per_chunk * half:(j + 1) * per_chunk * half],
                         s[r, j * per_chunk:(j + 1) * per_chunk], block[j, k])


@njit(**_OPTS)
def _widen_int4_span(src, scales, dst):
    wide_vectors()
    half = GROUP // 2
    for g in range(scales.shape[0]):
        scale = scales[g]
        for i in range(half):
            b = src[g * half + i]
            dst[g * GROUP + i] = (_lo_nibble_f32(b) - np.float32(8.0)) * scale
            dst[g * GROUP + half + i] = (_hi_nibble_f32(b) - np.float32(8.0)) * scale


def _widen_quant_into(q, s, r, k, block):
    """_widen_int8_into (int8 q) or _widen_int4_into (uint8 planar nibbles), chosen when numba compiles."""


@overload(_widen_quant_into)
def _widen_quant_into_impl(q, s, r, k, block):
    if q.dtype == types.int8:
        return lambda q, s, r, k, block: _widen_int8_into(q, s, r, k, block)
    return lambda q, s, r, k, block: _widen_int4_into(q, s, r, k, block)


# Each parallel step takes 16 rows: they are widened to float32 straight into
# chunks of columns like the tokens' (a last partial group of four padded
# with zero rows); then, one tile of tokens at a time (kept in L2), each group
# of four rows is dotted with the tile's tokens chunk by chunk, so the rows'
# chunk and the tokens' chunks being multiplied stay in L1.


@njit(**dict(_OPTS, parallel=True))
def matmat_bf16(w, x, out):
    """out[t, r] = w[r, :] . x[t, :] for a bf16 (uint16) w [rows, cols]."""
    rows, cols = w.shape
    width = _chunk_width(cols)
    xs = _chunked_tokens(x, width)
    for b in prange((rows + _ROW_BLOCK - 1) // _ROW_BLOCK):
        blocks = np.empty((_ROW_BLOCK // 4, cols // width, 4, width), dtype=np.float32)
        r_start = b * _ROW_BLOCK
        n_rows = min(_ROW_BLOCK, rows - r_start)
        _zero_padding(blocks, n_rows)
        for i in range(n_rows):
            _widen_bf16_into(w, r_start + i, i % 4, blocks[i // 4])
        nxt = r_start + _ROW_BLOCK  # this thread's next step, most likely
        _store_block(blocks, r_start, n_rows, xs, out, w, nxt, w, -1, max(0, min(_ROW_BLOCK, rows - nxt)))


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
    width = _chunk_width(cols)
    xs = _chunked_tokens(x, width)
    for b in prange((rows + _ROW_BLOCK - 1) // _ROW_BLOCK):
        blocks = np.empty((_ROW_BLOCK // 4, cols // width, 4, width), dtype=np.float32)
        r_start = b * _ROW_BLOCK
        n_rows = min(_ROW_BLOCK, rows - r_start)
        _zero_padding(blocks, n_rows)
        for i in range(n_rows):
            _widen_quant_into(q, s, r_start + i, i % 4, blocks[i // 4])
        nxt = r_start + _ROW_BLOCK
        _store_block(blocks, r_start, n_rows, xs, out, q, nxt, s, nxt, max(0, min(_ROW_BLOCK, rows - nxt)))


TOKEN_BLOCK = 256  # a long prompt's tokens per launch of a projection


def token_blocks(t_count: int) -> list[tuple[int, int]]:
    """(first, end) of each block of TOKEN_BLOCK tokens. Why: every projection kernel goes over
    all the tokens it is given once per block of rows; at 4096 tokens of 2048 columns that is
    32 MiB of x read from DRAM per block (half the kernels' rate at 4096 tokens against 512),
    while a block's tokens stay in L2/L3. A token's sums never depend on the other tokens of
    a launch, so the blocks change no bits."""
    return [(t0, min(t_count, t0 + TOKEN_BLOCK)) for t0 in range(0, t_count, TOKEN_BLOCK)]


def rows_past_items(kernel, parts: tuple, x: np.ndarray, out: np.ndarray, whole: int) -> None:
    """out[:, whole:] = x times the rows of `parts` from `whole` on, by `kernel` (`matmat_bf16`:
    parts (w,); `matmat_quant`: (q, s)). Why: the tile kernels take whole 32-row work items, and
    a fused router block's last rows (the shared-expert gate) are fewer than an item."""
    rows = parts[0].shape[0]
    if whole < rows:
        rest = np.empty((x.shape[0], rows - whole), np.float32)
        kernel(*(p[whole:] for p in parts), x, rest)
        out[:, whole:] = rest


def matmat(kind: str, parts: tuple, x: np.ndarray) -> np.ndarray:
    """x [T, cols] times the matrix in `parts` (bf16: (w,), int8/int4: (q, scales)) -> [T, rows].

    (float32 matrices go to BLAS, which is faster for them.)
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = parts[0].shape[0]
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    if kind not in ("bf16", "int8", "int4"):
        raise ValueError(f"unknown weight kind {kind!r}")
    for t0, t1 in token_blocks(x.shape[0]):
        if kind == "bf16":
            matmat_bf16(parts[0], x[t0:t1], out[t0:t1])
        else:
            matmat_quant(parts[0], parts[1], x[t0:t1], out[t0:t1])
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


# --- several experts of a prompt in two launches ------------------------------------------------
# One launch computes h = silu(gate x) * (up x) for every (expert, block of rows) of a batch of
# experts, the next one down(h) for every (expert, block of rows). Each work item writes only
# its own outputs and sums in a fixed order, so the results never depend on how the threads
# take the work items. The blobs are found by address (`_at`), so the experts of a batch may
# lie anywhere (RAM slots, scratch buffers) while the caller holds them.

_PAIR_ROWS = 8  # gate rows (and the same up rows) per work item of the gate|up launch


@njit(**_OPTS)
def _dealt_share(n_items, threads, run):
    """Steps of each thread's contiguous share when n_items are dealt in runs of `run`."""
    runs = (n_items + run - 1) // run
    return (runs + threads - 1) // threads * run


@njit(**_OPTS)
def _dealt(step, n_items, threads, run):
    """The work item that `step` of a parallel loop over n_items takes, dealt round-robin in
    runs of `run` consecutive items.

    Why: numba's OpenMP pool hands each thread one contiguous share of the steps (also
    with a parallel chunk size: the chunks are split the same way), and an expert's
    items cost in proportion to its tokens, which a trained router makes uneven; dealt
    round-robin, each thread takes every `threads`-th run (`_expert_run`: its share of
    each expert).
    Results do not depend on which thread takes an item."""
    share = _dealt_share(n_items, threads, run)
    k = step % share
    return ((k // run) * threads + step // share) * run + k % run


@njit(**_OPTS)
def _dealt_next(step, w, n_items, threads, run):
    """The item that step's thread most likely takes after item w (w itself when none)."""
    if (step + 1) % _dealt_share(n_items, threads, run) == 0:
        return w
    nxt = _dealt(step + 1, n_items, threads, run)
    return nxt if nxt < n_items else w


@njit(**_OPTS)
def _expert_run(per, threads):
    """Run length for dealing an experts' launch whose experts have `per` items each: every
    expert's items in `threads` runs, so each thread takes an equal share of every expert
    (whatever the token counts) as one contiguous stretch of its rows, which the hardware
    prefetchers follow (dealt one item at a time, each thread skipped every other 4 KiB
    of int4 rows and the down launch ran 5-20% slower with even token counts)."""
    threads = max(1, threads)
    return max(1, (per + threads - 1) // threads)


@njit(**_OPTS)
def _deal_plan(n_experts, per, threads):
    """(items, threads, run, steps) of an experts' launch of n_experts with `per` items each
    dealt to `threads` threads (at least 1): the loop runs `steps` steps (`_dealt`)."""
    threads = max(1, threads)
    run = _expert_run(per, threads)
    n_items = n_experts * per
    return n_items, threads, run, _dealt_steps(n_items, threads, run)


@njit(**_OPTS)
def _dealt_steps(n_items, threads, run):
    """Steps of the parallel loop that deals n_items to `threads` threads (`_dealt`): a whole
    share per thread; steps past the last item do nothing."""
    return _dealt_share(n_items, max(1, threads), run) * max(1, threads)


@intrinsic
def _at(typingctx, addr, marker):
    """A pointer to marker's dtype at the integer address addr."""
    ptr = types.CPointer(marker.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(types.intp, marker), codegen


_U8_MARKER = np.empty(0, np.uint8)


@njit(**_OPTS)
def _expert_matrices(marker, base, nbytes, hidden, inter):
    """(gate, gate scales, up, up scales, down, down scales) of the nbytes-byte blob at address
    base, as `qmatvec.expert_views` lays them out for weights of marker's dtype (float32,
    uint16 bf16, int8, uint8 int4 nibbles)."""
    return expert_views(carray(_at(base, _U8_MARKER), (nbytes,)), marker, hidden, inter)


def _widen_row_into(w, s, r, k, block):
    """Row r of w (scales s) as float32 into row k of a four-row group (block [chunks, 4, width])."""


@overload(_widen_row_into)
def _widen_row_into_impl(w, s, r, k, block):
    if w.dtype == types.float32:
        return lambda w, s, r, k, block: _copy_f32_into(w, r, k, block)
    if w.dtype == types.uint16:
        return lambda w, s, r, k, block: _widen_bf16_into(w, r, k, block)
    return lambda w, s, r, k, block: _widen_quant_into(w, s, r, k, block)


@njit(**_OPTS)
def _copy_f32_into(w, r, k, block):
    width = block.shape[2]
    for j in range(block.shape[0]):
        _copy_f32_span(w[r, j * width:(j + 1) * width], block[j, k])


@njit(**_OPTS)
def _copy_f32_span(src, dst):
    wide_vectors()
    for c in range(dst.shape[0]):
        dst[c] = src[c]


@njit(**_OPTS)
def _dot_groups(blocks, n_groups, xs, t0, t1, acc, res, pa, ra, pb, rb, pn):
    """res[t - t0, 4g + k] = row k of group g of `blocks` . token t of xs, for t0 <= t < t1,
    group by group (`_dot_rows4`). Meanwhile rows ra..ra+pn-1 of pa and rb..rb+pn-1 of pb,
    the next work item's, are prefetched a few lines a pass, so that their reads from DRAM
    overlap this item's arithmetic: without it a prompt's bf16 experts (rows of 4 KiB, each
    a new page where the hardware prefetchers stop) ran 25-35% slower from DRAM than from
    cache at 128 tokens (docs/benchmarks.md, "The next work item's rows")."""
    step = _lines_per_pass(pa, pn, n_groups * xs.shape[0] * ((t1 - t0 + 3) // 4))
    done = 0
    for g in range(n_groups):
        done = _dot_rows4(blocks[g], xs, t0, t1, acc, pa, ra, pb, rb, pn, step, done)
        for t in range(t1 - t0):
            for k in range(4):
                res[t, 4 * g + k] = acc[t, k]


@njit(**dict(_OPTS, parallel=True))
def gather_chunked(x, rows, width, xs):
    """xs[j, i, c] = x[rows[i], j * width + c]: the tokens of a batch side by side, chunk by chunk."""
    for i in prange(rows.shape[0]):
        r = rows[i]
        for j in range(xs.shape[0]):
            for c in range(width):
                xs[j, i, c] = x[r, j * width + c]


@njit(**dict(_OPTS, parallel=True, error_model="numpy"))
def experts_gate_up(marker, bases, nbytes, hidden, inter, xs, starts, hs, threads):
    """hs[j, t, c] = silu(gate x_t) * (up x_t) at row j * width + c of expert e's inter rows,
    for the tokens starts[e] <= t < starts[e + 1] of xs [chunks, N, hidden's width] and the
    blob at address bases[e]; hs is [inter chunks, N, inter's width]. The work items are
    dealt to `threads` threads round-robin, a run per thread and expert (`_dealt`)."""
    per = (inter + _PAIR_ROWS - 1) // _PAIR_ROWS
    chunks, width = xs.shape[0], xs.shape[2]
    h_width = hs.shape[2]
    tile = _token_tile(hidden)
    n_items, threads, run, steps = _deal_plan(bases.shape[0], per, threads)
    for step in prange(steps):
        w = _dealt(step, n_items, threads, run)
        if w >= n_items:
            continue
        e = w // per
        r0 = (w % per) * _PAIR_ROWS
        n = min(_PAIR_ROWS, inter - r0)
        gate, sg, up, su, _, _ = _expert_matrices(marker, bases[e], nbytes, hidden, inter)
        blocks = np.empty((2 * _PAIR_ROWS // 4, chunks, 4, width), dtype=np.float32)
        if n < _PAIR_ROWS:
            blocks[:] = 0.0
        for i in range(n):
            _widen_row_into(gate, sg, r0 + i, i % 4, blocks[i // 4])
            _widen_row_into(up, su, r0 + i, i % 4, blocks[_PAIR_ROWS // 4 + i // 4])
        acc = np.empty((tile + 3, 4), dtype=np.float32)
        res = np.empty((tile, 2 * _PAIR_ROWS), dtype=np.float32)
        # the item this thread most likely takes next: its rows are prefetched while this one
        # computes (int8 and int4 too: gate|up 10% and 4% faster at 128 tokens, 2026-12-04)
        nxt = _dealt_next(step, w, n_items, threads, run)
        gate_n, up_n = gate, up  # the next item is mostly the same expert's: its views as they are
        if nxt // per != e:
            gate_n, _, up_n, _, _, _ = _expert_matrices(marker, bases[nxt // per], nbytes, hidden, inter)
        r_n = (nxt % per) * _PAIR_ROWS
        n_n = min(_PAIR_ROWS, inter - r_n) if nxt != w else 0
        for t0 in range(starts[e], starts[e + 1], tile):
            t1 = min(starts[e + 1], t0 + tile)
            _dot_groups(blocks, 2 * _PAIR_ROWS // 4, xs, t0, t1, acc, res, gate_n, r_n, up_n, r_n, n_n)
            for t in range(t1 - t0):
                for i in range(n):
                    r = r0 + i
                    hs[r // h_width, t0 + t, r % h_width] = silu_f32(res[t, i]) * res[t, _PAIR_ROWS + i]


@njit(**dict(_OPTS, parallel=True))
def experts_down(marker, bases, nbytes, hidden, inter, hs, starts, out, out_rows, threads):
    """out[out_rows[t]] = down h_t of expert e for the tokens starts[e] <= t < starts[e + 1] of
    hs (from `experts_gate_up`) and the blob at address bases[e]; items dealt as there."""
    per = (hidden + _ROW_BLOCK - 1) // _ROW_BLOCK
    chunks, width = hs.shape[0], hs.shape[2]
    tile = _token_tile(inter)
    n_items, threads, run, steps = _deal_plan(bases.shape[0], per, threads)
    for step in prange(steps):
        w = _dealt(step, n_items, threads, run)
        if w >= n_items:
            continue
        e = w // per
        r0 = (w % per) * _ROW_BLOCK
        n = min(_ROW_BLOCK, hidden - r0)
        _, _, _, _, down, sd = _expert_matrices(marker, bases[e], nbytes, hidden, inter)
        blocks = np.empty((_ROW_BLOCK // 4, chunks, 4, width), dtype=np.float32)
        _zero_padding(blocks, n)
        for i in range(n):
            _widen_row_into(down, sd, r0 + i, i % 4, blocks[i // 4])
        acc = np.empty((tile + 3, 4), dtype=np.float32)
        res = np.empty((tile, _ROW_BLOCK), dtype=np.float32)
        nxt = _dealt_next(step, w, n_items, threads, run)
        down_n = down
        if nxt // per != e:
            _, _, _, _, down_n, _ = _expert_matrices(marker, bases[nxt // per], nbytes, hidden, inter)
        r_n = (nxt % per) * _ROW_BLOCK
        n_n = min(_ROW_BLOCK, hidden - r_n) if nxt != w else 0
        for t0 in range(starts[e], starts[e + 1], tile):
            t1 = min(starts[e + 1], t0 + tile)
            _dot_groups(blocks, (n + 3) // 4, hs, t0, t1, acc, res, down_n, r_n, down_n, -1, n_n)
            for t in range(t1 - t0):
                row = out_rows[t0 + t]
                for k in range(n):
                    out[row, r0 + k] = res[t, k]


_MARKERS = {"fp32": np.empty(0, np.float32), "bf16": np.empty(0, np.uint16),
            "int8": np.empty(0, np.int8), "int4": np.empty(0, np.uint8)}


def expert_batch(who: str, kind: str, blobs: list, hidden: int, inter: int, x: np.ndarray, token_rows: list,
                 out: np.ndarray, out_rows: list) -> tuple:
    """A prompt's batch of experts checked and laid out for the experts' launches: (blob bytes,
    blob addresses, starts [experts + 1], token rows, output rows), each expert's pairs
    starts[e]..starts[e + 1]; ValueError naming `who` on a short blob, bad arrays or rows
    out of range."""
    nbytes = blob_nbytes(kind, hidden, inter)
    for b in blobs:
        if b.dtype != np.uint8 or b.ndim != 1 or b.size < nbytes or not b.flags.c_contiguous:
            raise ValueError(f"a {kind} expert blob of {hidden}x{inter} needs {nbytes} contiguous bytes")
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != hidden or not x.flags.c_contiguous:
        raise ValueError(f"{who} needs x float32[T, {hidden}] (C order), got {x.dtype}{x.shape}")
    if out.dtype != np.float32 or out.ndim != 2 or out.shape[1] != hidden or not out.flags.c_contiguous:
        raise ValueError(f"{who} needs out float32[rows, {hidden}] (C order)")
    starts = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in token_rows], out=starts[1:])
    pairs = int(starts[-1])
    rows = np.fromiter((r for rs in token_rows for r in rs), dtype=np.int64, count=pairs)
    dest = np.fromiter((r for rs in out_rows for r in rs), dtype=np.int64, count=pairs)
    if rows.size and (rows.min() < 0 or rows.max() >= x.shape[0] or dest.min() < 0 or dest.max() >= out.shape[0]):
        raise ValueError(f"{who}: a token or output row out of range")
    bases = np.array([b.ctypes.data for b in blobs], dtype=np.intp)
    return nbytes, bases, starts, rows, dest


def experts_matmat(kind: str, blobs: list, hidden: int, inter: int, x: np.ndarray, token_rows: list,
                   out: np.ndarray, out_rows: list) -> None:
    """out[out_rows[e][i]] = expert e (blobs[e]) of x[token_rows[e][i]], for a batch of experts
    in two parallel launches.

    Why: a prompt's experts each see a few tokens; one launch over (expert, rows) work items for
    all of them keeps both cores busy where one expert's launch would be too small, and fuses
    silu into the gate|up store. Each out row is the same whatever else is in the batch, within
    1e-5 relative of the one-token kernels; x [T, hidden], out [rows, hidden] float32. int4 and
    int8 experts on CPUs with AVX-512 VNNI take `experts_vnni.experts_integer` (no row widened
    to float32).
    """
    if kind in ("int4", "int8"):
        from tierlab.engine.kernels import experts_vnni  # (it builds on this module)

        if experts_vnni.usable(kind, hidden, inter):  # integer dot products, 16 rows to a vector
            experts_vnni.experts_integer(kind, blobs, hidden, inter, x, token_rows, out, out_rows)
            return
    if kind in ("bf16", "fp32"):
        from tierlab.engine.kernels import float_tiles  # (it builds on this module)

        if float_tiles.usable(kind, hidden, inter):  # float32 tiles, 16 rows to a vector
            float_tiles.experts_tiles(kind, blobs, hidden, inter, x, token_rows, out, out_rows)
            return
    nbytes, bases, starts, rows, dest = expert_batch("experts_matmat", kind, blobs, hidden, inter, x, token_rows,
                                                     out, out_rows)
    width = _chunk_width(hidden)
    xs = np.empty((hidden // width, rows.size, width), dtype=np.float32)
    gather_chunked(x, rows, width, xs)
    h_width = _chunk_width(inter)
    hs = np.empty((inter // h_width, rows.size, h_width), dtype=np.float32)
    marker = _MARKERS[kind]
    threads = numba.get_num_threads()
    experts_gate_up(marker, bases, nbytes, hidden, inter, xs, starts, hs, threads)
    experts_down(marker, bases, nbytes, hidden, inter, hs, starts, out, dest, threads)
