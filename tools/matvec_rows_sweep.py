#!/usr/bin/env python3
"""A matvec call's time against its rows, from DRAM: what a call costs besides its bytes.

Why: `bench kernels` times the two expert shapes only, and a share of the stream
below 100% can be a slow row loop or a fixed cost per call. Timing the same
kernel at 128..4096 rows (2 threads, operands rotating through a working set
larger than the last-level cache, median of >= 300 calls) and fitting a line
through the calls of >= 512 rows separates the two: the slope is the rate the
row loop reads at, the intercept what every call pays besides (the Python
entry, numba's dispatch, x's preparation, the parallel launch and join, each
thread's first rows arriving cold).

    .venv/bin/python tools/matvec_rows_sweep.py [--kind int4] [--cols 2048] [--working-set 512]
"""

from __future__ import annotations

import argparse

import numba
import numpy as np

from tierlab.app.lab import bench_kernels as B


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="int4", choices=sorted(B._MATVEC))
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--working-set", type=int, default=512, help="MiB of operands the calls rotate through")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    numba.set_num_threads(min(a.threads, numba.config.NUMBA_NUM_THREADS))
    rng = np.random.default_rng(0)
    fn = B._MATVEC[a.kind]
    points = []
    for rows in (128, 256, 512, 1024, 2048, 4096):
        nbytes = int(rows * a.cols * B.BYTES_PER_WEIGHT[a.kind])
        ops = B._random_operands(a.kind, rows, a.cols, B._copies_for(nbytes, a.working_set << 20), rng)
        x = rng.standard_normal(a.cols, dtype=np.float32)
        y = np.empty(rows, np.float32)
        median = B._time_calls(lambda i: fn(*ops[i % len(ops)], x, y), 300, 0.3).median_s
        points.append((rows, nbytes, median))
        print(f"{a.kind} {rows}x{a.cols}: {nbytes / 1024:7.0f} KiB {median * 1e6:7.1f} us {nbytes / median / 1e9:5.1f} GB/s",
              flush=True)
        del ops
    big = [(b, t) for rows, b, t in points if rows >= 512]
    slope, intercept = np.polyfit([b for b, _ in big], [t for _, t in big], 1)
    stream = B.measure_bandwidth(512 << 20, 15)[0]
    print(f"fit over >= 512 rows: {intercept * 1e6:.2f} us a call + bytes at {1 / slope / 1e9:.1f} GB/s; "
          f"stream read {stream:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
