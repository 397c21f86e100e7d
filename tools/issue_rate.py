#!/usr/bin/env python3
"""How many zmm FMAs and zmm `vpdpbusd`s one core issues a second: the arithmetic ceilings.

Why: a prompt's matmats are bound by arithmetic, not memory, so their share is
only meaningful against what the core can issue. Each kind runs a compiled
loop of N independent accumulator chains (8 and 12: enough to hide the
latency) on one thread and reports instructions a second of the thread's CPU
time. An FMA does 16 float32 multiply-adds; a `vpdpbusd` does 64 u8 x s8
products (21 useful ones per float32 value with the three 7-bit digits the
quantised kernels split x into, engine/kernels/qmatvec.py). CPUs without
AVX-512 VNNI print the FMA lines only.

    .venv/bin/python tools/issue_rate.py
"""

from __future__ import annotations

import time

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from tierlab.engine.kernels.qmatvec import _VNNI, _counted_loop

_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16I, _V16F = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)


def _operations(kind: str, builder):
    """(vector type, the per-chain instruction acc -> new acc given a, b, the lane sum's add,
    the result as an int64) of `kind`."""
    if kind == "vpdpbusd":
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16I, [_V16I] * 3),
                                            "llvm.x86.avx512.vpdpbusd.512")
        return (_V16I, lambda acc, a, b: builder.call(fn, [acc, a, b]), builder.add,
                lambda v: builder.sext(v, _I64), lambda i: builder.trunc(i, _I32), 0x01020304, 0x05060708)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    return (_V16F, lambda acc, a, b: builder.call(fn, [a, b, acc]), builder.fadd,
            lambda v: builder.fptosi(v, _I64), lambda i: builder.sitofp(i, _F32), 1.0001, 0.9999)


def _chains_loop(kind: str, chains: int):
    """A compiled function (n) -> int: n rounds of `chains` independent zmm instructions of `kind`."""

    @intrinsic
    def loop(typingctx, n):
        def codegen(context, builder, signature, args):
            vec, step, add, to_int, lane_of, a_value, b_value = _operations(kind, builder)
            a, b = ir.Constant(vec, [a_value] * 16), ir.Constant(vec, [b_value] * 16)
            inits = [ir.Constant(vec, [i] * 16) for i in range(chains)]
            zero = ir.Constant(vec, [0] * 16)

            def body(i, accs):  # the round number in one lane keeps the loop from being folded
                ai = add(a, builder.insert_element(zero, lane_of(i), ir.Constant(_I32, 0)))
                return [step(acc, ai, b) for acc in accs]

            accs = _counted_loop(builder, args[0], inits, body)
            total = accs[0]
            for acc in accs[1:]:
                total = add(total, acc)
            return to_int(builder.extract_element(total, ir.Constant(_I32, 3)))

        return types.int64(n), codegen

    @njit
    def run(n):
        return loop(n)

    return run


def main() -> int:
    kinds = ["fma"] + (["vpdpbusd"] if _VNNI else [])
    rounds = 20_000_000
    for chains in (8, 12):
        for kind in kinds:
            run = _chains_loop(kind, chains)
            run(10)  # compile
            best = float("inf")
            for _ in range(3):
                t0 = time.thread_time()
                run(rounds)
                best = min(best, time.thread_time() - t0)
            rate = rounds * chains / best / 1e9
            per = 16 if kind == "fma" else 64
            print(f"{kind} x{chains} chains: {rate:.2f} G zmm instructions/s on one core = {rate * per:.1f} G products/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
