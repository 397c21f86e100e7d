"""Per-token decode times (min, p10, median): on a shared machine the fastest tokens show
what the engine does when the other jobs leave the cores free, which a mean hides.

Warm slots (a random prompt and 32 greedy tokens first), then each greedy token timed alone.

    python tools/token_times.py --model DIR [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from tierlab.engine.options import EngineOptions


def token_times(model: Path, tokens: int) -> dict:
    engine = EngineOptions(model=model).open(with_tokenizer=False)
    rng = np.random.default_rng(0)
    logits = engine.prefill([int(t) for t in rng.integers(0, engine.config.vocab_size, 32)])
    for _ in range(32):
        logits = engine.step(int(np.argmax(logits)))
    times = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        logits = engine.step(int(np.argmax(logits)))
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"min_ms": 1000 * times[0], "p10_ms": 1000 * times[len(times) // 10], "median_ms": 1000 * times[len(times) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=EngineOptions().model)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(token_times(args.model, args.tokens)))


if __name__ == "__main__":
    main()
