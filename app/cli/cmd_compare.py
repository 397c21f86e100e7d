"""`tierlab compare A.jsonl B.jsonl [--markdown]`: the A/B table from session logs.

Logs of different models (by their fingerprint) are refused unless
`--allow-different-models`, which flags them in the table; a log without a
fingerprint (version 1) gets a warning line. The gate column judges what a
log can say about quality: none of the paired figures (they need the
next-token distributions, which logs do not hold), so it shows '–' and
`tierlab replay` gives the gated rows.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from tierlab.app.cli.gate_args import add_gate_args, gates_from_args
from tierlab.app.lab.abtable import COLUMNS, GATE_COLUMNS, distinct_labels, render_markdown, render_text, summarise_logs
from tierlab.app.lab.gates import judge
from tierlab.engine.errors import FormatError, TierlabError
from tierlab.engine.fingerprint import short
from tierlab.engine.sessionlog import read_session_log


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="A/B table (hit rates, oracle, swap, agreement, KL, timings) from session logs",
        description="Print one table row per session log written with --log. "
        "Join repeated runs of one configuration with commas (a.jsonl,a2.jsonl) "
        "to get the median and min-max band of the timing columns. "
        "Logs of different models (model fingerprint) are refused unless --allow-different-models.",
    )
    parser.add_argument("logs", nargs="+", metavar="LOG", help="session log; comma-separated repeats form one row")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--allow-different-models", action="store_true",
                        help="put logs of different models side by side, each row flagged with its model")
    add_gate_args(parser)
    parser.set_defaults(run=run)


def _fingerprints(paths: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """Each log's model fingerprint, and the logs old enough (version 1) to have none."""
    found, old = {}, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # summarise_logs reports damage once
        for path in paths:
            log = read_session_log(path)
            found[path] = log.fingerprint
            if log.version < 2:
                old.append(path)
    return found, old


def run(args: argparse.Namespace) -> int:
    gates = gates_from_args(args)
    groups = []
    for arg in args.logs:
        paths = [p for p in arg.split(",") if p]
        if not paths:
            raise FormatError("no session log named", arg)
        groups.append(paths)
    prints, old = _fingerprints([p for paths in groups for p in paths])
    models = {fp for fp in prints.values() if fp is not None}
    if len(models) > 1 and not args.allow_different_models:
        shown = ", ".join(f"{p}: {short(fp)}" for p, fp in prints.items() if fp is not None)
        raise TierlabError(f"the logs are of different models ({shown}); "
                           "use --allow-different-models to compare them anyway")
    notes = [f"{p}: no model fingerprint (a version-1 log); its model is not checked" for p in old]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = [summarise_logs(paths) for paths in groups]
    for warning in caught:
        print(f"tierlab: warning: {warning.message}", file=sys.stderr)
    for note in notes:
        print(f"tierlab: warning: {note}", file=sys.stderr)
    for row, paths in zip(rows, groups):
        row["gate"] = judge(row, gates).label()
        if len(models) > 1:
            row["row"] = f"{row['row']} [model {short(prints[paths[0]])}]"
    rows = distinct_labels(rows)
    columns = COLUMNS + GATE_COLUMNS
    print(render_markdown(rows, columns) if args.markdown else render_text(rows, columns))
    return 0
