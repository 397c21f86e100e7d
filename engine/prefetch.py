"""PILOT: guess the next layers' experts early and load them in the background.

Right after layer i's mixer, the residual already says a lot about where
layer i+1 (and i+2, i+3 with PILOT=2/3) will route: run that layer's router
on it (normed with that layer's post-attention norm), blend with a per-layer
EMA of the logits it actually produced, and take experts until their mass
reaches CONF_LIMIT (at least K, at most K*WIDE). A loader thread has the
expert store read them into RAM while the CPU computes this layer. Prefetch
only moves bytes: it never changes which experts run or what they compute.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

import numpy as np

from tierlab.engine.kernels.dense import linear, rmsnorm


class RouterHead(NamedTuple):
    """What PILOT needs of a MoE layer to guess its experts: the post-attention norm and the router."""

    post_norm: np.ndarray
    router_w: object  # float32/bf16 [E, H] matrix or a QuantMatrix: anything `linear` takes


class Loader:
    """A background thread with a deduplicated queue of (layer, expert) loads into the expert store."""

    def __init__(self, store) -> None:
        self.store = store
        self._queue: deque[tuple[int, int]] = deque()
        self._queued: set[tuple[int, int]] = set()
        self._cond = threading.Condition()
        self._stop = False
        self.issued = 0  # reads actually issued (the expert was not resident)
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="tierlab-prefetch", daemon=True)
        self._thread.start()

    def submit(self, layer: int, expert: int) -> None:
        key = (layer, expert)
        with self._cond:
            if key in self._queued:
                return
            self._queued.add(key)
            self._queue.append(key)
            self._cond.notify()

    def drain(self) -> None:
        """Wait until the queue is empty (tests and benchmarks use this for determinism)."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait(0.05)

    _busy = False

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                key = self._queue.popleft()
                self._busy = True
            try:
                if self.store.prefetch(*key):
                    self.issued += 1
                    self.on_loaded(*key)
            except Exception:  # a failed read is retried by the decode thread on demand
                self.errors += 1
            finally:
                with self._cond:
                    self._queued.discard(key)
                    self._busy = False
                    self._cond.notify_all()

    def on_loaded(self, layer: int, expert: int) -> None:  # replaced by Pilot
        pass

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=2)


class Pilot:
    """Predicts and prefetches; keeps the meters (issued, useful, wasted, prefetch hits)."""

    def __init__(self, config, store, heads: list[RouterHead | None]) -> None:
        """`heads[i]`: layer i's router head, None for a layer without experts."""
        cfg = config
        self.config = config
        self.store = store
        self.heads = heads
        self.ema = np.zeros((cfg.n_layers, cfg.n_experts), dtype=np.float32)
        self.ema_ready = np.zeros(cfg.n_layers, dtype=np.bool_)
        self.loader = Loader(store)
        self.loader.on_loaded = self._loaded
        self._lock = threading.Lock()
        self._pending: list[set[int]] = [set() for _ in range(cfg.n_layers)]  # prefetched, not yet routed
        self.useful = 0
        self.prefetch_hits = 0
        self.predicted = 0

    # -- prediction ------------------------------------------------------------
    def after_mixer(self, layer: int, x: np.ndarray, knobs) -> None:
        """Called with the residual right after `layer`'s mixer (last token only)."""
        cfg = self.config
        store = self.store
        for ahead in range(1, knobs.PILOT + 1):
            target = layer + ahead
            if target >= cfg.n_layers or not cfg.moe_layers[target]:
                continue
            head = self.heads[target]
            h = rmsnorm(x[-1:], head.post_norm, cfg.rms_eps)[0]
            z = linear(head.router_w, h)
            if self.ema_ready[target]:
                z = (1.0 - knobs.SMOOTH) * z + knobs.SMOOTH * self.ema[target]
            for e in self.choose(z, cfg.top_k, knobs):
                self.predicted += 1
                if not store.in_ram(target, e):
                    self.loader.submit(target, e)

    @staticmethod
    def choose(z: np.ndarray, k: int, knobs) -> list[int]:
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        n = int(np.searchsorted(cum, knobs.CONF_LIMIT) + 1)
        n = max(k, min(n, k * max(knobs.WIDE, 1)))
        return [int(e) for e in order[:n]]

    def observe(self, layer: int, logits: np.ndarray, chosen: np.ndarray, hits_before: int, knobs) -> None:
        """Called after `layer` routed: update its EMA and the useful/prefetch-hit meters."""
        if self.ema_ready[layer]:
            self.ema[layer] = knobs.SMOOTH * logits + (1.0 - knobs.SMOOTH) * self.ema[layer]
        else:
            self.ema[layer] = logits
            self.ema_ready[layer] = True
        with self._lock:
            pending = self._pending[layer]
            for e in chosen:
                e = int(e)
                if e in pending:
                    pending.discard(e)
                    self.useful += 1
                    self.prefetch_hits += 1

    def _loaded(self, layer: int, expert: int) -> None:
        with self._lock:
            self._pending[layer].add(expert)

    def reset_meters(self) -> None:
        self.loader.issued = 0
        self.useful = 0
        self.prefetch_hits = 0
        self.predicted = 0

    def meters(self) -> dict:
        issued = self.loader.issued
        return {"prefetch_issued": issued, "prefetch_useful": self.useful,
                "prefetch_wasted": max(issued - self.useful, 0), "prefetch_predicted": self.predicted}

    def close(self) -> None:
        self.loader.close()

