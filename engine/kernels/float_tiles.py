"""A prompt's bf16 / fp32 experts and bf16 projections by tiles of sixteen rows, one row to a lane.

Why: the float path (`qmatmat.experts_gate_up` / `experts_down`, `matmat_bf16`) lays
four rows by four tokens a pass out along the columns and ends every pass with a
tree of shuffles (`qmatmat._dot4x4_into`); at 128 tokens an expert of the
64-expert slice sees about 16 tokens, and there its launches ran at 60-75% of
that pass's own rate on one core (`tools/prompt_kernels.py`): the sums, the
copies of each group's results and the short passes cost up to a quarter of the
FMAs. Here a work item takes 32 rows as two tiles of 16, a chunk of 128 columns
at a time: the chunk's rows are transposed in registers by 4-byte words
(`_float_tile`: bf16 as pairs of columns, fp32 as columns) so that lane l holds
row l, and each token's x[c] is broadcast to every lane; a column then costs a
load per tile, a broadcast per token and an FMA per token and tile (16
accumulators for 8 tokens), and a token's 16 sums come out as whole vectors (no
horizontal sum, no copies). The chunk's tiles (8 or 16 KiB) stay in L1 while
every token goes over them; whole-width tiles, written to L2 and read back,
cost 40% of the FMAs' time at 16 tokens. Items are dealt and the next item's
rows prefetched as in `experts_vnni` (int4's integer-dot tiles).

Exactness: every product is the float path's (the same float32 weights, bf16
widened exactly), summed in column order 128 columns at a time and each block's
sums added in order; a token's sums depend only on its own x, never on the
other tokens of a pass or of the batch. Within 1e-5 relative of a float64
reference (tests/test_float_tiles.py); not bit-identical to the float path or
to decode. Widths must be whole 128-column blocks (`usable`, `usable_dense`).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from tierlab.engine.kernels.experts_vnni import _step_item, _transpose16
from tierlab.engine.kernels.fastexp import silu_f32
from tierlab.engine.kernels.qmatmat import (_MARKERS, _deal_plan, _expert_matrices, _lines_per_pass, _prefetch_lines,
                                            expert_batch, matmat_bf16, rows_past_items, token_blocks)
from tierlab.engine.kernels.qmatvec import _I32, _I64, _V16F, _WIDE, _counted_loop, _load_vec, _row_start, _splat

_OPTS = dict(nogil=True, cache=True, fastmath=True)
_TILE = 16  # rows of a tile: one per lane
_TILES = 2  # tiles a work item takes (each broadcast of a token's x[c] serves both)
_PASS = 8  # tokens a pass: 2 tiles x 8 tokens = 16 accumulators
_BLOCK = 128  # columns summed in fresh accumulators before they are added to a token's sums
_V16I = ir.VectorType(_I32, 16)


def usable(kind: str, hidden: int, inter: int) -> bool:
    """True where the experts' launches run here: bf16 or fp32 weights, AVX-512, whole
    128-column blocks in both widths."""
    return _WIDE and kind in ("bf16", "fp32") and hidden % _BLOCK == 0 and inter % _BLOCK == 0


def usable_dense(rows: int, cols: int) -> bool:
    """True where `matmat_tiles` takes a bf16 matrix [rows, cols]: AVX-512, whole 128-column
    blocks, at least one work item of 32 rows (the rows after the last whole item, such as a
    fused router block's shared-expert gate, go to `qmatmat.matmat_bf16`)."""
    return _WIDE and cols % _BLOCK == 0 and rows >= _TILES * _TILE


@intrinsic
def _float_tile(typingctx, w, r0, c0, tile):
    """The tile of rows r0..r0+15 of w from column c0 on: for w a C matrix of bf16 bits
    (uint16), tile int32 [pairs, 16] with tile[k, l] = columns c0 + 2k (low half) and
    c0 + 2k + 1 (high half) of row r0 + l; for float32 w, tile float32 [columns, 16] with
    tile[c, l] = w[r0 + l, c0 + c]. 64 bytes of each row at a time, transposed in registers
    by 4-byte words."""
    if not (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C"
            and w.dtype in (types.uint16, types.float32) and isinstance(r0, types.Integer)
            and isinstance(c0, types.Integer) and isinstance(tile, types.Array) and tile.ndim == 2
            and tile.layout == "C" and tile.dtype == (types.int32 if w.dtype == types.uint16 else types.float32)):
        return None
    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        out = context.make_array(signature.args[3])(context, builder, args[3])
        first, col0 = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 2))
        rows = [builder.gep(_row_start(context, builder, a, builder.add(first, ir.Constant(_I64, lane)), types.int64),
                            [col0]) for lane in range(_TILE)]
        words_per_row = builder.extract_value(out.shape, 0)  # tile rows: bf16 pairs or fp32 columns
        dst = out.data

        def store(column, v):
            where = builder.mul(column, ir.Constant(_I64, 16))
            builder.store(v, builder.bitcast(builder.gep(dst, [where]), _V16I.as_pointer()), align=4)

        def body(blk, carried):
            # 16 words of each row a block: bf16 pairs (half the shuffles a weight that widening
            # first would take; `_pass_of` widens them) or fp32 columns
            step = builder.mul(blk, ir.Constant(_I64, 16))  # the block's first element, in 4-byte words
            words = [_load_vec(builder, builder.bitcast(p, _I32.as_pointer()), step, _V16I, 4) for p in rows]
            for c, v in enumerate(_transpose16(builder, words)):
                store(builder.add(step, ir.Constant(_I64, c)), v)
            return carried

        blocks = builder.sdiv(words_per_row, ir.Constant(_I64, 16))
        _counted_loop(builder, blocks, [ir.Constant(_I64, 0)], body)
        return context.get_dummy_value()

    return types.none(w, r0, c0, tile), codegen


