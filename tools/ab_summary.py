#!/usr/bin/env python3
"""Per-round decode tok/s and one phase's ms/token from `tools/decode_ab.sh` output, with medians.

    WARM=1 TOKENS=128 PROMPT_TOKENS=16 tools/decode_ab.sh /tmp/v/before MODEL 6 | tools/ab_summary.py --phase deltanet
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", default="deltanet", help="a key of bench decode's ms_per_token")
    a = p.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for line in sys.stdin:
        tag, _, payload = line.strip().partition(" ")
        if tag not in runs or not payload.strip():
            continue
        report = json.loads(payload)
        runs[tag].append((report["decode_tok_s"], report["ms_per_token"].get(a.phase, 0.0)))
    for tag, values in runs.items():
        if not values:
            continue
        rates = " ".join(f"{r:.1f}" for r, _ in values)
        phases = " ".join(f"{m:.2f}" for _, m in values)
        print(f"{tag:<6} decode tok/s {rates} (median {statistics.median(r for r, _ in values):.1f}); "
              f"{a.phase} ms/token {phases} (median {statistics.median(m for _, m in values):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
