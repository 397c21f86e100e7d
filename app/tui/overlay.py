"""Token overlay: each generated token of the conversation coloured by what it cost.

`TokenRing` is a token listener that keeps a compact record of the last
`RING_TOKENS` passes (RAM misses, swaps and KL summed over the layers, and
each layer's chosen and swapped experts); the app notes, for every token a
reply produces, the record of the pass that produced it. `TokenOverlay`
turns that into colours: ctrl+o cycles off → misses → swaps → KL → off, a
legend in the chat's border names the measure and its scale, and a click on
a token pins that token's per-layer routes in the heatmap (a second click,
or turning the overlay off, goes back to the live view).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, replace

import numpy as np
from rich.style import Style
from rich.text import Text

from tierlab.engine.events import TokenEvent

RING_TOKENS = 4096
"""Passes whose routes the ring keeps (older tokens of a long conversation lose their colour)."""
MEASURES = ("misses", "swaps", "kl")
"""What the overlay colours by, in the order ctrl+o cycles through them."""
MEASURE_TITLES = {"misses": "RAM misses", "swaps": "swaps", "kl": "KL (nats)"}
RAMP = ("#1b3a2a", "#2f5e1f", "#6b6b10", "#8a4a0c", "#9c1c1c")
"""Background colours from the least to the most costly token of the conversation."""


@dataclass(frozen=True)
class TokenRecord:
    """One pass, as the overlay and the heatmap need it."""

    seq: int  # the pass's number in the ring (counted since the ring started)
    token_id: int
    phase: str
    misses: int  # RAM misses summed over the layers
    swaps: int  # swapped slots summed over the layers
    kl: float | None  # KL summed over the measured layers (None when none was measured)
    layers: tuple[int, ...]  # the layer of each route
    chosen: np.ndarray  # int32[routes, K]
    swapped: np.ndarray  # bool[routes, K]

    def value(self, measure: str) -> float | None:
        if measure == "misses":
            return float(self.misses)
        if measure == "swaps":
            return float(self.swaps)
        return self.kl


class TokenRing:
    """The last RING_TOKENS passes of an engine (its listener runs on the engine thread)."""

    def __init__(self, size: int = RING_TOKENS) -> None:
        self.records: deque[TokenRecord] = deque(maxlen=size)
        self.lock = threading.Lock()
        self.count = 0
        self.engine = None

    @property
    def last_seq(self) -> int:
        """The latest pass's number (-1 before any)."""
        return self.count - 1

    def attach(self, engine) -> None:
        self.engine = engine
        engine.subscribe(self.add)

    def detach(self) -> None:
        if self.engine is not None:
            self.engine.unsubscribe(self.add)
            self.engine = None

    def add(self, event: TokenEvent) -> None:
        routes = event.layers
        kls = [r.kl for r in routes if r.measured and r.kl is not None]
        k = max((r.chosen.shape[0] for r in routes), default=0)
        chosen = np.full((len(routes), k), -1, np.int32)
        swapped = np.zeros((len(routes), k), bool)
        for i, r in enumerate(routes):
            chosen[i, : r.chosen.shape[0]] = r.chosen
            swapped[i, : r.swapped.shape[0]] = r.swapped
        with self.lock:
            record = TokenRecord(self.count, int(event.token_id), event.phase, sum(r.ram_misses for r in routes),
                                 sum(r.swaps for r in routes if r.measured), float(sum(kls)) if kls else None,
                                 tuple(r.layer for r in routes), chosen, swapped)
            self.records.append(record)
            self.count += 1

    def get(self, seq: int) -> TokenRecord | None:
        """The record of pass `seq`, None once it left the ring."""
        with self.lock:
            first = self.count - len(self.records)
            if seq < first or seq >= self.count:
                return None
            return self.records[seq - first]


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text (decoding the growing prefix keeps multi-byte characters whole)."""
    pieces, shown = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special=True)
        if text.startswith(shown):
            pieces.append(text[len(shown):])
            shown = text
        else:  # a prefix that decodes differently once longer: the token's own text
            piece = tokenizer.decode([ids[i]], skip_special=True)
            pieces.append(piece)
            shown += piece
    return pieces


def ramp_color(value: float | None, top: float) -> str | None:
    """The background of a token whose measure is `value` when the conversation's largest is `top`."""
    if value is None or value <= 0 or top <= 0:
        return None
    step = min(len(RAMP) - 1, int(len(RAMP) * value / top * 0.999))
    return RAMP[step]


