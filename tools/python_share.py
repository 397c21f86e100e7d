#!/usr/bin/env python3
"""How much of a decoded token is Python between the compiled calls.

Why: a decode token is a handful of compiled calls per layer with Python
between them (routing records, the store's checks and lock, timers, the
next call's operands). Each call streams megabytes of weights through the
caches, so the Python after it runs with cold caches and costs several
times what it costs on a small model (the first numpy call after a 40 MB
stream took about 7 us instead of 0.9 on the Zen 4 of 2026-12-07). The
phase timers cannot show this: most of it falls inside them or in "other".

This wraps every compiled entry point (numba dispatcher) the engine's
modules call from Python with a clock, decodes greedily, and prints per
token the wall time, the time inside those calls, and the rest. The wrapper
itself costs well under a microsecond a call (about 15 calls a token).

    .venv/bin/python tools/python_share.py --model DIR [--tokens 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import time

import numpy as np
from numba.core.registry import CPUDispatcher

import tierlab.engine as engine_pkg
from tierlab.engine.options import EngineOptions

_inside = [0.0]


def _clocked(kernel):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return kernel(*args, **kwargs)
        finally:
            _inside[0] += time.perf_counter() - t0
    return call


def clock_entry_points() -> int:
    """Replace every numba dispatcher bound at module level in the engine's packages by a
    clocked wrapper (compiled callers keep calling the compiled function directly)."""
    count = 0
    for package in (engine_pkg, importlib.import_module("tierlab.engine.kernels"),
                    importlib.import_module("tierlab.engine.models")):
        for info in pkgutil.iter_modules(package.__path__):
            if info.ispkg:
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for name, value in list(vars(module).items()):
                if isinstance(value, CPUDispatcher):
                    setattr(module, name, _clocked(value))
                    count += 1
    return count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    engine = EngineOptions(model=a.model).open(with_tokenizer=False)
    clock_entry_points()  # after loading: the warm-up compiles through the plain dispatchers
    try:
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, engine.config.vocab_size, 16)]
        logits = engine.prefill(prompt)
        for _ in range(16):  # warm: the prompt's experts in their slots, every kernel called once
            logits = engine.step(int(np.argmax(logits)))
        print(f"{a.model}: {a.tokens} greedy tokens a round, per token")
        for r in range(a.rounds):
            _inside[0] = 0.0
            t0 = time.perf_counter()
            for _ in range(a.tokens):
                logits = engine.step(int(np.argmax(logits)))
            wall = (time.perf_counter() - t0) / a.tokens * 1e6
            inside = _inside[0] / a.tokens * 1e6
            print(f"round {r + 1}: wall {wall:.0f} us, in compiled calls {inside:.0f} us, "
                  f"Python around them {wall - inside:.0f} us ({100 * (wall - inside) / wall:.1f}%)")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
