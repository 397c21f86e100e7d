"""The heat-profile inspector (F2): open, read and compare heat profiles.

A heat profile decides what the GPU tier holds from the start, so it is
worth seeing: which experts a layer prefers (the heatmap), how concentrated
each layer is (entropy, and how many experts cover 50% / 90% of its
routings), and how two profiles differ layer by layer: B's table starts with
the comparison (top overlap, TVD, JS), and `d` shows B's pane as A − B.
The app keeps one inspector, so F2 again finds the profiles it left.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.suggester import SuggestFromList
from textual.widgets import Button, DataTable, Footer, Header, Input, Static

from tierlab.app.tui.files import list_heat_files

from tierlab.app.cli.errors import error_line
from tierlab.engine.heat import HeatProfile, LayerDiff, diff
from tierlab.widgets.heatmap import DIFF_MODE, ExpertHeatmap, HeatmapData


def bar(fraction: float, width: int = 10) -> str:
    """A left-to-right bar of `width` cells filled to `fraction` (eighths for smoothness)."""
    if math.isnan(fraction):
        return "·" * width
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")
    return text.ljust(width, "░")


def profile_data(profile: HeatProfile) -> HeatmapData:
    """Heatmap arrays for a profile on its own (no residency, no current token)."""
    data = HeatmapData.empty(profile.n_layers, profile.n_experts)
    data.heat = profile.counts.copy()
    return data


def difference_data(a: HeatProfile, b: HeatProfile) -> HeatmapData:
    """A − B per cell, in hundredths of a percent of each layer's routings (profiles of different
    lengths compare by share, not by count)."""
    def shares(counts: np.ndarray) -> np.ndarray:
        totals = counts.sum(axis=1, keepdims=True).astype(np.float64)
        return np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)

    data = HeatmapData.empty(a.n_layers, a.n_experts)
    data.heat = np.rint((shares(a.counts) - shares(b.counts)) * 10000).astype(np.int64)
    return data


class ProfilePane(Vertical):
    """One profile: its name, heatmap and per-layer table."""

    DEFAULT_CSS = """
    ProfilePane { width: 1fr; border: round $primary-darken-1; }
    ProfilePane > ExpertHeatmap { height: 1fr; min-height: 6; }
    ProfilePane > DataTable { height: 1fr; }
    """

    def __init__(self, side: str) -> None:
        super().__init__(id=f"pane-{side}")
        self.side = side
        self.profile: HeatProfile | None = None
        self.source_name = ""
        self.difference = None
        self.border_title = f"profile {side.upper()}"

    def compose(self) -> ComposeResult:
        yield ExpertHeatmap(profile=True, id=f"heat-map-{self.side}")
        yield DataTable(id=f"stats-{self.side}", zebra_stripes=True, cursor_type="row")

    def show(self, profile: HeatProfile, source: str, diffs: list[LayerDiff] | None = None) -> None:
        self.profile = profile
        self.source_name = Path(source).name
        self.border_title = f"{self.side.upper()}: {self.source_name}"
        self.query_one(ExpertHeatmap).update_data(profile_data(profile), now=True)
        heatmap = self.query_one(ExpertHeatmap)
        heatmap.mode = "heat"
        self.difference = None
        table = self.query_one(DataTable)
        table.clear(columns=True)
        compared = ("top overlap", "TVD", "JS") if diffs is not None else ()
        for label in ("layer", *compared, "routings", "entropy", "cover 50%", "cover 90%", "top experts"):
            table.add_column(label, key=label)
        for summary in profile.summaries(top=4):
            row = [str(summary.layer)]
            if diffs is not None:  # first, so that a half-width pane still shows them
                d = diffs[summary.layer]
                row += [f"{d.top_overlap:.2f}", f"{d.tvd:.3f}", f"{d.js:.3f}"]
            row += [
                f"{summary.routings:,}",
                f"{bar(summary.entropy_norm, 8)} {summary.entropy_norm:.2f}",
                f"{bar(summary.cover50 / profile.n_experts, 6)} {summary.cover50}",
                f"{bar(summary.cover90 / profile.n_experts, 6)} {summary.cover90}",
                " ".join(str(e) for e, _ in summary.top),
            ]
            table.add_row(*row)

    def show_difference(self, a: HeatProfile, on: bool) -> None:
        """Show A − B in this (B's) pane, or B itself again."""
        heatmap = self.query_one(ExpertHeatmap)
        if on and self.profile is not None:
            heatmap.update_data(difference_data(a, self.profile), now=True)
            heatmap.mode = DIFF_MODE
            self.border_title = f"A − B · {self.source_name}"
        elif self.profile is not None:
            heatmap.update_data(profile_data(self.profile), now=True)
            heatmap.mode = "heat"
            self.border_title = f"B: {self.source_name}"


class HeatInspector(Screen):
    """Open a heat profile, compare it with a second one, save this session's heat."""

    DEFAULT_CSS = """
    HeatInspector #heat-inputs { height: auto; }
    HeatInspector #heat-inputs Input { width: 1fr; }
    HeatInspector #heat-inputs Button { min-width: 10; }
    HeatInspector #heat-body { height: 1fr; }
    HeatInspector #pane-b { display: none; }
    HeatInspector.-compare #pane-b { display: block; }
    HeatInspector #heat-status { height: 1; color: $text-muted; padding: 0 1; }
    """
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("ctrl+s", "save", "Save session heat"),
        Binding("ctrl+o", "load", "Load"),
        Binding("ctrl+d", "toggle_difference", "A − B"),
    ]

    def __init__(self, initial: Path | None = None) -> None:
        super().__init__()
        self.initial = initial
        self.showing_difference = False

    def compose(self) -> ComposeResult:
        known = list_heat_files(Path.cwd(), self.app.sessions_dir)  # type: ignore[attr-defined]
        suggester = SuggestFromList(known, case_sensitive=True)
        yield Header()
        with Horizontal(id="heat-inputs"):
            yield Input(placeholder="heat profile A (path; → completes)", id="heat-path-a", suggester=suggester)
            yield Input(placeholder="profile B to compare (optional)", id="heat-path-b", suggester=suggester)
            yield Button("Load", id="heat-load", variant="primary", compact=True)
            yield Input(placeholder="save session heat to… (empty = new file)", id="heat-save-path")
            yield Button("Save", id="heat-save", compact=True)
        with Horizontal(id="heat-body"):
            yield ProfilePane("a")
            yield ProfilePane("b")
        yield Static("Enter a path and press Enter (or Load).", id="heat-status")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "heat profiles"
        if self.initial is not None:
            self.query_one("#heat-path-a", Input).value = str(self.initial)
            self.action_load()
        self.query_one("#heat-path-a", Input).focus()

    def _read(self, raw: str) -> HeatProfile | None:
        try:
            return HeatProfile.read(Path(raw).expanduser())
        except Exception as exc:  # any bad file is one notification; the app keeps running
            self.app.notify(error_line(exc), title="Heat profile", severity="error")
            return None

    @on(Input.Submitted, "#heat-path-a, #heat-path-b")
    @on(Button.Pressed, "#heat-load")
    def action_load(self) -> None:
        """Load A (and B if given); B is compared with A layer by layer."""
        path_a = self.query_one("#heat-path-a", Input).value.strip()
        path_b = self.query_one("#heat-path-b", Input).value.strip()
        if not path_a:
            self.app.notify("give the path of a heat profile", severity="warning")
            return
        profile_a = self._read(path_a)
        if profile_a is None:
            return
        self.query_one("#pane-a", ProfilePane).show(profile_a, path_a)
        status = f"A: {profile_a.n_layers} layers × {profile_a.n_experts} experts, {int(profile_a.counts.sum()):,} routings"
        self.remove_class("-compare")
        if path_b:
            profile_b = self._read(path_b)
            if profile_b is None:
                return
            try:
                diffs = diff(profile_a, profile_b)
            except Exception as exc:
                self.app.notify(error_line(exc), title="Compare", severity="error")
                return
            self.query_one("#pane-b", ProfilePane).show(profile_b, path_b, diffs)
            self.showing_difference = False
            self.add_class("-compare")
            mean_tvd = [d.tvd for d in diffs if not math.isnan(d.tvd)]
            if mean_tvd:
                status += f" | B vs A: mean TVD {sum(mean_tvd) / len(mean_tvd):.3f} · ^D shows A − B"
        self.query_one("#heat-status", Static).update(status)

    def action_toggle_difference(self) -> None:
        """Pane B as A − B (amber: more in A, blue: more in B) or as B again."""
        pane_a = self.query_one("#pane-a", ProfilePane)
        pane_b = self.query_one("#pane-b", ProfilePane)
        if not self.has_class("-compare") or pane_a.profile is None or pane_b.profile is None:
            self.app.notify("load two profiles first (A and B)", severity="warning")
            return
        self.showing_difference = not self.showing_difference
        pane_b.show_difference(pane_a.profile, self.showing_difference)

    @on(Input.Submitted, "#heat-save-path")
    @on(Button.Pressed, "#heat-save")
    def action_save(self) -> None:
        """Save the running session's heat and open it as profile A."""
        raw = self.query_one("#heat-save-path", Input).value.strip()
        written = self.app.action_save_heat(raw or None)  # type: ignore[attr-defined]
        if written is not None:
            self.query_one("#heat-path-a", Input).value = str(written)
            self.action_load()
