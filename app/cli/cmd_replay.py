"""`tierlab replay LOG [--row "KNOBS"]...`: a recorded session re-run under other knobs, paired."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

from tierlab.app.cli.gate_args import add_gate_args, gates_from_args
from tierlab.app.cli.signals import sigterm_exits
from tierlab.app.lab.abtable import render_markdown, render_text
from tierlab.app.lab.replay import check_model, parse_rows, read_recording, run_replay
from tierlab.engine.errors import TierlabError
from tierlab.engine.meters import select

COLUMNS = select(("ram_hit", "dram_hit", "vram_hit", "dvram_hit", "dnll", "dnll_lo", "dnll_hi", "agree",
                  "kl_mean", "kl_p50", "kl_p99", "flips", "diverge", "rep4", "gate"))
CSV_KEYS = ("row", "tokens", "nll", "ram_hit", "dram_hit", "vram_hit", "dvram_hit", "dnll", "dnll_lo", "dnll_hi",
            "agree", "kl_mean", "kl_p50", "kl_p99", "flips", "flips_n", "confident_n", "diverge", "rep4", "gate")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "replay", help="re-run a session log's tokens teacher-forced under other knobs, paired with the recording",
        description="The first row is the recording (its knobs and knob changes); each --row runs its knobs "
                    "(and CACHE or tier settings) from the first token. Rows are paired token by token with the "
                    "first: ΔRAM/VRAM hit, ΔNLL with a paired bootstrap 95%% interval, top-1 agreement, "
                    "KL(recorded‖row), confident flips, then a greedy free generation as long as the recorded one "
                    "(the first diverging token, repeated 4-grams). Rates are fractions in --json and --csv.")
    p.add_argument("log", metavar="LOG", help="session log (written with --log, version 2)")
    p.add_argument("--row", action="append", default=[], metavar="SETTINGS", help='e.g. "CACHE_ROUTE=1 ROUTE_J=1"')
    p.add_argument("--model", metavar="DIR", type=Path, default=None,
                   help="the model folder (default: the one the log names); refused if its fingerprint differs")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap (default 0)")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--no-generate", action="store_true", help="skip the free generations")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the rows as JSON")
    out.add_argument("--csv", action="store_true", help="print the rows as CSV")
    out.add_argument("--md", "--markdown", dest="md", action="store_true", help="print a markdown table")
    add_gate_args(p)
    p.set_defaults(run=run)


def _csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_KEYS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_KEYS})
    return buffer.getvalue().rstrip("\n")


def run(args) -> int:
    if args.resamples < 100:
        raise TierlabError(f"--resamples {args.resamples}: at least 100")
    gates = gates_from_args(args)
    recording = read_recording(args.log, warn=lambda s: print(f"tierlab: warning: {s}", file=sys.stderr))
    parse_rows(recording, args.row)  # a bad row is refused before the model opens
    model = check_model(recording, args.model)
    with sigterm_exits():  # run_replay closes its engines in a finally
        results = run_replay(recording, model, args.row, gates=gates, seed=args.seed, resamples=args.resamples,
                             generate=not args.no_generate, progress=lambda s: print(f"  {s}", file=sys.stderr))
    rows = [r.as_row() for r in results]
    if args.json:
        print(json.dumps({"log": str(recording.path), "model": str(model), "fingerprint": recording.fingerprint,
                          "prompt_tokens": len(recording.prompt), "tokens": len(recording.generated),
                          "gates": gates.as_dict(), "rows": rows}))
    elif args.csv:
        print(_csv(rows))
    elif args.md:
        print(render_markdown(rows, COLUMNS))
    else:
        print(render_text(rows, COLUMNS))
    return 0
