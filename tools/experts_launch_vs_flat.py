#!/usr/bin/env python3
"""A decoded token's eight experts from a RAM store against flat matvecs of the same bytes, from DRAM.

Why: `qmatvec._experts` runs gate/up of all of a layer's experts in one launch
and down in another, each expert a slot of the layer's RAM store viewed inside
the launch. One int4 matvec over a matrix as large as the eight experts' gate/up
(8192x2048), and one as large as their down (16384x512), read the same bytes
with the same row loop, so the difference is what the experts' launch costs
besides its bytes (work items, views, the jumps between slots). Real expert
shape (hidden 2048, intermediate 512), 64 slots on huge pages, 8 random ones a
call; the flat matrices rotate through 8 copies, so both come from DRAM; the
two pairs of calls alternate, medians of 300 each per round, with the stream read
(`bench_kernels.StreamProbe`) taken around each round:

    NUMBA_NUM_THREADS=2 .venv/bin/python tools/experts_launch_vs_flat.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import inspect
import time

import numpy as np

from tierlab.app.lab.bench_kernels import StreamProbe
from tierlab.engine import hugepages
from tierlab.engine import quant as Q
from tierlab.engine.kernels import qmatvec as K

HIDDEN, INTER, SLOTS, EXPERTS, COPIES = 2048, 512, 64, 8, 8


def _flat(rows: int, cols: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """COPIES int4 matrices [rows, cols] (random nibbles, sane scales) on huge pages."""
    q = hugepages.empty((COPIES, rows, cols // 2), np.uint8)
    s = hugepages.empty((COPIES, rows, cols // Q.GROUP), np.float32)
    q[:] = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    s[:] = 1e-3
    return q, s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    store = hugepages.empty((SLOTS, K.blob_nbytes("int4", HIDDEN, INTER)), np.uint8)
    mats = [rng.standard_normal(s).astype(np.float32) * np.float32(0.05)
            for s in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))]
    store[:] = Q.build_blob(*mats, 4)
    x = rng.standard_normal(HIDDEN).astype(np.float32)
    h = np.zeros((EXPERTS, INTER), np.float32)
    out = np.zeros((EXPERTS, HIDDEN), np.float32)
    rows = np.arange(EXPERTS)
    marker = K._WEIGHT_MARKER["int4"]
    # trees before 2026-12-07 13:40 UTC take no thread count (for an A/B from a `git archive`)
    threads = (K._thread_count(),) if "threads" in inspect.signature(K._experts.py_func).parameters else ()
    gate_up, down = _flat(2 * EXPERTS * INTER, HIDDEN, rng), _flat(EXPERTS * HIDDEN, INTER, rng)
    o_gu, o_dn = np.empty(2 * EXPERTS * INTER, np.float32), np.empty(EXPERTS * HIDDEN, np.float32)
    hd = rng.standard_normal(INTER).astype(np.float32)
    probe = StreamProbe(256 << 20)

    def experts(i: int) -> tuple[float, float]:
        slots = rng.choice(SLOTS, EXPERTS, replace=False)
        t0 = time.perf_counter()
        K._experts(store, slots, marker, HIDDEN, INTER, x, h, out, rows, K.GATE_UP, 1.0, *threads)
        t1 = time.perf_counter()
        K._experts(store, slots, marker, HIDDEN, INTER, x, h, out, rows, K.ADD, 1.0, *threads)
        return t1 - t0, time.perf_counter() - t1

    def flat(i: int) -> tuple[float, float]:
        j = i % COPIES
        t0 = time.perf_counter()
        K.matvec_int4(gate_up[0][j], gate_up[1][j], x, o_gu)
        t1 = time.perf_counter()
        K.matvec_int4(down[0][j], down[1][j], hd, o_dn)
        return t1 - t0, time.perf_counter() - t1

    experts(0), flat(0)
    print("| round | stream GB/s | experts gate/up us | flat gate/up us | experts down us | flat down us | "
          "experts / flat, both launches |")
    print("|---|---|---|---|---|---|---|")
    for r in range(a.rounds):
        before = probe.read_gbs()
        times: dict[str, list[tuple[float, float]]] = {"experts": [], "flat": []}
        for i in range(a.calls):
            times["experts"].append(experts(i))
            times["flat"].append(flat(i))
        stream = max(before, probe.read_gbs())
        med = {k: np.median(np.array(v), axis=0) * 1e6 for k, v in times.items()}
        print(f"| {r} | {stream:.1f} | {med['experts'][0]:.0f} | {med['flat'][0]:.0f} | {med['experts'][1]:.0f} | "
              f"{med['flat'][1]:.0f} | {med['experts'].sum() / med['flat'].sum():.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
