"""`tierlab compare A.jsonl B.jsonl [--markdown]`: the A/B table from session logs."""

from __future__ import annotations

import argparse
import sys
import warnings

from tierlab.app.lab.abtable import distinct_labels, render_markdown, render_text, summarise_logs
from tierlab.engine.errors import FormatError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="A/B table (hit rates, oracle, swap, agreement, KL, timings) from session logs",
        description="Print one table row per session log written with --log. "
        "Join repeated runs of one configuration with commas (a.jsonl,a2.jsonl) "
        "to get the median and min-max band of the timing columns.",
    )
    parser.add_argument("logs", nargs="+", metavar="LOG", help="session log; comma-separated repeats form one row")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = []
        for arg in args.logs:
            paths = [p for p in arg.split(",") if p]
            if not paths:
                raise FormatError("no session log named", arg)
            rows.append(summarise_logs(paths))
    for warning in caught:
        print(f"tierlab: warning: {warning.message}", file=sys.stderr)
    rows = distinct_labels(rows)
    print(render_markdown(rows) if args.markdown else render_text(rows))
    return 0
