"""Record the greedy ids of the shipped models with the routing lever off (tests/data/lever_off_ids.json).

The file pins what the engine decodes, so that later changes are checked against
ids written before them rather than against a second run of the same code.
Usage: PYTHONPATH=<parent of the repository> python tests/record_lever_off_ids.py
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from tierlab.app.lab.evaluate import greedy_decode
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine
from tierlab.engine.tiering import TierOptions

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).with_name("data") / "lever_off_ids.json"
N = 64
#: shipped model -> RAM cache sizes (slots per layer; null = every expert resident)
CACHES = {"tiny-moe": [4, 8, 16, None], "tiny-moe-8x2": [2, 3, 5, None]}


def lever_off_ids(folder: Path, prompt: list[int], cache: int | None, n: int = N) -> list[int]:
    """Greedy ids with CACHE_ROUTE off, no GPU tier, no prefetch."""
    engine = load_engine(folder, cache_slots=cache, knobs=Knobs.from_env({}, CACHE_ROUTE="0"),
                         tier=TierOptions(enabled=False))
    try:
        ids, _ = greedy_decode(engine, prompt, n)
    finally:
        engine.close()
    return ids


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    models = {}
    for name, caches in CACHES.items():
        folder = REPO / "assets" / name
        prompt = json.loads((folder / "ref.json").read_text())["prompt_ids"]
        models[name] = {"prompt_ids": prompt, "n": N,
                        "ids": {str(c): lever_off_ids(folder, prompt, c) for c in caches}}
    record = {"how": f"PYTHONPATH=<parent of the repository> python tests/record_lever_off_ids.py (at {commit})",
              "models": models}
    text = json.dumps(record, indent=1)
    OUT.write_text(re.sub(r"\[[^\[\]{}]*\]", lambda m: json.dumps(json.loads(m.group(0))), text) + "\n")


if __name__ == "__main__":
    main()
