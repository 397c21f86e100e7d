"""The expert heatmap: layers x experts, every cell reachable.

When the pane is tall enough each layer has its own row (`█`); otherwise
two layers share a row through the upper half block (`▀`): the foreground
paints layer 2i, the background layer 2i+1. When the experts do not fit
across, the grid either scrolls sideways or folds into bands stacked
vertically; when the lines do not fit down, it scrolls, and the pane's
bottom border says which layers (and band) are in view ("layers 0–19 ▼").
The expert ruler is drawn when the rows leave room for it. Redraws are
throttled, because the engine produces tokens faster than anyone can read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

from tierlab.engine.events import LEVEL_DISK, LEVEL_GPU, LEVEL_RAM

MODES = ("residency", "heat", "token", "swaps")
DIFF_MODE = "diff"
"""Two heat profiles' difference (A − B, in hundredths of a percent of each layer's routings): heat screen only."""
FOLDS = ("auto", "fold", "scroll")
GUTTER = 4
"""Columns for the row labels (the even layer of each row)."""
SIDE_WIDTH = 12
"""Columns of the per-layer RAM hit column, drawn right of the grid when every expert fits beside it."""
MAX_CELL_WIDTH = 4
"""Few experts (a tiny model) are drawn up to this many columns wide each, so they stay easy to hit."""
MAX_REDRAWS_PER_SECOND = 10

BLANK = "#161b22"
LEVEL_COLORS = {LEVEL_DISK: "#30363d", LEVEL_RAM: "#1f6feb", LEVEL_GPU: "#238636"}
CHOSEN_COLORS = {LEVEL_DISK: "#ff7b72", LEVEL_RAM: "#79c0ff", LEVEL_GPU: "#7ee787"}
SWAPPED_COLOR = "#f778ba"
CURSOR_COLOR = "#ffffff"
DIFF_RAMP_MORE = ("#161b22", "#3b2a12", "#7a4b12", "#c77d1a", "#f7b955")
DIFF_RAMP_LESS = ("#161b22", "#12283b", "#125a7a", "#1a8fc7", "#55c8f7")
HEAT_RAMP = ("#161b22", "#2d1b4e", "#58207a", "#8e2c7d", "#c53e6b", "#ea6a4a", "#f7a23b", "#fbe26a")
LEVEL_NAMES = {LEVEL_DISK: "disk", LEVEL_RAM: "RAM cache", LEVEL_GPU: "GPU tier"}


@dataclass(frozen=True)
class TierNames:
    """What the first residency level is called: a GPU, or an OpenCL CPU device (PoCL), which
    is a tier of the same kind but no GPU."""

    level: str = "GPU tier"
    short: str = "GPU"
    meter: str = "VRAM hit"


GPU_TIER = TierNames()
CPU_TIER = TierNames("OpenCL CPU tier", "CL-CPU", "tier hit")


def tier_names(report: dict | None) -> TierNames:
    """The names for the tier an engine reports (`tier_description()`), by its OpenCL device type."""
    return CPU_TIER if report and report.get("cpu_device") else GPU_TIER


@dataclass
class HeatmapData:
    """What the heatmap shows: one value per (layer, expert) for each view."""

    levels: np.ndarray  # int8[L, E]: 2 GPU tier, 1 RAM cache, 0 disk
    heat: np.ndarray  # int64[L, E]: routing counts so far
    chosen: np.ndarray  # bool[L, E]: run for the latest token
    swapped: np.ndarray  # bool[L, E]: chosen only because resident (latest token)
    last_use: np.ndarray  # int64[L, E]: token index of the latest use, -1 never
    swap_counts: np.ndarray = field(default=None)  # type: ignore[assignment]  # int64[L, E]
    token: int = -1
    layer_hit: np.ndarray | None = None  # float[L]: RAM hit % per layer (NaN: no requests yet); None: not shown

    def __post_init__(self) -> None:
        if self.swap_counts is None:
            self.swap_counts = np.zeros(self.levels.shape, dtype=np.int64)

    @classmethod
    def empty(cls, n_layers: int, n_experts: int) -> "HeatmapData":
        shape = (n_layers, n_experts)
        return cls(
            levels=np.zeros(shape, np.int8),
            heat=np.zeros(shape, np.int64),
            chosen=np.zeros(shape, bool),
            swapped=np.zeros(shape, bool),
            last_use=np.full(shape, -1, np.int64),
        )

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.levels.shape)  # type: ignore[return-value]


@lru_cache(maxsize=1024)
def half_block_style(top: str, bottom: str) -> Style:
    """One cell showing `top` in its upper half and `bottom` in its lower half."""
    return Style(color=top, bgcolor=bottom)


@lru_cache(maxsize=256)
def solid_style(color: str) -> Style:
    """One cell filled with `color` (one layer per row)."""
    return Style(color=color)


def ramp_colors(values: np.ndarray, ramp: tuple[str, ...] = HEAT_RAMP) -> np.ndarray:
    """Map values in [0, 1] onto a colour ramp; exact zeros stay on the ramp's first colour."""
    steps = len(ramp) - 1
    index = np.where(values > 0, 1 + np.floor(np.clip(values, 0, 1) * (steps - 1) + 0.5), 0).astype(int)
    return np.asarray(ramp, dtype=object)[np.clip(index, 0, steps)]


