#!/usr/bin/env python3
"""Wall time per call of each weight matrix and engine step in warm greedy decode, in situ.

Why: `bench decode`'s phases say which part of a layer is slow; a kernel benchmark
says what a kernel does alone, from DRAM, with nothing else in the caches. This
times every call inside real decode steps (each `linear` by its weight's kind and
shape, the DeltaNet and attention layers with their MoE router block, each one call
in decode, a layer's routed experts in one call, routing records, norms and the
per-token meters), so each can be set against
the bytes it reads: a 1 MiB matrix that takes three times its memory time is
launch and Python overhead, not bandwidth. The wrappers add about a microsecond
per call, so the figures are a little high for the cheapest calls.

    .venv/bin/python tools/decode_calls.py --model DIR [--tokens 128] [--rounds 4]
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

import tierlab.engine.expert_store as expert_store
import tierlab.engine.kernels.dense as dense
import tierlab.engine.kernels.qmatvec as qmatvec
import tierlab.engine.model as model
import tierlab.engine.models.attention as attention
import tierlab.engine.models.deltanet as deltanet
import tierlab.engine.moe as moe
from tierlab.engine.options import EngineOptions

_TOTALS: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])


def _book(label: str, seconds: float) -> None:
    entry = _TOTALS[label]
    entry[0] += 1
    entry[1] += seconds


def _timed(fn, label):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _book(label(*args) if callable(label) else label, time.perf_counter() - t0)
    return call


def _weight_label(w, _x=None) -> str:
    """`linear`'s weight as kind and shape; a RowStack as its parts."""
    parts = getattr(w, "parts", [w])
    return "linear " + " + ".join(
        f"{'int%d' % p.bits if hasattr(p, 'bits') else p.dtype} {p.shape[0]}x{p.shape[1]}" for p in parts)


def instrument() -> None:
    """Wrap the engine's calls (module attributes, so every caller's lookup finds the wrapper)."""
    timed_linear = _timed(dense.linear, _weight_label)
    for module in (moe, deltanet, attention, model):
        module.linear = timed_linear
    deltanet.gated_deltanet = _timed(deltanet.gated_deltanet, "DeltaNet recurrence (gated_deltanet)")
    # decode's one-call layers (a prompt's calls above): engine/kernels/*_step.py; a MoE layer's
    # router block runs inside them (the "router" phase of `bench decode` gives its share)
    deltanet.deltanet_step = _timed(deltanet.deltanet_step, "DeltaNet layer + router block, one call (deltanet_step)")
    attention.attention_step = _timed(attention.attention_step,
                                      "attention layer + router block, one call (attention_step)")
    moe.RouterCall.run = _timed(moe.RouterCall.run, "router block alone, one call (RouterCall.run)")
    moe.shared_expert_step = _timed(moe.shared_expert_step, "shared expert, one call (shared_expert_step)")
    model.rmsnorm = _timed(model.rmsnorm, "rmsnorm (layer norms)")
    expert_store.add_weighted = _timed(expert_store.add_weighted, "experts' weighted sum (add_weighted)")
    kernel = qmatvec._experts
    modes = {qmatvec.GATE_UP: "routed experts gate|up launch", qmatvec.ADD: "routed experts down launch"}
    qmatvec._experts = _timed(kernel, lambda *a: modes.get(a[9], "routed experts launch"))
    store = expert_store.ExpertStore
    store.compute_weighted = _timed(store.compute_weighted,
                                    "store.compute_weighted (a layer's experts: claims, launches, release, sum)")
    moe.MoEBlock.route = _timed(moe.MoEBlock.route, "routing record (MoEBlock.route)")
    moe.MoEBlock._plain_route = _timed(moe.MoEBlock._plain_route, "stock routing record (MoEBlock._plain_route)")
    model.Engine._publish = _timed(model.Engine._publish, "per-token meters (_publish)")
    model.Engine._count_routes = _timed(model.Engine._count_routes, "heat counts (_count_routes)")


def timed_warm_decode(model: str, tokens: int, rounds: int, before_timed) -> float:
    """Seconds of the last of `rounds` greedy decodes of `tokens` tokens, each after a fresh
    16-token random prompt and 16 untimed steps (the slots warm, as in a chat);
    `before_timed()` runs just before each timed decode (to empty the tallies)."""
    engine = EngineOptions(model=model).open(with_tokenizer=False)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, engine.config.vocab_size, 16)]
    elapsed = 0.0
    for _ in range(rounds):
        engine.reset()
        logits = engine.prefill(prompt)
        for _ in range(16):
            logits = engine.step(int(np.argmax(logits)))
        before_timed()
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = engine.step(int(np.argmax(logits)))
        elapsed = time.perf_counter() - t0
    return elapsed


def decode_arguments(description: str, rounds: int) -> argparse.Namespace:
    """--model, --tokens and --rounds, as `timed_warm_decode` takes them."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=rounds, help="decodes of --tokens; the last one is reported")
    return p.parse_args()


def main() -> int:
    a = decode_arguments(__doc__.splitlines()[0], rounds=4)
    instrument()
    elapsed = timed_warm_decode(a.model, a.tokens, a.rounds, _TOTALS.clear)
    n = a.tokens
    print(f"model {a.model}: {1000 * elapsed / n:.3f} ms/token over {n} warm decode tokens (instrumented)")
    print(f"| {'call':<58} | calls/token | us/call | ms/token |")
    print(f"|{'-' * 60}|---|---|---|")
    for label, (count, seconds) in sorted(_TOTALS.items(), key=lambda kv: -kv[1][1]):
        print(f"| {label:<58} | {count / n:.1f} | {1e6 * seconds / count:.1f} | {1000 * seconds / n:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
