#!/usr/bin/env python3
"""Would int4 weights stored sixteen rows to a vector decode faster? A measured probe, not an engine path.

Why: the decode matvec (`qmatvec.matvec_int4`) keeps the stored row layout, so
each row's 16 lanes hold partial sums of that one row: every group of 64
weights and row pays an offset, a conversion and a scaled FMA beside its six
`vpdpbusd`, and that arithmetic, not memory, bounds the loop when the stream
is fast (docs/engine.md, "What bounds them here"). With the rows stored
transposed by 4-byte columns, 16 rows to a 64-byte vector (the layout
`experts_vnni` builds at run time for a prompt), lane l holds row l: a group's
float work is paid once per 16 rows and no horizontal sum is left. This probe
tiles random int4 matrices once (`tile`), multiplies one token with a
compiled tile loop (x prepared as `experts_vnni.prepared` prepares it) and
times it beside `matvec_int4` on the same matrices, in cache ("hot": one
matrix, in L2, or in L3 for the 8192-row one) and from DRAM (enough copies
to pass the L3), with 1 and 2 threads, each figure beside the stream read
(`bench_kernels.StreamProbe`) taken around it at the same thread count. It
checks the two results agree before timing. TILED_PROBE_AHEAD=BYTES adds a
software prefetch that far ahead of each item's stream (none by default:
none of 2, 4 and 8 KiB read faster from DRAM, docs/benchmarks.md).

    NUMBA_NUM_THREADS=2 .venv/bin/python tools/tiled_int4_probe.py [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from tierlab.app.lab.bench_kernels import StreamProbe
from tierlab.engine.kernels import qmatvec
from tierlab.engine.kernels.experts_vnni import prepared
from tierlab.engine.kernels.qmatvec import _I32, _I64, _V16F, _VNNI, _counted_loop, _load_vec, _prefetch, _splat
from tierlab.engine.quant import pack_weights, quantize_fast

_I8 = ir.IntType(8)
_V16I = ir.VectorType(_I32, 16)
_TILES = 2  # tiles (16 rows each) of a work item: each broadcast digit serves both
_BLOCK_DIGITS = 384  # prepared digit bytes per 64-byte block of a row: 3 digits x 2 nibbles x 64
_AHEAD = int(os.environ.get("TILED_PROBE_AHEAD", "0"))  # bytes of an item's stream prefetched ahead (0: none)


@intrinsic
def _item_dot(typingctx, tiles, item, digits, corr, unit, scales, out):
    """out[32 item + 16 i + l] = row 16 (2 item + i) + l . x, for tiles uint8 [items, blocks, 16,
    _TILES, 64] (`tile`), x prepared into digits / corr / unit (one token), scales float32
    [rows / 16, groups, 16]. Each digit has its own accumulators, joined at the block's end."""
    def codegen(context, builder, signature, args):
        tl, dg, co, un, sc, ot = (context.make_array(signature.args[i])(context, builder, args[i])
                                  for i in (0, 2, 3, 4, 5, 6))
        item = context.cast(builder, args[1], signature.args[1], types.int64)
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16I, [_V16I] * 3),
                                             "llvm.x86.avx512.vpdpbusd.512")
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
        n_blocks = builder.extract_value(tl.shape, 1)
        n_groups = builder.extract_value(co.shape, 0)
        step = 16 * _TILES * 64
        base = builder.gep(builder.bitcast(tl.data, _I8.as_pointer()),
                           [builder.mul(item, builder.mul(n_blocks, ir.Constant(_I64, step)))])
        dptr = builder.bitcast(dg.data, _I8.as_pointer())
        low = ir.Constant(_V16I, [0x0F0F0F0F] * 16)
        zero = ir.Constant(_V16I, [0] * 16)

        def body(blk, faccs):
            at = builder.mul(blk, ir.Constant(_I64, step))
            dat = builder.mul(blk, ir.Constant(_I64, _BLOCK_DIGITS))
            accs = [[[zero, zero] for _ in range(3)] for _ in range(_TILES)]  # [tile][digit][group]
            for c in range(16):  # 4-byte column c: group c // 8 of the block
                nibbles = []
                for i in range(_TILES):
                    at_line = builder.add(at, ir.Constant(_I64, (c * _TILES + i) * 64))
                    if _AHEAD:
                        _prefetch(builder, base, builder.add(at_line, ir.Constant(_I64, _AHEAD)))
                    w = _load_vec(builder, base, at_line, _V16I, 4)
                    nibbles.append((builder.and_(w, low),
                                    builder.and_(builder.lshr(w, ir.Constant(_V16I, [4] * 16)), low)))
                for d in range(3):
                    for k in range(2):
                        pos = builder.add(dat, ir.Constant(_I64, d * 128 + k * 64 + 4 * c))
                        word = builder.load(builder.bitcast(builder.gep(dptr, [pos]), _I32.as_pointer()), align=1)
                        digit = _splat(builder, word, _V16I)
                        for i in range(_TILES):
                            accs[i][d][c // 8] = builder.call(dot, [accs[i][d][c // 8], nibbles[i][k], digit])
            out = []
            for i in range(_TILES):
                f = faccs[i]
                for h in range(2):
                    g = builder.add(builder.mul(blk, ir.Constant(_I64, 2)), ir.Constant(_I64, h))
                    total = builder.add(builder.add(builder.shl(accs[i][0][h], ir.Constant(_V16I, [14] * 16)),
                                                    builder.shl(accs[i][1][h], ir.Constant(_V16I, [7] * 16))),
                                        accs[i][2][h])
                    offset = _splat(builder, builder.load(builder.gep(co.data, [g])), _V16I)
                    exact = builder.sitofp(builder.sub(total, offset), _V16F)
                    tile_no = builder.add(builder.mul(item, ir.Constant(_I64, _TILES)), ir.Constant(_I64, i))
                    lanes = builder.mul(builder.add(builder.mul(tile_no, n_groups), g), ir.Constant(_I64, 16))
                    weight = builder.fmul(_load_vec(builder, sc.data, lanes, _V16F, 4),
                                          _splat(builder, builder.load(builder.gep(un.data, [g])), _V16F))
                    f = builder.call(fma, [exact, weight, f])
                out.append(f)
            return out

        faccs = _counted_loop(builder, n_blocks, [ir.Constant(_V16F, [0.0] * 16)] * _TILES, body)
        for i in range(_TILES):
            at = builder.add(builder.mul(item, ir.Constant(_I64, 16 * _TILES)), ir.Constant(_I64, 16 * i))
            builder.store(faccs[i], builder.bitcast(builder.gep(ot.data, [at]), _V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(tiles, item, digits, corr, unit, scales, out), codegen


@njit(nogil=True, parallel=True)
def tiled_matvec(tiles, digits, corr, unit, scales, out):
    """out = the tiled matrix times one prepared token, a prange over 32-row items."""
    for it in prange(tiles.shape[0]):
        _item_dot(tiles, it, digits, corr, unit, scales, out)


def tile(q: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Planar-nibble q [rows, cols / 2] and scales s [rows, groups] in the tile loop's layout."""
    rows, half = q.shape
    items, blocks = rows // (16 * _TILES), half // 64
    t = q.reshape(items, _TILES, 16, blocks, 16, 4).transpose(0, 3, 4, 1, 2, 5)
    return (np.ascontiguousarray(t).reshape(items, blocks, 16, _TILES, 64),
            np.ascontiguousarray(s.reshape(rows // 16, 16, -1).transpose(0, 2, 1)))


def _matrices(rows: int, cols: int, copies: int, rng) -> list[tuple]:
    """`copies` separate copies of one random int4 matrix, each as (q, scales, tiles, tile scales)."""
    q, s = quantize_fast(rng.standard_normal((rows, cols)).astype(np.float32), 4)
    q = np.ascontiguousarray(pack_weights(q, 4).reshape(rows, -1))
    tq, ts = tile(q, s)
    return [(q.copy(), s.copy(), tq.copy(), ts.copy()) for _ in range(copies)]


def _gbs(call, mats, nbytes: int, seconds: float) -> float:
    """Weights' GB/s of the median of timed rounds of one call per matrix."""
    rates = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(rates) < 3:
        t0 = time.perf_counter()
        for m in mats:
            call(m)
        rates.append(nbytes * len(mats) / (time.perf_counter() - t0) / 1e9)
    return float(np.median(rates))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0, help="timing per figure")
    a = p.parse_args()
    if not _VNNI:
        print("this CPU has no AVX-512 VNNI (or TIERLAB_VNNI=0): nothing to probe")
        return 1
    rng = np.random.default_rng(0)
    probe = StreamProbe(512 << 20)
    print("| shape | where | threads | rows GB/s | tiles GB/s (x prepared in the call) | tiles, kernel only | "
          "tiles / rows | stream GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for rows, cols in ((1024, 2048), (2048, 512), (8192, 2048)):
        nbytes = rows * cols // 2 + rows * cols // 64 * 4
        x = rng.standard_normal(cols).astype(np.float32)
        for where, copies in (("hot", 1), ("DRAM", max(2, (192 << 20) // nbytes))):
            mats = _matrices(rows, cols, copies, rng)
            out_rows, out_tiles = np.empty(rows, np.float32), np.empty(rows, np.float32)
            first = np.zeros(1, np.int64)
            dg, co, un = prepared(x[None], first, 4)
            qmatvec.matvec_int4(mats[0][0], mats[0][1], x, out_rows)
            tiled_matvec(mats[0][2], dg[0], co[0], un[0], mats[0][3], out_tiles)
            err = float(np.abs(out_tiles - out_rows).max() / np.abs(out_rows).max())
            if err > 1e-5:
                print(f"tiles and rows disagree at {rows}x{cols}: {err:.1e}")
                return 1

            def with_x(m):
                d, c, u = prepared(x[None], first, 4)
                tiled_matvec(m[2], d[0], c[0], u[0], m[3], out_tiles)

            for threads in (1, 2):
                numba.set_num_threads(threads)
                before = probe.read_gbs()
                r = _gbs(lambda m: qmatvec.matvec_int4(m[0], m[1], x, out_rows), mats, nbytes, a.seconds)
                t = _gbs(with_x, mats, nbytes, a.seconds)
                k = _gbs(lambda m: tiled_matvec(m[2], dg[0], co[0], un[0], m[3], out_tiles), mats, nbytes, a.seconds)
                stream = max(before, probe.read_gbs())
                print(f"| {rows}x{cols} | {where} | {threads} | {r:.1f} | {t:.1f} | {k:.1f} | {t / r:.2f} | "
                      f"{stream:.1f} |", flush=True)
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
