"""The help screen (F1 or ?): every key, read from the bindings themselves, and what each meter means.

Listing the bindings and the meter catalogue instead of writing them out
keeps the help true when a key or a meter changes.
"""

from __future__ import annotations

from typing import Iterable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

PANE_NOTES = (
    "Chat: type a prompt and press Enter; replies stream in. Tab moves between panes. "
    "On an empty prompt ? opens this help and q quits.",
    "Knobs: ←/→ step, PgUp/PgDn big step, Home/End min/max, Del default; click or drag the bar.",
    "Experts heatmap: one row per layer when the pane is tall enough, else two (upper half = even layer); "
    "the bottom border says which layers are in view when not all fit (▲/▼: more above/below).",
    "Command palette: ^P lists every action with its key, including themes.",
)

PLOT_NOTES = (
    ("N→V", "after the swap rate: how many of the window's swaps took a substitute held by the GPU tier"),
    ("–", "no samples yet in this window (e.g. VRAM hit without a GPU tier)"),
    ("plot axes", "left: hit rates in %; right: tok/s (the plot's title says which series is which)"),
    ("plot │ label", "a knob change, at the token it first applied to"),
)


def meter_rows() -> list[tuple[str, str]]:
    """(label, meaning) for every meter of the panel, from the one meter catalogue, then the marks."""
    from tierlab.widgets.meters import METERS

    return [(spec.label, spec.help) for spec in METERS] + list(PLOT_NOTES)


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
    HelpScreen #help-meters { height: 1fr; max-height: 18; }
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
            yield DataTable(id="help-meters", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        meters = self.query_one("#help-meters", DataTable)
        meters.add_column("meter", key="meter")
        meters.add_column("meaning", key="meaning")
        for row in meter_rows():
            meters.add_row(*row)
        table = self.query_one("#help-keys", DataTable)
        table.add_column("keys", key="keys")
        table.add_column("action", key="action")
        table.add_column("where", key="where")
        for row in binding_rows(self.binding_sources(), self.app.get_key_display):
            table.add_row(*row)
        table.focus()

    def meters(self) -> list[tuple[str, str]]:
        table = self.query_one("#help-meters", DataTable)
        return [tuple(str(c) for c in table.get_row_at(i)) for i in range(table.row_count)]  # type: ignore[misc]

    def rows(self) -> list[tuple[str, str, str]]:
        table = self.query_one("#help-keys", DataTable)
        return [tuple(str(c) for c in table.get_row_at(i)) for i in range(table.row_count)]  # type: ignore[misc]
