"""What the app keeps of the engine's per-token reports.

The engine calls its listeners from its own thread after every token; the
UI redraws at its own pace (a few times a second). This object sits between
the two: the listener only folds the event into its own meters and a few
arrays under a lock (it never calls back into the engine), and the UI copies
them out when it is ready to draw. The Belady bound comes from an
`OracleBand` over the last `WINDOW` tokens, replayed on the band's own thread.
"""

from __future__ import annotations

import threading

import numpy as np

from tierlab.app.lab.oracle import OracleBand, OracleReading
from tierlab.engine.events import TokenEvent
from tierlab.engine.knobs import KnobChange
from tierlab.engine.meters import MeterFold
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
        self.fold = MeterFold()
        """The meters of every token watched (the app's figures)."""
        self.oracle = OracleBand(interval=ORACLE_INTERVAL, n_experts=self.n_experts)
        self.history = MeterHistory()
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
                self.fold.add(event)
                meters = self.fold.summary()
                meters["oracle_hit"] = self.oracle.latest
            except Exception:  # a meter that fails must not stop generation
                self.meter_errors += 1
                meters = {}
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
            self.history.add(token, meters)

    def refresh_oracle(self) -> None:
        """Bring the oracle up to date now (when a reply ends), so the last figure is not a second old."""
        value = self.oracle.refresh()
        with self.lock:
            self.history.replace_latest("oracle_hit", value)

    def oracle_reading(self) -> OracleReading | None:
        """The oracle band's latest replay (Belady here, LRU at other cache sizes), from its own thread;
        None before the first one. Its `meters()` are keyed by the catalogue (oracle_hit, lru_*)."""
        return self.oracle.latest_reading

    def _on_knob(self, change: KnobChange) -> None:
        self.mark(f"{change.name}={format_knob_value(change.new)}")

    def mark(self, label: str) -> None:
        """Note a change at the next token (knob changes arrive here; the app adds cache-size changes)."""
        with self.lock:
            self.history.mark(self.tokens_seen, label)

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
            self.history.clear()
            self.fold.reset()
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
