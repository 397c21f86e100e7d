#!/usr/bin/env python3
"""What a matvec call from Python costs besides its row loop, from DRAM, part by part.

Why: at the expert shapes a call is 25-30 us, and a few of them are not the
weights' bytes (docs/benchmarks.md, Kernels: "A call's cost besides its bytes").
This times, 2 threads, operands rotating through a working set larger than the
last-level cache, the calls in a shuffled order each iteration (a call's cost
depends on the one before it: Python right after a streaming call runs several
times slower than alone):

- entry: the public `matvec_int4` / `matvec_int8` / ..., as the engine calls it;
- pass: the compiled pass called straight, no checks, no Python frame of ours;
- launch: a parallel no-op with the pass's arguments (dispatch, fork and join);
- prepare: x prepared for the integer dots, as each thread of a pass prepares it (a
  dispatch from Python included: compare with a serial no-op, about 0.3 us alone).

    .venv/bin/python tools/matvec_entry_cost.py [--kind int4] [--shape 512x2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit, prange

from tierlab.app.lab import bench_kernels as B
from tierlab.engine.kernels import qmatvec as K


@njit(parallel=True)
def _launch(qa, sa, qb, sb, x, out, mode, w, threads):
    """A parallel region with the pass's arguments and no work."""
    for t in prange(threads):
        out[t] = np.float32(0.0)


@njit
def _prepare(x, bits):
    """x's preparation as a pass makes it (three arrays allocated and filled); one number
    back, so that no array is boxed for Python."""
    digits, unit, corr = K._prepare_x(x, bits)
    return digits.size + unit.size + corr.size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="int4", choices=sorted(B._MATVEC))
    p.add_argument("--shape", default="512x2048")
    p.add_argument("--working-set", type=int, default=512, help="MiB of operands the calls rotate through")
    p.add_argument("--calls", type=int, default=3000, help="calls of each part per round")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    rows, cols = (int(v) for v in a.shape.split("x"))
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    rng = np.random.default_rng(0)
    nbytes = int(rows * cols * B.BYTES_PER_WEIGHT[a.kind])
    ops = B._random_operands(a.kind, rows, cols, B._copies_for(nbytes, a.working_set << 20), rng)
    # the pass takes (weights, scales) twice; fp32 and bf16 pass the matrix as its own scales
    pairs = [o if len(o) == 2 else (o[0], o[0]) for o in ops]
    x = rng.standard_normal(cols, dtype=np.float32)
    y = np.empty(rows, np.float32)
    bits = {"int4": 4, "int8": 8}.get(a.kind, 0)
    entry = B._MATVEC[a.kind]
    threads = K._thread_count()
    n = len(ops)
    parts = {
        "entry": lambda i: entry(*ops[i % n], x, y),
        "pass": lambda i: K._pass(pairs[i % n][0], pairs[i % n][1], pairs[i % n][0], pairs[i % n][1], x, y,
                                  K.SET, 1.0, threads),
        "launch": lambda i: _launch(pairs[i % n][0], pairs[i % n][1], pairs[i % n][0], pairs[i % n][1], x, y,
                                    K.SET, 1.0, threads),
        "prepare": lambda i: _prepare(x, bits),
    }
    for part in parts.values():
        part(0)
    names = list(parts)
    print(f"{a.kind} {rows}x{cols}, {nbytes / 1024:.0f} KiB a call, {n} copies; median us of {a.calls} calls a part")
    for r in range(a.rounds):
        times = {k: [] for k in names}
        i = 0
        for _ in range(a.calls):
            for k in rng.permutation(names):
                i += 1
                t0 = time.perf_counter()
                parts[k](i)
                times[k].append(time.perf_counter() - t0)
        print(f"round {r}: " + " | ".join(f"{k} {np.median(times[k]) * 1e6:6.2f}" for k in names), flush=True)
    stream = B.measure_bandwidth(512 << 20, 15)[0]
    print(f"stream read {stream:.1f} GB/s: the weights alone {nbytes / stream / 1e3:.1f} us a call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
