"""`tierlab ab`: the A/B table, rows of settings side by side in one run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tierlab.app.cli.engine_options import add_knobs_at_arg, knob_steps_from_args
from tierlab.app.cli.gate_args import add_gate_args, gates_from_args
from tierlab.app.cli.signals import sigterm_exits
from tierlab.app.lab.ab import run_ab
from tierlab.app.lab.abtable import COLUMNS, GATE_COLUMNS, render_markdown, render_text
from tierlab.app.lab.evaluate import read_ref
from tierlab.engine.errors import TierlabError
from tierlab.engine.options import default_model


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "ab", help="A/B rows of knob settings against a reference, as one table",
        description="Each --row is NAME=VALUE words: knobs (CACHE_ROUTE, ROUTE_J, ...) or engine settings "
                    "(CACHE, TIER, TIER_GB, TIER_DEVICE, HEAT_FILE, TIER_NO_WARMSTART); 'off' = all defaults. "
                    "Every run starts from the same cache and heat state; HEAT_FILE is read, never written. "
                    "The first row is the baseline of the paired figures and the quality gates.")
    p.add_argument("--model", metavar="DIR", type=Path, default=default_model(),
                   help=f"model folder or tierlab container (default: the shipped {default_model().name})")
    p.add_argument("--ref", required=True, help="reference file (ref.json)")
    p.add_argument("--row", action="append", required=True, metavar="SETTINGS", help='e.g. "CACHE_ROUTE=1 ROUTE_J=4"')
    p.add_argument("--repeat", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    p.add_argument("--cache", type=int, default=None, metavar="N", help="RAM cache slots per layer for every row")
    p.add_argument("--no-tf", action="store_true", help="skip the teacher-forced NLL")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--json", action="store_true", help="print the rows as JSON (with each row's segments)")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap of the ΔNLL interval (default 0)")
    add_knobs_at_arg(p)
    add_gate_args(p)
    p.set_defaults(run=run)


def run(args) -> int:
    if args.repeat < 0:
        raise TierlabError("--repeat must be >= 0")
    steps = knob_steps_from_args(args)
    gates = gates_from_args(args)
    prompt, full = read_ref(args.ref)
    default_engine = {"CACHE": str(args.cache)} if args.cache else {}
    with sigterm_exits():  # run_ab closes its engines in a finally
        results = run_ab(args.model, prompt, full, args.row, repeat=args.repeat, default_engine=default_engine,
                         tf_nll=not args.no_tf, steps=steps, gates=gates, seed=args.seed,
                         progress=lambda s: print(f"  {s}", file=sys.stderr))
    rows = [r.as_row() for r in results]
    for row, res in zip(rows, results):
        row["gate_verdict"] = res.verdict.as_dict() if res.verdict is not None else None
    columns = COLUMNS + (GATE_COLUMNS if not args.no_tf else ())
    if args.json:
        print(json.dumps(rows))
    elif args.markdown:
        print(render_markdown(rows, columns))
    else:
        print(render_text(rows, columns))
    return 0
