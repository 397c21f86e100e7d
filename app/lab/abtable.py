"""The A/B table of the seed PR: one row per configuration, one column per figure.

A row is a dict. Rates (``ram_hit``, ``vram_hit``, ``oracle_hit``, ``swap``,
``agree``) are fractions in [0, 1]; ``kl`` and ``tf_nll`` are nats; timing
columns (``tok_s``, ``fetch_ms``, ``compute_ms``) are a number or a list of
repeats, shown as the median with the min–max band, because timings on a
shared machine are noisy while routing figures are deterministic. None is
shown as "–" (not measured, or the lever was off).

``summarise_log`` builds a row from session logs, so ``tierlab compare``
can put two runs side by side without rerunning them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tierlab.app.lab.belady import CacheReplay, belady_hits
from tierlab.engine.errors import FormatError
from tierlab.engine.knobs import SPEC_BY_NAME, KnobValues
from tierlab.engine.routing import topk_kl
from tierlab.engine.sessionlog import SessionLog, read_session_log

MISSING = "–"


def _pct(value: float) -> str:
    return f"{100.0 * value:.1f}%"


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    fmt: Callable[[Any], str]
    timing: bool = False


COLUMNS: tuple[Column, ...] = (
    Column("tok_s", "tok/s", lambda v: f"{v:.2f}", timing=True),
    Column("fetch_ms", "fetch ms/tok", lambda v: f"{v:.1f}", timing=True),
    Column("compute_ms", "compute ms/tok", lambda v: f"{v:.1f}", timing=True),
    Column("ram_hit", "RAM hit", _pct),
    Column("vram_hit", "VRAM hit", _pct),
    Column("oracle_hit", "oracle hit", _pct),
    Column("swap", "swap", _pct),
    Column("agree", "agree", _pct),
    Column("kl", "KL", lambda v: f"{v:.2f}"),
    Column("ids_match", "ids match", str),
    Column("tf_nll", "TF-NLL", lambda v: f"{v:.4f}"),
)


def _cell(column: Column, value: Any) -> str:
    if value is None:
        return MISSING
    if column.timing and isinstance(value, (list, tuple)):
        repeats = [v for v in value if v is not None]
        if not repeats:
            return MISSING
        middle = column.fmt(statistics.median(repeats))
        if len(repeats) == 1:
            return middle
        return f"{middle} ({column.fmt(min(repeats))}–{column.fmt(max(repeats))})"
    return column.fmt(value)


def table_cells(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Titles and formatted cells, every column always (a missing figure is '–')."""
    titles = ["row"] + [c.title for c in COLUMNS]
    body = [[str(r.get("row", ""))] + [_cell(c, r.get(c.key)) for c in COLUMNS] for r in rows]
    return titles, body


def render_text(rows: Sequence[dict[str, Any]]) -> str:
    """Aligned plain text: first column left, figures right."""
    titles, body = table_cells(rows)
    widths = [max(len(line[i]) for line in [titles, *body]) for i in range(len(titles))]

    def line(cells: list[str]) -> str:
        parts = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    return "\n".join([line(titles), *(line(r) for r in body)])


def render_markdown(rows: Sequence[dict[str, Any]]) -> str:
    titles, body = table_cells(rows)
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


def _layer_kl(layer: dict[str, Any]) -> float | None:
    """The routing KL meter of one record (None when the record lacks true_weights)."""
    true_weights = layer.get("true_weights")
    if true_weights is None:
        return None
    return topk_kl(layer["true_topk"], true_weights, layer["chosen"], layer["weights"])


def _requests_per_layer(log: SessionLog) -> dict[int, list[list[int]]]:
    per_layer: dict[int, list[list[int]]] = {}
    for token in log.tokens:
        for layer in token["layers"]:
            per_layer.setdefault(layer["layer"], []).append(layer["chosen"])
    return per_layer


def _oracle_hit(log: SessionLog) -> float | None:
    slots = log.header.get("cache", {}).get("ram_slots")
    if not slots:
        return None
    total = CacheReplay(0, 0)
    for requests in _requests_per_layer(log).values():
        width = max(len(r) for r in requests)
        padded = np.full((len(requests), width), -1, dtype=np.int32)
        for t, r in enumerate(requests):
            padded[t, : len(r)] = r
        total = total + belady_hits(padded, int(slots))
    return total.hit_rate if total.requests else None


def _timings(log: SessionLog) -> dict[str, float | None]:
    """Mean decode timings: tok/s from 'total' (else the sum of the parts), fetch and compute."""
    decode = [t["timings_ms"] for t in log.tokens if t.get("phase") == "decode" and t.get("timings_ms")]
    if not decode:
        return {"tok_s": None, "fetch_ms": None, "compute_ms": None}

    def mean_of(key: str) -> float | None:
        values = [t[key] for t in decode if t.get(key) is not None]
        return float(np.mean(values)) if values else None

    totals = [t["total"] if t.get("total") is not None else sum(v for v in t.values() if v) for t in decode]
    mean_total = float(np.mean(totals))
    return {
        "tok_s": 1000.0 / mean_total if mean_total > 0 else None,
        "fetch_ms": mean_of("fetch"),
        "compute_ms": mean_of("compute"),
    }


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
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"session log records are malformed ({type(exc).__name__}: {exc})", path) from None


def _summarise(log: SessionLog) -> dict[str, Any]:
    path = log.path
    ram_hits = ram_misses = vram = filled = swaps = swaps_vram = agree_hit = agree_tot = 0
    kls: list[float] = []
    kl_complete = True
    for token in log.tokens:
        for layer in token["layers"]:
            ram_hits += layer.get("ram_hits", 0)
            ram_misses += layer.get("ram_misses", 0)
            vram += layer.get("vram_served", 0)
            chosen = [e for e in layer["chosen"] if e >= 0]
            true = {e for e in layer["true_topk"] if e >= 0}
            filled += len(chosen)
            for e, swapped, level in zip(layer["chosen"], layer["swapped"], layer["level"]):
                if e >= 0 and swapped:
                    swaps += 1
                    swaps_vram += level == 2
            agree_hit += len(true.intersection(chosen))
            agree_tot += len(true)
            kl = _layer_kl(layer)
            if kl is None:
                kl_complete = False
            else:
                kls.append(kl)

    # the summary may hold figures at top level or, as the app writes it, under "meters"
    summary = dict(log.summary or {})
    if isinstance(summary.get("meters"), dict):
        summary = {**summary["meters"], **summary}
    routed = _routing_measured(log)
    kl_value = float(np.mean(kls)) if kl_complete and kls else summary.get("route_kl")
    gpu_tier = bool(log.header.get("cache", {}).get("gpu_tier")) or vram > 0
    return {
        "row": knob_label(log.header.get("knobs", {})),
        "path": str(path),
        "tokens": len(log.tokens),
        **_timings(log),
        "ram_hit": ram_hits / (ram_hits + ram_misses) if ram_hits + ram_misses else None,
        "vram_hit": vram / filled if gpu_tier and filled else None,
        "oracle_hit": _oracle_hit(log),
        "swap": swaps / filled if routed and filled else None,
        "swaps_to_vram": swaps_vram if routed else None,
        "agree": agree_hit / agree_tot if routed and agree_tot else None,
        "kl": kl_value if routed else None,
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
