"""Kernel warm-up: every numba kernel a session can reach is compiled while the model loads.

Why: numba compiles a kernel the first time it meets a new combination of
argument types, and a compile takes up to a second per kernel. Left to the
session, that is a first reply stuck on `…` and a stall the first time a
lever is moved mid-reply. Compiled here, during loading, with progress on
screen, and cached on disk (`cache=True` on every kernel), a session never
compiles.

How: a scratch twin of the loaded engine (`Engine.scratch_twin`: the same
weights, layers and expert source; its own sequence state, RAM cache,
router, prefetcher and meters) runs short real passes through one layer of
each kind, once per path a session can take: a prompt with all logits
(evaluation), a prompt through a RAM cache smaller than the expert count
(its experts streamed through scratch buffers, the prompt long enough that
some expert runs the matrix-matrix kernels), a prompt with PREFILL_EXACT's
kernels, decode, each routing strategy, the agreement meters, and PILOT's
prefetch. Because the twin passes the engine's own arrays
through the engine's own code, numba meets exactly the argument types the
session will give it; a GPU tier's CPU fallback runs the RAM path's
kernels. The loaded engine is not touched: its logits, caches, counters and
knobs are as if no warm-up had run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tierlab.engine.kernels.experts_tokens import few_token_limit
from tierlab.engine.knobs import Knobs
from tierlab.engine.qlinear import QuantMatrix, RowStack

#: progress(done, total, label, compiled): after each step, and once before the first (done = 0)
Progress = Callable[[int, int, str, int], None]


@dataclass(frozen=True)
class Step:
    """One warm-up pass: a label for the progress line, the twin's RAM slots and its knobs."""

    label: str
    slots: str  # "all" (every expert in RAM) or "top_k" (evictions, scratch buffers)
    knobs: dict = field(default_factory=dict)
    all_logits: bool = False
    wide_experts: bool = False  # a prompt long enough that some expert gets more tokens than the one-token kernel takes


STEPS = (
    Step("prompt and decode", "all", all_logits=True),
    Step("prompt, small cache", "top_k", wide_experts=True),
    Step("prompt exact", "all", {"PREFILL_EXACT": "1"}),
    Step("routing maxrank", "top_k", {"CACHE_ROUTE": "1", "ROUTE_MODE": "maxrank", "ROUTE_ALPHA": "0.5"}),
    Step("routing cumprob", "top_k", {"CACHE_ROUTE": "1", "ROUTE_MODE": "cumprob", "ROUTE_P": "0.5"}),
    Step("routing prior", "top_k", {"CACHE_ROUTE": "1", "ROUTE_MODE": "prior"}),
    Step("agreement meters", "top_k", {"ROUTE_AGREE": "1"}),
    Step("prefetch", "top_k", {"PILOT": "3"}),
)


@dataclass
class WarmupReport:
    steps: int
    compiled: int  # kernel specialisations numba compiled (0: all came from the on-disk cache)
    seconds: float


def representative_layers(engine) -> list[int]:
    """The first layer of each distinct kind: mixer, MLP and the storage types of their weights
    (dtype, dimensions, layout, writability), which is what numba specialises on."""
    seen: dict[tuple, int] = {}
    for layer in engine.layers:
        key = (layer.kind, type(layer.mlp).__name__, _describe(layer.mixer), _describe(layer.mlp))
        seen.setdefault(key, layer.index)
    return sorted(seen.values())


def _describe(value, depth: int = 0):
    """The numba-relevant shape of a weight container: array storage types, recursively."""
    if isinstance(value, np.ndarray):
        return ("a", value.dtype.str, value.ndim, value.flags.c_contiguous, value.flags.writeable)
    if isinstance(value, QuantMatrix):
        return ("q", value.bits, _describe(value.q), _describe(value.scales))
    if isinstance(value, RowStack):
        return ("r", tuple(_describe(p, depth + 1) for p in value.parts))
    if depth < 2 and type(value).__module__.startswith("tierlab.engine.") and hasattr(value, "__dict__"):
        return (type(value).__name__,
                tuple((k, _describe(v, depth + 1)) for k, v in sorted(vars(value).items()) if k != "cfg"))
    return type(value).__name__


