"""What the load follower's bookkeeping costs decode, in one process: follower on against off.

The default pool and "libgomp's spin with the threads fixed" differ only in the load follower
(engine/load_follow.py): a reading of /proc/stat every SAMPLE_S and one `numba.set_num_threads`
per change. Between fresh processes this VM's decode moves by 20% or more, so the two are
compared here in one process, rounds alternating (on, off; then off, on), each round a new
16-token prompt and `--tokens` greedy steps; prints each round's tok/s and the medians.

    TIERLAB_FOLLOW_LOAD unset: .venv/bin/python tools/follower_cost.py --model DIR [--rounds 8] [--tokens 48]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tierlab.engine.options import EngineOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    engine = EngineOptions(model=args.model).open(with_tokenizer=False)
    if not engine.threads.enabled:
        raise SystemExit("follower_cost: the load follower is off here (a threading setting or "
                         "TIERLAB_FOLLOW_LOAD=0 in the environment); run with tierlab's default")
    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size

    def decode(n: int) -> float:
        token = int(np.argmax(engine.prefill(rng.integers(0, vocab, 16))))
        t0 = time.perf_counter()
        for _ in range(n):
            token = int(np.argmax(engine.step(token)))
        return n / (time.perf_counter() - t0)

    decode(8)
    got: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for which in ("on", "off") if r % 2 == 0 else ("off", "on"):
            engine.threads.enabled = which == "on"
            got[which].append(decode(args.tokens))
    engine.threads.enabled = True
    for which, values in got.items():
        print(f"follower {which}: " + " ".join(f"{v:.1f}" for v in values)
              + f" | median {float(np.median(values)):.1f} tok/s")


if __name__ == "__main__":
    main()
