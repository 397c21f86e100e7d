#!/usr/bin/env python3
"""One core's matrix-matrix rate: numpy's BLAS sgemm against tierlab's int4 and bf16 `matmat`.

Why: a prompt's projections and experts are matrix-matrix products; this says how near
one core's kernel is to the float32 BLAS on the same core (process CPU time, best of 5).

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python tools/matmat_vs_blas.py [--rows 4096 --cols 2048]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from tierlab.engine import quant
from tierlab.engine.kernels import qmatmat


def best_cpu_s(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 512])
    a = p.parse_args()
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((a.rows, a.cols), dtype=np.float32)
    q, s = quant.quantize(w, 4)
    q4 = quant.pack_int4(q)
    wf = quant.dequantize(q, s).astype(np.float32)
    wb = (wf.view(np.uint32) >> 16).astype(np.uint16)
    print(f"{a.rows}x{a.cols}, one thread, GFLOPS (2 x rows x cols x T / CPU seconds, best of 5)")
    for t in a.tokens:
        x = rng.standard_normal((t, a.cols), dtype=np.float32)
        qmatmat.matmat("int4", (q4, s), x)  # compile
        qmatmat.matmat("bf16", (wb,), x)
        flop = 2.0 * a.rows * a.cols * t
        blas = best_cpu_s(lambda: x @ wf.T)
        int4 = best_cpu_s(lambda: qmatmat.matmat("int4", (q4, s), x))
        bf16 = best_cpu_s(lambda: qmatmat.matmat("bf16", (wb,), x))
        print(f"T={t:4d}  sgemm {flop / blas / 1e9:6.1f}  int4 matmat {flop / int4 / 1e9:6.1f}  "
              f"bf16 matmat {flop / bf16 / 1e9:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
