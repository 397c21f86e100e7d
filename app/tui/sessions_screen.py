"""Sessions and A/B (F3): the recorded session logs, and two of them side by side.

Pick a log as A and another as B; the A/B table is the engine's own
(`tierlab.app.lab.abtable`), so the app shows the same figures as
`tierlab compare`, and can export them as markdown for a pull request.
"""

from __future__ import annotations

import datetime as _dt
import warnings
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Static

from tierlab.app.tui.files import describe_log, list_logs, read_header, stamped_path, start_label
from tierlab.app.lab import abtable
from tierlab.engine.atomic import write_atomic
from tierlab.app.cli.errors import error_line


def ab_rows(path_a: Path, path_b: Path) -> list[dict]:
    """Two A/B table rows from two logs, labelled by their knobs and RAM cache so that they never collide."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = [abtable.summarise_log(path_a), abtable.summarise_log(path_b)]
    rows[0]["row"] = f"A: {start_label(read_header(path_a))}"
    rows[1]["row"] = f"B: {start_label(read_header(path_b))}"
    for row, w in zip(rows, caught):
        row.setdefault("warning", str(w.message))
    return abtable.distinct_labels(rows)


EMPTY = "–"


def drop_empty_columns(titles: list[str], body: list[list[str]]) -> tuple[list[str], list[list[str]], list[str]]:
    """Leave out the columns no row has a figure for (ids match and TF-NLL without a reference)."""
    keep = [i for i, _ in enumerate(titles) if i == 0 or any(str(row[i]).strip() not in (EMPTY, "") for row in body)]
    dropped = [t for i, t in enumerate(titles) if i not in keep]
    return [titles[i] for i in keep], [[row[i] for i in keep] for row in body], dropped


class SessionsScreen(Screen):
    """Recorded logs (newest first), A/B picking, the table and its markdown export."""

    DEFAULT_CSS = """
    SessionsScreen #sessions-top { height: auto; }
    SessionsScreen #sessions-folder { width: 1fr; }
    SessionsScreen #sessions-list { height: 1fr; }
    SessionsScreen #ab-box { height: auto; max-height: 12; border: round $primary-darken-1; }
    SessionsScreen #ab-table { height: auto; }
    SessionsScreen #sessions-status { height: 1; color: $text-muted; padding: 0 1; }
    """
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("a", "pick('a')", "Set A"),
        Binding("b", "pick('b')", "Set B"),
        Binding("e", "export", "Export markdown"),
        Binding("r", "record", "Record on/off"),
        Binding("f5", "reload", "Reload list"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.logs: list[Path] = []
        self.picked: dict[str, Path] = {}
        self.rows: list[dict] = []

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="sessions-top"):
            yield Input(placeholder="folder of session logs", id="sessions-folder")
            yield Button("Export markdown", id="ab-export", compact=True)
        yield DataTable(id="sessions-list", cursor_type="row", zebra_stripes=True)
        with Vertical(id="ab-box") as box:
            box.border_title = "A/B"
            yield DataTable(id="ab-table", cursor_type="none")
        yield Static("a / b pick the highlighted log; Enter picks A, then B.", id="sessions-status")
        yield Footer()

    @property
    def folder(self) -> Path:
        raw = self.query_one("#sessions-folder", Input).value.strip()
        return Path(raw).expanduser() if raw else self.app.sessions_dir  # type: ignore[attr-defined]

    def on_mount(self) -> None:
        self.sub_title = "sessions & A/B"
        self.query_one("#sessions-folder", Input).value = str(self.app.sessions_dir)  # type: ignore[attr-defined]
        table = self.query_one("#sessions-list", DataTable)
        for label in ("pick", "log", "knobs at start", "records", "modified"):
            table.add_column(label, key=label)
        self.action_reload()
        table.focus()

    @on(Input.Submitted, "#sessions-folder")
    def action_reload(self) -> None:
        """List the logs of the folder again (newest first)."""
        table = self.query_one("#sessions-list", DataTable)
        table.clear()
        self.logs = list_logs(self.folder)
        for path in self.logs:
            listing = describe_log(path)
            when = _dt.datetime.fromtimestamp(listing.modified).strftime("%Y-%m-%d %H:%M:%S")
            table.add_row(self._pick_mark(path), path.name, listing.knobs, f"{listing.records:,}", when, key=str(path))
        recorder = getattr(self.app, "recorder", None)
        if recorder is not None:
            self._status(f"recording to {recorder.path.name}: r stops it")
        elif not self.logs:
            self._status(f"no session logs in {self.folder} yet: press r to record one")

    def _pick_mark(self, path: Path) -> str:
        return " ".join(side.upper() for side, p in sorted(self.picked.items()) if p == path) or " "

    def _status(self, text: str) -> None:
        self.query_one("#sessions-status", Static).update(text)

    def highlighted(self) -> Path | None:
        table = self.query_one("#sessions-list", DataTable)
        if not self.logs or table.cursor_row is None or table.cursor_row >= len(self.logs):
            return None
        return self.logs[table.cursor_row]

    def action_pick(self, side: str) -> None:
        """Pick the log highlighted in the list; from elsewhere, say so and go back to the list."""
        table = self.query_one("#sessions-list", DataTable)
        if self.focused is not table:
            table.focus()
            self.app.notify(f"{side} picks the highlighted log of the list: the list has the focus again",
                            severity="warning", timeout=4)
            return
        path = self.highlighted()
        if path is None:
            self.app.notify("no session log to pick", severity="warning")
            return
        self.pick(side, path)

    def pick(self, side: str, path: Path) -> None:
        """Make `path` log A or B; with both picked, build the table. A log is never both."""
        other = "b" if side == "a" else "a"
        if self.picked.get(other) == path:
            self.app.notify(f"{path.name} is {other.upper()} already: pick another log for {side.upper()}",
                            severity="warning", timeout=4)
            return
        self.picked[side] = path
        table = self.query_one("#sessions-list", DataTable)
        for log in self.logs:
            table.update_cell(str(log), "pick", self._pick_mark(log))
        if "a" in self.picked and "b" in self.picked:
            self.build_table()
        else:
            self._status(f"A = {self.picked['a'].name}" if "a" in self.picked else f"B = {self.picked['b'].name}")

    @on(DataTable.RowSelected, "#sessions-list")
    def pick_in_turn(self, event: DataTable.RowSelected) -> None:
        path = Path(str(event.row_key.value))
        side = "b" if "a" in self.picked and "b" not in self.picked else "a"
        if side == "a" and "b" in self.picked and "a" in self.picked:
            self.picked.clear()
        self.pick(side, path)

    def build_table(self) -> None:
        try:
            self.rows = ab_rows(self.picked["a"], self.picked["b"])
        except Exception as exc:  # any bad log is one notification; the app keeps running
            self.rows = []
            self.app.notify(error_line(exc), title="A/B", severity="error")
            return
        titles, body = abtable.table_cells(self.rows)
        titles, body, dropped = drop_empty_columns(titles, body)
        table = self.query_one("#ab-table", DataTable)
        table.clear(columns=True)
        for title in titles:
            table.add_column(title, key=title)
        for cells in body:
            table.add_row(*cells)
        tokens = " vs ".join(str(r.get("tokens", "?")) for r in self.rows)
        note = f" · {', '.join(dropped)}: need a reference run (tierlab ab)" if dropped else ""
        self._status(f"A/B over {tokens} tokens · e exports markdown{note}")

    @on(Button.Pressed, "#ab-export")
    def action_export(self) -> Path | None:
        """Write the A/B table as markdown next to the logs."""
        if not self.rows:
            self.app.notify("pick two logs first (a, b)", severity="warning")
            return None
        path = stamped_path(self.folder, "ab", ".md")
        lines = [f"A: `{self.picked['a'].name}`  ", f"B: `{self.picked['b'].name}`", "", abtable.render_markdown(self.rows), ""]
        write_atomic(path, "\n".join(lines))
        self.app.notify(str(path), title="A/B exported", timeout=4)
        return path

    def action_record(self) -> None:
        self.app.action_toggle_recording()  # type: ignore[attr-defined]
        self.action_reload()
