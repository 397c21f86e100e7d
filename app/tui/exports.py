"""Exports from the app, all into the sessions folder (never ~/Downloads).

A screenshot (SVG, Textual's own, pointed at the sessions folder so that it
works on a server without ~/Downloads), the meters of this session as CSV,
the heatmap's counts as a heat profile (files.save_session_heat, the format
`tierlab heat show` reads) and a copy of the last reply to the clipboard
through OSC 52 (the terminal decides whether to honour it). The A/B table
is exported by the sessions screen (F3, `e`).

The CSV has one row per knob setting the watch saw (the closed segments,
then the open one) and one per meter window now (last N tokens, since the
knob change, since start); its columns are the row's label, the setting's
knobs, RAM slots and token range, then every meter of the catalogue by key,
rates in percent as the JSON outputs write them, empty where a meter has no
samples.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from tierlab.app.tui.files import stamped_path
from tierlab.engine.atomic import write_atomic
from tierlab.engine.meters import CATALOGUE, WINDOWS, meters_json, window_title

CSV_SUFFIX = ".csv"
SVG_SUFFIX = ".svg"
CSV_LEAD = ("row", "knobs", "ram_slots", "first_token", "end_token")
"""The CSV's columns before the catalogue's meter keys."""


def meters_header() -> list[str]:
    return [*CSV_LEAD, *(meter.key for meter in CATALOGUE)]


def _knob_text(values) -> str:
    if values is None:
        return ""
    from tierlab.app.tui.presets import format_value

    return " ".join(f"{k}={format_value(v)}" for k, v in values.changed_from_default().items()) or "lever off"


def _cells(summary: dict) -> list[str]:
    shown = meters_json(summary)
    cells = []
    for meter in CATALOGUE:
        value = shown.get(meter.key)
        cells.append("" if value is None else str(value))
    return cells


def meters_rows(watch) -> list[list[str]]:
    """The CSV's rows (header first) from the app's watch."""
    rows = [meters_header()]
    for number, (segment, values) in enumerate(watch.segments(), 1):
        slots = "" if segment.ram_slots is None else str(segment.ram_slots)
        rows.append([f"setting {number}", _knob_text(values), slots, str(segment.first), str(segment.end),
                     *_cells(segment.meters)])
    reading = watch.oracle_reading()
    oracle = reading.meters() if reading is not None else {}
    knobs = watch.engine.knobs.snapshot()
    with watch.lock:
        summaries = {window: watch.windows.summary(window, knobs) for window in WINDOWS}
        recent, total = watch.windows.recent, watch.windows.tokens
    for window in WINDOWS:
        summary = dict(summaries[window], **oracle)
        rows.append([window_title(window, recent), _knob_text(knobs), str(summary.get("ram_slots", "")),
                     str(max(0, total - summary["tokens"])), str(total), *_cells(summary)])
    return rows


def save_meters_csv(watch, folder: Path) -> Path:
    """Write this session's meters as CSV into `folder`; returns the path."""
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(meters_rows(watch))
    return write_atomic(stamped_path(Path(folder), "meters", CSV_SUFFIX), buffer.getvalue())


def screenshot_name(folder: Path) -> str:
    """A new stamped file name for a screenshot in `folder` (the folder is made if missing)."""
    return stamped_path(Path(folder), "screen", SVG_SUFFIX).name


def last_reply(chat) -> str | None:
    """The text of the conversation's last reply (chat or raw), None before the first."""
    from tierlab.app.tui.chat import ChatMessage

    replies = [m for m in chat.query(ChatMessage) if m.role in ("assistant", "raw") and m.text]
    return replies[-1].text if replies else None
