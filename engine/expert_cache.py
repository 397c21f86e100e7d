"""The RAM expert cache: a fixed number of expert slots per layer, LRU.

A miss reads the expert from its source (disk) into a free slot, or into the
slot of a victim chosen in this order: an expert the GPU tier already holds,
then the least-recently-used unpinned one, then the least-recently-used
pinned one; never a slot being loaded or in use. The cache only decides
where bytes live; it never changes the math.

Thread safety: the decode thread and the PILOT prefetch thread share it.
Reads from disk happen outside the lock, with the slot marked as loading.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from tierlab.engine import hugepages


class ExpertCache:
    def __init__(self, source, n_layers: int, n_experts: int, slots: int, moe_layers: list[bool]) -> None:
        self.source = source
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.moe_layers = moe_layers
        self.slots = max(1, min(int(slots), n_experts))
        self._cond = threading.Condition()
        self._clock = 0
        self.hits = np.zeros(n_layers, dtype=np.int64)
        self.misses = np.zeros(n_layers, dtype=np.int64)
        self.bytes_read = 0
        #: 1 where the expert sits in a RAM slot (ready), else 0.
        self.in_ram = np.zeros((n_layers, n_experts), dtype=np.int8)
        self.gpu_resident: Callable[[int, int], bool] = lambda layer, expert: False
        self._pool = None  # background readers for acquire_token
        self._layers = [self._new_layer(self.slots) if moe else None for moe in moe_layers]

    def _new_layer(self, slots: int) -> dict:
        return {
            "store": hugepages.empty((slots, self.source.blob_nbytes), np.uint8),
            "expert": np.full(slots, -1, dtype=np.int64),  # expert held by each slot
            "slot_of": np.full(self.n_experts, -1, dtype=np.int64),
            "last": np.zeros(slots, dtype=np.int64),
            "busy": np.zeros(slots, dtype=np.int64),  # in-use refcount
            "loading": np.zeros(slots, dtype=np.bool_),
            "pinned": np.zeros(slots, dtype=np.bool_),
        }

    # -- queries -------------------------------------------------------------
    def is_resident(self, layer: int, expert: int) -> bool:
        return bool(self.in_ram[layer, expert])

    def hit_rate(self) -> float:
        total = int(self.hits.sum() + self.misses.sum())
        return float(self.hits.sum()) / total if total else 0.0

    def reset_counters(self) -> None:
        self.hits[:] = 0
        self.misses[:] = 0
        self.bytes_read = 0

    # -- victim choice -------------------------------------------------------
    def _victim(self, layer: int, st: dict) -> int:
        free = np.flatnonzero(st["expert"] < 0)
        if free.size:
            return int(free[0])
        best = -1
        best_key = None
        for s in range(st["expert"].shape[0]):
            if st["busy"][s] or st["loading"][s]:
                continue
            on_gpu = self.gpu_resident(layer, int(st["expert"][s]))
            # smaller key = better victim: GPU-held first, then unpinned, then LRU
            key = (0 if on_gpu else 1, 1 if st["pinned"][s] else 0, int(st["last"][s]))
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best

    def _claim(self, layer: int, expert: int) -> tuple[int, bool]:
        """Under the lock: the slot for `expert`, and whether it must be loaded."""
        st = self._layers[layer]
        while True:
            s = int(st["slot_of"][expert])
            if s >= 0:
                if st["loading"][s]:
                    self._cond.wait()
                    continue
                return s, False
            s = self._victim(layer, st)
            if s < 0:  # every slot busy or loading: wait for one to free up
                self._cond.wait()
                continue
            old = int(st["expert"][s])
            if old >= 0:
                st["slot_of"][old] = -1
                self.in_ram[layer, old] = 0
            st["expert"][s] = expert
            st["slot_of"][expert] = s
            st["loading"][s] = True
            st["pinned"][s] = False
            return s, True

    def _load(self, layer: int, expert: int, s: int) -> None:
        st = self._layers[layer]
        try:
            self.source.read(layer, expert, st["store"][s])
        except BaseException:
            with self._cond:
                st["loading"][s] = False
                st["expert"][s] = -1
                st["slot_of"][expert] = -1
                self._cond.notify_all()
            raise
        with self._cond:
            st["loading"][s] = False
            self.in_ram[layer, expert] = 1
            self.bytes_read += self.source.blob_nbytes
            self._cond.notify_all()

    # -- use -----------------------------------------------------------------
    def _take(self, layer: int, expert: int) -> tuple[int, bool]:
        """Under the lock: claim the expert's slot, mark it in use and recent, count hit or miss."""
        st = self._layers[layer]
        s, must_load = self._claim(layer, expert)
        st["busy"][s] += 1
        self._clock += 1
        st["last"][s] = self._clock
        if must_load:
            self.misses[layer] += 1
        else:
            self.hits[layer] += 1
        return s, must_load

    def acquire(self, layer: int, expert: int) -> tuple[np.ndarray, bool]:
        """The expert's blob, loading it on a miss; counts a hit or miss. Pair with release()."""
        st = self._layers[layer]
        with self._cond:
            s, must_load = self._take(layer, expert)
        if must_load:
            try:
                self._load(layer, expert, s)
            except BaseException:
                with self._cond:
                    st["busy"][s] -= 1
                raise
        return st["store"][s], not must_load

    def acquire_token(self, layer: int, experts: list[int]) -> "TokenFetch | None":
        """Claim slots for all of one token's experts at once, counting hits and misses; a
        token's resident experts are held before its misses pick victims (the K experts of a
        token are needed together). Misses after the first are read in the background while
        the caller computes the earlier ones. None when the layer has fewer slots than experts
        (then the caller acquires one at a time)."""
        if len(experts) > self.slots or len(set(experts)) != len(experts):
            return None
        st = self._layers[layer]
        plan: list = [None] * len(experts)
        with self._cond:
            # first hold the experts already resident, so that loading this token's misses
            # never evicts one of its own hits; then claim slots for the misses in rank order
            resident = [i for i, e in enumerate(experts)
                        if st["slot_of"][e] >= 0 and not st["loading"][st["slot_of"][e]]]
            for i in resident + [i for i in range(len(experts)) if i not in resident]:
                plan[i] = (experts[i], *self._take(layer, experts[i]))
        fetch = TokenFetch(self, layer, plan)
        missing = [(e, s) for e, s, must in plan if must]
        for e, s in missing[1:]:
            fetch.futures[e] = self._readers().submit(self._load, layer, e, s)
        return fetch

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _readers(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierlab-read")
        return self._pool

    def release(self, layer: int, expert: int) -> None:
        st = self._layers[layer]
        with self._cond:
            s = int(st["slot_of"][expert])
            if s >= 0 and st["busy"][s] > 0:
                st["busy"][s] -= 1
                self._cond.notify_all()

    def prefetch(self, layer: int, expert: int) -> bool:
        """Load without counting a hit or miss (PILOT); True if a read was issued."""
        st = self._layers[layer]
        if st is None:
            return False
        with self._cond:
            s = int(st["slot_of"][expert])
            if s >= 0:
                return False
            s = self._victim(layer, st)
            if s < 0:
                return False
            s, must_load = self._claim(layer, expert)
        if must_load:
            self._load(layer, expert, s)
        return must_load

    def clear(self) -> None:
        """Empty every slot (a cold start for the next run); counters are kept."""
        with self._cond:
            for layer, st in enumerate(self._layers):
                if st is None:
                    continue
                while np.any(st["busy"]) or np.any(st["loading"]):
                    self._cond.wait()
                st["expert"][:] = -1
                st["slot_of"][:] = -1
                st["last"][:] = 0
                st["pinned"][:] = False
            self.in_ram[:] = 0

    def pin(self, layer: int, experts) -> None:
        """Mark these experts' slots as pinned (they are evicted last)."""
        st = self._layers[layer]
        with self._cond:
            for e in experts:
                s = int(st["slot_of"][int(e)])
                if s >= 0:
                    st["pinned"][s] = True

    def set_slots(self, slots: int) -> None:
        """Change the slots per layer, keeping the most recently used experts."""
        slots = max(1, min(int(slots), self.n_experts))
        with self._cond:
            if slots == self.slots:
                return
            for layer, st in enumerate(self._layers):
                if st is None:
                    continue
                while np.any(st["busy"]) or np.any(st["loading"]):
                    self._cond.wait()
                new = self._new_layer(slots)
                held = [s for s in np.argsort(-st["last"]) if st["expert"][s] >= 0][:slots]
                for i, s in enumerate(held):
                    e = int(st["expert"][s])
                    new["store"][i] = st["store"][s]
                    new["expert"][i] = e
                    new["slot_of"][e] = i
                    new["last"][i] = st["last"][s]
                    new["pinned"][i] = st["pinned"][s]
                self.in_ram[layer, :] = 0
                for e in new["expert"]:
                    if e >= 0:
                        self.in_ram[layer, e] = 1
                self._layers[layer] = new
            self.slots = slots


class TokenFetch:
    """The slots of one token's experts; `blob(i)` waits for the i-th to be loaded."""

    def __init__(self, cache: ExpertCache, layer: int, plan: list[tuple[int, int, bool]]) -> None:
        self.cache = cache
        self.layer = layer
        self.plan = plan
        self.futures: dict = {}
        self._done: set[int] = set()

    def hit(self, i: int) -> bool:
        return not self.plan[i][2]

    def blob(self, i: int) -> np.ndarray:
        e, s, must_load = self.plan[i]
        if must_load and e not in self._done:
            future = self.futures.get(e)
            if future is not None:
                future.result()
            else:
                self.cache._load(self.layer, e, s)
            self._done.add(e)
        return self.cache._layers[self.layer]["store"][s]

    def close(self) -> None:
        """Release every slot; wait for background reads; abandon loads that never started."""
        cache = self.cache
        st = cache._layers[self.layer]
        for e, s, must_load in self.plan:
            future = self.futures.get(e)
            if future is not None:
                try:
                    future.result()
                except Exception:
                    pass
            elif must_load and e not in self._done:
                with cache._cond:
                    st["loading"][s] = False
                    st["expert"][s] = -1
                    st["slot_of"][e] = -1
        with cache._cond:
            for e, s, _ in self.plan:
                if st["busy"][s] > 0:
                    st["busy"][s] -= 1
            cache._cond.notify_all()
