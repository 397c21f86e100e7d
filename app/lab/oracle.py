"""The Belady bound over a bounded window of recent tokens, computed off the engine thread.

`OracleBand.add` is a token listener that only appends the token's chosen
experts (one array per MoE layer) to a deque of the last `window` tokens,
so its cost per token never grows with the session. `hit_rate` replays a
snapshot of that window with Belady's optimal eviction (belady.py) at the
current RAM cache size, in the caller's thread; `start` does it every
`interval` seconds on a thread of its own and keeps the result in `latest`.
A run's own band (window None) holds the whole run, for `eval` and `ab`.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from tierlab.app.lab.belady import belady_hit_rate
from tierlab.engine.events import TokenEvent

WINDOW = 1024
"""Tokens the app's band replays: long enough to span several replies, short enough to replay in milliseconds."""


class OracleBand:
    """The chosen experts of the last `window` tokens and the Belady hit rate over them."""

    def __init__(self, window: int | None = WINDOW, interval: float = 1.0) -> None:
        self.window = window
        self.interval = interval
        self._tokens: deque[list[np.ndarray]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._added = 0
        self._computed_at = -1
        self.slots: int | None = None  # RAM slots per layer, as the latest event's store counters say
        self.latest: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._tokens)

    def add(self, event: TokenEvent) -> None:
        """Remember one token's requests (engine thread: an append, nothing else)."""
        chosen = [route.chosen for route in event.layers]
        slots = event.store.get("ram_slots")
        with self._lock:
            self._tokens.append(chosen)
            self._added += 1
            if slots is not None:
                self.slots = slots

    def clear(self) -> None:
        with self._lock:
            self._tokens.clear()
            self._added += 1
            self.latest = None

    def hit_rate(self, slots: int | None = None) -> float | None:
        """Belady hit rate (a fraction) over the window at `slots` (default: the cache's size); None if empty."""
        with self._lock:
            snapshot = list(self._tokens)
            slots = self.slots if slots is None else slots
        if not snapshot or not slots:
            return None
        width = len(snapshot[0])
        rows = [t for t in snapshot if len(t) == width]
        layers = [np.stack([t[j] for t in rows]) for j in range(width)]
        return belady_hit_rate(layers, slots) if layers else None

    def refresh(self) -> float | None:
        """Compute `latest` now, in the caller's thread."""
        with self._lock:
            added = self._added
        value = self.hit_rate()
        with self._lock:
            self.latest, self._computed_at = value, added
        return value

    def start(self) -> None:
        """Recompute `latest` every `interval` seconds, when tokens arrived, on a daemon thread."""
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

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