class TokenOverlay:
    """The overlay's state: the measure shown (None: off) and the token pinned in the heatmap."""

    def __init__(self) -> None:
        self.ring = TokenRing()
        self.measure: str | None = None
        self.pinned: int | None = None
        self.saved_subtitle: str | None = None  # the chat border's subtitle while the legend is in its place
        self.saved_title: str | None = None  # the heatmap's title while a pinned token's is in its place

    def cycle(self) -> str | None:
        """The next measure (after the last one: off); the measure now shown."""
        order = (None, *MEASURES)
        self.measure = order[(order.index(self.measure) + 1) % len(order)]
        if self.measure is None:
            self.pinned = None
        return self.measure

    def top(self, messages) -> float:
        """The largest value of the measure over every token shown (the ramp's top)."""
        values = [self._value(seq) for m in messages for _, seq in m.tokens]
        return max([v for v in values if v is not None], default=0.0)

    def _value(self, seq: int) -> float | None:
        record = self.ring.get(seq)
        return None if record is None else record.value(self.measure)

    def render(self, message, tokenizer, top: float) -> Text:
        """A reply's text with each token on its colour, each clickable (pins it in the heatmap)."""
        ids = [t for t, _ in message.tokens]
        text = Text()
        for piece, (_, seq) in zip(token_pieces(tokenizer, ids), message.tokens):
            color = ramp_color(self._value(seq), top)
            style = Style(bgcolor=color, meta={"@click": f"app.select_token({seq})"})
            if seq == self.pinned:
                style += Style(underline=True, bold=True)
            text.append(piece, style=style)
        shown = text.plain
        if message.text.startswith(shown) and len(message.text) > len(shown):  # the stop mark
            text.append(message.text[len(shown):])
        return text

    def legend(self, top: float) -> str:
        """What the colours mean, for the chat's border."""
        title = MEASURE_TITLES[self.measure]
        scale = f"{top:.3g}" if self.measure == "kl" else f"{top:.0f}"
        ramp = "".join(f"[on {c}] [/]" for c in RAMP)
        return f"{title} 0 {ramp} {scale} · click a token"

    def heatmap_data(self, live):
        """The heatmap's data: the live arrays, with the pinned token's routes in place of the latest."""
        if self.pinned is None:
            return live
        record = self.ring.get(self.pinned)
        if record is None:
            return live
        chosen = np.zeros_like(live.chosen)
        swapped = np.zeros_like(live.swapped)
        for row, layer in enumerate(record.layers):
            ids = record.chosen[row]
            used = ids >= 0
            chosen[layer, ids[used]] = True
            swapped[layer, ids[used & record.swapped[row]]] = True
        return replace(live, chosen=chosen, swapped=swapped, token=record.seq)

    def describe(self, seq: int, token_id: int, tokenizer) -> str:
        """`token 41 'foo' · 3 misses · 1 swaps · KL 0.012`: the pinned token (`token_id`, produced by
        pass `seq`; -1 when unknown), for the heatmap's title."""
        record = self.ring.get(seq)
        if record is None:
            return f"token {seq}: no longer kept"
        kl = "–" if record.kl is None else f"{record.kl:.3g}"
        figures = f"{record.misses} misses · {record.swaps} swaps · KL {kl}"
        if token_id < 0 or tokenizer is None:  # its reply was cleared from the chat
            return f"token {seq} · {figures}"
        return f"token {seq} {tokenizer.decode([token_id], skip_special=False)!r} · {figures}"
