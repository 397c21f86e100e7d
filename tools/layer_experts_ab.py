"""A token's routed experts of one layer from a RAM store: one launch pair for all of them
(`experts_forward`) against a launch pair per expert, calls alternated in one process.

Both see the same load, so their ratio survives a busy machine. 1 thread: CPU time
per call; 2 threads: wall time. Real expert shape (2048 x 512), 64 slots on huge pages,
8 different slots per call.

    python tools/layer_experts_ab.py [int4|int8] [--calls 400]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from tierlab.engine import hugepages
from tierlab.engine import quant as Q
from tierlab.engine.kernels import qmatvec as K

HIDDEN, INTER, SLOTS, EXPERTS = 2048, 512, 64, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", nargs="?", default="int4", choices=("int4", "int8"))
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    kind = args.kind
    rng = np.random.default_rng(0)
    store = hugepages.empty((SLOTS, K.blob_nbytes(kind, HIDDEN, INTER)), np.uint8)
    mats = [rng.standard_normal(s).astype(np.float32) * np.float32(0.05) for s in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))]
    store[:] = Q.build_blob(*mats, 4 if kind == "int4" else 8)
    x = rng.standard_normal(HIDDEN).astype(np.float32)
    out = np.zeros((EXPERTS, HIDDEN), np.float32)
    rows = np.arange(EXPERTS)

    def one(slots):
        K.experts_forward(kind, store, slots, HIDDEN, INTER, x, out, rows)

    def each(slots):
        for k, s in enumerate(slots):
            K.EXPERT_FORWARD[kind](store[s], HIDDEN, INTER, x, out[k], 1.0)

    for threads in (1, 2):
        numba.set_num_threads(threads)
        clock = time.thread_time_ns if threads == 1 else time.perf_counter_ns
        times: dict[str, list[int]] = {"one launch pair": [], "a pair per expert": []}
        for i in range(args.calls):
            slots = rng.choice(SLOTS, EXPERTS, replace=False)
            pairs = (("one launch pair", one), ("a pair per expert", each))
            for name, call in pairs if i % 2 else pairs[::-1]:
                t0 = clock()
                call(slots)
                times[name].append(clock() - t0)
        for name, ts in times.items():
            us = np.array(ts[20:]) / 1e3
            print(f"{kind} {threads} thread(s), {name}: median {np.median(us):.0f} us, p10 {np.percentile(us, 10):.0f} us "
                  f"({'CPU' if threads == 1 else 'wall'} time per layer)")


if __name__ == "__main__":
    main()
