#!/usr/bin/env python3
"""How much of a warm decoded token runs outside the compiled kernels, and where.

Why: every numba function (the matvecs, the experts' launches, the DeltaNet
recurrence, norms, routing, the store's claims) is wrapped to time its calls;
what is left of the token is Python between them. The gaps are booked by the
pair of calls around them (a `_pass` by its matrix's rows), so each names the
Python it holds: e.g. `route_rows -> claim_resident` is the routing record and
the store's checks before its claims. The wrappers add about a microsecond per
call, so the "outside" figure is a little high.

    .venv/bin/python tools/decode_gaps.py --model DIR [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import collections
import importlib
import pkgutil
import time

from numba.core.registry import CPUDispatcher

import tierlab.engine as engine_package
from decode_calls import decode_arguments, timed_warm_decode  # tools/ is on sys.path when a tool runs

_SPENT: dict[str, float] = collections.defaultdict(float)
_CALLS: collections.Counter = collections.Counter()
_GAPS: dict[tuple[str, str], float] = collections.defaultdict(float)
_GAP_COUNT: collections.Counter = collections.Counter()
_LAST = ["start", 0.0]
_INSTRUMENTED: list[bool] = []


def _wrapped(dispatcher, cache: dict):
    """One timing wrapper per compiled function (shared by every module that imported it)."""
    if id(dispatcher) in cache:
        return cache[id(dispatcher)]
    base = dispatcher.py_func.__name__

    def call(*args, **kwargs):
        name = f"{base}[{args[0].shape[0]}]" if base == "_pass" else base
        t0 = time.perf_counter()
        pair = (_LAST[0], name)
        _GAPS[pair] += t0 - _LAST[1]
        _GAP_COUNT[pair] += 1
        try:
            return dispatcher(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            _SPENT[name] += t1 - t0
            _CALLS[name] += 1
            _LAST[0], _LAST[1] = name, t1

    cache[id(dispatcher)] = call
    return call


def instrument() -> None:
    """Replace every numba dispatcher in the engine's modules by its timing wrapper."""
    cache: dict = {}
    for info in pkgutil.walk_packages(engine_package.__path__, "tierlab.engine."):
        module = importlib.import_module(info.name)
        for attr, value in list(vars(module).items()):
            if isinstance(value, CPUDispatcher):
                setattr(module, attr, _wrapped(value, cache))


def main() -> int:
    a = decode_arguments(__doc__.splitlines()[0], rounds=3)

    def empty_tallies() -> None:
        # wrapped only once the engine's warm-up and the first prompt have compiled every
        # kernel: a kernel compiled later would see a wrapper where its callee should be
        if not _INSTRUMENTED:
            instrument()
            _INSTRUMENTED.append(True)
        for table in (_SPENT, _CALLS, _GAPS, _GAP_COUNT):
            table.clear()
        _LAST[0], _LAST[1] = "start", time.perf_counter()

    wall = timed_warm_decode(a.model, a.tokens, a.rounds, empty_tallies)
    n = a.tokens
    inside = sum(_SPENT.values())
    print(f"model {a.model}: {1e3 * wall / n:.3f} ms a token, {1e3 * inside / n:.3f} ms in "
          f"{sum(_CALLS.values()) / n:.0f} compiled calls, {1e3 * (wall - inside) / n:.3f} ms outside them")
    print("| compiled function | calls/token | us/token | us/call |")
    print("|---|---|---|---|")
    for name, spent in sorted(_SPENT.items(), key=lambda kv: -kv[1])[:14]:
        print(f"| {name} | {_CALLS[name] / n:.1f} | {1e6 * spent / n:.1f} | {1e6 * spent / _CALLS[name]:.1f} |")
    print()
    print("| Python between (previous call -> next call) | gaps/token | us/token | us/gap |")
    print("|---|---|---|---|")
    for pair, spent in sorted(_GAPS.items(), key=lambda kv: -kv[1])[:14]:
        print(f"| {pair[0]} -> {pair[1]} | {_GAP_COUNT[pair] / n:.1f} | {1e6 * spent / n:.1f} | "
              f"{1e6 * spent / _GAP_COUNT[pair]:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
