"""The oracle band: Belady and LRU replays of a bounded window of recent tokens, off the engine thread.

`OracleBand.add` is a token listener that only appends the token's chosen
experts (one array per MoE layer) to a deque of the last `window` tokens,
so its cost per token never grows with the session. `reading` replays a
snapshot of that window in the caller's thread: Belady's optimal eviction
at the current RAM cache size, and the engine's own LRU (belady.py,
`engine_lru_hits`) at the current size and at other sizes (`band_sizes`).
The two answer different questions: Belady above the realised hit rate is
what a smarter eviction could win at this size, the LRU at 2x or 4x what a
bigger cache would buy, so the band says whether more RAM or the routing
lever is the better move. `start` refreshes the reading every `interval`
seconds on a thread of its own and keeps it in `latest_reading` (and the
Belady figure in `latest`). A run's own band (window None) holds the whole
run, for `eval` and `ab`.

Every replay starts with an empty cache at the window's first token and
models the RAM cache alone: no GPU tier, prefetch or pins.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tierlab.app.lab.belady import CacheReplay, belady_hits, engine_lru_hits
from tierlab.engine.events import TokenEvent

WINDOW = 1024
"""Tokens the app's band replays: long enough to span several replies, short enough to replay in milliseconds."""

SIZE_KEYS: tuple[tuple[str, float | None], ...] = (
    ("lru_half", 0.5), ("lru_1x", 1.0), ("lru_2x", 2.0), ("lru_4x", 4.0), ("lru_all_but_one", None),
)
"""Meter key and cache size of each LRU replay: a multiple of the current slots, or None for E - 1."""


def band_sizes(slots: int, n_experts: int | None) -> dict[str, int | None]:
    """The cache size each LRU meter replays; None where that size is outside [1, E - 1].

    The current size (lru_1x) is always replayed. Two keys may name one size
    (2x of 12 is 24, the same as all-but-one for E = 25): it is replayed once.
    """
    out: dict[str, int | None] = {}
    for key, factor in SIZE_KEYS:
        if factor is None:
            size = n_experts - 1 if n_experts is not None else None
        elif factor == 1.0:
            size = int(slots)
        else:
            size = int(slots * factor)
        if size is not None and factor != 1.0 and (size < 1 or (n_experts is not None and size > n_experts - 1)):
            size = None
        out[key] = size
    return out


@dataclass(frozen=True)
class OracleReading:
    """One replay of the band's window: how an optimal cache and LRU caches of other sizes would have done."""

    window_tokens: int  # tokens replayed
    slots: int  # the RAM cache's size (slots per MoE layer) the Belady figure is for
    belady_hit: float | None  # Belady's hit rate at `slots` (a fraction); None when nothing was requested
    lru_hit_by_size: dict[int, float] = field(default_factory=dict)  # the engine's LRU hit rate at each size
    sizes: dict[str, int | None] = field(default_factory=dict)  # meter key -> size it replays (band_sizes)
    replay_s: float = 0.0  # seconds the replay took

    def meters(self) -> dict[str, float | None]:
        """`oracle_hit` and one rate per LRU meter key (None for a size not replayed)."""
        out: dict[str, float | None] = {"oracle_hit": self.belady_hit}
        for key, _ in SIZE_KEYS:
            size = self.sizes.get(key)
            out[key] = self.lru_hit_by_size.get(size) if size is not None else None
        return out


