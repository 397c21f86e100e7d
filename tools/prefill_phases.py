"""Where a prompt's time goes: the engine's phase timers over one prefill, in ms for the prompt.

Opens the model (kernels warmed up as the CLI does), prefills a different random
prompt first so that the RAM slots and the compiled kernels are as a chat
leaves them, then prefills `--prompt-tokens` random tokens `--rounds` times and
prints each round's tok/s and its phases (attention, deltanet, router, fetch,
compute = the routed experts, shared, lm_head, other), and the round with the
median total as JSON with --json.

    python tools/prefill_phases.py --model DIR [--prompt-tokens 128] [--rounds 3] [--cache N] [--cold] [--json]

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
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache", type=int, default=None, help="RAM slots per layer (default: every expert)")
    p.add_argument("--cold", action="store_true", help="empty the RAM slots before each round")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    engine = EngineOptions(model=args.model, cache=args.cache).open(with_tokenizer=False)
    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size
    engine.prefill(rng.integers(0, vocab, args.prompt_tokens))
    rows = []
    for _ in range(args.rounds):
        ids = rng.integers(0, vocab, args.prompt_tokens)
        if args.cold:
            engine.cold_start()
        before = dict(engine.timers)
        t0 = time.perf_counter()
        engine.prefill(ids)
        total = time.perf_counter() - t0
        ms = {k: round(1000.0 * (engine.timers.get(k, 0.0) - before.get(k, 0.0)), 1) for k in TIMER_NAMES}
        rows.append({"tok_s": round(args.prompt_tokens / total, 1), "total_ms": round(1000.0 * total, 1), **ms})
        if not args.json:
            print("  ".join(f"{k}={v}" for k, v in rows[-1].items() if v))
    median = sorted(rows, key=lambda r: r["total_ms"])[len(rows) // 2]
    if args.json:
        print(json.dumps({"model": args.model, "prompt_tokens": args.prompt_tokens, **median}))


if __name__ == "__main__":
    main()