def heat_fraction(counts: np.ndarray) -> np.ndarray:
    """Log-scaled heat per layer: 1 for a layer's hottest expert, 0 for a never-used one."""
    counts = np.asarray(counts, dtype=np.float64)
    peak = counts.max(axis=1, keepdims=True) if counts.size else counts
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.log1p(counts) / np.log1p(np.maximum(peak, 1))
    return np.nan_to_num(frac)


def cell_colors(data: HeatmapData, mode: str) -> np.ndarray:
    """The colour of every (layer, expert) cell in a view mode, as an object array of hex strings."""
    if mode == DIFF_MODE:
        delta = data.heat.astype(np.float64)
        peak = np.maximum(np.abs(delta).max(axis=1, keepdims=True), 1.0)
        more = ramp_colors(np.clip(delta / peak, 0, 1), DIFF_RAMP_MORE)
        less = ramp_colors(np.clip(-delta / peak, 0, 1), DIFF_RAMP_LESS)
        return np.where(delta < 0, less, more)
    if mode == "heat":
        return ramp_colors(heat_fraction(data.heat))
    if mode == "swaps":
        peak = max(int(data.swap_counts.max(initial=0)), 1)
        colors = ramp_colors(np.log1p(data.swap_counts) / math.log1p(peak))
        colors[data.swapped] = SWAPPED_COLOR
        return colors
    levels = np.clip(data.levels, LEVEL_DISK, LEVEL_GPU)
    chosen_colors = np.vectorize(CHOSEN_COLORS.get, otypes=[object])(levels)
    if mode == "token":
        colors = np.full(data.shape, BLANK, dtype=object)
    else:
        colors = np.vectorize(LEVEL_COLORS.get, otypes=[object])(levels)
    colors[data.chosen] = chosen_colors[data.chosen]
    colors[data.swapped & data.chosen] = SWAPPED_COLOR
    return colors


def legend_entries(mode: str, tier: TierNames = GPU_TIER) -> list[tuple[str, str]]:
    """(colour, meaning) for each colour of a view mode."""
    return {
        "residency": [(LEVEL_COLORS[2], tier.short), (LEVEL_COLORS[1], "RAM"), (LEVEL_COLORS[0], "disk"),
                      (CHOSEN_COLORS[2], f"now {tier.short}"), (CHOSEN_COLORS[1], "now RAM"), (CHOSEN_COLORS[0], "miss"),
                      (SWAPPED_COLOR, "swap")],
        "heat": [(HEAT_RAMP[1], "cold"), (HEAT_RAMP[4], "warm"), (HEAT_RAMP[-1], "hottest in layer"),
                 (HEAT_RAMP[0], "never")],
        "token": [(CHOSEN_COLORS[2], tier.short), (CHOSEN_COLORS[1], "RAM hit"), (CHOSEN_COLORS[0], "disk miss"),
                  (SWAPPED_COLOR, "swapped in")],
        "swaps": [(HEAT_RAMP[2], "few swaps"), (HEAT_RAMP[-1], "most swaps"), (SWAPPED_COLOR, "swapped now")],
        DIFF_MODE: [(DIFF_RAMP_MORE[-1], "more in A"), (DIFF_RAMP_MORE[2], "a little more in A"), (BLANK, "same"),
                    (DIFF_RAMP_LESS[2], "a little more in B"), (DIFF_RAMP_LESS[-1], "more in B")],
    }[mode]


@dataclass(frozen=True)
class GridLine:
    """One line of the grid area: a ruler ("header") or a row of one or two layers."""

    kind: str
    first_expert: int
    last_expert: int  # exclusive
    top: int = 0  # the layer of the row (the upper half when two share it)
    bottom: int = -1  # the layer of the lower half, -1 when the row holds one layer
    band: int = 0  # which band of experts (0 unless folded)


