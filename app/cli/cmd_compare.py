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
import math
import sys
import warnings

from tierlab.app.cli.gate_args import add_gate_args, gates_from_args
from tierlab.app.lab.abtable import COLUMNS, GATE_COLUMNS, distinct_labels, render_markdown, render_text, summarise_logs
from tierlab.app.lab.gates import judge
from tierlab.engine.errors import FormatError, TierlabError
from tierlab.engine.fingerprint import short
from tierlab.engine.sessionlog import read_session_log


#: summary figures a table row shows as numbers
NUMERIC_SUMMARY = ("tf_nll", "route_kl")
#: per-layer fields that hold expert ids (-1: an unfilled slot)
EXPERT_ID_FIELDS = ("chosen", "true_topk")


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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_log_values(path: str) -> None:
    """Refuse, in one line naming the file, a log whose expert ids lie outside the header's
    model or whose summary figures are not numbers: a table built from them would be wrong."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the table's own read reports damage once
        log = read_session_log(path)
    model = log.header.get("model") if isinstance(log.header.get("model"), dict) else {}
    n_layers, n_experts = model.get("n_layers"), model.get("n_experts")
    layer_cap = n_layers if _is_int(n_layers) and n_layers > 0 else 1 << 12
    expert_cap = n_experts if _is_int(n_experts) and n_experts > 0 else 1 << 16
    for token in log.tokens:
        if not _is_int(token.get("index")) or token["index"] < 0:
            raise FormatError(f"token record has index {token.get('index')!r:.40}, not a position", path)
        for layer in token["layers"]:
            if not isinstance(layer, dict):
                raise FormatError(f"token {token['index']}: a layer record is not an object", path)
            if not _is_int(layer.get("layer")) or not 0 <= layer["layer"] < layer_cap:
                raise FormatError(f"token {token['index']}: layer {layer.get('layer')!r:.40} is outside "
                                  f"0..{layer_cap - 1}", path)
            for key in EXPERT_ID_FIELDS:
                ids = layer.get(key)
                if not isinstance(ids, list) or not all(_is_int(i) and -1 <= i < expert_cap
                                                        for i in ids):
                    raise FormatError(f"token {token['index']} layer {layer['layer']}: {key} holds ids outside "
                                      f"-1..{expert_cap - 1}", path)
    summary = log.summary or {}
    figures = {**summary.get("meters", {}), **summary} if isinstance(summary.get("meters"), dict) else summary
    for key in NUMERIC_SUMMARY:
        value = figures.get(key)
        if value is not None and not (_is_int(value) or (isinstance(value, float) and math.isfinite(value))):
            raise FormatError(f"summary {key} is {value!r:.40}, not a number", path)


def run(args: argparse.Namespace) -> int:
    gates = gates_from_args(args)
    groups = []
    for arg in args.logs:
        paths = [p for p in arg.split(",") if p]
        if not paths:
            raise FormatError("no session log named", arg)
        for path in paths:
            check_log_values(path)
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
