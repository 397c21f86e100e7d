"""Knobs: one-line sliders for numeric levers, plus a switch and a select.

Textual has no slider, and the one on PyPI is GPL and integer-only, so the
numeric knob is drawn here: a name, a bar with the default marked, and the
value. Keys and mouse both move it; every move posts `Knob.Changed` so the
app can hand the new value to the engine at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Label, Select, Switch

NAME_WIDTH = 13
"""Columns reserved for the knob's name (the longest lever, ROUTE_LAMBDA, fits)."""


def format_number(value: float, integer: bool) -> str:
    """Short text for a knob value: integers plain, floats with two decimals."""
    return str(int(value)) if integer else f"{value:.2f}"


@dataclass(frozen=True)
class BarLayout:
    """Where the parts of a knob sit on its line, so drawing and clicking agree."""

    bar_x: int
    bar_width: int
    value_width: int
    show_default: bool


def knob_layout(width: int, value_width: int, default_width: int) -> BarLayout:
    """Split a line of `width` cells into name, bar and value (dropping the default if cramped)."""
    show_default = width - NAME_WIDTH - value_width - default_width - 2 >= 6
    tail = value_width + 1 + (default_width + 1 if show_default else 0)
    return BarLayout(NAME_WIDTH, max(1, width - NAME_WIDTH - tail), value_width, show_default)


class KnobChanged(Message):
    """A knob-like widget took a new value; each widget's `Changed` subclasses this."""

    def __init__(self, knob, value) -> None:
        super().__init__()
        self.knob = knob
        self.value = value

    @property
    def control(self):
        return self.knob

    @property
    def knob_name(self) -> str:
        return self.knob.knob_name