class _CompileCounter:
    """Counts the kernel specialisations numba compiles (cache loads are not compiles) and
    calls `on_compiled` after each, so progress moves during a long step too."""

    def __init__(self, on_compiled: Callable[[int], None] | None = None) -> None:
        self.count = 0
        self.on_compiled = on_compiled

    def __enter__(self):
        from numba.core import event

        counter = self

        class Listener(event.Listener):
            def on_start(self, ev) -> None:
                pass

            def on_end(self, ev) -> None:
                counter.count += 1
                if counter.on_compiled is not None:
                    counter.on_compiled(counter.count)

        self._listener = Listener()
        event.register("numba:compile", self._listener)
        return self

    def __exit__(self, *exc) -> None:
        from numba.core import event

        event.unregister("numba:compile", self._listener)


def warm_up(engine, progress: Progress | None = None) -> WarmupReport:
    """Run every step on a scratch twin of `engine`; `engine` itself is left as it was."""
    cfg = engine.config
    layers = representative_layers(engine)
    ids = [i % cfg.vocab_size for i in (1, 2)]
    # more (token, expert) pairs than few_token_limit per expert, so some expert takes the
    # matrix kernels; one token repeated routes to few experts, so the step reads few
    few = few_token_limit(engine.store_stats().expert_kind, cfg.hidden_size, cfg.moe_inter)
    wide_ids = ids[:1] * (few * cfg.n_experts // cfg.top_k + 1)
    total = len(STEPS)
    t0 = time.perf_counter()
    at = [0]  # the step under way, for progress during its compiles

    def compiled_one(count: int) -> None:
        if progress is not None:
            progress(at[0], total, STEPS[at[0]].label, count)

    with _CompileCounter(compiled_one) as compiled:
        if progress is not None:
            progress(0, total, STEPS[0].label, 0)
        for done, step in enumerate(STEPS, start=1):
            at[0] = done - 1
            slots = cfg.n_experts if step.slots == "all" else cfg.top_k
            twin = engine.scratch_twin(layers, slots, Knobs.from_env({}, **step.knobs))
            twin.subscribe(_ignore)  # listeners ask for residency levels, as the app's do
            try:
                logits = twin.prefill(wide_ids if step.wide_experts else ids, all_logits=step.all_logits)
                twin.step(int(np.argmax(logits[-1] if logits.ndim == 2 else logits)))
                twin.step(ids[0])
            finally:
                twin.close_twin()
            if progress is not None:
                label = STEPS[done].label if done < total else "ready"
                progress(done, total, label, compiled.count)
    return WarmupReport(total, compiled.count, time.perf_counter() - t0)


def _ignore(event) -> None:
    pass


def kernels() -> dict:
    """Every numba kernel (dispatcher) defined at the top of a loaded tierlab module, by name."""
    import sys

    from numba.core.dispatcher import Dispatcher

    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("tierlab.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, Dispatcher) and value.__module__ == name:
                found[f"{name}.{attr}"] = value
    return found


def kernel_signatures() -> dict[str, set[str]]:
    """Every kernel of `kernels()` and the argument types it is compiled for: a session after
    the warm-up adds none (tests/test_warmup.py)."""
    return {name: {str(sig) for sig in kernel.signatures} for name, kernel in kernels().items()}


def new_signatures(before: dict[str, set[str]], after: dict[str, set[str]]) -> dict[str, list[str]]:
    """The specialisations in `after` that `before` lacks, kernel by kernel."""
    return {k: sorted(v - before.get(k, set())) for k, v in after.items() if v - before.get(k, set())}
