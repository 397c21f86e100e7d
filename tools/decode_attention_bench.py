#!/usr/bin/env python3
"""One decoded token's attention at Qwen3.6-35B-A3B's shape, by context length, from DRAM.

Why: decode's attention reads the whole KV cache of its layer every token (float32 keys and
values: 16.8 MB a layer at 4096 positions, 10 such layers in Qwen3.6-35B-A3B), so at long
contexts it is a large part of a token beside the weights. This times, in turn in each
round, the kernel decode runs (`decode_attention.attention_decode`), the token-by-token
kernel it replaced (`dense.attention`, one task per query head) and the prompt's tiles
with one token (`prompt_attention.attention_tiles`), each on caches rotating through at
least 96 MB (so that each call reads its cache from DRAM, as in decode where a token's
weights stream through the caches between two layers' attention), and reads the stream
around each length (`bench kernels`' probe). Median microseconds a call, and the distinct
cache's bytes over that time against the stream:

    .venv/bin/python tools/decode_attention_bench.py [--lengths 144 1024 4096 16384] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tierlab.app.lab.bench_kernels import StreamProbe
from tierlab.engine.kernels.decode_attention import attention_decode
from tierlab.engine.kernels.dense import attention
from tierlab.engine.kernels.prompt_attention import attention_tiles

Q_HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256  # Qwen3.6-35B-A3B's gated attention layers
ROTATE_BYTES = 96 << 20


def _kernels():
    def decode(q, k, v, pos, out):
        attention_decode(q[0], k, v, pos, out[0], 2)

    return {"attention_decode": decode, "dense.attention": attention, "attention_tiles (1 token)": attention_tiles}


def _time(fn, q, caches, pos, out, calls: int) -> float:
    fn(q, caches[0][0], caches[0][1], pos, out)  # compiled or loaded before the clock
    times = []
    for i in range(calls):
        k, v = caches[i % len(caches)]
        t0 = time.perf_counter()
        fn(q, k, v, pos, out)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[144, 1024, 4096, 16384])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    probe = StreamProbe(256 << 20)
    kernels = _kernels()
    print(f"{Q_HEADS} query / {KV_HEADS} key-value heads of {HEAD_DIM}, float32 cache; median us a call "
          f"(rounds in turn), distinct K+V GB/s, and that over the stream read around the length's calls")
    print("| positions | K+V MB | stream GB/s | " + " | ".join(kernels) + " |")
    print("|---|---|---|" + "---|" * len(kernels))
    for length in a.lengths:
        nbytes = 2 * KV_HEADS * length * HEAD_DIM * 4
        copies = max(1, -(-ROTATE_BYTES // nbytes))
        caches = [(rng.standard_normal((KV_HEADS, length, HEAD_DIM), dtype=np.float32),
                   rng.standard_normal((KV_HEADS, length, HEAD_DIM), dtype=np.float32)) for _ in range(copies)]
        q = rng.standard_normal((1, Q_HEADS, HEAD_DIM), dtype=np.float32)
        out = np.empty((1, Q_HEADS, HEAD_DIM), dtype=np.float32)
        calls = max(8, min(400, (1 << 31) // (nbytes * 8)), copies)
        streams = [probe.read_gbs()]
        times = {name: [] for name in kernels}
        for _ in range(a.rounds):
            for name, fn in kernels.items():
                times[name].append(_time(fn, q, caches, length - 1, out, calls))
            streams.append(probe.read_gbs())
        stream = float(np.mean(streams))
        cells = []
        for name in kernels:
            t = float(np.median(times[name]))
            gbs = nbytes / t / 1e9
            cells.append(f"{1e6 * t:.0f} us, {gbs:.1f} GB/s, {100 * gbs / stream:.0f}%")
        print(f"| {length} | {nbytes / 1e6:.1f} | {stream:.1f} | " + " | ".join(cells) + " |", flush=True)
        del caches
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
