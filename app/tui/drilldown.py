"""Layer drill-down: one layer of the model up close, live while a reply streams.

Enter on the heatmap (or a double click on one of its cells) opens it for
the cursor's layer, in a pane docked right; up/down move to the neighbouring
layer; Esc closes it.
It shows the layer's last-token router probabilities (the top 16, with the
chosen and the swapped experts marked), its RAM cache in LRU order, its
GPU-resident experts, its realised / shadow / oracle hit rates over the
meter window shown and the bytes it read from disk. Every figure comes from
the existing instruments: the token's `LayerRoute` (its `probs`), the
store's `ram_order`, the watch's fold and the oracle band.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static

from tierlab.engine.events import LEVEL_GPU, LayerRoute

TOP_PROBS = 16
"""Router probabilities the drill-down lists (the top ones of the last token)."""
REDRAW_INTERVAL = 0.5
"""Seconds between redraws while the drill-down is open."""
LAYER = "drill"
"""The screen layer the drill-down pane is drawn on (above the default one)."""


@dataclass(frozen=True)
class ExpertProb:
    """One expert in the router's list: its probability and what became of it."""

    expert: int
    prob: float
    chosen: bool  # run for the token
    swapped: bool  # chosen only because it was resident (the routing lever)
    passed_over: bool  # in the router's true top-K but not run


@dataclass(frozen=True)
class LayerDetail:
    """What the drill-down shows of one layer."""

    layer: int
    moe: bool  # the layer routes experts (False: a dense layer)
    token: int  # the token the routing is from (-1: none yet)
    probs: list[ExpertProb]  # the top TOP_PROBS by probability, then chosen experts outside them
    ram_lru: list[int]  # experts in RAM slots, least recently used first
    gpu: list[int]  # experts the GPU tier holds
    realised: float | None  # RAM hit rate over the window (a fraction; None without samples)
    shadow: float | None  # the stock top-K's RAM hit rate in the same cache state
    oracle: float | None  # Belady's hit rate on the same requests (the oracle band's window)
    misses: int  # experts read on demand over the window
    prefetch_reads: int  # PILOT reads over the window
    bytes_read: int  # (misses + prefetch reads) x expert bytes
    window: str  # the meter window's title


def router_list(route: LayerRoute, top: int = TOP_PROBS) -> list[ExpertProb]:
    """The router's top experts by probability (ties by id), then any chosen expert outside them."""
    chosen = [int(e) for e in np.asarray(route.chosen) if e >= 0]
    swapped = {int(e) for e, s in zip(np.asarray(route.chosen), np.asarray(route.swapped, bool)) if s and e >= 0}
    true_set = {int(e) for e in np.asarray(route.true_topk) if e >= 0}
    if route.probs is not None:
        probs = np.asarray(route.probs, dtype=np.float32)
    else:  # a route read back from a log keeps only the true top-K's probabilities
        probs = np.zeros(max([0, *chosen, *true_set]) + 1, dtype=np.float32)
        if route.true_weights is not None:
            for e, p in zip(np.asarray(route.true_topk), np.asarray(route.true_weights)):
                if e >= 0:
                    probs[int(e)] = p
    order = sorted(range(probs.shape[0]), key=lambda e: (-float(probs[e]), e))
    listed = order[:top] + [e for e in chosen if e not in order[:top]]
    return [ExpertProb(e, float(probs[e]), e in chosen, e in swapped, e in true_set and e not in chosen)
            for e in listed]


def layer_detail(engine, watch, layer: int) -> LayerDetail:
    """The drill-down's figures for `layer`, read consistently from the engine and the watch."""
    levels = np.asarray(engine.residency(layer))
    gpu = [int(e) for e in np.flatnonzero(levels == LEVEL_GPU)]
    ram_lru = list(engine.ram_order(layer))
    moe = bool(engine.config.moe_layers[layer])
    blob = int(engine.store_stats().blob_nbytes)
    with watch.lock:
        event = watch.last_event
        route = None if event is None else next((r for r in event.layers if r.layer == layer), None)
        token = watch.tokens_seen - 1 if event is not None else -1
        fold = watch.fold
        realised = _at(fold.layer_hit_rates(), layer)
        shadow = _at(fold.layer_shadow_rates(), layer)
        misses = _at(fold.layer_misses, layer) or 0
        prefetch = fold.counts.get("prefetch_layers")
        reads = (_at(prefetch["issued"], layer) or 0) if isinstance(prefetch, dict) and "issued" in prefetch else 0
        title = watch.window_title()
    oracle = watch.oracle.layer_hit_rate(layer)
    return LayerDetail(layer=layer, moe=moe, token=token, probs=router_list(route) if route is not None else [],
                       ram_lru=ram_lru, gpu=gpu, realised=realised, shadow=shadow, oracle=oracle, misses=int(misses),
                       prefetch_reads=int(reads), bytes_read=(int(misses) + int(reads)) * blob, window=title)