@dataclass(frozen=True)
class Layout:
    """How the grid fits the pane: folded into bands or not, layers per row, rulers or not."""

    folded: bool
    per_row: int  # 1 or 2 layers per terminal row
    ruler: bool


class ExpertHeatmap(Widget, can_focus=True):
    """Layers x experts, coloured by residency, heat, this token or swaps, with a cursor."""

    DEFAULT_CSS = """
    ExpertHeatmap {
        height: 1fr;
        width: 1fr;
    }
    ExpertHeatmap > .heatmap--ruler { color: $text-muted; }
    ExpertHeatmap > .heatmap--info { color: $text; }
    ExpertHeatmap > .heatmap--legend { color: $text-muted; }
    """
    COMPONENT_CLASSES = {"heatmap--ruler", "heatmap--info", "heatmap--legend"}

    BINDINGS = [
        Binding("left", "move(0, -1)", "Expert left", show=False),
        Binding("right", "move(0, 1)", "Expert right", show=False),
        Binding("up", "move(-1, 0)", "Layer up", show=False),
        Binding("down", "move(1, 0)", "Layer down", show=False),
        Binding("pageup", "page(-1)", "Page left", show=False),
        Binding("pagedown", "page(1)", "Page right", show=False),
        Binding("home", "edge(0)", "First expert", show=False),
        Binding("end", "edge(1)", "Last expert", show=False),
        Binding("m", "cycle_mode", "View mode"),
        Binding("f", "cycle_fold", "Fold/scroll"),
    ]

    mode: reactive[str] = reactive("residency")
    fold: reactive[str] = reactive("auto")
    cursor: reactive[tuple[int, int]] = reactive((0, 0))
    hover: reactive[tuple[int, int] | None] = reactive(None)

    class CellSelected(Message):
        """The cursor moved onto a cell."""

        def __init__(self, heatmap: "ExpertHeatmap", layer: int, expert: int) -> None:
            super().__init__()
            self.heatmap = heatmap
            self.layer = layer
            self.expert = expert

    def __init__(
        self, data: HeatmapData | None = None, *, profile: bool = False, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(id=id, classes=classes)
        self.data = data
        self.profile = profile
        """A stored heat profile has no residency and no current token: heat view only."""
        self.placeholder = "no profile loaded: give a path above" if profile else "no model loaded"
        """What an empty heatmap says."""
        if profile:
            self.set_reactive(ExpertHeatmap.mode, "heat")
        self.tier = GPU_TIER
        """What the first residency level is called (`tier_names`)."""
        self.x_offset = 0
        self.y_offset = 0
        self.redraw_count = 0
        self._hover_pair: int | None = None
        """The lower layer of the row under the mouse when two layers share it."""
        self._dirty = False
        self._colors: np.ndarray | None = None

    def on_mount(self) -> None:
        self.set_interval(1 / MAX_REDRAWS_PER_SECOND, self._flush, name="heatmap-throttle")

    # -- data ------------------------------------------------------------

    def update_data(self, data: HeatmapData, *, now: bool = False) -> None:
        """Take new arrays; the screen catches up at the next throttle tick (or at once with `now`)."""
        self.data = data
        self._colors = None
        if self.cursor[0] >= data.shape[0] or self.cursor[1] >= data.shape[1]:
            self.cursor = (0, 0)
        if now:
            self._dirty = False
            self.refresh()
        else:
            self._dirty = True

    def _flush(self) -> None:
        if self._dirty:
            self._dirty = False
            self.refresh()

    def colors(self) -> np.ndarray:
        """Colours of every cell in the current mode (cached until the data or mode changes)."""
        assert self.data is not None
        if self._colors is None:
            self._colors = cell_colors(self.data, self.mode)
        return self._colors

    def watch_mode(self) -> None:
        self._colors = None
        self.refresh()

    def watch_fold(self) -> None:
        self.y_offset = 0
        self.x_offset = 0
        self._scroll_to_cursor()
        self.refresh()

    def watch_hover(self) -> None:
        self.refresh()

    def watch_cursor(self, cursor: tuple[int, int]) -> None:
        self._scroll_to_cursor()
        self.refresh()
        self.post_message(self.CellSelected(self, *cursor))

    # -- geometry --------------------------------------------------------

    @property
    def grid_width(self) -> int:
        return max(1, self.size.width - GUTTER)

    @property
    def shows_side(self) -> bool:
        """Is there room for the per-layer hit column next to all experts?"""
        if self.data is None or self.data.layer_hit is None:
            return False
        return self.data.shape[1] <= self.grid_width - SIDE_WIDTH

    @property
    def content_width(self) -> int:
        """Columns for expert cells (the grid minus the side column when it is shown)."""
        return self.grid_width - SIDE_WIDTH if self.shows_side else self.grid_width

    @property
    def cell_width(self) -> int:
        """Columns per expert: 1, or more when all experts fit several times over."""
        if self.data is None or self.data.shape[1] == 0:
            return 1
        return max(1, min(MAX_CELL_WIDTH, self.content_width // self.data.shape[1]))

    @property
    def experts_across(self) -> int:
        """Experts that fit on one line."""
        return max(1, self.content_width // self.cell_width)

    @property
    def grid_height(self) -> int:
        """Lines for the grid: everything but the legend and the info line."""
        return max(1, self.size.height - 2)

    def layout(self) -> Layout:
        """The densest-but-readable fit: every layer and expert on screen if any fit allows it,
        preferring one layer per row, then folded bands, then the ruler; otherwise the lines scroll."""
        if self.data is None:
            return Layout(False, 2, True)
        n_layers, n_experts = self.data.shape
        height = self.grid_height
        bands = math.ceil(n_experts / self.experts_across)
        pairs = math.ceil(n_layers / 2)
        fold_ok = self.fold != "scroll" and bands > 1
        if self.fold == "fold" or (fold_ok and bands * (pairs + 1) <= height):
            per_row = 1 if bands * (n_layers + 1) <= height else 2
            return Layout(True, per_row, True)
        if n_layers + 1 <= height:
            return Layout(False, 1, True)
        if pairs + 1 <= height:
            return Layout(False, 2, True)
        return Layout(False, 2, pairs > height)

    def is_folded(self) -> bool:
        return self.layout().folded

    def grid_lines(self) -> list[GridLine]:
        """Every line of the grid, before vertical scrolling."""
        if self.data is None:
            return []
        n_layers, n_experts = self.data.shape
        layout = self.layout()
        if layout.folded:
            across = self.experts_across
            bands = [(start, min(n_experts, start + across)) for start in range(0, n_experts, across)]
        else:
            bands = [(self.x_offset, min(n_experts, self.x_offset + self.experts_across))]
        lines = []
        for band, (first, last) in enumerate(bands):
            if layout.ruler:
                lines.append(GridLine("header", first, last, band=band))
            for top in range(0, n_layers, layout.per_row):
                bottom = top + 1 if layout.per_row == 2 and top + 1 < n_layers else -1
                lines.append(GridLine("row", first, last, top, bottom, band))
        return lines

    def position_text(self) -> str:
        """Which layers (and band) the pane shows when not every line fits, e.g. "layers 32–39 ▲",
        "band 2/3 · layers 0–19 ▼"; empty when everything is in view."""
        lines = self.grid_lines()
        if len(lines) <= self.grid_height:
            return ""
        visible = [line for line in lines[self.y_offset: self.y_offset + self.grid_height] if line.kind == "row"]
        if not visible:
            return ""
        n_layers = self.data.shape[0]  # type: ignore[union-attr]
        first, last = visible[0], visible[-1]
        low, high = first.top, max(last.top, last.bottom)
        arrows = ("▲" if self.y_offset > 0 else "") + ("▼" if self.y_offset + self.grid_height < len(lines) else "")
        text = f"layers {low}–{high} of {n_layers} {arrows}"
        if self.layout().folded:
            n_bands = lines[-1].band + 1
            bands = sorted({line.band + 1 for line in visible})
            which = str(bands[0]) if len(bands) == 1 else f"{bands[0]}–{bands[-1]}"
            text = f"band {which}/{n_bands} · {text}"
        return text

    def _scroll_to_cursor(self) -> None:
        if self.data is None or not self.size.width:
            return
        layer, expert = self.cursor
        if not self.is_folded():
            if expert < self.x_offset:
                self.x_offset = expert
            elif expert >= self.x_offset + self.experts_across:
                self.x_offset = expert - self.experts_across + 1
        ruler = 1 if self.layout().ruler else 0
        for index, line in enumerate(self.grid_lines()):
            if line.kind == "row" and layer in (line.top, line.bottom) and line.first_expert <= expert < line.last_expert:
                if index < self.y_offset + ruler:
                    self.y_offset = max(0, index - ruler)
                elif index >= self.y_offset + self.grid_height:
                    self.y_offset = index - self.grid_height + 1
                break

    def cell_at(self, x: int, y: int) -> tuple[int, int, int] | None:
        """(expert, top layer, bottom layer or -1) under screen cell (x, y), or None."""
        if self.data is None or x < GUTTER or y >= self.grid_height:
            return None
        lines = self.grid_lines()
        index = self.y_offset + y
        if index >= len(lines) or lines[index].kind != "row":
            return None
        line = lines[index]
        expert = line.first_expert + (x - GUTTER) // self.cell_width
        if expert >= line.last_expert:
            return None
        return expert, line.top, line.bottom

    # -- actions ---------------------------------------------------------

    def action_move(self, layers: int, experts: int) -> None:
        if self.data is None:
            return
        n_layers, n_experts = self.data.shape
        layer, expert = self.cursor
        self.cursor = (min(n_layers - 1, max(0, layer + layers)), min(n_experts - 1, max(0, expert + experts)))

    def action_page(self, direction: int) -> None:
        self.action_move(0, direction * self.experts_across)

    def action_edge(self, which: int) -> None:
        if self.data is not None:
            self.cursor = (self.cursor[0], (self.data.shape[1] - 1) if which else 0)

    def action_cycle_mode(self) -> None:
        if self.profile:
            return
        self.mode = MODES[(MODES.index(self.mode) + 1) % len(MODES)]

    def action_cycle_fold(self) -> None:
        self.fold = FOLDS[(FOLDS.index(self.fold) + 1) % len(FOLDS)]

    # -- mouse -----------------------------------------------------------

    def on_resize(self, event: events.Resize) -> None:
        """A new size starts from the top-left, with the cursor still in view."""
        self.x_offset = 0
        self.y_offset = 0
        self._scroll_to_cursor()
        self.refresh()

    def on_mouse_move(self, event: events.MouseMove) -> None:
        cell = self.cell_at(event.x, event.y)
        self._hover_pair = None if cell is None else cell[2]
        self.hover = None if cell is None else (cell[1], cell[0])

    def on_leave(self, event: events.Leave) -> None:
        self.hover = None

    def on_click(self, event: events.Click) -> None:
        cell = self.cell_at(event.x, event.y)
        if cell is not None:
            self.focus()
            self.cursor = (cell[1], cell[0])

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        self._scroll_lines(1)

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        self._scroll_lines(-1)

    def _scroll_lines(self, amount: int) -> None:
        limit = max(0, len(self.grid_lines()) - self.grid_height)
        self.y_offset = min(limit, max(0, self.y_offset + amount))
        self.refresh()

    # -- text ------------------------------------------------------------

    def describe(self, layer: int, expert: int) -> str:
        """One line about one cell: layer, expert, level, heat and last use."""
        if self.data is None:
            return ""
        data = self.data
        level = int(data.levels[layer, expert])
        heat = int(data.heat[layer, expert])
        total = int(data.heat[layer].sum())
        share = f" ({100 * heat / total:.1f}%)" if total else ""
        last = int(data.last_use[layer, expert])
        if self.mode == DIFF_MODE:
            return f"L{layer} E{expert} · A − B {heat / 100:+.2f} points of the layer's routings"
        if self.profile:
            return f"L{layer} E{expert} · heat {heat:,}{share}"
        parts = [
            f"L{layer} E{expert}",
            self.tier.level if level == LEVEL_GPU else LEVEL_NAMES.get(level, f"level {level}"),
            f"heat {heat:,}{share}",
            f"last use #{last}" if last >= 0 else "never used",
        ]
        if data.chosen[layer, expert]:
            parts.append("swapped in now" if data.swapped[layer, expert] else "chosen now")
        if data.swap_counts[layer, expert]:
            parts.append(f"swaps {int(data.swap_counts[layer, expert])}")
        return " · ".join(parts)

    def info_text(self) -> str:
        if self.data is None:
            return "no model"
        if self.hover is not None:
            layer, expert = self.hover
            text = self.describe(layer, expert)
            below = self._hover_pair
            if below is not None and below >= 0:  # the mouse cannot tell the halves of a cell apart
                text += "  |  " + self.describe(below, expert)
            return text
        return self.describe(*self.cursor)

    def _side_text(self, top: int, bottom: int) -> str:
        """RAM hit % of the two layers of a row, e.g. '  88%  41%'."""
        assert self.data is not None and self.data.layer_hit is not None

        def pct(layer: int) -> str:
            if layer < 0 or layer >= self.data.shape[0]:  # type: ignore[union-attr]
                return ""
            value = float(self.data.layer_hit[layer])  # type: ignore[index]
            return "   –" if math.isnan(value) else f"{value:3.0f}%"

        return f"  {pct(top)} {pct(bottom)}"

    def _ruler(self, first: int, last: int) -> str:
        cell = self.cell_width
        width = (last - first) * cell
        chars = [" "] * width
        step = 8 if width >= 32 else 4
        if cell >= 3:
            step = 2 if cell == 3 else 1
        for expert in range(first, last):
            if expert % step == 0:
                label = str(expert)
                offset = (expert - first) * cell
                if offset + len(label) <= width and all(c == " " for c in chars[max(0, offset - 1): offset + len(label)]):
                    chars[offset: offset + len(label)] = label
        return "".join(chars)

    def _show_position(self, text: str) -> None:
        self.border_subtitle = text

    def _append_cells(self, text: Text, colors: np.ndarray, line: GridLine, glyph: str,
                      cursor_expert: int, cursor_layer: int) -> None:
        """One row of cells; neighbours of one colour are appended as one run (a 256-expert row
        is a few dozen runs, not 256 spans)."""
        first, last = line.first_expert, line.last_expert
        top_colors = list(colors[line.top, first:last])
        pair = line.bottom >= 0
        bottom_colors = list(colors[line.bottom, first:last]) if pair else None
        if 0 <= cursor_expert - first < len(top_colors):
            if cursor_layer == line.top:
                top_colors[cursor_expert - first] = CURSOR_COLOR
            elif pair and cursor_layer == line.bottom:
                bottom_colors[cursor_expert - first] = CURSOR_COLOR  # type: ignore[index]
        cell = self.cell_width
        keys = list(zip(top_colors, bottom_colors)) if pair else top_colors
        run_start = 0
        for index in range(1, len(keys) + 1):
            if index < len(keys) and keys[index] == keys[run_start]:
                continue
            key = keys[run_start]
            style = half_block_style(*key) if pair else solid_style(key)  # type: ignore[misc]
            text.append(glyph * (cell * (index - run_start)), style)
            run_start = index

    def render(self) -> Text:
        self.redraw_count += 1
        text = Text(no_wrap=True, overflow="crop", end="")
        if self.data is None or self.data.levels.size == 0:
            text.append(self.placeholder)
            return text
        n_layers, n_experts = self.data.shape
        colors = self.colors()
        ruler_style = self.get_component_rich_style("heatmap--ruler")
        cursor_layer, cursor_expert = self.cursor
        show_cursor = self.has_focus
        subtitle = self.position_text()
        if self.border_subtitle != subtitle:  # the border is drawn apart from the content: after this frame
            self.call_after_refresh(self._show_position, subtitle)
        lines = self.grid_lines()
        layout = self.layout()
        folded = layout.folded
        glyph = "▀" if layout.per_row == 2 else "█"
        visible = lines[self.y_offset: self.y_offset + self.grid_height]
        for line in visible:
            if line.kind == "header":
                text.append("exp ".ljust(GUTTER), ruler_style)
                ruler = self._ruler(line.first_expert, line.last_expert)
                if not folded and n_experts > self.experts_across:
                    where = f" ◀{line.first_expert}–{line.last_expert - 1} of {n_experts}▶"
                    ruler = ruler[: max(0, len(ruler) - len(where))] + where
                text.append(ruler, ruler_style)
                if self.shows_side:
                    text.append("  RAM hit", ruler_style)
                text.append("\n")
                continue
            text.append(f"{line.top:>3} ", ruler_style)
            self._append_cells(text, colors, line, glyph, cursor_expert if show_cursor else -1, cursor_layer)
            if self.shows_side:
                text.append(self._side_text(line.top, line.bottom), ruler_style)
            text.append("\n")
        for _ in range(self.grid_height - len(visible)):
            text.append("\n")
        legend_style = self.get_component_rich_style("heatmap--legend")
        legend = Text(f"{self.mode}: ", legend_style, no_wrap=True)
        for color, label in legend_entries(self.mode, self.tier):
            legend.append("■", Style(color=color))
            legend.append(f"{label} ", legend_style)
        info = Text(self.info_text(), self.get_component_rich_style("heatmap--info"), no_wrap=True)
        if self.size.width:
            legend.truncate(self.size.width)
            info.truncate(self.size.width, overflow="ellipsis")
        text.append_text(legend)
        text.append("\n")
        text.append_text(info)
        return text
