#!/usr/bin/env python3
"""Decode and prefill speed under each thread-pool policy, quiet and with a competing process.

Decides tierlab's default threading (engine/threading_layer.py); the table in
docs/engine.md, "Threads", is what this prints. Each cell is the median of
`tierlab bench decode --json` runs in fresh processes, interleaved across
policies so that drift in the machine's load hits all of them alike, each
round in its own shuffled order (seeded by the round's number), so that no
policy always runs first or right after the same one.

    .venv/bin/python tools/threading_bench.py --model DIR [--rounds 3] [--tokens 64]
        [--prompt-tokens 32] [--policies default,active,...] [--conditions quiet,loaded]
        [--tree LABEL=DIR ...]

Below the table it prints how far the default is from the best fixed policy
in each column (the issue's "within 5%" quiet, "no worse than PASSIVE"
loaded). Single runs on a shared VM move by 10% or more, so that gap means
something only over many rounds. The "decode share" columns are each run's
`roofline_share` (its tokens against the stream read between their chunks):
on a VM whose memory bandwidth moves from one minute to the next, a policy
that happened to run in a fast stretch reads fast in tok/s but not in share,
so the share's gap line is the one that decides.

"loaded" runs one CPU-bound Python process beside each measurement, the
situation of a compile or a second program on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

#: short key -> (row name, environment overrides); "default" sets nothing.
POLICIES = {
    "default": ("tierlab default", {}),
    "tbb": ("tbb (the default before)", {"NUMBA_THREADING_LAYER": "tbb"}),
    "passive": ("omp PASSIVE, spin 1000 (old default)", {"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}),
    "spin300k": ("omp, libgomp default spin (300000), threads fixed", {"NUMBA_THREADING_LAYER": "omp", "GOMP_SPINCOUNT": "300000"}),
    "spininf": ("omp, spin infinite, threads fixed", {"NUMBA_THREADING_LAYER": "omp", "GOMP_SPINCOUNT": "infinite"}),
    "active": ("omp ACTIVE, spin infinite", {"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "infinite"}),
}
_DEFAULT_SET = "default,tbb,passive,spin300k,active"
_CLEARED = ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TIERLAB_THREADING")


def run_once(model: str, tokens: int, prompt_tokens: int, overrides: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(overrides)
    cmd = [sys.executable, "-m", "tierlab", "bench", "decode", "--model", model,
           "--tokens", str(tokens), "--prompt-tokens", str(prompt_tokens), "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


#: what each run gives, in the order the rows keep it: (column name, JSON key)
COLUMNS = (("decode", "decode_tok_s"), ("prefill", "prefill_tok_s"), ("decode share", "roofline_share"))


def _follower_state(run: dict) -> str:
    """The load follower's state at the run's end, from its threading line (" (2 of 2 now,
    0 changes)"), or "" where the threads did not follow the load."""
    return run.get("threading", "").partition("threads follow the load")[2]


def medians(rows: dict) -> dict:
    """(policy, condition) -> the medians of the runs' COLUMNS (tok/s, tok/s, share)."""
    return {key: tuple(statistics.median(v[i] for v in vals) for i in range(len(COLUMNS)))
            for key, vals in rows.items()}


def _figure(value: float, idx: int) -> str:
    return f"{100 * value:.1f}%" if COLUMNS[idx][0] == "decode share" else f"{value:.1f}"


def gap_lines(med: dict, keys: list, conds: list) -> list:
    """How far the default's median is behind the best fixed policy, per column (another
    tree's default is no fixed policy: it is only printed)."""
    out = []
    fixed = [k for k in keys if k != "default" and k in POLICIES]
    if "default" not in keys or not fixed:
        return out
    for cond in conds:
        for idx, (what, _) in enumerate(COLUMNS):
            col = {k: med[(k, cond)][idx] for k in keys}
            best = max(fixed, key=col.get)
            gap = 100.0 * (col["default"] / col[best] - 1.0)
            line = (f"{cond} {what}: default {_figure(col['default'], idx)}, best fixed {POLICIES[best][0]} "
                    f"{_figure(col[best], idx)} ({gap:+.1f}%)")
            if "passive" in keys:
                line += f"; PASSIVE {_figure(col['passive'], idx)}"
            for tree in (k for k in keys if k not in POLICIES):
                line += f"; tree {tree} {_figure(col[tree], idx)}"
            out.append(line)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--policies", default=_DEFAULT_SET, help=f"comma-separated, of {','.join(POLICIES)}")
    p.add_argument("--conditions", default="quiet,loaded")
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                   help="also run the default of another tree of tierlab, interleaved with the policies: DIR holds "
                        "its package as DIR/tierlab (`git archive REV --prefix=tierlab/ | tar x -C DIR`) and gets "
                        "its own numba cache in DIR/.numba_cache")
    a = p.parse_args()
    keys = [k.strip() for k in a.policies.split(",") if k.strip()]
    conds = [c.strip() for c in a.conditions.split(",") if c.strip()]
    bad = [k for k in keys if k not in POLICIES] + [c for c in conds if c not in ("quiet", "loaded")]
    if bad:
        p.error(f"unknown policy or condition: {', '.join(bad)}")
    policies = dict(POLICIES)
    for spec in a.tree:
        label, _, tree = spec.partition("=")
        if not label or not os.path.isdir(os.path.join(tree, "tierlab")):
            p.error(f"--tree {spec}: want LABEL=DIR with DIR/tierlab a tree of the package")
        policies[label] = (f"tierlab default, tree {label}",
                           {"PYTHONPATH": tree, "NUMBA_CACHE_DIR": os.path.join(tree, ".numba_cache")})
        keys.append(label)
    rows = {(k, cond): [] for k in keys for cond in conds}
    run_once(a.model, 4, 4, {})  # compile once
    for label in a.tree:
        run_once(a.model, 4, 4, policies[label.partition("=")[0]][1])
    for cond in conds:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if cond == "loaded" else None
        try:
            for r in range(a.rounds):
                # each round in its own order (seeded, so a run can be repeated): no policy
                # always runs first, or always right after the same one
                for k in random.Random(r).sample(keys, len(keys)):
                    d = run_once(a.model, a.tokens, a.prompt_tokens, policies[k][1])
                    rows[(k, cond)].append(tuple(float(d[key]) for _, key in COLUMNS))
                    print(f"  {cond} round {r + 1} {k}: decode {d['decode_tok_s']:.1f} prefill {d['prefill_tok_s']:.1f} "
                          f"share {100 * d['roofline_share']:.1f}% stream {d['bandwidth_gbs']:.1f} GB/s"
                          f"{_follower_state(d)}", file=sys.stderr)
        finally:
            if hog:
                hog.kill()
    print(f"model {a.model}, {a.prompt_tokens}-token prompt, {a.tokens} decode tokens, {a.rounds} rounds, "
          "medians (tok/s; decode share: of the roofline at the stream read between its chunks)")
    print("| policy | " + " | ".join(f"{c} {what}" for c in conds for what, _ in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS) * len(conds))
    med = medians(rows)
    for k in keys:
        cells = [_figure(v, i) for cond in conds for i, v in enumerate(med[(k, cond)])]
        print(f"| {policies[k][0]} | " + " | ".join(cells) + " |")
    for line in gap_lines(med, keys, conds):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
