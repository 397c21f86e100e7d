"""exp, SiLU and sigmoid in float32 that LLVM can vectorise: elementwise work at SIMD speed.

Why: numba compiles `math.exp` to a call of the C library's scalar expf, which
keeps every loop that uses it scalar (a prompt's conv, its gated norms and its
experts' SiLU: millions of calls per layer at 512 tokens; a decoded DeltaNet
token's conv and gated norms: 12,288 a layer). `exp_f32` is the
textbook float32 exp (round x / ln 2 to n, subtract n ln 2 in two parts, a
degree-7 polynomial on [-ln 2 / 2, ln 2 / 2], times 2^n set in the exponent
bits), within 2 ulp of expf; every step is a plain add, multiply or bit move, so
a loop calling it vectorises. Callers compile with error_model="numpy" (else
numba guards each division with a ZeroDivisionError branch, which stops the
vectoriser too); these compile without `arcp`/`reassoc` (FAST_EXACT), and a
caller's own fast-math flags do not reach their instructions, so the vector and
scalar copies of a loop compute the same bits.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: fastmath flags that keep IEEE division and the written order of the sums
FAST_EXACT = {"nnan", "ninf", "nsz", "contract"}

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 = _LN2_HI + _LN2_LO, _LN2_HI exact in 9 bits
_LN2_LO = np.float32(-2.12194440e-4)
_ROUND = np.float32(12582912.0)  # 1.5 * 2^23: x + _ROUND - _ROUND rounds x to an integer
_LOW = np.float32(-87.0)  # exp(-87) is still a normal float32
_HIGH = np.float32(88.0)


@intrinsic
def _f32_bits(typingctx, b):
    """The float32 whose bits are the int32 b."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@njit(nogil=True, fastmath=FAST_EXACT, cache=True)
def exp_f32(x):
    """e^x for float32 x, x clamped to [-87, 88] (so 0 and inf come out as tiny and huge)."""
    x = x if x > _LOW else _LOW
    x = x if x < _HIGH else _HIGH
    n = (x * _LOG2E + _ROUND) - _ROUND
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = (p * r) * r + r + np.float32(1.0)
    return p * _f32_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(nogil=True, fastmath=FAST_EXACT, cache=True, error_model="numpy")
def silu_f32(v):
    """v * sigmoid(v) as v / (1 + e^-v), with an IEEE division."""
    return v / (np.float32(1.0) + exp_f32(-v))


@njit(nogil=True, fastmath=FAST_EXACT, cache=True, error_model="numpy")
def sigmoid_f32(v):
    """1 / (1 + e^-v), with an IEEE division."""
    return np.float32(1.0) / (np.float32(1.0) + exp_f32(-v))
