"""What the oracle band costs, for docs/benchmarks.md.

    python tools/oracle_band_bench.py [--window 1024] [--tokens 20000] [--repeat 5]

Two figures per model shape, on a synthetic skewed expert trace (Zipf-like
popularity per layer, K distinct experts a token): the listener's cost per
token (`OracleBand.add`, the only part on the engine thread) early in a
session and after `--tokens` tokens, to show it does not grow; and the time
of one replay (`OracleBand.reading`: Belady at the cache's size and the
engine's LRU at every band size) over a full window, the work the band's
own thread does about once a second, each time after 50 new tokens (the
conversion of new tokens holds the interpreter; the replays release it).
Medians of `--repeat` timings; the listener's over 20 batches of 100 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tierlab.app.lab.oracle import OracleBand
from tierlab.engine.events import LayerRoute, TokenEvent

SHAPES = (  # name, MoE layers, experts per layer, K, RAM slots
    ("tiny-moe", 8, 32, 4, 12),
    ("Qwen3-30B-A3B shape", 48, 128, 8, 32),
    ("Qwen3.5-35B-A3B shape", 40, 256, 8, 64),
)


def events(n_layers: int, n_experts: int, k: int, slots: int, tokens: int, seed: int = 0) -> list[TokenEvent]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_experts + 1) ** 1.1
    p /= p.sum()
    out = []
    for t in range(tokens):
        routes = []
        for layer in range(n_layers):
            ids = rng.choice(n_experts, k, replace=False, p=p).astype(np.int32)
            routes.append(LayerRoute(layer, ids, np.full(k, 1.0 / k, np.float32), ids, None,
                                     np.ones(k, np.int8), np.zeros(k, bool), slots=k))
        out.append(TokenEvent(t, 0, "decode", routes, store={"ram_slots": slots}))
    return out


def per_token_us(band: OracleBand, batch: list[TokenEvent]) -> float:
    t0 = time.perf_counter()
    for event in batch:
        band.add(event)
    return 1e6 * (time.perf_counter() - t0) / len(batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=20000, help="session length for the late listener timing")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    warm = OracleBand(window=8, n_experts=8)  # compile the replays once, outside the timings
    for event in events(1, 8, 2, 3, 8):
        warm.add(event)
    warm.reading()
    print(f"window {args.window} tokens; listener µs/token over the first 2000 tokens and after "
          f"{args.tokens}; one replay (Belady + LRU at every band size) after 50 new tokens")
    print("| shape | layers × experts, K, slots | listener early | listener late | replay ms |")
    print("|---|---|---:|---:|---:|")
    for name, n_layers, n_experts, k, slots in SHAPES:
        trace = events(n_layers, n_experts, k, slots, 2048)
        band = OracleBand(window=args.window, n_experts=n_experts)
        early = statistics.median(per_token_us(band, trace[i * 100:(i + 1) * 100]) for i in range(20))
        added = 2000
        while added < args.tokens:  # a long session: the same trace again and again
            chunk = trace[: min(2048, args.tokens - added)]
            for event in chunk:
                band.add(event)
            added += len(chunk)
        late = statistics.median(per_token_us(band, trace[i * 100:(i + 1) * 100]) for i in range(20))
        band.reading()
        replays = []
        for r in range(args.repeat):
            for event in trace[r * 50:(r + 1) * 50]:
                band.add(event)
            t0 = time.perf_counter()
            reading = band.reading()
            replays.append(1000 * (time.perf_counter() - t0))
        assert reading.window_tokens == args.window
        print(f"| {name} | {n_layers} × {n_experts}, {k}, {slots} | {early:.2f} µs | {late:.2f} µs | "
              f"{statistics.median(replays):.1f} |")


if __name__ == "__main__":
    main()
