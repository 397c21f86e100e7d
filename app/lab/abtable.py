"""The A/B table: one row per configuration, one column per figure.

A row is a dict keyed by the meter catalogue (engine/meters.py), which
also says each column's title, unit and format: rates (``ram_hit``,
``vram_hit``, ``oracle_hit``, ``swap``, ``route_agree``) are fractions in
[0, 1] (``shadow_hit`` is the stock top-K's RAM hit rate in the same cache
state, beside the realised ``ram_hit``); ``route_kl`` and ``tf_nll`` are nats; timing columns (``tok_s``,
``fetch_ms``, ``compute_ms``) are a number or a list of repeats, shown as
the median with the min–max band, because timings on a shared machine are
noisy while routing figures are deterministic. None is shown as "–" (not
measured, or the lever was off).

``summarise_log`` builds a row from session logs by folding their token
records into a ``MeterFold``, so ``tierlab compare`` can put two runs side
by side without rerunning them.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

from tierlab.app.lab.oracle import OracleBand
from tierlab.engine.errors import FormatError
from tierlab.engine.knobs import SPEC_BY_NAME, KnobValues
from tierlab.engine.meters import MISSING, Meter, MeterFold, select
from tierlab.engine.sessionlog import SessionLog, event_from_record, read_session_log

COLUMNS: tuple[Meter, ...] = select(
    ("tok_s", "fetch_ms", "compute_ms", "ram_hit", "shadow_hit", "vram_hit", "oracle_hit", "swap", "route_agree", "route_kl",
     "ids_match", "tf_nll")
)
#: The quality-gate columns `ab` and `compare` add: the figures the gates judge and the verdict.
GATE_COLUMNS: tuple[Meter, ...] = select(("dnll_hi", "agree", "kl_p99", "flips", "gate"))


def _cell(column: Meter, value: Any) -> str:
    if value is None:
        return MISSING
    if column.timing and isinstance(value, (list, tuple)):
        repeats = [v for v in value if v is not None]
        if not repeats:
            return MISSING
        middle = column.show(statistics.median(repeats))
        if len(repeats) == 1:
            return middle
        return f"{middle} ({column.show(min(repeats))}–{column.show(max(repeats))})"
    return column.show(value)


def table_cells(rows: Sequence[dict[str, Any]],
                columns: Sequence[Meter] = COLUMNS) -> tuple[list[str], list[list[str]]]:
    """Titles and formatted cells, every column always (a missing figure is '–')."""
    titles = ["row"] + [c.title for c in columns]
    body = [[str(r.get("row", ""))] + [_cell(c, r.get(c.key)) for c in columns] for r in rows]
    return titles, body


def render_text(rows: Sequence[dict[str, Any]], columns: Sequence[Meter] = COLUMNS) -> str:
    """Aligned plain text: first column left, figures right."""
    titles, body = table_cells(rows, columns)
    widths = [max(len(line[i]) for line in [titles, *body]) for i in range(len(titles))]

    def line(cells: list[str]) -> str:
        parts = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    return "\n".join([line(titles), *(line(r) for r in body)])


def render_markdown(rows: Sequence[dict[str, Any]], columns: Sequence[Meter] = COLUMNS) -> str:
    titles, body = table_cells(rows, columns)
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" + "---:|" * (len(titles) - 1)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


# --- rows from session logs ----------------------------------------------------


def knob_label(knobs: dict[str, Any]) -> str:
    """'lever off', or the knobs that differ from their defaults (as an A/B row is written)."""
    changed = []
    for name, value in knobs.items():
        spec = SPEC_BY_NAME.get(name)
        if spec is None or value == spec.default:
            continue
        shown = int(value) if isinstance(value, bool) else value
        changed.append(f"{name}={shown:g}" if isinstance(shown, float) else f"{name}={shown}")
    return " ".join(changed) if changed else "lever off"


def _knob_values(knobs: dict[str, Any]) -> KnobValues:
    known = {k: v for k, v in knobs.items() if k in SPEC_BY_NAME}
    try:
        return KnobValues(**known)
    except TypeError:
        return KnobValues()


def _routing_measured(log: SessionLog) -> bool:
    """Were routing meters on at any point (else swap/agree/KL are shown as '–')?"""
    if _knob_values(log.header.get("knobs", {})).meters_on:
        return True
    return any(c["name"] in ("CACHE_ROUTE", "ROUTE_AGREE") for c in log.knob_changes)


def _ids_match(summary: dict[str, Any] | None) -> str | None:
    if not summary or summary.get("ids_match") is None:
        return None
    value = summary["ids_match"]
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return f"{value[0]}/{value[1]}"
    return str(value)


def summarise_log(path: str | Path) -> dict[str, Any]:
    """One table row from one session log (see the module docstring for units).

    Raises FormatError (one line) for a file that is not a session log or
    whose records lack the fields a row needs."""
    log = read_session_log(path)
    try:
        return _summarise(log)
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, IndexError) as exc:
        raise FormatError(f"session log records are malformed ({type(exc).__name__}: {exc})", path) from None


def _summarise(log: SessionLog) -> dict[str, Any]:
    fold = MeterFold(timing_phase="decode")
    oracle = OracleBand(window=None)
    measured = _routing_measured(log)
    gpu_tier = bool(log.header.get("cache", {}).get("gpu_tier"))
    for token in log.tokens:
        event = event_from_record(token, measured=measured, gpu_tier=gpu_tier)
        fold.add(event)
        oracle.add(event)
    meters = fold.summary()
    slots = log.header.get("cache", {}).get("ram_slots")

    # the summary may hold figures at top level or, as the app writes it, under "meters"
    summary = dict(log.summary or {})
    if isinstance(summary.get("meters"), dict):
        summary = {**summary["meters"], **summary}
    kl_from_records = fold.kl_count > 0 and fold.kl_count == fold.decisions
    return {
        "row": knob_label(log.header.get("knobs", {})),
        "path": str(log.path),
        "tokens": len(log.tokens),
        "tok_s": meters["tok_s"],
        "fetch_ms": meters["fetch_ms"],
        "compute_ms": meters["compute_ms"],
        "ram_hit": meters["ram_hit"],
        "shadow_hit": meters["shadow_hit"],
        "vram_hit": meters["vram_hit"],
        "oracle_hit": oracle.hit_rate(int(slots)) if slots else None,
        "swap": meters["swap"],
        "swaps_to_vram": meters["swaps_to_vram"],
        "route_agree": meters["route_agree"],
        "route_kl": (meters["route_kl"] if kl_from_records else summary.get("route_kl")) if measured else None,
        "ids_match": _ids_match(summary),
        "tf_nll": summary.get("tf_nll"),
        "damaged": log.damage,
    }


TIMING_KEYS = tuple(c.key for c in COLUMNS if c.timing)


def summarise_logs(paths: Iterable[str | Path]) -> dict[str, Any]:
    """One row from repeated runs of one configuration: routing figures from the
    first log (they are deterministic), every timing column as the list of repeats."""
    rows = [summarise_log(p) for p in paths]
    if not rows:
        raise ValueError("no session logs given")
    row = dict(rows[0])
    for key in TIMING_KEYS:
        row[key] = [r[key] for r in rows]
    return row


def distinct_labels(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows whose knob labels collide get their file name appended."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["row"]] = counts.get(r["row"], 0) + 1
    return [
        {**r, "row": f"{r['row']} ({Path(r['path']).name})"} if counts[r["row"]] > 1 else r for r in rows
    ]
