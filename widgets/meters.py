"""Meters: the routing and cache figures of the running session.

Each meter shows its current value and a sparkline of its recent past; a
plot below draws hit rate and speed over tokens with a vertical mark at
every knob change, so the effect of a change is visible where it happened.
Meter values arrive as the meter fold gives them (rates as fractions, None
without samples); percent appears only as they are drawn. Percentage
sparklines use a fixed 0–100 scale (a steady 100% is a full bar, a steady
0% the lowest); the others run from 0 to their largest recent value.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from rich.color import Color as RichColor
from rich.color_triplet import ColorTriplet
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult, RenderResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static
from textual_plotext import PlotextPlot

from tierlab.engine.meters import METER_BY_KEY, RATE, Meter, select

HISTORY = 400
"""Tokens of history kept for sparklines and the plot."""


METERS: tuple[Meter, ...] = select(
    ("ram_hit", "shadow_hit", "vram_hit", "oracle_hit", "swap", "route_agree", "route_kl", "tok_s", "fetch_ms",
     "compute_ms", "disk_mib", "ram_hit_without_prefetch")
)
"""The panel's rows, from the one meter catalogue (engine/meters.py)."""


BAND: tuple[tuple[str, str], ...] = (("lru_half", "½×"), ("lru_2x", "2×"), ("lru_4x", "4×"))
"""The oracle band's LRU sizes the meters box names, with their short labels."""


def band_line(meters: Mapping[str, float | None] | None) -> str:
    """The LRU hit rates at other cache sizes as one short line ('LRU ½× 51% · 2× 91% · 4× –'), or ''
    before the band's first replay: beside the realised hit and the Belady bound it says whether a
    bigger cache or the routing lever is the better move."""
    if not meters:
        return ""
    parts = [f"{label} {METER_BY_KEY[key].show(meters.get(key)).strip()}" for key, label in BAND]
    return "LRU " + " · ".join(parts)


@dataclass
class KnobMark:
    """A knob change, placed at the token it first applied to."""

    token: int
    label: str


@dataclass
class MeterHistory:
    """Meter values per token, plus where knobs changed.

    ``latest`` holds the last values as given (fractions, None = no samples);
    ``series`` the drawn history in the unit shown (percent for rates, 0 where missing, for
    the sparklines); ``present`` says which of those had samples (the plot draws only those).
    """

    limit: int = HISTORY
    tokens: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    series: dict[str, deque] = field(default_factory=dict)
    latest: dict[str, float | None] = field(default_factory=dict)
    marks: list[KnobMark] = field(default_factory=list)
    present: dict[str, deque] = field(default_factory=dict)

    def add(self, token: int, meters: Mapping[str, float]) -> None:
        """Record one token's meters."""
        self.tokens.append(token)
        for spec in METERS:
            value = meters.get(spec.key)
            shown = spec.scaled(float(value)) if value is not None else 0.0
            self.series.setdefault(spec.key, deque(maxlen=self.limit)).append(shown)
            self.present.setdefault(spec.key, deque(maxlen=self.limit)).append(value is not None)
        self.latest = {key: None if value is None else float(value) for key, value in meters.items()
                       if value is None or isinstance(value, (int, float))}

    def set_latest(self, meters: Mapping[str, float | None]) -> None:
        """Show these values now, before the next token (a knob change empties a window)."""
        self.latest = {key: None if value is None else float(value) for key, value in meters.items()
                       if value is None or isinstance(value, (int, float))}

    def replace_latest(self, key: str, value: float | None) -> None:
        """Correct one meter of the latest token (a figure computed after the token was recorded)."""
        if not self.latest:
            return
        self.latest[key] = value
        series = self.series.get(key)
        if series:
            series[-1] = METER_BY_KEY[key].scaled(float(value)) if value is not None else 0.0
            self.present[key][-1] = value is not None

    def mark(self, token: int, label: str) -> None:
        """Remember a knob change at `token`."""
        self.marks.append(KnobMark(token, label))

    def copy(self) -> "MeterHistory":
        """An independent copy (the values are floats, so copying the containers is enough)."""
        return MeterHistory(
            limit=self.limit,
            tokens=deque(self.tokens, maxlen=self.tokens.maxlen),
            series={key: deque(values, maxlen=values.maxlen) for key, values in self.series.items()},
            latest=dict(self.latest),
            marks=list(self.marks),
            present={key: deque(flags, maxlen=flags.maxlen) for key, flags in self.present.items()},
        )

    def values(self, key: str) -> list[float]:
        return list(self.series.get(key, ()))

    def points(self, key: str) -> tuple[list[int], list[float]]:
        """(tokens, values) of the tokens where the meter had samples: no line where it had none."""
        flags = self.present.get(key, ())
        pairs = [(t, v) for t, v, ok in zip(self.tokens, self.series.get(key, ()), flags) if ok]
        return [t for t, _ in pairs], [v for _, v in pairs]

    def clear(self) -> None:
        self.present.clear()
        self.tokens.clear()
        self.series.clear()
        self.latest.clear()
        self.marks.clear()


