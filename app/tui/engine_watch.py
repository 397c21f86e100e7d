"""What the app keeps of the engine's per-token reports.

The engine calls its listeners from its own thread after every token; the
UI redraws at its own pace (a few times a second). This object sits between
the two: the listener only folds the event into its own meters and a few
arrays under a lock (it never calls back into the engine), and the UI copies
them out when it is ready to draw. The Belady bound comes from an
`OracleBand` over the last `WINDOW` tokens, replayed on the band's own thread.

The meters are a `WindowedMeters` (engine/meters.py): the last N tokens,
since the last knob change, since the watch started. The watch keeps a
history per window, so switching windows (`cycle_window`) shows that
window's past at once; a knob change empties the knob window and blanks the
lever's meters (when the change turned them off) before the next token.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from tierlab.app.lab.oracle import OracleBand, OracleReading
from tierlab.engine.events import TokenEvent
from tierlab.engine.knobs import KnobChange
from tierlab.engine.meters import RECENT_TOKENS, WINDOWS, MeterFold, Segment, WindowedMeters, read_store_counters, \
    window_title
from tierlab.engine.surface import EngineSurface
from tierlab.widgets.heatmap import HeatmapData
from tierlab.widgets.meters import MeterHistory


ORACLE_INTERVAL = 1.0
"""Seconds between recomputations of the oracle (Belady) hit rate."""


def format_knob_value(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class EngineWatch:
    """Collects routing, residency and meters from an engine for the app to draw."""

    def __init__(self, engine: EngineSurface) -> None:
        self.engine = engine
        config = engine.config
        self.n_layers = int(config.n_layers)
        self.n_experts = int(config.n_experts)
        shape = (self.n_layers, self.n_experts)
        self.lock = threading.Lock()
        self.tokens_seen = 0
        """Tokens (prefill and decode) since the app opened the engine: the x axis of the plots."""
        self.last_use = np.full(shape, -1, np.int64)
        self.swap_counts = np.zeros(shape, np.int64)
        self.chosen = np.zeros(shape, bool)
        self.swapped = np.zeros(shape, bool)
        self.windows = WindowedMeters(RECENT_TOKENS, baseline=read_store_counters(engine))
        """The meters of the tokens watched, over three windows (the app's figures)."""
        self.window = WINDOWS[0]
        """The window the app shows."""
        self.histories = {window: MeterHistory() for window in WINDOWS}
        seq, values = engine.knobs.versioned()
        self.knobs_by_seq = {seq: values}
        """The knob values of each change seen, by its number (segments name their setting)."""
        self.oracle = OracleBand(interval=ORACLE_INTERVAL, n_experts=self.n_experts)
        self.last_event: TokenEvent | None = None
        self.meter_errors = 0
        self._closed = False
        self.oracle.start()
        engine.subscribe(self._on_token)
        engine.knobs.subscribe(self._on_knob)

    # -- listeners (engine thread for tokens, any thread for knobs) ---------

    def _on_token(self, event: TokenEvent) -> None:
        if self._closed:
            return
        chosen = np.zeros_like(self.chosen)
        swapped = np.zeros_like(self.swapped)
        self.oracle.add(event)
        with self.lock:
            token = self.tokens_seen
            self.tokens_seen += 1
            try:
                self.windows.add(event)
                knobs = self.engine.knobs.snapshot()
                oracle = self.oracle.latest
                for window, history in self.histories.items():
                    meters = self.windows.summary(window, knobs)
                    meters["oracle_hit"] = oracle
                    history.add(token, meters)
            except Exception:  # a meter that fails must not stop generation
                self.meter_errors += 1
                for history in self.histories.values():
                    history.add(token, {})
            for route in event.layers:
                ids = np.asarray(route.chosen)
                used = ids >= 0
                chosen[route.layer, ids[used]] = True
                self.last_use[route.layer, ids[used]] = token
                subs = ids[used & np.asarray(route.swapped, bool)]
                swapped[route.layer, subs] = True
                self.swap_counts[route.layer, subs] += 1
            self.chosen = chosen
            self.swapped = swapped
            self.last_event = event

    @property
    def history(self) -> MeterHistory:
        """The history of the window shown (the engine thread adds to it: copy with `meter_history`)."""
        return self.histories[self.window]

    @property
    def fold(self) -> MeterFold:
        """The fold of the window shown."""
        return self.windows.fold(self.window)

    def window_title(self) -> str:
        """The window shown, as the meters box names it."""
        return window_title(self.window, self.windows.recent)

    def cycle_window(self) -> str:
        """Show the next window (last N tokens, since knob change, since start); its title."""
        with self.lock:
            self.window = WINDOWS[(WINDOWS.index(self.window) + 1) % len(WINDOWS)]
        return self.window_title()

    def set_recent(self, tokens: int) -> None:
        """Change N, the recent window's length."""
        with self.lock:
            self.windows.set_recent(tokens)

    def segments(self) -> list[tuple[Segment, object]]:
        """Every knob setting watched (the open one last), each with its knob values (None if unknown)."""
        with self.lock:
            found = list(self.windows.segments)
            current = self.windows.current()
            if current is not None:  # after a change, the old setting's until the new one's first token
                found.append(current)
            return [(segment, self.knobs_by_seq.get(segment.knob_seq)) for segment in found]

    def refresh_oracle(self) -> None:
        """Bring the oracle up to date now (when a reply ends), so the last figure is not a second old."""
        value = self.oracle.refresh()
        with self.lock:
            for history in self.histories.values():
                history.replace_latest("oracle_hit", value)

    def oracle_reading(self) -> OracleReading | None:
        """The oracle band's latest replay (Belady here, LRU at other cache sizes), from its own thread;
        None before the first one. Its `meters()` are keyed by the catalogue (oracle_hit, lru_*)."""
        return self.oracle.latest_reading

    def _on_knob(self, change: KnobChange) -> None:
        with self.lock:
            previous = self.knobs_by_seq.get(change.seq - 1, self.engine.knobs.snapshot())
            self.knobs_by_seq[change.seq] = replace(previous, **{change.name: change.new})
        self.mark(f"{change.name}={format_knob_value(change.new)}")

    def mark(self, label: str) -> None:
        """Note a change at the next token (knob changes arrive here; the app adds cache-size changes).

        The knob window is empty from now until the new setting's first token, and the lever's
        meters follow the knobs now in force, so the panel shows "–" where they are off."""
        with self.lock:
            self.windows.changed()
            knobs = self.engine.knobs.snapshot()
            for window, history in self.histories.items():
                history.mark(self.tokens_seen, label)
                if history.latest:
                    meters = self.windows.summary(window, knobs)
                    meters["oracle_hit"] = history.latest.get("oracle_hit")
                    history.set_latest(meters)

    # -- snapshots for the UI ----------------------------------------------

    def residency(self) -> np.ndarray:
        """Current level of every expert, int8 [L, E]."""
        return np.stack([np.asarray(self.engine.residency(layer), np.int8) for layer in range(self.n_layers)])

    def heatmap_data(self) -> HeatmapData:
        """A consistent copy of everything the heatmap draws."""
        levels = self.residency()
        heat = np.array(self.engine.heat, dtype=np.int64, copy=True)
        with self.lock:
            return HeatmapData(
                levels=levels,
                heat=heat,
                chosen=self.chosen.copy(),
                swapped=self.swapped.copy(),
                last_use=self.last_use.copy(),
                swap_counts=self.swap_counts.copy(),
                token=self.tokens_seen - 1,
                layer_hit=self.layer_hit_percent(),
            )

    def layer_hit_percent(self) -> np.ndarray:
        """RAM hit rate of each layer over the tokens watched, in percent (NaN where nothing was requested)."""
        shown = np.full(self.n_layers, np.nan)
        for layer, rate in enumerate(self.fold.layer_hit_rates()[: self.n_layers]):
            if rate is not None:
                shown[layer] = 100.0 * rate
        return shown

    def meter_history(self) -> MeterHistory:
        """A copy of the meter history that the engine thread cannot change under the reader."""
        with self.lock:
            return self.history.copy()

    def clear_history(self) -> None:
        """Forget the per-token pictures and start the watch's meters and oracle window afresh."""
        with self.lock:
            for history in self.histories.values():
                history.clear()
            self.windows = WindowedMeters(self.windows.recent, baseline=read_store_counters(self.engine))
            self.last_use[:] = -1
            self.swap_counts[:] = 0
            self.chosen[:] = False
            self.swapped[:] = False
        self.oracle.clear()

    def close(self) -> None:
        """Stop listening to the engine."""
        self._closed = True
        self.oracle.close()
        self.engine.unsubscribe(self._on_token)
        self.engine.knobs.unsubscribe(self._on_knob)