def _pass_of(builder, n, tile_ptrs, x_rows, res_rows, pairs):
    """Emit one pass of n tokens over a chunk's `_BLOCK` columns: res_rows[s][16 i + l] += row l
    of tile i . x_rows[s], column by column into fresh accumulators. `pairs`: the tiles hold bf16
    pairs (columns 2k, 2k + 1 in one word), widened here: the low one shifted into a float32's
    high half, the high one masked."""
    zero = ir.Constant(_V16F, [0.0] * 16)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    per_step = 2 if pairs else 1

    def step(k, accs):
        c = builder.mul(k, ir.Constant(_I64, per_step))
        loaded = [_load_vec(builder, p, builder.mul(k, ir.Constant(_I64, 16)), _V16I, 4) for p in tile_ptrs]
        if pairs:
            columns = [[builder.bitcast(builder.shl(v, ir.Constant(_V16I, [16] * 16)), _V16F) for v in loaded],
                       [builder.bitcast(builder.and_(v, ir.Constant(_V16I, [-65536] * 16)), _V16F) for v in loaded]]
        else:
            columns = [[builder.bitcast(v, _V16F) for v in loaded]]
        out = list(accs)
        for j, w in enumerate(columns):
            cj = builder.add(c, ir.Constant(_I64, j))
            for s in range(n):
                xv = _splat(builder, builder.load(builder.gep(x_rows[s], [cj])), _V16F)
                for i in range(_TILES):
                    out[s * _TILES + i] = builder.call(fma, [w[i], xv, out[s * _TILES + i]])
        return out

    sums = _counted_loop(builder, ir.Constant(_I64, _BLOCK // per_step), [zero] * (n * _TILES), step)
    for s in range(n):
        for i in range(_TILES):
            ptr = builder.bitcast(builder.gep(res_rows[s], [ir.Constant(_I64, 16 * i)]), _V16F.as_pointer())
            builder.store(builder.fadd(builder.load(ptr, align=4), sums[s * _TILES + i]), ptr, align=4)


@intrinsic
def _tile_dots(typingctx, tiles, x, rows, t, n, c0, res, at):
    """res[at + s, 16 i + l] += row l of tile i . x[rows[t + s], c0:c0 + _BLOCK] for s < n
    (1 <= n <= _PASS); tiles [_TILES, words, 16] from `_float_tile` (bf16 pairs as int32, 64
    words; or float32 columns, 128), x float32 [N, cols], res [M, 32]."""
    arrays = (tiles, x, res)
    pairs = isinstance(tiles, types.Array) and tiles.dtype == types.int32
    if not (all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32 for a in arrays[1:])
            and isinstance(tiles, types.Array) and tiles.layout == "C" and tiles.dtype in (types.float32, types.int32)
            and isinstance(rows, types.Array) and rows.dtype == types.int64
            and all(isinstance(v, types.Integer) for v in (t, n, c0, at))):
        return None

    def codegen(context, builder, signature, args):
        tl, xa, ro, rs = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 6))
        t0, count, col0, row0 = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (3, 4, 5, 7))
        words = _BLOCK // 2 if pairs else _BLOCK
        base = builder.bitcast(tl.data, _I32.as_pointer())
        tile_ptrs = [builder.gep(base, [ir.Constant(_I64, words * 16 * i)]) for i in range(_TILES)]
        # the pass's x rows and res rows (those past n repeat the last: never read by the cases below)
        last = builder.sub(count, ir.Constant(_I64, 1))
        x_rows, res_rows = [], []
        for s in range(_PASS):
            s_c = ir.Constant(_I64, s)
            k = builder.select(builder.icmp_signed("<", s_c, count), s_c, last)
            token = builder.load(builder.gep(ro.data, [builder.add(t0, k)]))
            x_rows.append(builder.gep(_row_start(context, builder, xa, token, types.int64), [col0]))
            res_rows.append(builder.gep(rs.data, [builder.mul(builder.add(row0, k), ir.Constant(_I64, 16 * _TILES))]))
        done = builder.append_basic_block("passes.done")
        switch = builder.switch(count, done)
        for n_tokens in range(1, _PASS + 1):
            case = builder.append_basic_block(f"pass.{n_tokens}")
            switch.add_case(ir.Constant(_I64, n_tokens), case)
            builder.position_at_end(case)
            _pass_of(builder, n_tokens, tile_ptrs, x_rows, res_rows, pairs)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return types.none(tiles, x, rows, t, n, c0, res, at), codegen


