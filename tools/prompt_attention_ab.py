#!/usr/bin/env python3
"""A prompt's tok/s with its attention tiled or token by token, alternated in one process.

Why: the tiled prompt attention (`prompt_attention.attention_tiles`) is a few percent of
a prefill, less than the spread between fresh processes on a shared VM; in one process,
with the two kernels alternating prompt by prompt (the order flipped each round), the
machine's drift hits both alike. Token by token is what head dims that are not a multiple
of 16 take (and PREFILL_EXACT did before 2026-12-07, when decode took the tiles' arithmetic).

    .venv/bin/python tools/prompt_attention_ab.py --model DIR [--rounds 6] [--lengths 128,512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import tierlab.engine.models.attention as attention_module
from tierlab.engine.kernels.dense import attention as token_by_token
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine

KERNELS = {"tiled": attention_module.attention_tiles, "token by token": token_by_token}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--lengths", default="128,512")
    a = p.parse_args()
    engine = load_engine(a.model, knobs=Knobs.from_env({}), with_tokenizer=False)
    rng = np.random.default_rng(0)
    rates: dict[tuple[int, str], list[float]] = {}
    for n in (int(x) for x in a.lengths.split(",")):
        prompt = [int(t) for t in rng.integers(0, engine.config.vocab_size, n)]
        engine.prefill(prompt)  # warm: kernels, pages, the cache's experts
        for r in range(a.rounds):
            for name in (list(KERNELS) if r % 2 == 0 else list(KERNELS)[::-1]):
                attention_module.attention_tiles = KERNELS[name]
                engine.reset()
                t0 = time.perf_counter()
                engine.prefill(prompt)
                rates.setdefault((n, name), []).append(n / (time.perf_counter() - t0))
    attention_module.attention_tiles = KERNELS["tiled"]
    engine.close()
    print(f"model {a.model}, prefill tok/s, {a.rounds} rounds alternating")
    for (n, name), v in rates.items():
        print(f"prompt {n} {name}: {' '.join(f'{x:.0f}' for x in v)}  median {statistics.median(v):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
