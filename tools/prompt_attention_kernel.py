#!/usr/bin/env python3
"""One prompt's attention kernel (`prompt_attention.attention_tiles`) alone, at Qwen3.6's shape, by length.

Why: a long prompt's attention grows with the square of its length, unlike the rest of a
prefill; this times the kernel by itself (16 query / 2 key-value heads of 256, a prompt
from position 0, operands warm), best of several calls, so that two checkouts can be set
side by side (`PYTHONPATH=OTHER_TREE` for the other one, in turn):

    NUMBA_NUM_THREADS=2 .venv/bin/python tools/prompt_attention_kernel.py [--lengths 128 512 2048 4096] [--label NAME]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tierlab.engine.kernels.prompt_attention import attention_tiles

Q_HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096])
    p.add_argument("--label", default="")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    cells = []
    for n in a.lengths:
        k = rng.standard_normal((KV_HEADS, n, HEAD_DIM), dtype=np.float32)
        v = rng.standard_normal((KV_HEADS, n, HEAD_DIM), dtype=np.float32)
        q = rng.standard_normal((n, Q_HEADS, HEAD_DIM), dtype=np.float32)
        out = np.empty_like(q)
        attention_tiles(q, k, v, 0, out)  # compiled or loaded before the clock
        best = float("inf")
        for _ in range(3 if n >= 2048 else 10):
            t0 = time.perf_counter()
            attention_tiles(q, k, v, 0, out)
            best = min(best, time.perf_counter() - t0)
        cells.append(f"{n} tokens {1e3 * best:.1f} ms")
    print(f"{a.label + ': ' if a.label else ''}" + ", ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
