"""The GPU-tier table of docs/routing.md: index-order vs heat-planned residency, then the lever.

    python tools/routing_sweep.py tier [--model assets/tiny-moe] [--tier-gb G]

The fixture, strategy and paper-protocol tables come from `tierlab sweep`
(app/lab/sweep.py, app/lab/protocol.py); this table needs a heat profile
written by a run and a GPU tier per row, which is A/B's job. It runs
`tierlab.app.lab.ab.run_ab` on a reference made from the model's held-out text (prompt = its first 32 tokens, continuation = the next N), and
reports the teacher-forced run: TF-NLL, hit rates and routing meters all come
from feeding real held-out text (a tiny model's greedy continuation loops,
which would flatter every cache). "ids match" is still the greedy decode
against the held-out text. Routing meters are deterministic; no timings are
taken (repeat 0). Prints markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import tierlab
from tierlab.app.lab.ab import run_ab
from tierlab.app.lab.abtable import render_markdown
from tierlab.engine.tokenizer import Tokenizer


def heldout_reference(model: Path, prompt_len: int, n: int) -> tuple[list[int], list[int]]:
    tok = Tokenizer.from_folder(model)
    ids = tok.encode((model / "heldout.txt").read_text(encoding="utf-8"))
    if len(ids) < prompt_len + n:
        raise SystemExit(f"{model}/heldout.txt has only {len(ids)} tokens")
    return ids[:prompt_len], ids[: prompt_len + n]


def tier(args) -> None:
    """The GPU tier's residency: index-order vs heat-planned warmstart, then the lever on top."""
    import tempfile

    from tierlab.engine.config import load_config
    from tierlab.app.lab.evaluate import teacher_forced_nll
    from tierlab.engine.model import load_engine
    from tierlab.engine.tiering import TierOptions

    cfg = load_config(args.model)
    prompt, full = heldout_reference(args.model, 32, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        heat = Path(tmp) / "heat.bin"
        # the profile of one lever-off run on the same text, then read-only: every row plans from the
        # same bytes, and a profile of the very text it is tested on is the best case for a heat plan
        engine = load_engine(args.model, cache_slots=cfg.n_experts, with_tokenizer=False,
                             tier=TierOptions(heat_file=str(heat)))
        teacher_forced_nll(engine, prompt, full)
        engine.close()
        heat.chmod(0o444)
        budget = f"TIER=1 TIER_GB={args.tier_gb}"
        rows = ["off", budget, f"{budget} HEAT_FILE={heat}", f"{budget} HEAT_FILE={heat} CACHE_ROUTE=1",
                f"{budget} HEAT_FILE={heat} CACHE_ROUTE=1 ROUTE_MODE=prior ROUTE_J=1 ROUTE_LAMBDA=0.1"]
        results = run_ab(args.model, prompt, full, rows, repeat=0, default_engine={"CACHE": str(args.cache)},
                         progress=lambda s: print(s, file=sys.stderr))
        table = [r.as_row("teacher_forced") for r in results]
        for row in table:
            row["row"] = row["row"].replace(str(heat), "heat.bin")
    print(render_markdown(table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tier")
    t.add_argument("--model", type=Path, default=tierlab.ASSETS_DIR / "tiny-moe")
    t.add_argument("--cache", type=int, default=32, help="RAM slots per layer (default: all, so only the tier moves)")
    t.add_argument("--tier-gb", default="0.003", help="tier budget in GiB (default: about a quarter of the experts)")
    t.add_argument("--tokens", type=int, default=1024)
    t.set_defaults(fn=tier)
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