class OracleBand:
    """The chosen experts of the last `window` tokens and the replays over them."""

    def __init__(self, window: int | None = WINDOW, interval: float = 1.0, n_experts: int | None = None) -> None:
        self.window = window
        self.interval = interval
        self.n_experts = n_experts  # experts per layer: the all-but-one size; None leaves it out
        self._tokens: deque[list[np.ndarray]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._added = 0  # tokens added or clears made: says when a refresh has something new
        self._seq = 0  # tokens added since the last clear
        self._epoch = 0  # clears made
        # the replaying side's copy of the window as int32[L, K] arrays, extended by the new tokens only
        self._replay_lock = threading.Lock()
        self._arrays: deque[np.ndarray] = deque(maxlen=window)
        self._arrays_seq = 0
        self._arrays_epoch = 0
        self._computed_at = -1
        self.slots: int | None = None  # RAM slots per layer, as the latest event's store counters say
        self.layer_ids: list[int] = []  # the layer of each route in an event, as the latest event says
        self.latest: float | None = None
        self.latest_reading: OracleReading | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._tokens)

    def add(self, event: TokenEvent) -> None:
        """Remember one token's requests (engine thread: an append, nothing else)."""
        chosen = [route.chosen for route in event.layers]
        slots = event.store.get("ram_slots")
        if len(chosen) != len(self.layer_ids):
            self.layer_ids = [route.layer for route in event.layers]
        with self._lock:
            self._tokens.append(chosen)
            self._added += 1
            self._seq += 1
            if slots is not None:
                self.slots = slots

    def clear(self) -> None:
        with self._lock:
            self._tokens.clear()
            self._added += 1
            self._seq = 0
            self._epoch += 1
            self.latest = None
            self.latest_reading = None

    def _layers(self) -> tuple[list[np.ndarray], int, int | None]:
        """A snapshot of the window as one [tokens, K] array per layer, its token count, and the slots.

        Only the tokens added since the last snapshot are converted (the rest are kept as arrays), so
        the time this holds the interpreter stays small however large the window.
        """
        with self._replay_lock:
            with self._lock:
                if self._arrays_epoch != self._epoch:
                    self._arrays.clear()
                    self._arrays_seq, self._arrays_epoch = 0, self._epoch
                fresh = min(self._seq - self._arrays_seq, len(self._tokens))
                new = [self._tokens[i] for i in range(len(self._tokens) - fresh, len(self._tokens))]
                self._arrays_seq = self._seq
                slots = self.slots
            self._arrays.extend(_as_arrays(new))
            if not self._arrays:
                return [], 0, slots
            shape = self._arrays[0].shape
            rows = np.stack([a for a in self._arrays if a.shape == shape])
        return [np.ascontiguousarray(rows[:, j, :]) for j in range(shape[0])], rows.shape[0], slots

    def hit_rate(self, slots: int | None = None) -> float | None:
        """Belady hit rate (a fraction) over the window at `slots` (default: the cache's size); None if empty."""
        layers, _, current = self._layers()
        slots = current if slots is None else slots
        if not layers or not slots:
            return None
        return _rate([belady_hits(r, slots) for r in layers])

    def layer_hit_rate(self, layer: int, slots: int | None = None) -> float | None:
        """Belady hit rate of one layer over the window at `slots` (default: the cache's size);
        None when the window is empty or the layer routes no experts."""
        layers, _, current = self._layers()
        slots = current if slots is None else slots
        ids = self.layer_ids
        if not layers or not slots or layer not in ids or ids.index(layer) >= len(layers):
            return None
        return _rate([belady_hits(layers[ids.index(layer)], slots)])

    def reading(self, slots: int | None = None) -> OracleReading | None:
        """Replay the window now, in the caller's thread, at `slots` (default: the cache's size); None if empty."""
        t0 = time.perf_counter()
        layers, tokens, current = self._layers()
        slots = current if slots is None else slots
        if not layers or not slots:
            return None
        sizes = band_sizes(int(slots), self.n_experts)
        lru = {}
        for size in sorted({s for s in sizes.values() if s is not None}):
            rate = _rate([engine_lru_hits(r, size, self.n_experts) for r in layers])
            if rate is not None:
                lru[size] = rate
        belady = _rate([belady_hits(r, slots) for r in layers])
        return OracleReading(tokens, int(slots), belady, lru, sizes, time.perf_counter() - t0)

    def refresh(self) -> float | None:
        """Compute `latest_reading` (and `latest`, its Belady figure) now, in the caller's thread."""
        with self._lock:
            added = self._added
        reading = self.reading()
        with self._lock:
            self.latest_reading = reading
            self.latest = reading.belady_hit if reading is not None else None
            self._computed_at = added
            return self.latest

    def start(self) -> None:
        """Refresh every `interval` seconds, when tokens arrived, on a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tierlab-oracle", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self._added != self._computed_at:
                try:
                    self.refresh()
                except Exception:  # a figure, never a reason to stop the thread
                    self.latest = None
                    self.latest_reading = None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _as_arrays(tokens: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Each token's chosen experts as one int32[L, K] array (one concatenation for a run of equal shapes)."""
    if not tokens:
        return []
    width, k = len(tokens[0]), (tokens[0][0].shape[0] if tokens[0] else 0)
    if all(len(t) == width and all(a.shape == (k,) for a in t) for t in tokens):
        if width == 0:
            return [np.zeros((0, 0), np.int32) for _ in tokens]
        flat = np.concatenate([a for t in tokens for a in t]).astype(np.int32, copy=False)
        return list(flat.reshape(len(tokens), width, k))
    return [np.stack(t).astype(np.int32, copy=False) if t else np.zeros((0, 0), np.int32) for t in tokens]


def _rate(replays: list[CacheReplay]) -> float | None:
    total = sum(replays, CacheReplay(0, 0))
    return total.hit_rate if total.requests else None
