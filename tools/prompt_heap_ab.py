#!/usr/bin/env python3
"""prompt_heap on against off, in one process: prefill tok/s of alternate prompts.

Why one process: fresh processes on this VM move 10-20% between runs, more than
the few percent at stake; here each round prefills a new random prompt with
`engine.prompt_heap` in force and one with it swapped for a no-op, the order of
the pair alternating, after one untimed prefill of the same length.

    python tools/prompt_heap_ab.py --model DIR [--prompt-tokens 512] [--rounds 6]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np

from tierlab.engine import model as engine_model
from tierlab.engine.options import EngineOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    engine = EngineOptions(model=a.model).open(with_tokenizer=False)
    rng = np.random.default_rng(0)
    vocab, n = engine.config.vocab_size, a.prompt_tokens
    real = engine_model.prompt_heap
    runs: dict[str, list[float]] = {"on": [], "off": []}
    engine.prefill(rng.integers(0, vocab, n))
    for r in range(a.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            engine_model.prompt_heap = real if mode == "on" else contextlib.nullcontext
            ids = rng.integers(0, vocab, n)
            t0 = time.perf_counter()
            engine.prefill(ids)
            runs[mode].append(round(n / (time.perf_counter() - t0), 1))
    engine_model.prompt_heap = real
    for mode, values in runs.items():
        print(f"{mode}: {', '.join(map(str, values))} (median {statistics.median(values):.1f}) tok/s")


if __name__ == "__main__":
    main()