class Knob(Widget, can_focus=True):
    """A numeric knob between `low` and `high`, stepped by keys or set by mouse."""

    DEFAULT_CSS = """
    Knob {
        height: 1;
        width: 1fr;
    }
    Knob > .knob--name { color: $text-muted; }
    Knob:focus > .knob--name { color: $accent; text-style: bold; }
    Knob > .knob--fill { color: $primary; }
    Knob:focus > .knob--fill { color: $accent; }
    Knob > .knob--empty { color: $panel-lighten-2; }
    Knob > .knob--default { color: $warning; }
    Knob > .knob--changed { color: $warning; text-style: bold; }
    """

    COMPONENT_CLASSES = {"knob--name", "knob--fill", "knob--empty", "knob--default", "knob--changed"}

    BINDINGS = [
        Binding("left", "step(-1)", "Step down", show=False),
        Binding("right", "step(1)", "Step up", show=False),
        Binding("pagedown", "step(-10)", "Big step down", show=False),
        Binding("pageup", "step(10)", "Big step up", show=False),
        Binding("home", "to_end(0)", "Minimum", show=False),
        Binding("end", "to_end(1)", "Maximum", show=False),
        Binding("delete,backspace", "to_default", "Default", show=False),
    ]

    value: reactive[float] = reactive(0.0, layout=False)

    class Changed(KnobChanged):
        """The knob moved to a new value."""

    def __init__(
        self,
        knob_name: str,
        low: float,
        high: float,
        *,
        value: float | None = None,
        default: float | None = None,
        integer: bool = False,
        step: float | None = None,
        big_step: float | None = None,
        help: str = "",
        id: str | None = None,
        classes: str | None = None,
        disabled: bool = False,
    ) -> None:
        super().__init__(id=id, classes=classes, disabled=disabled)
        self.knob_name = knob_name
        self.integer = integer
        self.low = float(low)
        self.high = float(max(high, low))
        self._wanted_default = float(low if default is None else default)
        self.default = self.clamp(self._wanted_default)
        self._auto_step = step is None
        self._auto_big_step = big_step is None
        self.step = 1.0 if integer else 0.01
        self.big_step = 1.0
        self._fit_steps()
        if step is not None:
            self.step = float(step)
        if big_step is not None:
            self.big_step = float(big_step)
        self._dragging = False
        if help:
            self.tooltip = f"{knob_name}: {help}"
        self.set_reactive(Knob.value, self.clamp(self.default if value is None else value))

    # -- value handling -------------------------------------------------

    def clamp(self, value: float) -> float:
        """Keep a value inside the range, rounded to whole steps for integer knobs."""
        value = min(self.high, max(self.low, float(value)))
        if self.integer:
            value = float(round(value))
        else:
            value = round(value, 6)
        return value

    def set_range(self, low: float, high: float, default: float | None = None) -> None:
        """Change the range (e.g. once the model's expert count is known), keeping the value inside."""
        if default is not None:
            self._wanted_default = float(default)
        self.low = float(low)
        self.high = float(max(high, low))
        self._fit_steps()
        self.default = self.clamp(self._wanted_default)
        self.set_reactive(Knob.value, self.clamp(self.value))
        self.refresh()

    def _fit_steps(self) -> None:
        """Steps not given explicitly follow the range: a hundredth (or 1) and a tenth (at least 1 for integers)."""
        span = self.high - self.low
        if self._auto_step:
            self.step = 1.0 if self.integer else (span / 100 or 0.01)
        if self._auto_big_step:
            self.big_step = max(1.0, float(round(span / 10))) if self.integer else max(self.step, span / 10)

    def validate_value(self, value: float) -> float:
        return self.clamp(value)

    def watch_value(self, old: float, new: float) -> None:
        if old != new:
            self.post_message(self.Changed(self, self.typed_value))

    def set_value_quietly(self, value: float) -> None:
        """Show a value that came from elsewhere (the engine) without posting Changed."""
        self.set_reactive(Knob.value, self.clamp(value))
        self.refresh()

    @property
    def typed_value(self) -> int | float:
        """The value as the knob's own type (int for integer knobs)."""
        return int(self.value) if self.integer else float(self.value)

    # -- actions ---------------------------------------------------------

    def action_step(self, steps: int) -> None:
        amount = self.step if abs(steps) == 1 else self.big_step
        self.value = self.clamp(self.value + (amount if steps > 0 else -amount))

    def action_to_end(self, which: int) -> None:
        self.value = self.high if which else self.low

    def action_to_default(self) -> None:
        self.value = self.default

    # -- drawing ---------------------------------------------------------

    def _texts(self) -> tuple[str, str]:
        value_text = format_number(self.value, self.integer)
        default_text = f"({format_number(self.default, self.integer)})"
        return value_text, default_text

    def _layout(self) -> BarLayout:
        width = max(self.size.width, NAME_WIDTH + 8)
        span = max(len(format_number(self.low, self.integer)), len(format_number(self.high, self.integer)))
        default_width = len(self._texts()[1])
        return knob_layout(width, max(span, 4), default_width)

    def _position(self, value: float, bar_width: int) -> int:
        if self.high <= self.low:
            return 0
        fraction = (value - self.low) / (self.high - self.low)
        return min(bar_width - 1, max(0, round(fraction * (bar_width - 1))))

    def render(self) -> Text:
        layout = self._layout()
        name_style = self.get_component_rich_style("knob--name")
        fill_style = self.get_component_rich_style("knob--fill")
        empty_style = self.get_component_rich_style("knob--empty")
        default_style = self.get_component_rich_style("knob--default")
        changed_style = self.get_component_rich_style("knob--changed")

        thumb = self._position(self.value, layout.bar_width)
        mark = self._position(self.default, layout.bar_width)
        text = Text(no_wrap=True, overflow="crop")
        text.append(self.knob_name[: NAME_WIDTH - 1].ljust(NAME_WIDTH), name_style)
        for x in range(layout.bar_width):
            if x == thumb:
                text.append("●", fill_style)
            elif x < thumb:
                text.append("━", fill_style)
            elif x == mark:
                text.append("┊", default_style)
            else:
                text.append("─", empty_style)
        value_text, default_text = self._texts()
        is_default = self.value == self.default
        text.append(" " + value_text.rjust(layout.value_width), "" if is_default else changed_style)
        if layout.show_default:
            text.append(" " + default_text, empty_style if is_default else default_style)
        return text

    # -- mouse -----------------------------------------------------------

    def _value_at(self, x: int) -> float | None:
        layout = self._layout()
        offset = x - layout.bar_x
        if offset < 0 or offset >= layout.bar_width:
            return None
        if layout.bar_width == 1:
            return self.low
        return self.clamp(self.low + (self.high - self.low) * offset / (layout.bar_width - 1))

    def on_mouse_down(self, event: events.MouseDown) -> None:
        value = self._value_at(event.x)
        if value is None:
            return
        self.focus()
        self._dragging = True
        self.capture_mouse()
        self.value = value

    def on_mouse_move(self, event: events.MouseMove) -> None:
        if not self._dragging:
            return
        layout = self._layout()
        x = min(layout.bar_x + layout.bar_width - 1, max(layout.bar_x, event.x))
        value = self._value_at(x)
        if value is not None:
            self.value = value

    def on_mouse_up(self, event: events.MouseUp) -> None:
        if self._dragging:
            self._dragging = False
            self.release_mouse()


