#!/usr/bin/env python3
"""One decoded token's Gated DeltaNet recurrence (`dense.gated_deltanet`) at Qwen3.6's shape, alone.

Why: in situ the recurrence shares the token with a hundred other calls; here it
runs by itself, with its 2 MiB state either the same every call (hot: in L2)
or rotating through 150 states (300 MiB: from DRAM, as decode meets it), and
the conv (in blocks of 512 channels) and the value heads are timed apart, each
as one parallel loop of the kernel's own functions. Median microseconds a call:

    .venv/bin/python tools/deltanet_decode_bench.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit, prange

from tierlab.engine.kernels.dense import deltanet_conv, deltanet_head, gated_deltanet

K_HEADS, V_HEADS, DK, DV, TAPS = 16, 32, 128, 128, 4  # Qwen3.6-35B-A3B's linear attention
CHANNELS = 2 * K_HEADS * DK + V_HEADS * DV
STATES = 150


@njit(parallel=True, nogil=True)
def _conv_only(mixed, conv_state, taps, conv_out):
    for blk in prange(CHANNELS // 512):
        deltanet_conv(0, blk * 512, (blk + 1) * 512, mixed, conv_state, taps, conv_out)


@njit(parallel=True, nogil=True)
def _heads_only(conv_out, q, k, z, b, a, a_log, dt_bias, norm_w, state, out):
    for hv in prange(V_HEADS):
        deltanet_head(hv, hv // (V_HEADS // K_HEADS), 0, conv_out, q, k, z, b, a, a_log, dt_bias, norm_w,
                      np.float32(1e-6), state, 2 * K_HEADS * DK + hv * DV, DV, out)


def _median_us(call, calls: int) -> float:
    call(0)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    f = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    mixed, conv_state, taps = f(1, CHANNELS), np.zeros((TAPS - 1, CHANNELS), np.float32), f(TAPS, CHANNELS, s=0.1)
    z, b, gate_a = f(1, V_HEADS * DV), f(1, V_HEADS), f(1, V_HEADS)
    a_log, dt_bias, norm_w = np.zeros(V_HEADS, np.float32), np.zeros(V_HEADS, np.float32), np.ones(DV, np.float32)
    out = np.empty((1, V_HEADS * DV), np.float32)
    states = [np.zeros((V_HEADS, DK, DV), np.float32) for _ in range(STATES)]
    conv_out = np.empty(CHANNELS, np.float32)
    q = np.full((K_HEADS, DK), 0.01, np.float32)
    k = q.copy()

    def whole(i, rotate):
        gated_deltanet(mixed, conv_state, taps, z, b, gate_a, a_log, dt_bias, norm_w, np.float32(1e-6),
                       states[i % STATES if rotate else 0], K_HEADS, V_HEADS, DK, DV, out)

    def heads(i, rotate):
        _heads_only(conv_out, q, k, z, b, gate_a, a_log, dt_bias, norm_w, states[i % STATES if rotate else 0], out)

    print(f"{K_HEADS} key / {V_HEADS} value heads of {DK}x{DV}, {CHANNELS} conv channels; state "
          f"{states[0].nbytes >> 20} MiB read and written a token; median us a call")
    for _ in range(a.rounds):
        print(f"whole: hot {_median_us(lambda i: whole(i, False), 200):.1f}, "
              f"rotating {_median_us(lambda i: whole(i, True), 600):.1f} | "
              f"conv {_median_us(lambda i: _conv_only(mixed, conv_state, taps, conv_out), 300):.1f} | "
              f"heads: hot {_median_us(lambda i: heads(i, False), 300):.1f}, "
              f"rotating {_median_us(lambda i: heads(i, True), 300):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