def _at(values, index: int):
    return values[index] if index < len(values) else None


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100.0 * value:.1f}%"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.3g} KiB"


def render_detail(detail: LayerDetail, n_layers: int) -> Text:
    """The drill-down as text: router list, caches, hit rates and bytes."""
    text = Text()
    text.append(f"Layer {detail.layer}", style="bold")
    text.append(f" of {n_layers} · ", style="dim")
    text.append(f"token {detail.token}" if detail.token >= 0 else "no token yet", style="dim")
    text.append(f" · meters {detail.window}\n\n", style="dim")
    if not detail.moe:
        text.append("a dense layer: it routes no experts\n")
        return text
    text.append("Router, last token\n", style="bold")
    text.append("  ● chosen  ⇄ swapped in  ✗ top-K passed over\n", style="dim")
    if not detail.probs:
        text.append("  no routing yet: send a prompt\n")
    top = max((p.prob for p in detail.probs), default=0.0) or 1.0
    for rank, item in enumerate(detail.probs, 1):
        mark = "⇄" if item.swapped else "●" if item.chosen else "✗" if item.passed_over else " "
        style = "magenta" if item.swapped else "green" if item.chosen else "red" if item.passed_over else ""
        bar = "█" * max(0, round(12 * item.prob / top))
        text.append(f" {mark} {rank:>2}  E{item.expert:<4} {100.0 * item.prob:6.2f}%  ", style=style)
        text.append(f"{bar}\n", style=style or "dim")
    text.append("\nRAM cache", style="bold")
    text.append(f" ({len(detail.ram_lru)}, least recently used first)\n", style="dim")
    text.append("  " + (" ".join(f"E{e}" for e in detail.ram_lru) or "empty") + "\n")
    text.append("GPU tier", style="bold")
    text.append(f" ({len(detail.gpu)})\n", style="dim")
    text.append("  " + (" ".join(f"E{e}" for e in detail.gpu) or "none") + "\n")
    text.append("\nHit rates", style="bold")
    text.append(f" ({detail.window}; oracle: the band's)\n", style="dim")
    text.append(f"  realised {_pct(detail.realised)} · shadow {_pct(detail.shadow)} · oracle {_pct(detail.oracle)}\n")
    text.append("Read from disk", style="bold")
    text.append(f"  {_mib(detail.bytes_read)} ({detail.misses} misses + {detail.prefetch_reads} PILOT reads)\n")
    return text


class DrillDownPane(VerticalScroll, can_focus=True):
    """One layer up close, docked right of the main screen; up/down change the layer, Esc closes.

    A pane of the main screen rather than a screen of its own: the main screen stays the active
    one, so a reply goes on streaming, and the pane redraws with it. It sits on a layer of its
    own (`LAYER`, which `open_on` adds to the screen), so it covers the panes beneath it instead
    of squeezing them."""

    DEFAULT_CSS = """
    DrillDownPane {
        layer: drill; dock: right; width: 52; max-width: 100%; height: 100%;
        border: round $accent; background: $surface; padding: 0 1;
    }
    DrillDownPane:focus { border: round $accent-lighten-2; }
    """
    BINDINGS = [
        Binding("escape", "close", "Close drill-down"),
        Binding("up", "layer(-1)", "Layer up", show=False),
        Binding("down", "layer(1)", "Layer down", show=False),
    ]

    def __init__(self, layer: int) -> None:
        super().__init__(id="drill-down")
        self.shown_layer = layer
        self.detail: LayerDetail | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="drill-body")

    def on_mount(self) -> None:
        self.border_subtitle = "↑/↓ layer · Esc close"
        self.redraw()
        self.set_interval(REDRAW_INTERVAL, self.redraw, name="drill-down")

    def show_layer(self, layer: int) -> None:
        self.shown_layer = layer
        self.redraw()

    def redraw(self) -> None:
        app = self.app
        engine, watch = getattr(app, "engine", None), getattr(app, "watch", None)
        self.border_title = f"Layer {self.shown_layer}"
        body = self.query_one("#drill-body", Static)
        if engine is None or watch is None:
            body.update("no model loaded")
            return
        self.detail = layer_detail(engine, watch, self.shown_layer)
        body.update(render_detail(self.detail, int(engine.config.n_layers)))

    def action_layer(self, step: int) -> None:
        engine = getattr(self.app, "engine", None)
        if engine is None:
            return
        self.show_layer(min(int(engine.config.n_layers) - 1, max(0, self.shown_layer + step)))

    def action_close(self) -> None:
        self.remove()


def open_on(screen, layer: int) -> DrillDownPane:
    """Show the drill-down for `layer` on `screen` (the one already open, or a new one), focused."""
    found = list(screen.query(DrillDownPane))
    if found:
        found[0].show_layer(layer)
        found[0].focus()
        return found[0]
    layers = tuple(screen.styles.layers) or ("default",)
    if LAYER not in layers:
        screen.styles.layers = (*layers, LAYER)
    pane = DrillDownPane(layer)
    screen.mount(pane)
    pane.focus()
    return pane
