"""PILOT: guess the next layers' experts early and load them in the background.

Right after layer i's mixer, the residual already says a lot about where
layer i+1 (and i+2, i+3 with PILOT=2/3) will route: run that layer's router
on it (normed with that layer's post-attention norm), blend with a per-layer
EMA of the logits it actually produced, and take experts until their mass
reaches CONF_LIMIT (at least K, at most K*WIDE). A loader thread has the
expert store read them into RAM while the CPU computes this layer. Prefetch
only moves bytes: it never changes which experts run or what they compute.

Each read is tagged with the pass (token) it was predicted for; the store
keeps the prefetch ledger of those reads (engine/expert_store.py), and
`Pilot.meters` reports it with the prediction counts.
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
    """A background thread with a deduplicated queue of (layer, expert) loads into the expert store,
    each for the pass it was first queued for."""

    def __init__(self, store) -> None:
        self.store = store
        self._queue: deque[tuple[int, int]] = deque()
        self._queued: dict[tuple[int, int], int | None] = {}  # queued load -> the pass it is for
        self._cond = threading.Condition()
        self._stop = False
        self.issued = 0  # reads actually issued (the expert was not resident)
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="tierlab-prefetch", daemon=True)
        self._thread.start()

    def submit(self, layer: int, expert: int, for_pass: int | None = None) -> None:
        key = (layer, expert)
        with self._cond:
            if key in self._queued:
                return
            self._queued[key] = for_pass
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
                for_pass = self._queued[key]
                self._busy = True
            try:
                if self.store.prefetch(*key, for_pass=for_pass):
                    self.issued += 1
            except Exception:  # a failed read is retried by the decode thread on demand
                self.errors += 1
            finally:
                with self._cond:
                    self._queued.pop(key, None)
                    self._busy = False
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=2)


class Pilot:
    """Predicts and prefetches; reports the store's prefetch ledger and its own prediction count."""

    def __init__(self, config, store, heads: list[RouterHead | None]) -> None:
        """`heads[i]`: layer i's router head, None for a layer without experts."""
        cfg = config
        self.config = config
        self.store = store
        self.heads = heads
        self.ema = np.zeros((cfg.n_layers, cfg.n_experts), dtype=np.float32)
        self.ema_ready = np.zeros(cfg.n_layers, dtype=np.bool_)
        self.loader = Loader(store)
        self.passes = 0  # passes (tokens, or prompts) PILOT has predicted for
        self.predicted = 0

    # -- prediction ------------------------------------------------------------
    def after_mixer(self, layer: int, x: np.ndarray, knobs) -> None:
        """Called with the residual right after `layer`'s mixer (last token only)."""
        cfg = self.config
        store = self.store
        if layer == 0:
            self.passes += 1
        store.ledger_position(self.passes, layer)
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
                    self.loader.submit(target, e, self.passes)

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
        """Called after `layer` routed: update its EMA (and, in a pass without PILOT, tell the
        store's ledger that no pass of PILOT's is running)."""
        if self.ema_ready[layer]:
            self.ema[layer] = knobs.SMOOTH * logits + (1.0 - knobs.SMOOTH) * self.ema[layer]
        else:
            self.ema[layer] = logits
            self.ema_ready[layer] = True
        if not knobs.PILOT:
            self.store.ledger_position(-1, layer)

    @property
    def prefetch_hits(self) -> int:
        """Demand hits on experts PILOT read: the misses it saved (the store's ledger)."""
        return int(self.store.prefetch_ledger().hits.sum())

    def reset_meters(self) -> None:
        """Zero the prediction counts (the engine resets the store's ledger with its counters)."""
        self.loader.issued = 0
        self.predicted = 0

    def meters(self) -> dict:
        """The ledger's totals as store counters, and its per-layer counts under `prefetch_layers`."""
        ledger = self.store.prefetch_ledger()
        issued, hits = int(ledger.issued.sum()), int(ledger.hits.sum())
        return {"prefetch_issued": issued, "prefetch_useful": hits, "prefetch_wasted": max(issued - hits, 0),
                "prefetch_predicted": self.predicted, "prefetch_own_hits": int(ledger.own.sum()),
                "prefetch_ahead_sum": int(ledger.ahead_sum.sum()),
                "prefetch_bytes": issued * ledger.blob_nbytes, "prefetch_saved_bytes": hits * ledger.blob_nbytes,
                "prefetch_layers": {"issued": ledger.issued.tolist(), "hits": ledger.hits.tolist(),
                                    "own": ledger.own.tolist(), "ahead_sum": ledger.ahead_sum.tolist()}}

    def close(self) -> None:
        self.loader.close()