class KnobSwitch(Horizontal):
    """A boolean knob: its name beside a Textual Switch."""

    DEFAULT_CSS = """
    KnobSwitch { height: 1; width: 1fr; }
    KnobSwitch > Label { width: 13; color: $text-muted; }
    KnobSwitch > Switch { height: 1; border: none; padding: 0; width: 6; }
    KnobSwitch > Switch:focus { border: none; }
    KnobSwitch > .knob-switch--state { width: 1fr; padding-left: 1; color: $text-muted; }
    """

    class Changed(KnobChanged):
        """The switch flipped."""

    def __init__(
        self,
        knob_name: str,
        value: bool = False,
        *,
        default: bool = False,
        on_text: str = "on",
        off_text: str = "off",
        help: str = "",
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.knob_name = knob_name
        self.default = default
        self.on_text = on_text
        self.off_text = off_text
        self._initial = value
        if help:
            self.tooltip = f"{knob_name}: {help}"

    def compose(self) -> ComposeResult:
        yield Label(self.knob_name)
        yield Switch(self._initial, animate=False)
        yield Label(self._state_text(self._initial), classes="knob-switch--state")

    def _state_text(self, value: bool) -> str:
        default = self.on_text if self.default else self.off_text
        return (self.on_text if value else self.off_text) + f" ({default})"

    @property
    def value(self) -> bool:
        return self.query_one(Switch).value

    @value.setter
    def value(self, value: bool) -> None:
        self.query_one(Switch).value = bool(value)

    def set_value_quietly(self, value: bool) -> None:
        """Show a value that came from elsewhere without posting Changed."""
        switch = self.query_one(Switch)
        with switch.prevent(Switch.Changed):
            switch.value = bool(value)
        self.query_one(".knob-switch--state", Label).update(self._state_text(bool(value)))

    def on_switch_changed(self, event: Switch.Changed) -> None:
        event.stop()
        self.query_one(".knob-switch--state", Label).update(self._state_text(event.value))
        self.post_message(self.Changed(self, event.value))


class KnobSelect(Horizontal):
    """A knob with named choices (ROUTE_MODE, ROUTE_AGREE): its name beside a Textual Select."""

    DEFAULT_CSS = """
    KnobSelect { height: 1; width: 1fr; }
    KnobSelect > Label { width: 13; color: $text-muted; }
    KnobSelect > Select { width: 1fr; }
    """

    class Changed(KnobChanged):
        """Another choice was picked."""

    def __init__(
        self, knob_name: str, choices: Sequence[str], value: str, *, default: str | None = None, help: str = "", id: str | None = None
    ) -> None:
        super().__init__(id=id)
        self.knob_name = knob_name
        self.choices = tuple(choices)
        self.default = default if default is not None else self.choices[0]
        self._initial = value
        self._shown = value
        if help:
            self.tooltip = f"{knob_name}: {help}"

    def compose(self) -> ComposeResult:
        yield Label(self.knob_name)
        yield Select([(c, c) for c in self.choices], value=self._initial, allow_blank=False, compact=True)

    @property
    def value(self) -> str:
        return str(self.query_one(Select).value)

    @value.setter
    def value(self, value: str) -> None:
        self.query_one(Select).value = value

    def set_value_quietly(self, value: str) -> None:
        """Show a value that came from elsewhere without posting Changed."""
        select = self.query_one(Select)
        self._shown = value
        with select.prevent(Select.Changed):
            select.value = value

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        if isinstance(event.value, str) and event.value != self._shown:
            self._shown = event.value
            self.post_message(self.Changed(self, str(event.value)))
