#!/usr/bin/env python3
"""What one matvec call costs besides its rows: Python checks, numba dispatch, the parallel launch, x's preparation.

At the expert shapes a call reads 0.5-1 MiB in 20-25 us, so a few
microseconds of fixed cost are a fifth of it; this splits that cost up. Each
line is the best of 7 rounds of 20,000 calls on a tiny int4 matrix (8 rows,
all of it cached), so what is left is the cost of the call itself:

    .venv/bin/python tools/call_overhead.py [--cols 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit, prange

from tierlab.app.lab import bench_kernels as B
from tierlab.engine.kernels import qmatvec as Q


@njit(nogil=True)
def _serial_noop(a, b, c, d, x, out, mode, w, threads):
    out[0] = x[0]


@njit(nogil=True, parallel=True)
def _parallel_noop(a, b, c, d, x, out, mode, w, threads):
    for i in prange(2):
        out[i] = x[i]


@njit(nogil=True)
def _prepare_only(a, b, c, d, x, out, mode, w, threads):
    _digits, unit, _corr = Q._prepare_x(x, 4)
    out[0] = unit[0]


def best_us(call, rounds: int = 7, calls: int = 20000) -> float:
    call()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cols", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    numba.set_num_threads(min(a.threads, numba.config.NUMBA_NUM_THREADS))
    q, s = B._random_operands("int4", 8, a.cols, 1, np.random.default_rng(0))[0]
    x = np.random.default_rng(1).standard_normal(a.cols, dtype=np.float32)
    y = np.empty(8, np.float32)
    args = (q, s, q, s, x, y, Q.SET, 1.0, numba.get_num_threads())
    rows = [
        ("matvec_int4 (what the engine calls)", lambda: Q.matvec_int4(q, s, x, y)),
        ("the kernel called directly (no Python checks)", lambda: Q._pass(*args)),
        ("a serial no-op with the same arguments (numba dispatch)", lambda: _serial_noop(*args)),
        ("a parallel no-op with the same arguments (dispatch + launch)", lambda: _parallel_noop(*args)),
        ("x's preparation alone, serial (dispatch + prepare)", lambda: _prepare_only(*args)),
    ]
    print(f"int4 8x{a.cols}, {numba.get_num_threads()} threads, best of 7 x 20,000 calls")
    for name, call in rows:
        print(f"{best_us(call):6.2f} us  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
