"""One line of matvec rates for comparing kernel variants in interleaved fresh processes.

Per kind and shape: one thread's Gweights per second of its CPU time, cache-hot
(1T) and from DRAM (1D: the calls rotate through the working set), 10th percentile
of 300 calls (time spent descheduled does not count); the best of 300 cache-hot
calls on `--threads` threads ("2H": what the arithmetic allows those threads
with no DRAM in the way, launch included); and the
median of >= 200 calls on `--threads` threads (default 2) rotating through a working set larger than the
last-level cache, with `tierlab bench kernels`' own helpers. Run it once per
checkout in turn (each with its own PYTHONPATH), several rounds, and compare
the rounds' ranges:

    for i in 1 2 3; do for p in /tmp/before /tmp/after; do
        PYTHONPATH=$p python tools/kernel_ab.py int4,int8 512x2048,2048x512; done; done
"""

from __future__ import annotations

import argparse

import numba
import numpy as np

from tierlab.app.lab import bench_kernels as B


def rates(kinds: list[str], shapes: list[tuple[int, int]], working_set_mib: int, threads: int) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for kind in kinds:
        fn = B._MATVEC[kind]
        for rows, cols in shapes:
            nbytes = int(rows * cols * B.BYTES_PER_WEIGHT[kind])
            ops = B._random_operands(kind, rows, cols, B._copies_for(nbytes, working_set_mib << 20), rng)
            x = rng.standard_normal(cols, dtype=np.float32)
            y = np.empty(rows, np.float32)
            numba.set_num_threads(1)
            one_core = B._cpu_time_rate(lambda i: fn(*ops[0], x, y), rows * cols, 300)
            one_dram = B._cpu_time_rate(lambda i: fn(*ops[i % len(ops)], x, y), rows * cols, 300)
            numba.set_num_threads(threads)
            hot = B._time_calls(lambda i: fn(*ops[0], x, y), 300, 0.2)
            timing = B._time_calls(lambda i: fn(*ops[i % len(ops)], x, y), 200, 0.3)
            label = f"{threads}T" if threads > 1 else "1W"  # 1W: one thread's median wall time, not "1T" again
            out.append(f"{kind} {rows}x{cols} 1T {one_core:.1f} 1D {one_dram:.1f} "
                       f"{threads}H {rows * cols / hot.best_s / 1e9:.1f} "
                       f"{label} {rows * cols / timing.median_s / 1e9:.1f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", help="comma-separated: fp32,bf16,int8,int4")
    parser.add_argument("shapes", nargs="?", default="512x2048,2048x512", help="comma-separated ROWSxCOLS")
    parser.add_argument("--working-set", type=int, default=256, help="MiB of operands for the many-thread rate")
    parser.add_argument("--threads", type=int, default=2,
                        help="threads of the last rate (default 2; at most NUMBA_NUM_THREADS, which caps it)")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    # numba refuses a count above NUMBA_NUM_THREADS: a run with NUMBA_NUM_THREADS=1 measures one thread
    threads = max(1, min(args.threads, numba.config.NUMBA_NUM_THREADS))
    print(" | ".join(rates(args.kinds.split(","), shapes, args.working_set, threads)))


if __name__ == "__main__":
    main()
