"""Where a prompt's time goes: the engine's phase timers over one prefill, in ms for the prompt.

Opens the model (kernels warmed up as the CLI does); for each prompt length in
`--prompt-tokens` (one or more, comma-separated) prefills a different random
prompt first so that the RAM slots and the compiled kernels are as a chat
leaves them, then prefills that many random tokens `--rounds` times and prints
each round's tok/s, wall ms, the process's CPU ms over the prefill (all
threads: on a loaded machine a steadier measure of the work than wall time)
and its phases (attention, deltanet, router, fetch, compute = the routed
experts, shared, lm_head, other), and with --json the round with the median
total per length, one JSON line each.

    python tools/prefill_phases.py --model DIR [--prompt-tokens 128,512] [--rounds 3] [--cache N] [--cold] [--json]

--cache sets the RAM slots per layer (default every expert, as the CLI); --cold
empties the slots before each round, so each prompt reads its experts.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from tierlab.engine.model import TIMER_NAMES
from tierlab.engine.options import EngineOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", default="128", help="one or more lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache", type=int, default=None, help="RAM slots per layer (default: every expert)")
    p.add_argument("--cold", action="store_true", help="empty the RAM slots before each round")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    engine = EngineOptions(model=args.model, cache=args.cache).open(with_tokenizer=False)
    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size
    for n in lengths:
        engine.prefill(rng.integers(0, vocab, n))
        rows = []
        for _ in range(args.rounds):
            ids = rng.integers(0, vocab, n)
            if args.cold:
                engine.cold_start()
            before = dict(engine.timers)
            c0 = time.process_time()
            t0 = time.perf_counter()
            engine.prefill(ids)
            total = time.perf_counter() - t0
            cpu = time.process_time() - c0
            ms = {k: round(1000.0 * (engine.timers.get(k, 0.0) - before.get(k, 0.0)), 1) for k in TIMER_NAMES}
            rows.append({"prompt_tokens": n, "tok_s": round(n / total, 1), "total_ms": round(1000.0 * total, 1),
                         "cpu_ms": round(1000.0 * cpu, 1), **ms})
            if not args.json:
                print("  ".join(f"{k}={v}" for k, v in rows[-1].items() if v))
        median = sorted(rows, key=lambda r: r["total_ms"])[len(rows) // 2]
        if args.json:
            print(json.dumps({"model": args.model, **median}))


if __name__ == "__main__":
    main()