def _new_tiles(w):
    """Room for a work item's two tiles of one chunk: bf16 pairs (int32) or float32 columns."""


@overload(_new_tiles)
def _new_tiles_impl(w):
    if w.dtype == types.uint16:
        return lambda w: np.empty((_TILES, _BLOCK // 2, _TILE), np.int32)
    return lambda w: np.empty((_TILES, _BLOCK, _TILE), np.float32)


@njit(**_OPTS)
def _item_sums(wa, ra, wb, rb, x, rows, first, last, na, rna, nb, rnb, pn):
    """One work item's sums [last - first, 32]: rows ra..ra+15 of wa and rb..rb+15 of wb against
    x[rows[first..last-1]], a chunk of `_BLOCK` columns at a time: the chunk's two tiles (8 or 16 KiB,
    kept in L1: whole-width tiles, written to L2 and read back, cost 40% of the FMAs' time at 16
    tokens), then every token, `_PASS` a pass. Meanwhile the next item's rows (rna.. of na, rnb..
    of nb, pn each; 0: none) are prefetched a few lines a pass, so that their reads from DRAM
    overlap this item's arithmetic, as the float path's items do (`qmatmat._dot_groups`)."""
    tiles = _new_tiles(wa)
    res = np.zeros((last - first, _TILES * _TILE), np.float32)
    chunks = wa.shape[1] // _BLOCK
    step = _lines_per_pass(na, pn, chunks * ((last - first + _PASS - 1) // _PASS))
    done = 0
    for j in range(chunks):
        c0 = j * _BLOCK
        _float_tile(wa, ra, c0, tiles[0])
        _float_tile(wb, rb, c0, tiles[1])
        for t in range(first, last, _PASS):
            _tile_dots(tiles, x, rows, t, min(_PASS, last - t), c0, res, t - first)
            if step:
                _prefetch_lines(na, rna, pn, done, step)
                _prefetch_lines(nb, rnb, pn, done, step)
                done += step
    return res


@njit(**dict(_OPTS, parallel=True, error_model="numpy"))
def gate_up_tiles(marker, bases, nbytes, hidden, inter, x, rows, starts, h, threads):
    """h[p, r] = silu(gate . x[rows[p]]) * (up . x[rows[p]]) at row r of expert e's inter rows,
    for the pairs starts[e] <= p < starts[e + 1] and the blob at address bases[e]; work items of
    16 gate and the same 16 up rows, dealt as `qmatmat._dealt` deals."""
    per = inter // _TILE
    n_items, threads, run, steps = _deal_plan(bases.shape[0], per, threads)
    for step in prange(steps):
        w, nxt = _step_item(step, per, n_items, threads, run, starts)
        if w < 0:
            continue
        e, r0 = w // per, (w % per) * _TILE
        gate, _, up, _, _, _ = _expert_matrices(marker, bases[e], nbytes, hidden, inter)
        gate_n, _, up_n, _, _, _ = _expert_matrices(marker, bases[nxt // per], nbytes, hidden, inter)
        r_n = (nxt % per) * _TILE
        first = starts[e]
        res = _item_sums(gate, r0, up, r0, x, rows, first, starts[e + 1], gate_n, r_n, up_n, r_n,
                         _TILE if nxt != w else 0)
        for p in range(first, starts[e + 1]):
            for i in range(_TILE):
                h[p, r0 + i] = silu_f32(res[p - first, i]) * res[p - first, _TILE + i]


@njit(**dict(_OPTS, parallel=True))
def down_tiles(marker, bases, nbytes, hidden, inter, h, pairs, starts, out, out_rows, threads):
    """out[out_rows[p]] = down . h[pairs[p]] of expert e for the pairs starts[e] <= p < starts[e + 1]
    and the blob at address bases[e]; work items of 32 rows."""
    item = _TILES * _TILE
    per = hidden // item
    n_items, threads, run, steps = _deal_plan(bases.shape[0], per, threads)
    for step in prange(steps):
        w, nxt = _step_item(step, per, n_items, threads, run, starts)
        if w < 0:
            continue
        e, r0 = w // per, (w % per) * item
        _, _, _, _, down, _ = _expert_matrices(marker, bases[e], nbytes, hidden, inter)
        _, _, _, _, down_n, _ = _expert_matrices(marker, bases[nxt // per], nbytes, hidden, inter)
        r_n = (nxt % per) * item
        first = starts[e]
        res = _item_sums(down, r0, down, r0 + _TILE, h, pairs, first, starts[e + 1], down_n, r_n, down_n,
                         r_n + _TILE, _TILE if nxt != w else 0)
        for p in range(first, starts[e + 1]):
            row = out_rows[p]
            for i in range(item):
                out[row, r0 + i] = res[p - first, i]


def experts_tiles(kind: str, blobs: list, hidden: int, inter: int, x: np.ndarray, token_rows: list,
                  out: np.ndarray, out_rows: list) -> None:
    """`qmatmat.experts_matmat` for bf16 / fp32 experts where `usable`: the gate|up launch into
    h [pairs, inter] straight from x's rows (no gathered copy), then the down launch."""
    nbytes, bases, starts, rows, dest = expert_batch("experts_matmat", kind, blobs, hidden, inter, x, token_rows,
                                                     out, out_rows)
    threads = numba.get_num_threads()
    marker = _MARKERS[kind]
    h = np.empty((rows.size, inter), np.float32)
    gate_up_tiles(marker, bases, nbytes, hidden, inter, x, rows, starts, h, threads)
    down_tiles(marker, bases, nbytes, hidden, inter, h, np.arange(rows.size, dtype=np.int64), starts, out, dest,
               threads)


@njit(**dict(_OPTS, parallel=True))
def _matmat_items(w, x, tokens, out):
    """out[t, r] = w[r] . x[t] for a bf16 w [rows, cols], r below the last whole 32 rows: work
    items of 32 rows, each thread's next item (the following 32 rows, numba's prange giving each
    thread a contiguous share) prefetched while it computes."""
    item = _TILES * _TILE
    n_items = w.shape[0] // item
    for it in prange(n_items):
        r0 = it * item
        nxt = r0 + item if it + 1 < n_items else r0
        res = _item_sums(w, r0, w, r0 + _TILE, x, tokens, 0, x.shape[0], w, nxt, w, nxt + _TILE,
                         _TILE if nxt != r0 else 0)
        for t in range(x.shape[0]):
            for i in range(item):
                out[t, r0 + i] = res[t, i]


def matmat_tiles(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out [T, rows] = x [T, cols] @ w.T for a bf16 (uint16) C matrix w where `usable_dense`: a
    prompt's projections (`qmatmat.matmat_bf16` elsewhere)."""
    if w.dtype != np.uint16 or w.ndim != 2 or not w.flags.c_contiguous or not usable_dense(*w.shape):
        raise ValueError(f"matmat_tiles needs a C-contiguous bf16 matrix of 32 rows or more and whole 128-column "
                         f"blocks, got {w.dtype}{w.shape}")
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmat_tiles needs x float32[T, {w.shape[1]}] (C order), got {x.dtype}{x.shape}")
    if out.shape != (x.shape[0], w.shape[0]) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"matmat_tiles needs out float32[{x.shape[0]}, {w.shape[0]}] (C order)")
    whole = w.shape[0] - w.shape[0] % (_TILES * _TILE)
    for t0, t1 in token_blocks(x.shape[0]):
        _matmat_items(w, x[t0:t1], np.arange(t1 - t0, dtype=np.int64), out[t0:t1])
        rows_past_items(matmat_bf16, (w,), x[t0:t1], out[t0:t1], whole)