BARS = "▁▂▃▄▅▆▇█"


def bar_levels(values: list[float], width: int, top: float | None) -> list[float]:
    """Each column's height in [0, 1]: the largest value of its share of `values` over `top`
    (a fixed scale; None: the largest value shown)."""
    if not values or width <= 0:
        return []
    if len(values) > width:
        step = len(values) / width
        values = [max(values[int(i * step):max(int((i + 1) * step), int(i * step) + 1)]) for i in range(width)]
    scale = top if top is not None else max(max(values), 0.0)
    if scale <= 0:
        return [0.0] * len(values)
    return [min(max(v / scale, 0.0), 1.0) for v in values]


class ScaledSparkline(Sparkline):
    """A sparkline on a fixed scale from 0 to `top` (None: to the largest value shown)."""

    def __init__(self, top: float | None = None, **kwargs) -> None:
        super().__init__([], **kwargs)
        self.top = top

    def render(self) -> RenderResult:
        _, base = self.background_colors
        low = (base + self.get_component_styles("sparkline--min-color").color).rich_color
        high = (base + self.get_component_styles("sparkline--max-color").color).rich_color
        text = Text()
        for level in bar_levels(list(self.data or []), self.size.width, self.top):
            colour = RichColor.from_triplet(_blend(low, high, level))
            text.append(BARS[min(int(level * (len(BARS) - 1) + 0.5), len(BARS) - 1)], Style(color=colour))
        return text


def _blend(low: RichColor, high: RichColor, level: float) -> ColorTriplet:
    a, b = low.get_truecolor(), high.get_truecolor()
    return ColorTriplet(*(int(x + (y - x) * level) for x, y in zip(a, b)))


class MeterRow(Horizontal):
    """One meter: label, current value, sparkline."""

    DEFAULT_CSS = """
    MeterRow { height: 1; }
    MeterRow > .meter--label { width: 11; color: $text-muted; }
    MeterRow > .meter--value { width: 16; text-align: right; padding-right: 1; }
    MeterRow > Sparkline { width: 1fr; height: 1; }
    """

    def __init__(self, spec: Meter) -> None:
        super().__init__(id=f"meter-{spec.key}")
        self.spec = spec
        self.tooltip = spec.help

    def compose(self) -> ComposeResult:
        yield Label(self.spec.label, classes="meter--label")
        yield Static("    –", classes="meter--value")
        yield ScaledSparkline(top=100.0 if self.spec.unit == RATE else None)

    def show(self, latest: Mapping[str, float], history: Iterable[float] | None) -> None:
        """Show the latest value, and the sparkline of `history` unless it is None (left as it is)."""
        value = latest.get(self.spec.key)
        text = "    –" if value is None else self.spec.show(value, "panel")
        if self.spec.key == "swap" and latest.get("swaps_to_vram") is not None:
            text = f"{text} {int(latest['swaps_to_vram'])}→V"
        shown = self.query_one(".meter--value", Static)
        if text != str(shown.content):  # the value has a fixed width: repaint it, no layout
            shown.update(text, layout=False)
        if history is not None:
            self.query_one(Sparkline).data = list(history)  # a reactive: repaints only when the values differ


