"""What the meters cost per token: one fold against the app's three windows.

The app's watch folds every token event on the engine thread; this times
that work on synthetic events the size of a real model's (40 MoE layers,
top-8), best of three passes over 400 tokens.

    python tools/meter_cost.py [--layers 40] [--top-k 8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tierlab.engine.events import LayerRoute, TokenEvent
from tierlab.engine.knobs import KnobValues
from tierlab.engine.meters import WINDOWS, MeterFold, WindowedMeters


def synthetic_event(index: int, layers: int, k: int) -> TokenEvent:
    ids = np.arange(k, dtype=np.int32)
    routes = [LayerRoute(layer, ids, np.full(k, 1 / k, np.float32), ids.copy(), None, np.ones(k, np.int8),
                         np.zeros(k, bool), slots=k, measured=True, kl=0.1, ram_hits=k - 2, ram_misses=2,
                         shadow_ram_hits=k - 3, shadow_ram_misses=3) for layer in range(layers)]
    return TokenEvent(index, 1, "decode", routes, {"fetch": 1.0, "compute": 2.0, "total": 5.0},
                      store={"ram_slots": 64, "bytes_read": index * 1000})


def best_per_token(events, fold_one) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fold_one(events)
        best = min(best, (time.perf_counter() - t0) / len(events))
    return best


def one_fold(events) -> None:
    fold = MeterFold()
    for event in events:
        fold.add(event)
        fold.summary()


def three_windows(events) -> None:
    windows, knobs = WindowedMeters(), KnobValues(CACHE_ROUTE=True)
    for event in events:
        windows.add(event)
        for window in WINDOWS:
            windows.summary(window, knobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    events = [synthetic_event(i, args.layers, args.top_k) for i in range(400)]
    print(f"one fold and its summary:        {best_per_token(events, one_fold) * 1e6:6.0f} µs per token")
    print(f"three windows and three summaries: {best_per_token(events, three_windows) * 1e6:6.0f} µs per token")


if __name__ == "__main__":
    main()
