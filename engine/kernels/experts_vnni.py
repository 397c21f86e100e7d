"""A prompt's int4 and int8 experts by integer dot products, sixteen rows to a vector (AVX-512 VNNI).

Why: at 128 tokens an expert of the 64-expert slice sees 16 tokens, and the
float32 path (`qmatmat.experts_gate_up` / `experts_down`) widens every weight
row to float32 and dots it with those 16 tokens by FMAs, 16 products an
instruction plus the widening (docs/benchmarks.md, "The Zen 4's prompt
against its FMA peak"). Here the rows stay integers: x is prepared once per
token as the decode matvecs prepare it (`qmatvec._prepare_into`: three 7-bit
digits, a unit and an offset per group), and `vpdpbusd` multiplies 64 bytes
at a time, which on the Zen 4 issues as fast as an FMA (tools/issue_rate.py).

Layout: a work item takes two tiles of 16 rows (16 gate rows and the same
16 up rows, or 32 down rows). Each tile's rows are transposed 128 columns
(two groups) at a time by 4-byte columns (`_transpose_tile`), so that lane l
of a vector holds row l, as bytes: int4's low and high nibbles, int8's bytes
plus 128 (the u8 operand, as in the matvec); a token's digits for 4 columns
are broadcast to every lane, once for both tiles. A group's integer sum per
row is then one lane of one register: the offset, the conversion and the
group's scale times the token's unit are paid once per group, token and 16
rows (not once per 64 bytes and row, as in the matvec), and no horizontal
sum is needed at the end. Widths must be whole 128-column blocks
(`usable`), so no item is short.

Exactness: the integer sums are the matvec's (the same digits, the same
wraparound-exact int32 arithmetic); only the float32 sums over groups run in
another order, so results are within 1e-5 relative of the float path and of
a float64 reference of the dequantised weights (tests/test_experts_vnni.py),
not bit-identical to decode.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from tierlab.engine.blob_layout import GROUP
from tierlab.engine.kernels.fastexp import silu_f32
from tierlab.engine.kernels.qmatmat import (_deal_plan, _dealt, _dealt_next, _expert_matrices, _lines_per_pass,
                                            _prefetch_lines, expert_batch)
from tierlab.engine.kernels.qmatvec import (_DIGIT_BITS, _I32, _I64, _V16F, _VNNI, _counted_loop, _load_vec,
                                            _prepare_into, _prepared_sizes, _row_start, _splat)

_I8 = ir.IntType(8)
_V16I = ir.VectorType(_I32, 16)
_OPTS = dict(nogil=True, cache=True, fastmath=True)
_TILE = 16  # rows of a tile: one per lane
_TILES = 2  # tiles a work item takes (each broadcast of a digit serves both)
_KIND_BITS = {"int4": 4, "int8": 8}
_MARKERS = {"int4": np.empty(0, np.uint8), "int8": np.empty(0, np.int8)}  # as `qmatmat._expert_matrices` reads them
_BLOCK = 2 * GROUP  # columns of a tile block: two groups (int4: 64 bytes of a row, int8: 128)
_DIGIT_BLOCK = 3 * 2 * 64  # prepared digit bytes per block: 3 digits x (int4 nibbles or int8 groups) x 64


def usable(kind: str, hidden: int, inter: int) -> bool:
    """True where this path runs: int4 or int8 weights, VNNI, and whole blocks in both widths."""
    return _VNNI and kind in _KIND_BITS and hidden % _BLOCK == 0 and inter % _BLOCK == 0


def _lane_masks():
    """The shuffle masks of a 16 x 16 dword transpose: interleave dwords, then pairs of dwords,
    within 128-bit lanes (`vpunpck*`), then pick 128-bit lanes twice (`vshufi32x4`)."""
    lo32 = [i for k in range(4) for i in (4 * k, 16 + 4 * k, 4 * k + 1, 17 + 4 * k)]
    hi32 = [i for k in range(4) for i in (4 * k + 2, 18 + 4 * k, 4 * k + 3, 19 + 4 * k)]
    lo64 = [i for k in range(4) for i in (4 * k, 4 * k + 1, 16 + 4 * k, 17 + 4 * k)]
    hi64 = [i for k in range(4) for i in (4 * k + 2, 4 * k + 3, 18 + 4 * k, 19 + 4 * k)]

    def lanes(picks):  # 128-bit lanes: the first two from a, the last two from b
        return [(0 if j < 2 else 16) + 4 * picks[j] + e for j in range(4) for e in range(4)]

    return lo32, hi32, lo64, hi64, lanes([0, 2, 0, 2]), lanes([1, 3, 1, 3])


_LO32, _HI32, _LO64, _HI64, _EVEN_LANES, _ODD_LANES = _lane_masks()


def _transpose16(builder, rows):
    """16 vectors of 16 dwords -> the transposed 16 (vector c, lane l = rows[l][c]): 64 shuffles,
    half of them within 128-bit lanes, where four rounds of two-input shuffles compiled to 128
    and the copies `vpermt2d` needs. The tiles built no faster on the Zen 4 (the rows' reads
    bound them there; docs/benchmarks.md, "bf16 prompts by float tiles"), but no slower either."""
    def mix(a, b, mask):
        return builder.shuffle_vector(a, b, ir.Constant(_V16I, mask))

    t = []
    for i in range(0, 16, 2):
        t += [mix(rows[i], rows[i + 1], _LO32), mix(rows[i], rows[i + 1], _HI32)]
    u = []
    for g in range(0, 16, 4):
        u += [mix(t[g], t[g + 2], _LO64), mix(t[g], t[g + 2], _HI64),
              mix(t[g + 1], t[g + 3], _LO64), mix(t[g + 1], t[g + 3], _HI64)]
    v = [None] * 16
    for h in (0, 8):
        for j in range(4):
            v[h + j] = mix(u[h + j], u[h + 4 + j], _EVEN_LANES)
            v[h + 4 + j] = mix(u[h + j], u[h + 4 + j], _ODD_LANES)
    return [mix(v[j], v[8 + j], _EVEN_LANES) for j in range(8)] + [mix(v[j], v[8 + j], _ODD_LANES) for j in range(8)]


@intrinsic
def _transpose_tile(typingctx, q, r0, n_blocks, tiles):
    """tiles[b, k, c] (int32 [blocks, 2, 16, 16]), lane l holding row r0 + l of q: for int4 (uint8
    [rows, cols / 2] planar nibbles) nibble k (0 low, 1 high) of the bytes 4c..4c+3 of the row's
    64-byte block b; for int8 (int8 [rows, cols]) the bytes 4c..4c+3 of group 2b + k, plus 128."""
    if not (isinstance(q, types.Array) and q.ndim == 2 and q.layout == "C" and q.dtype in (types.uint8, types.int8)):
        return None
    nibbles = q.dtype == types.uint8

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        out = context.make_array(signature.args[3])(context, builder, args[3])
        first, nb = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 2))
        row_ptrs = [_row_start(context, builder, a, builder.add(first, ir.Constant(_I64, lane)), types.int64)
                    for lane in range(_TILE)]
        low = ir.Constant(_V16I, [0x0F0F0F0F] * 16)
        four = ir.Constant(_V16I, [4] * 16)
        bias = ir.Constant(_V16I, [0x80808080] * 16)  # int8 + 128 as u8: flip each byte's top bit
        dst = builder.bitcast(out.data, _I8.as_pointer())

        def store(base, k, c, v):
            off = builder.add(base, ir.Constant(_I64, (k * 16 + c) * 64))
            builder.store(v, builder.bitcast(builder.gep(dst, [off]), _V16I.as_pointer()), align=4)

        def body(blk, carried):
            base = builder.mul(blk, ir.Constant(_I64, 2 * 16 * 64))
            if nibbles:
                at = builder.mul(blk, ir.Constant(_I64, 64))
                cols = _transpose16(builder, [_load_vec(builder, p, at, _V16I, 1) for p in row_ptrs])
                for c, v in enumerate(cols):
                    store(base, 0, c, builder.and_(v, low))
                    store(base, 1, c, builder.and_(builder.lshr(v, four), low))
                return carried
            for k in range(2):
                at = builder.add(builder.mul(blk, ir.Constant(_I64, 128)), ir.Constant(_I64, 64 * k))
                cols = _transpose16(builder, [_load_vec(builder, p, at, _V16I, 1) for p in row_ptrs])
                for c, v in enumerate(cols):
                    store(base, k, c, builder.xor(v, bias))
            return carried

        _counted_loop(builder, nb, [ir.Constant(_I64, 0)], body)
        return context.get_dummy_value()

    return types.none(q, r0, n_blocks, tiles), codegen


@intrinsic
def _tile_dots(typingctx, tiles, digits, corr, unit, scales, ta, tb, tc, td, res, at, q):
    """res[at + s, 16 i + l] = row l of tile i . token t_s (s < 4, i < _TILES; ta..td are rows of
    the prepared arrays: digits int8 [N, bytes], corr int32 [N, groups] the group's offset,
    unit float32 [N, groups]); scales float32 [_TILES, groups, 16] the tiles' scales by group;
    tiles [_TILES, blocks, 2, 16, 16] from `_transpose_tile` of weights like q (whose dtype picks
    the layout). Each broadcast of a token's digits serves every tile: a broadcast for each
    `vpdpbusd` held the one-core rate to 2.35 G a second against 3.3 with it shared
    (docs/benchmarks.md)."""
    def codegen(context, builder, signature, args):
        tl, dg, co, un, sc, rs = (context.make_array(signature.args[i])(context, builder, args[i])
                                  for i in (0, 1, 2, 3, 4, 9))
        toks = [context.cast(builder, args[i], signature.args[i], types.int64) for i in (5, 6, 7, 8)]
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16I, [_V16I] * 3),
                                             "llvm.x86.avx512.vpdpbusd.512")
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
        n_blocks = builder.extract_value(tl.shape, 1)
        n_groups = builder.extract_value(co.shape, 1)
        tile_ptr = builder.bitcast(tl.data, _I8.as_pointer())
        tile_bytes = builder.mul(n_blocks, ir.Constant(_I64, 2 * 16 * 64))
        dig_rows = [_row_start(context, builder, dg, t, types.int64) for t in toks]
        co_rows = [builder.gep(co.data, [builder.mul(t, n_groups)]) for t in toks]
        un_rows = [builder.gep(un.data, [builder.mul(t, n_groups)]) for t in toks]
        zero_i = ir.Constant(_V16I, [0] * 16)
        shift = ir.Constant(_V16I, [_DIGIT_BITS] * 16)
        # (tile half k, quad c, group) in issue order, one quad of each group a step so that the
        # two groups' chains alternate: int4's quads c and c + 8 of nibble k, int8's quad c of group k
        if nibbles:
            steps = [(k, c8 + 8 * h, h) for k in range(2) for c8 in range(8) for h in range(2)]
        else:
            steps = [(k, c, k) for c in range(16) for k in range(2)]

        def body(blk, faccs):
            block_at = builder.mul(blk, ir.Constant(_I64, 2 * 16 * 64))
            dig_at = builder.mul(blk, ir.Constant(_I64, _DIGIT_BLOCK))
            # [token][tile][group of the block]: 16 independent chains
            accs = [[[zero_i, zero_i] for _ in range(_TILES)] for _ in range(4)]
            for d in range(3):
                if d:
                    accs = [[[builder.shl(v, shift) for v in pair] for pair in row] for row in accs]
                for k, c, group in steps:
                    w = [_load_vec(builder, tile_ptr,
                                   builder.add(builder.add(builder.mul(tile_bytes, ir.Constant(_I64, i)), block_at),
                                               ir.Constant(_I64, (k * 16 + c) * 64)), _V16I, 4)
                         for i in range(_TILES)]
                    for s in range(4):
                        place = d * 128 + k * 64 + 4 * c if nibbles else k * 192 + d * 64 + 4 * c
                        pos = builder.add(dig_at, ir.Constant(_I64, place))
                        word = builder.load(builder.bitcast(builder.gep(dig_rows[s], [pos]), _I32.as_pointer()),
                                            align=1)
                        digit = _splat(builder, word, _V16I)
                        for i in range(_TILES):
                            accs[s][i][group] = builder.call(dot, [accs[s][i][group], w[i], digit])
            out = []
            for s in range(4):
                for i in range(_TILES):
                    f = faccs[s * _TILES + i]
                    for h in range(2):
                        g = builder.add(builder.mul(blk, ir.Constant(_I64, 2)), ir.Constant(_I64, h))
                        offset = _splat(builder, builder.load(builder.gep(co_rows[s], [g])), _V16I)
                        exact = builder.sitofp(builder.sub(accs[s][i][h], offset), _V16F)
                        lanes = builder.add(builder.mul(builder.add(builder.mul(ir.Constant(_I64, i), n_groups), g),
                                                        ir.Constant(_I64, 16)), ir.Constant(_I64, 0))
                        weight = builder.fmul(_load_vec(builder, sc.data, lanes, _V16F, 4),
                                              _splat(builder, builder.load(builder.gep(un_rows[s], [g])), _V16F))
                        f = builder.call(fma, [exact, weight, f])
                    out.append(f)
            return out

        zero_f = ir.Constant(_V16F, [0.0] * 16)
        faccs = _counted_loop(builder, n_blocks, [zero_f] * (4 * _TILES), body)
        row0 = context.cast(builder, args[10], signature.args[10], types.int64)
        for s in range(4):
            for i in range(_TILES):
                lane0 = builder.add(builder.mul(builder.add(row0, ir.Constant(_I64, s)), ir.Constant(_I64, 16 * _TILES)),
                                    ir.Constant(_I64, 16 * i))
                builder.store(faccs[s * _TILES + i], builder.bitcast(builder.gep(rs.data, [lane0]), _V16F.as_pointer()),
                              align=4)
        return context.get_dummy_value()

    arrays = (tiles, digits, corr, unit, scales, res)
    if not all(isinstance(t, types.Array) and t.layout == "C" for t in arrays) or not isinstance(q, types.Array):
        return None
    nibbles = q.dtype == types.uint8
    return types.none(tiles, digits, corr, unit, scales, ta, tb, tc, td, res, at, q), codegen


@njit(**dict(_OPTS, parallel=True))
def prepare_rows(x, rows, bits, digits, corr, unit):
    """Rows rows[i] of x [T, cols] prepared for `_tile_dots` on `bits`-bit weights into row i of
    digits / corr / unit: the matvecs' preparation (`qmatvec._prepare_into`), then each group's
    offset (the sum of its lanes' offsets: int4 pairs groups in a block's lanes 0-7 and 8-15,
    int8 gives a group 16 lanes of its own) and unit."""
    cols = x.shape[1]
    n_digits, n_unit, n_corr = _prepared_sizes(cols, bits)
    groups = cols // GROUP
    lanes = 8 if bits == 4 else 16
    for i in prange(rows.shape[0]):
        lane_unit = np.empty(n_unit, np.float32)
        lane_corr = np.empty(n_corr, np.int32)
        _prepare_into(x[rows[i]], bits, digits[i], lane_unit, lane_corr)
        for g in range(groups):
            lane0 = (g // 2) * 16 + (g % 2) * 8 if bits == 4 else g * 16
            total = np.int32(0)
            for j in range(lanes):
                total += lane_corr[lane0 + j]
            corr[i, g] = total
            unit[i, g] = lane_unit[lane0]


def prepared(x: np.ndarray, rows: np.ndarray, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(digits, corr, unit) of rows `rows` of x [T, cols] for `_tile_dots` on `bits`-bit weights
    (the same bytes for both: 3 digits x 128 a block of two groups)."""
    n_digits = _prepared_sizes(x.shape[1], bits)[0]
    groups = x.shape[1] // GROUP
    digits = np.empty((rows.shape[0], n_digits), np.int8)
    corr = np.empty((rows.shape[0], groups), np.int32)
    unit = np.empty((rows.shape[0], groups), np.float32)
    prepare_rows(x, rows, bits, digits, corr, unit)
    return digits, corr, unit