class MetersPanel(Vertical):
    """All meters, one per row."""

    DEFAULT_CSS = """
    MetersPanel { height: auto; }
    """

    def compose(self) -> ComposeResult:
        for spec in METERS:
            yield MeterRow(spec)

    def name_tier(self, label: str) -> None:
        """Call the tier's hit meter `label` ("VRAM hit" on a GPU, "tier hit" on an OpenCL CPU device)."""
        self.query_one("#meter-vram_hit .meter--label", Label).update(label)

    def show(self, history: MeterHistory, *, sparklines: bool = True) -> None:
        """Draw the latest values and, with `sparklines`, the recent past from `history`.

        Sparklines are the costly part to draw (nine Rich renders), so the app draws them
        less often than the values while tokens stream.
        """
        for row in self.query(MeterRow):
            row.show(history.latest, history.values(row.spec.key) if sparklines else None)


PLOT_AXES_WIDTH = 14
"""Columns the plot's two tick-label axes take at most; the rest is the canvas the labels share."""
PLOT_FRAME_ROWS = 4
"""Rows of the plot outside its canvas: title, top and bottom frame, the token axis."""
LABEL_LEVELS = 3
"""Rows from the top of the canvas that knob-change labels may use."""


@dataclass(frozen=True)
class PlacedLabel:
    """A knob change's label where the plot writes it: canvas row from the top, and its text."""

    token: int
    level: int
    text: str


def place_labels(marks: Iterable[KnobMark], first: int, last: int, columns: int,
                 levels: int = LABEL_LEVELS) -> list[PlacedLabel]:
    """Labels that never overlap: each on the highest row where it clears the labels already
    there by a column, shortened to the canvas edge; one that fits nowhere is left to its line."""
    span = max(last - first, 1)
    per_column = span / max(columns - 1, 1)
    taken: list[list[tuple[int, int]]] = [[] for _ in range(levels)]
    placed = []
    for mark in sorted(marks, key=lambda m: m.token):
        if not first <= mark.token <= last:
            continue
        start = round((mark.token - first) / per_column)
        room = columns - start
        text = mark.label if len(mark.label) <= room else mark.label[: max(room - 1, 0)] + "…"
        if room < 2:
            continue
        end = start + len(text)
        for level, spans in enumerate(taken):
            if all(end + 1 <= a or start >= b + 1 for a, b in spans):
                spans.append((start, end))
                placed.append(PlacedLabel(mark.token, level, text))
                break
    return placed


class MeterPlot(PlotextPlot):
    """Hit rates and tokens/s over tokens, with a vertical line at each knob change.

    The title is the legend (which series is on which axis), so no legend box covers the
    curves, and the knob changes' labels are placed so that none covers another.
    """

    DEFAULT_CSS = """
    MeterPlot { height: 1fr; min-height: 6; }
    """

    TITLE = "left: RAM hit rate %{vram} · right: tok/s · │ knob change"
    tier_meter = "VRAM hit"
    """The tier's hit meter as the plot names it (`tier hit` for an OpenCL CPU device)."""

    def show(self, history: MeterHistory) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        tokens = list(history.tokens)
        vram = history.points("vram_hit")
        plt.title(self.TITLE.format(vram=f", {self.tier_meter} %" if vram[0] else ""))
        if tokens:
            for key, color in (("ram_hit", "cyan"), ("vram_hit", "green")):
                xs, ys = history.points(key)
                if xs:
                    plt.plot(xs, ys, marker="braille", color=color)
            xs, ys = history.points("tok_s")
            if xs:
                plt.plot(xs, ys, marker="braille", color="orange", yside="right")
            first, last = tokens[0], max(tokens[-1], tokens[0] + 1)
            for mark in history.marks:
                if mark.token >= first:  # a vertical line (a two-point series)
                    plt.plot([mark.token, mark.token], [0, 100], marker="braille", color="magenta")
            rows = max(self.size.height - PLOT_FRAME_ROWS, 1)
            columns = max(self.size.width - PLOT_AXES_WIDTH, 1)
            for label in place_labels(history.marks, first, last, columns, min(LABEL_LEVELS, rows)):
                height = 100 - (label.level + 0.5) * 100 / rows
                plt.text(label.text, label.token, height, color="magenta", alignment="left")
            plt.xlim(first, last)
        plt.ylim(0, 100, yside="left")
        self.refresh()

    def on_resize(self) -> None:
        self.refresh()
