"""How many kernel calls one decode token makes, and how many of them are parallel launches.

Each parallel numba function call wakes the thread pool and waits for its
slowest thread, so the count per token is a cost of its own next to the
bytes read. This decodes a few greedy tokens under cProfile and counts the
calls of every numba kernel of the engine per token, marking the parallel
ones.

    python tools/launch_count.py [--model DIR] [--tokens 16]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pkgutil
import pstats
from pathlib import Path

import numpy as np
from numba.core.registry import CPUDispatcher

import tierlab.engine as engine_pkg
from tierlab.engine.options import EngineOptions


def engine_kernels() -> dict[tuple[str, str], bool]:
    """(source file, function name) -> parallel, for every numba kernel in the engine's modules."""
    kernels = {}
    for info in pkgutil.walk_packages(engine_pkg.__path__, engine_pkg.__name__ + "."):
        if ".tiers" in info.name:
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, CPUDispatcher):
                code = value.py_func.__code__
                kernels[(code.co_filename, code.co_name)] = bool(value.targetoptions.get("parallel"))
    return kernels


def count_calls(model: Path, tokens: int) -> tuple[dict[str, float], dict[str, bool]]:
    """Calls per decode token of each engine kernel (name -> calls), and which are parallel."""
    engine = EngineOptions(model=model).open(with_tokenizer=False)
    rng = np.random.default_rng(0)
    logits = engine.prefill([int(t) for t in rng.integers(0, engine.config.vocab_size, 16)])
    logits = engine.step(int(np.argmax(logits)))  # every decode kernel compiled and warm
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(tokens):
        logits = engine.step(int(np.argmax(logits)))
    profile.disable()
    kernels = engine_kernels()
    calls: dict[str, float] = {}
    parallel: dict[str, bool] = {}
    for (filename, _, name), row in pstats.Stats(profile).stats.items():
        if (filename, name) in kernels:
            key = f"{Path(filename).stem}.{name}"
            calls[key] = calls.get(key, 0.0) + row[1] / tokens  # row[1]: primitive calls
            parallel[key] = kernels[(filename, name)]
    return calls, parallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=EngineOptions().model)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    calls, parallel = count_calls(args.model, args.tokens)
    for key in sorted(calls, key=lambda k: (-parallel[k], -calls[k])):
        print(f"{calls[key]:7.1f}  {'parallel' if parallel[key] else 'serial  '}  {key}")
    print(f"per decode token: {sum(v for k, v in calls.items() if parallel[k]):.1f} parallel launches, "
          f"{sum(v for k, v in calls.items() if not parallel[k]):.1f} serial kernel calls")


if __name__ == "__main__":
    main()
