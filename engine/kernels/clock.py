"""A monotonic clock that compiled code can read: nanoseconds of `clock_gettime(CLOCK_MONOTONIC)`.

Why: a decoded layer runs several phases in one compiled call (engine/kernels/
deltanet_step.py, attention_step.py), and the per-phase timers (`bench decode`'s
table) still want each phase's share. The call stamps the boundaries itself. The
function is declared by name in the generated code, so numba's disk cache keeps the
functions that use it (a ctypes pointer would not be cached), and the call costs
about 20 ns (vDSO).
"""

from __future__ import annotations

import time

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_CLOCK = int(getattr(time, "CLOCK_MONOTONIC", 1))
_I32, _I64 = ir.IntType(32), ir.IntType(64)


@intrinsic
def monotonic_ns(typingctx):
    """Nanoseconds on the monotonic clock (in njit code only): subtract two readings."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        timespec = ir.LiteralStructType([_I64, _I64])  # seconds, nanoseconds (64-bit Linux and macOS)
        fnty = ir.FunctionType(_I32, [_I32, timespec.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "clock_gettime")
        ts = cgutils.alloca_once(builder, timespec)
        builder.call(fn, [ir.Constant(_I32, _CLOCK), ts])
        seconds = builder.load(cgutils.gep_inbounds(builder, ts, 0, 0))
        nanos = builder.load(cgutils.gep_inbounds(builder, ts, 0, 1))
        return builder.add(builder.mul(seconds, ir.Constant(_I64, 1_000_000_000)), nanos)

    return sig, codegen
