#!/usr/bin/env python3
"""A prompt's kernels at the real width, one line each: multiply-adds per second and ms.

Why: a prompt's time is in three kinds of kernel calls (the dense projections'
`qmatmat.matmat_*`, the routed experts' `experts_gate_up` / `experts_down`, and
the attention, `prompt_attention.attention_tiles`); this times each alone at the shapes of Qwen3.6-35B-A3B
(hidden 2048, experts 512 wide, 16 query / 2 key-value heads of 256) on random
weights, so that a kernel change can be compared in interleaved fresh processes
of two checkouts without the rest of a prefill's noise:

    for i in 1 2 3; do for p in /tmp/before ""; do
        env ${p:+PYTHONPATH=$p} python tools/prompt_kernels.py; done; done

Lines: `pass` (one core, cache-hot: `qmatmat._dot_rows4`, four widened rows of 512
columns against 16 tokens, the inner step of every matmat; GMAC/s of the calling
thread's CPU time); `matmat KIND ROWSxCOLS T=n` (median of timed calls over copies of the
matrix that do not fit in the last-level cache, GMAC/s; bf16 on CPUs with AVX-512 also
`float_tiles.matmat_tiles`, "tiles", which `linear` runs there, and int8/int4 with AVX-512
VNNI `dense_vnni.matmat_integer`, "integer tiles", which `qlinear` runs there; `--long`: the
shapes at 512 and 4096 tokens); `experts KIND
gate_up|down` (64 experts, 128 tokens routed top-8 at random, or unevenly with
`--skew`; the float path's launches, and what `experts_matmat` runs instead where it
does: bf16 on CPUs with AVX-512 `float_tiles`' launches, "tiles", int4 and int8 with AVX-512
VNNI `experts_vnni`'s, "integer dots"; GMAC/s of the launch, work items dealt round-robin to the threads or, `--deals
halves`, each thread a contiguous half; with --from-cache also with all 64 on one cache-resident blob); `attention
T=n` (a causal prompt of n tokens, ms: the tiled kernel a prompt runs, then decode's
token-by-token kernel that PREFILL_EXACT runs), `attention decode at N` (one token over N
cached positions, us) and `deltanet T=n` (`deltanet_prompt.gated_deltanet_prompt`, the
prompt's Gated DeltaNet between its projections: 16 key / 32 value heads of 128, ms).
`--parts` picks the lines (default all). Threads: numba's (NUMBA_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit

from tierlab.app.lab import bench_kernels as B
from tierlab.engine import hugepages
from tierlab.engine.blob_layout import blob_nbytes
from tierlab.engine.kernels import dense_vnni, experts_vnni, float_tiles, qmatmat
from tierlab.engine.kernels.dense import attention
from tierlab.engine.kernels.deltanet_prompt import gated_deltanet_prompt
from tierlab.engine.kernels.prompt_attention import attention_tiles

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 512, 64, 8
Q_HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256
K_HEADS, V_HEADS, K_DIM, V_DIM, CONV = 16, 32, 128, 128, 4


def median_s(call, n: int) -> float:
    """Median seconds of n timed calls after a warm-up (`bench kernels`' own timer)."""
    return B._time_calls(lambda i: call(), n, 0.0).median_s


@njit(nogil=True)
def _passes(block, xs, acc, calls):
    """`calls` calls of the pass, in compiled code (a call from Python costs as much as one pass)."""
    for _ in range(calls):
        qmatmat._dot_rows4(block, xs, 0, xs.shape[1], acc, xs[0], 0, xs[0], 0, 0, 0, 0)


def pass_line(rng) -> str:
    block = rng.standard_normal((1, 4, 512), dtype=np.float32)
    xs = rng.standard_normal((1, 16, 512), dtype=np.float32)
    acc = np.empty((16 + 3, 4), np.float32)  # room for a last pass's repeated tokens
    calls = 20000
    _passes(block, xs, acc, 1)
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        _passes(block, xs, acc, calls)
        best = min(best, time.thread_time() - t0)
    return f"pass 4x512 T=16: {calls * 4 * 512 * 16 / best / 1e9:.1f} GMAC/s"


MATMAT_SHAPES = ((12352, 2048, 128), (12352, 2048, 32), (2048, 4096, 128), (512, 2048, 16))
LONG_SHAPES = ((12352, 2048, 512), (12352, 2048, 4096), (2048, 4096, 4096))  # --long: long prompts


def matmat_lines(kinds: list[str], rng, shapes=MATMAT_SHAPES) -> list[str]:
    lines = []
    for kind in kinds:
        for rows, cols, tokens in shapes:
            calls = 20 if tokens <= 512 else 3
            bytes_one = rows * cols * (2 if kind == "bf16" else 1)
            ops = B._random_operands(kind, rows, cols, max(2, (256 << 20) // bytes_one), rng)
            x = rng.standard_normal((tokens, cols), dtype=np.float32)
            out = np.empty((tokens, rows), np.float32)
            turn = iter(range(1 << 30))

            def call():
                parts = ops[next(turn) % len(ops)]
                if kind == "bf16":
                    qmatmat.matmat_bf16(parts[0], x, out)
                else:
                    qmatmat.matmat_quant(parts[0], parts[1], x, out)

            def tiled():
                float_tiles.matmat_tiles(ops[next(turn) % len(ops)][0], x, out)

            def integer():
                parts = ops[next(turn) % len(ops)]
                dense_vnni.matmat_integer(parts[0], parts[1], x, out)

            t = median_s(call, calls)
            lines.append(f"matmat {kind} {rows}x{cols} T={tokens}: {rows * cols * tokens / t / 1e9:.1f} GMAC/s")
            if kind == "bf16" and float_tiles.usable_dense(rows, cols):  # what `linear` runs there
                t = median_s(tiled, calls)
                lines.append(f"matmat {kind} {rows}x{cols} T={tokens}, tiles: {rows * cols * tokens / t / 1e9:.1f} GMAC/s")
            if kind != "bf16" and dense_vnni.usable(rows, cols):  # what `qlinear` runs there
                t = median_s(integer, calls)
                lines.append(f"matmat {kind} {rows}x{cols} T={tokens}, integer tiles: "
                             f"{rows * cols * tokens / t / 1e9:.1f} GMAC/s")
    return lines


def routed(tokens: int, skew: float, rng) -> np.ndarray:
    """Each token's top-8 experts [tokens, 8]: at random (skew 0), or with expert e's
    logit raised by skew * log(1 / (e + 1)), so a few experts take many tokens and the
    rest few, as a trained router's layers do."""
    logits = rng.gumbel(size=(tokens, EXPERTS)) - skew * np.log1p(np.arange(EXPERTS))
    return np.argsort(-logits, axis=1)[:, :TOP_K]


def experts_lines(kinds: list[str], tokens: int, rng, from_cache: bool = False, skew: float = 0.0,
                  deals: tuple[str, ...] = ("dealt",)) -> list[str]:
    lines = []
    for kind in kinds:
        nbytes = blob_nbytes(kind, HIDDEN, INTER)
        arena = hugepages.empty((EXPERTS, nbytes), np.uint8)
        for e in range(EXPERTS):
            arena[e] = B._fused_blob(kind, HIDDEN, INTER, rng)
        chosen = routed(tokens, skew, rng)
        users = [np.nonzero((chosen == e).any(axis=1))[0] for e in range(EXPERTS)]
        starts = np.zeros(EXPERTS + 1, np.int64)
        np.cumsum([len(u) for u in users], out=starts[1:])
        rows = np.concatenate(users).astype(np.int64)
        dest = np.arange(rows.size, dtype=np.int64)
        # from_cache: every expert is the first one's blob (6 MiB at most), read from cache
        bases = np.array([arena[0 if from_cache else e].ctypes.data for e in range(EXPERTS)], np.intp)
        x = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
        width, h_width = qmatmat._chunk_width(HIDDEN), qmatmat._chunk_width(INTER)
        xs = np.empty((HIDDEN // width, rows.size, width), np.float32)
        qmatmat.gather_chunked(x, rows, width, xs)
        hs = np.empty((INTER // h_width, rows.size, h_width), np.float32)
        out = np.empty((rows.size, HIDDEN), np.float32)
        marker = qmatmat._MARKERS[kind]
        macs = rows.size * HIDDEN * INTER
        where = " (one blob, from cache)" if from_cache else ""
        counts = np.diff(starts)
        spread = f", skew {skew:g}: tokens per expert {counts.min()}-{counts.max()}" if skew else ""
        for deal in deals:  # "dealt": as `experts_matmat` runs them; "halves": each thread its own half
            threads = numba.get_num_threads() if deal == "dealt" else 1
            gate_up = median_s(lambda: qmatmat.experts_gate_up(marker, bases, nbytes, HIDDEN, INTER, xs, starts, hs,
                                                               threads), 8)
            down = median_s(lambda: qmatmat.experts_down(marker, bases, nbytes, HIDDEN, INTER, hs, starts, out, dest,
                                                         threads), 8)
            how = f"{where}{spread}" + (f", items {deal}" if len(deals) > 1 else "")
            lines.append(f"experts {kind} gate_up{how}: {2 * macs / gate_up / 1e9:.1f} GMAC/s ({1e3 * gate_up:.1f} ms)")
            lines.append(f"experts {kind} down{how}: {macs / down / 1e9:.1f} GMAC/s ({1e3 * down:.1f} ms)")
            if float_tiles.usable(kind, HIDDEN, INTER):  # what `experts_matmat` runs for bf16 / fp32 here
                h = np.empty((rows.size, INTER), np.float32)
                pairs = np.arange(rows.size, dtype=np.int64)
                gate_up = median_s(lambda: float_tiles.gate_up_tiles(marker, bases, nbytes, HIDDEN, INTER, x, rows,
                                                                     starts, h, threads), 8)
                down = median_s(lambda: float_tiles.down_tiles(marker, bases, nbytes, HIDDEN, INTER, h, pairs, starts,
                                                               out, dest, threads), 8)
                lines.append(f"experts {kind} gate_up, tiles{how}: {2 * macs / gate_up / 1e9:.1f} GMAC/s "
                             f"({1e3 * gate_up:.1f} ms)")
                lines.append(f"experts {kind} down, tiles{how}: {macs / down / 1e9:.1f} GMAC/s ({1e3 * down:.1f} ms)")
            if experts_vnni.usable(kind, HIDDEN, INTER):  # what `experts_matmat` runs for int4 / int8 here
                gate_up, down = _integer_dot_times(kind, marker, bases, nbytes, x, rows, starts, dest, threads)
                lines.append(f"experts {kind} gate_up, integer dots{how}: {2 * macs / gate_up / 1e9:.1f} GMAC/s "
                             f"({1e3 * gate_up:.1f} ms)")
                lines.append(f"experts {kind} down, integer dots{how}: {macs / down / 1e9:.1f} GMAC/s "
                             f"({1e3 * down:.1f} ms)")
    return lines


def _integer_dot_times(kind, marker, bases, nbytes, x, rows, starts, dest, threads) -> tuple[float, float]:
    """Median seconds of `experts_vnni`'s two launches, each with its preparation of x or h."""
    h = np.empty((rows.size, INTER), np.float32)
    out = np.empty((rows.size, HIDDEN), np.float32)
    tokens, pairs = np.arange(x.shape[0], dtype=np.int64), np.arange(rows.size, dtype=np.int64)
    bits = 4 if kind == "int4" else 8

    def gate_up():
        digits, corr, unit = experts_vnni.prepared(x, tokens, bits)
        experts_vnni.gate_up_dots(marker, bases, nbytes, HIDDEN, INTER, digits, corr, unit, rows, starts, h, threads)

    def down():
        digits, corr, unit = experts_vnni.prepared(h, pairs, bits)
        experts_vnni.down_dots(marker, bases, nbytes, HIDDEN, INTER, digits, corr, unit, pairs, starts, out, dest,
                               threads)

    return median_s(gate_up, 8), median_s(down, 8)


def attention_lines(lengths: list[int], decode_at: int, rng) -> list[str]:
    lines = []
    cap = max(lengths + [decode_at + 1])
    k = rng.standard_normal((KV_HEADS, cap, HEAD_DIM), dtype=np.float32)
    v = rng.standard_normal((KV_HEADS, cap, HEAD_DIM), dtype=np.float32)
    for n in lengths:
        q = rng.standard_normal((n, Q_HEADS, HEAD_DIM), dtype=np.float32)
        out = np.empty_like(q)
        t = median_s(lambda: attention_tiles(q, k, v, 0, out), 5)
        exact = median_s(lambda: attention(q, k, v, 0, out), 5)
        lines.append(f"attention T={n}: {1e3 * t:.1f} ms tiled, {1e3 * exact:.1f} ms token by token (PREFILL_EXACT)")
    q = rng.standard_normal((1, Q_HEADS, HEAD_DIM), dtype=np.float32)
    out = np.empty_like(q)
    t = median_s(lambda: attention(q, k, v, decode_at, out), 200)
    lines.append(f"attention decode at {decode_at}: {1e6 * t:.1f} us")
    return lines


def deltanet_lines(lengths: list[int], rng) -> list[str]:
    lines = []
    channels = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM
    taps = (0.3 * rng.standard_normal((CONV, channels))).astype(np.float32)  # [K, C], as the layer holds them
    a_log = rng.standard_normal(V_HEADS).astype(np.float32)
    dt_bias = rng.standard_normal(V_HEADS).astype(np.float32)
    norm_w = np.ones(V_DIM, np.float32)
    for n in lengths:
        mixed = rng.standard_normal((n, channels), dtype=np.float32)
        z = rng.standard_normal((n, V_HEADS * V_DIM), dtype=np.float32)
        b, a = (rng.standard_normal((n, V_HEADS), dtype=np.float32) for _ in range(2))
        out = np.empty((n, V_HEADS * V_DIM), np.float32)

        def call():
            conv = np.zeros((CONV - 1, channels), np.float32)
            state = np.zeros((V_HEADS, K_DIM, V_DIM), np.float32)
            gated_deltanet_prompt(mixed, conv, taps, z, b, a, a_log, dt_bias, norm_w, np.float32(1e-6), state,
                                  K_HEADS, V_HEADS, K_DIM, V_DIM, out)

        lines.append(f"deltanet T={n}: {1e3 * median_s(call, 5):.1f} ms")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="int4,int8,bf16", help="comma-separated: int4,int8,bf16")
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens routed in the experts' launches")
    p.add_argument("--attention", default="128,512", help="prompt lengths for attention and deltanet, comma-separated")
    p.add_argument("--decode-at", type=int, default=300)
    p.add_argument("--from-cache", action="store_true",
                   help="also the experts' launches with all 64 experts on one blob (cache-resident): "
                        "the gap to the default lines is what reading the experts from DRAM costs")
    p.add_argument("--skew", type=float, default=0.0,
                   help="uneven routing in the experts' lines: expert e's logit lowered by skew * log(e + 1)")
    p.add_argument("--deals", default="dealt",
                   help="how the experts' work items go to the threads, comma-separated, each in turn: dealt "
                        "(round-robin, as the engine runs them), halves (each thread a contiguous half)")
    p.add_argument("--long", action="store_true",
                   help="the matmat lines at 512 and 4096 tokens (a long prompt's projections) instead")
    p.add_argument("--parts", default="pass,matmat,experts,attention,deltanet",
                   help="which lines, comma-separated: pass,matmat,experts,attention,deltanet")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    kinds = a.kinds.split(",")
    parts = set(a.parts.split(","))
    lengths = [int(n) for n in a.attention.split(",")]
    deals = tuple(a.deals.split(","))
    shapes = LONG_SHAPES if a.long else MATMAT_SHAPES
    makers = [("pass", lambda: [pass_line(rng)]), ("matmat", lambda: matmat_lines(kinds, rng, shapes)),
              ("experts", lambda: experts_lines(kinds, a.prompt_tokens, rng, skew=a.skew, deals=deals)
               + (experts_lines(kinds, a.prompt_tokens, rng, from_cache=True, skew=a.skew, deals=deals)
                  if a.from_cache else [])),
              ("attention", lambda: attention_lines(lengths, a.decode_at, rng)),
              ("deltanet", lambda: deltanet_lines(lengths, rng))]
    for name, make in makers:
        if name in parts:
            for line in make():
                print(line, flush=True)


if __name__ == "__main__":
    main()
