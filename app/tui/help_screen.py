"""The help screen (F1 or ?): every key, read from the bindings themselves.

Listing the bindings instead of writing them out keeps the help true when a
key changes.
"""

from __future__ import annotations

from typing import Iterable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

PANE_NOTES = (
    "Chat: type a prompt and press Enter; replies stream in. Tab moves between panes.",
    "Knobs: ←/→ step, PgUp/PgDn big step, Home/End min/max, Del default; click or drag the bar.",
    "Experts heatmap: two layers per row (upper half = even layer); arrows move the cursor.",
    "Command palette: ctrl+p lists every action, including themes.",
)


def binding_rows(sources: Iterable[tuple[str, list[Binding | tuple]]], key_display) -> list[tuple[str, str, str]]:
    """(keys, what it does, where) for each binding with a description, duplicates merged."""
    rows: dict[tuple[str, str], list[str]] = {}
    for where, bindings in sources:
        for binding in bindings:
            if not isinstance(binding, Binding):
                binding = Binding(*binding)
            if not binding.description:
                continue
            keys = [key_display(Binding(key.strip(), binding.action)) for key in binding.key.split(",")]
            rows.setdefault((binding.description, where), [])
            for key in keys:
                if key not in rows[(binding.description, where)]:
                    rows[(binding.description, where)].append(key)
    return [(" / ".join(keys), description, where) for (description, where), keys in rows.items()]


class HelpScreen(ModalScreen):
    """Keys of the app, its panes and its screens."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical {
        width: 90%; max-width: 110; height: 90%;
        border: thick $primary; background: $surface; padding: 0 1;
    }
    HelpScreen DataTable { height: 1fr; }
    HelpScreen .help--notes { color: $text-muted; height: auto; }
    """
    BINDINGS = [Binding("escape,f1,q,question_mark", "dismiss", "Close help")]

    def binding_sources(self) -> list[tuple[str, list]]:
        from tierlab.app.tui.heat_screen import HeatInspector
        from tierlab.app.tui.sessions_screen import SessionsScreen
        from tierlab.widgets.heatmap import ExpertHeatmap
        from tierlab.widgets.knob import Knob

        app = self.app
        return [
            ("everywhere", list(app.BINDINGS)),
            ("knob", list(Knob.BINDINGS)),
            ("heatmap", list(ExpertHeatmap.BINDINGS)),
            ("heat inspector", list(HeatInspector.BINDINGS)),
            ("sessions", list(SessionsScreen.BINDINGS)),
            ("help", list(self.BINDINGS)),
        ]

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = "Help"
            yield Static("\n".join(PANE_NOTES), classes="help--notes")
            yield DataTable(id="help-keys", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_column("keys", key="keys")
        table.add_column("action", key="action")
        table.add_column("where", key="where")
        for row in binding_rows(self.binding_sources(), self.app.get_key_display):
            table.add_row(*row)
        table.focus()

    def rows(self) -> list[tuple[str, str, str]]:
        table = self.query_one(DataTable)
        return [tuple(str(c) for c in table.get_row_at(i)) for i in range(table.row_count)]  # type: ignore[misc]
