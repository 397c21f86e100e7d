#!/usr/bin/env python3
"""What a call costs right after a call that streamed megabytes of weights, against the same call alone.

Why: in a decoded token every kernel call follows one that read megabytes of
weights through the caches, and the small ones (the shared expert's down
projection, the router block, the experts' weighted sum) and the Python
between them took two to three times what they take in a loop of their own
(tools/decode_gaps.py, tools/decode_calls.py). This separates the parts: the
same small matvec alone and right after a 12352x2048 int4 matvec (its
operands rotating through RAM, or one copy cache-hot), a launch with almost
no work, and numba no-ops (a serial one: Python and numba's dispatch; a
parallel one: dispatch and the OpenMP fork and join). Medians of alternating
calls in one process.

    .venv/bin/python tools/after_stream_penalty.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit, prange

from tierlab.app.lab import bench_kernels as B

K = B.K


@njit(nogil=True)
def _serial_noop(x, out):
    out[0] = x[0]


@njit(nogil=True, parallel=True)
def _parallel_noop(x, out):
    for i in prange(2):
        out[i] = x[i]


def _median_us(samples: list[float]) -> float:
    return 1e6 * sorted(samples)[len(samples) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    n = p.parse_args().rounds
    rng = np.random.default_rng(0)
    small = B._random_operands("int4", 2048, 512, 200, rng)
    big = B._random_operands("int4", 12352, 2048, 4, rng)
    tiny = B._random_operands("int4", 8, 512, 1, rng)[0]
    xs, xb = rng.standard_normal(512, dtype=np.float32), rng.standard_normal(2048, dtype=np.float32)
    ys, yb, yt = np.empty(2048, np.float32), np.empty(12352, np.float32), np.empty(8, np.float32)

    def stream(i: int) -> None:
        K.matvec_int4(*big[i % len(big)], xb, yb)

    cases = [
        ("int4 2048x512 matvec, operands rotating through RAM", lambda i: K.matvec_int4(*small[i % 200], xs, ys)),
        ("int4 2048x512 matvec, one copy (cache-hot alone)", lambda i: K.matvec_int4(*small[0], xs, ys)),
        ("int4 8x512 matvec (a launch, almost no work)", lambda i: K.matvec_int4(*tiny, xs, yt)),
        ("serial numba no-op (Python and dispatch)", lambda i: _serial_noop(xs, yt)),
        ("parallel numba no-op (dispatch, fork and join)", lambda i: _parallel_noop(xs, yt)),
    ]
    for i in range(5):
        stream(i)
        for _, call in cases:
            call(i)
    print("| call | alone, us | right after a 12352x2048 int4 matvec, us |\n|---|---|---|")
    for label, call in cases:
        alone, after = [], []
        for i in range(n):
            t0 = time.perf_counter()
            call(i)
            alone.append(time.perf_counter() - t0)
        for i in range(n):
            stream(i)
            t0 = time.perf_counter()
            call(i)
            after.append(time.perf_counter() - t0)
        print(f"| {label} | {_median_us(alone):.1f} | {_median_us(after):.1f} |")


if __name__ == "__main__":
    main()
