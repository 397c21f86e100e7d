#!/usr/bin/env python3
"""Decode and prefill speed under each thread-pool policy, quiet and with a competing process.

Decides tierlab's default threading (engine/threading_layer.py); the table in
docs/engine.md, "Threads", is what this prints. Each cell is the median of
`tierlab bench decode --json` runs in fresh processes, interleaved across
policies so that drift in the machine's load hits all of them alike.

    .venv/bin/python tools/threading_bench.py --model DIR [--rounds 3] [--tokens 64]

"loaded" runs one CPU-bound Python process beside each measurement, the
situation of a compile or a second program on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

#: name -> environment overrides; "tierlab default" sets nothing.
POLICIES = {
    "tierlab default": {},
    "tbb (the default before)": {"NUMBA_THREADING_LAYER": "tbb"},
    "omp PASSIVE, spin 1000 (old default)": {"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},
    "omp, libgomp default spin (300000), threads fixed": {"NUMBA_THREADING_LAYER": "omp", "GOMP_SPINCOUNT": "300000"},
    "omp ACTIVE, spin infinite": {"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "infinite"},
}
_CLEARED = ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TIERLAB_THREADING")


def run_once(model: str, tokens: int, overrides: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(overrides)
    cmd = [sys.executable, "-m", "tierlab", "bench", "decode", "--model", model,
           "--tokens", str(tokens), "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    rows = {(name, cond): [] for name in POLICIES for cond in ("quiet", "loaded")}
    run_once(a.model, 4, {})  # compile once
    for cond in ("quiet", "loaded"):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if cond == "loaded" else None
        try:
            for r in range(a.rounds):
                for name, env in POLICIES.items():
                    d = run_once(a.model, a.tokens, env)
                    rows[(name, cond)].append((d["decode_tok_s"], d["prefill_tok_s"]))
                    print(f"  {cond} round {r + 1} {name}: decode {d['decode_tok_s']:.1f}", file=sys.stderr)
        finally:
            if hog:
                hog.kill()
    print(f"model {a.model}, {a.tokens} decode tokens, {a.rounds} rounds, median tok/s (decode / prefill)")
    print("| policy | quiet decode | quiet prefill | loaded decode | loaded prefill |")
    print("|---|---|---|---|---|")
    for name in POLICIES:
        cells = []
        for cond in ("quiet", "loaded"):
            vals = rows[(name, cond)]
            cells += [f"{statistics.median(v[0] for v in vals):.1f}", f"{statistics.median(v[1] for v in vals):.1f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