@njit(**_OPTS)
def _scales_by_group(s, r0, out):
    """out[g, l] = the scale of row r0 + l in group g (s [rows, groups])."""
    for lane in range(_TILE):
        for g in range(out.shape[0]):
            out[g, lane] = s[r0 + lane, g]


@njit(**_OPTS)
def _tile_item(qa, sa, ra, qb, sb, rb, blocks, tiles, scales):
    """The two tiles of a work item: rows ra..ra+15 of qa (scales sa) and rb..rb+15 of qb (sb)."""
    _transpose_tile(qa, ra, blocks, tiles[0])
    _transpose_tile(qb, rb, blocks, tiles[1])
    _scales_by_group(sa, ra, scales[0])
    _scales_by_group(sb, rb, scales[1])


@njit(**_OPTS)
def _token_passes(q, tiles, digits, corr, unit, scales, rows, first, last, res, pa, ra, pb, rb, pn):
    """`_tile_dots` (tiles of weights like q) for the prepared rows rows[first..last-1], four a
    pass (a short last pass repeats its last row): res[i - first] for each i (res [last - first
    + 3, 32]). Meanwhile
    rows ra..ra+pn-1 of pa and rb..rb+pn-1 of pb (the next work item's) are prefetched, a few
    lines a pass, as the float path's items do (`qmatmat._dot_groups`)."""
    step = _lines_per_pass(pa, pn, (last - first + 3) // 4)
    done = 0
    final = last - 1
    for t in range(first, last, 4):
        _tile_dots(tiles, digits, corr, unit, scales, rows[t], rows[min(t + 1, final)], rows[min(t + 2, final)],
                   rows[min(t + 3, final)], res, t - first, q)
        if step:
            _prefetch_lines(pa, ra, pn, done, step)
            _prefetch_lines(pb, rb, pn, done, step)
            done += step


# Every width is a whole number of 128-column blocks (`usable`), so the inter rows (gate, up)
# come in items of 16 and the hidden rows (down) in items of 32, none short.


@njit(**_OPTS)
def _item_sums(qa, sa, ra, qb, sb, rb, blocks, digits, corr, unit, rows, first, last, na, rna, nb, rnb, pn):
    """One work item's sums [last - first + 3, 32]: its two tiles (rows ra.. of qa, scales sa;
    rb.. of qb, sb) against the prepared rows rows[first..last-1], while the next item's rows
    (rna.. of na, rnb.. of nb, pn each; 0: none) are prefetched."""
    tiles = np.empty((_TILES, blocks, 2, _TILE, _TILE), np.int32)
    scales = np.empty((_TILES, sa.shape[1], _TILE), np.float32)
    _tile_item(qa, sa, ra, qb, sb, rb, blocks, tiles, scales)
    res = np.empty((last - first + 3, _TILES * _TILE), np.float32)
    _token_passes(qa, tiles, digits, corr, unit, scales, rows, first, last, res, na, rna, nb, rnb, pn)
    return res


@njit(**_OPTS)
def _step_item(step, per, n_items, threads, run, starts):
    """(work item, the item this thread most likely takes next) of a launch's step, dealt as
    `qmatmat._dealt` deals; (-1, -1) past the last item or for an expert without tokens."""
    w = _dealt(step, n_items, threads, run)
    if w >= n_items or starts[w // per] == starts[w // per + 1]:
        return -1, -1
    return w, _dealt_next(step, w, n_items, threads, run)


@njit(**dict(_OPTS, parallel=True, error_model="numpy"))
def gate_up_dots(marker, bases, nbytes, hidden, inter, digits, corr, unit, rows, starts, h, threads):
    """h[p, r] = silu(gate . x_p) * (up . x_p) at row r of expert e's inter rows, for the pairs
    starts[e] <= p < starts[e + 1], x_p row rows[p] of the prepared `digits` / `corr` / `unit`
    (each token prepared once, whatever number of its experts), and the blob at address bases[e]
    of weights like marker (int4 or int8); work items of 16 gate and the same 16 up rows, dealt
    as `qmatmat._dealt` deals."""
    per = inter // _TILE
    n_items, threads, run, steps = _deal_plan(bases.shape[0], per, threads)
    for step in prange(steps):
        w, nxt = _step_item(step, per, n_items, threads, run, starts)
        if w < 0:
            continue
        e, r0 = w // per, (w % per) * _TILE
        gate, sg, up, su, _, _ = _expert_matrices(marker, bases[e], nbytes, hidden, inter)
        gate_n, _, up_n, _, _, _ = _expert_matrices(marker, bases[nxt // per], nbytes, hidden, inter)
        r_n = (nxt % per) * _TILE
        first = starts[e]
        res = _item_sums(gate, sg, r0, up, su, r0, hidden // _BLOCK, digits, corr, unit, rows, first, starts[e + 1],
                         gate_n, r_n, up_n, r_n, _TILE if nxt != w else 0)
        for p in range(first, starts[e + 1]):
            for i in range(_TILE):
                h[p, r0 + i] = silu_f32(res[p - first, i]) * res[p - first, _TILE + i]


@njit(**dict(_OPTS, parallel=True))
def down_dots(marker, bases, nbytes, hidden, inter, digits, corr, unit, pairs, starts, out, out_rows, threads):
    """out[out_rows[p]] = down . h_p of expert e for the pairs starts[e] <= p < starts[e + 1]
    (h_p the prepared row pairs[p] of h) and the blob at address bases[e]; work items of 32 rows."""
    item = _TILES * _TILE
    per = hidden // item
    n_items, threads, run, steps = _deal_plan(bases.shape[0], per, threads)
    for step in prange(steps):
        w, nxt = _step_item(step, per, n_items, threads, run, starts)
        if w < 0:
            continue
        e, r0 = w // per, (w % per) * item
        _, _, _, _, down, sd = _expert_matrices(marker, bases[e], nbytes, hidden, inter)
        _, _, _, _, down_n, _ = _expert_matrices(marker, bases[nxt // per], nbytes, hidden, inter)
        r_n = (nxt % per) * item
        first = starts[e]
        res = _item_sums(down, sd, r0, down, sd, r0 + _TILE, inter // _BLOCK, digits, corr, unit, pairs, first,
                         starts[e + 1], down_n, r_n, down_n, r_n + _TILE, _TILE if nxt != w else 0)
        for p in range(first, starts[e + 1]):
            row = out_rows[p]
            for i in range(item):
                out[row, r0 + i] = res[p - first, i]


def experts_integer(kind: str, blobs: list, hidden: int, inter: int, x: np.ndarray, token_rows: list,
                    out: np.ndarray, out_rows: list) -> None:
    """`qmatmat.experts_matmat` for int4 or int8 experts where `usable`: the batch's tokens
    prepared once each (a streamed prompt runs many batches: not all of x for each), the
    gate|up launch into h [pairs, inter], h's rows prepared, the down launch."""
    nbytes, bases, starts, rows, dest = expert_batch("experts_matmat", kind, blobs, hidden, inter, x, token_rows,
                                                     out, out_rows)
    threads = numba.get_num_threads()
    bits, marker = _KIND_BITS[kind], _MARKERS[kind]
    tokens, at = np.unique(rows, return_inverse=True)
    digits, corr, unit = prepared(x, tokens, bits)
    h = np.empty((rows.size, inter), np.float32)
    gate_up_dots(marker, bases, nbytes, hidden, inter, digits, corr, unit, at.astype(np.int64, copy=False), starts, h,
                 threads)
    pairs = np.arange(rows.size, dtype=np.int64)
    digits, corr, unit = prepared(h, pairs, bits)
    down_dots(marker, bases, nbytes, hidden, inter, digits, corr, unit, pairs, starts, out, dest, threads)
