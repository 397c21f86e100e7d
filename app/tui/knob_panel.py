"""The knobs panel: the routing levers the app lets you move while chatting.

Ranges that depend on the model (ROUTE_J up to K, ROUTE_M from K to E, the
RAM cache up to E slots) are set once the engine is loaded; the others come
from the knob specs. The panel only shows values and posts changes: the app
hands them to the engine.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Button

from tierlab.engine.knobs import SPEC_BY_NAME, KnobValues
from tierlab.widgets.knob import Knob, KnobSelect, KnobSwitch

CACHE_SLOTS = "cache slots"
"""Name of the knob that sets the RAM cache slots per layer (an engine setting, not a routing knob)."""

NUMERIC_KNOBS = ("ROUTE_J", "ROUTE_M", "ROUTE_P", "ROUTE_ALPHA", "ROUTE_LAMBDA", "PILOT")
FLOAT_STEPS = {"ROUTE_P": (0.01, 0.1), "ROUTE_ALPHA": (0.01, 0.1), "ROUTE_LAMBDA": (0.01, 0.1)}


def knob_id(name: str) -> str:
    return "knob-" + name.lower().replace(" ", "-").replace("_", "-")


def agree_to_switch(value: str) -> bool:
    """ROUTE_AGREE as a switch: on (ROUTE_AGREE=1, meters always on), auto (on with the lever)."""
    return value == "1"


class KnobsPanel(VerticalScroll):
    """Switches, select and sliders for the routing levers and the RAM cache size."""

    DEFAULT_CSS = """
    KnobsPanel { height: auto; max-height: 100%; overflow-x: hidden; scrollbar-size-vertical: 1; }
    KnobsPanel > Button { width: 1fr; margin-top: 0; }
    """

    def __init__(self, top_k: int = 2, n_experts: int = 8, cache_slots: int = 4, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.top_k = top_k
        self.n_experts = n_experts
        self.cache_slots = cache_slots

    def _range(self, name: str) -> tuple[float, float]:
        spec = SPEC_BY_NAME[name]
        if name == "ROUTE_J":
            return 0, self.top_k
        if name == "ROUTE_M":
            return self.top_k, self.n_experts
        return float(spec.lo or 0), float(spec.hi if spec.hi is not None else 1)

    def compose(self) -> ComposeResult:
        defaults = KnobValues()
        yield KnobSwitch("CACHE_ROUTE", defaults.CACHE_ROUTE, default=defaults.CACHE_ROUTE,
                         help=SPEC_BY_NAME["CACHE_ROUTE"].help, id=knob_id("CACHE_ROUTE"))
        yield KnobSwitch("ROUTE_AGREE", agree_to_switch(defaults.ROUTE_AGREE), default=False, on_text="on",
                         off_text="auto", help=SPEC_BY_NAME["ROUTE_AGREE"].help + " (off = auto)", id=knob_id("ROUTE_AGREE"))
        mode = SPEC_BY_NAME["ROUTE_MODE"]
        yield KnobSelect("ROUTE_MODE", mode.choices or (), defaults.ROUTE_MODE, default=str(mode.default),
                         help=mode.help, id=knob_id("ROUTE_MODE"))
        for name in NUMERIC_KNOBS:
            spec = SPEC_BY_NAME[name]
            low, high = self._range(name)
            step, big = FLOAT_STEPS.get(name, (None, None))
            yield Knob(name, low, high, value=getattr(defaults, name), default=spec.default,  # type: ignore[arg-type]
                       integer=spec.kind is int, step=step, big_step=big, help=spec.help, id=knob_id(name))
        yield Knob(CACHE_SLOTS, 1, max(1, self.n_experts), value=self.cache_slots, default=self.cache_slots, integer=True,
                   help="RAM cache slots per layer (experts kept in memory; ┊ marks the size at start)",
                   id=knob_id(CACHE_SLOTS))
        yield Button("Reset to defaults", id="reset-knobs", compact=True)

    def configure(self, top_k: int, n_experts: int, cache_slots: int) -> None:
        """Fit the model-dependent ranges once the engine is known."""
        self.top_k, self.n_experts, self.cache_slots = top_k, n_experts, cache_slots
        for name in ("ROUTE_J", "ROUTE_M"):
            self.query_one("#" + knob_id(name), Knob).set_range(*self._range(name))
        slots = self.query_one("#" + knob_id(CACHE_SLOTS), Knob)
        slots.set_range(1, max(1, n_experts), default=cache_slots)
        slots.set_value_quietly(cache_slots)

    def show(self, values: KnobValues, cache_slots: int | None = None) -> None:
        """Show the engine's values without posting changes back."""
        self.query_one("#" + knob_id("CACHE_ROUTE"), KnobSwitch).set_value_quietly(values.CACHE_ROUTE)
        self.query_one("#" + knob_id("ROUTE_AGREE"), KnobSwitch).set_value_quietly(agree_to_switch(values.ROUTE_AGREE))
        self.query_one("#" + knob_id("ROUTE_MODE"), KnobSelect).set_value_quietly(values.ROUTE_MODE)
        for name in NUMERIC_KNOBS:
            self.query_one("#" + knob_id(name), Knob).set_value_quietly(getattr(values, name))
        if cache_slots is not None:
            self.query_one("#" + knob_id(CACHE_SLOTS), Knob).set_value_quietly(cache_slots)
