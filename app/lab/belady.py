"""How good could an expert cache be? Belady's optimum and LRU, replayed offline.

Given the experts each token requested in one layer (a set of K per token)
and the cache's slot count, ``belady_hits`` replays the sequence with the
furthest-next-use eviction policy, the best any cache of that size can do
for that request sequence; ``lru_hits`` replays it with least-recently-used
eviction for comparison. The K experts of a token are all needed at once,
so an expert the same token requested is never evicted to make room; if a
token requests more experts than there are slots, the extras are served
without being cached. Hits count per requested expert (-1 entries are
skipped). Cache-aware routing can beat the Belady figure because it changes
the requests themselves.

``engine_lru_hits`` is the engine's own RAM cache rule (docs/tiers.md), the
replay the live oracle band uses for its LRU figures: a token whose experts
fit in the slots touches its resident experts first (each becomes most
recently used, in rank order), then its misses in rank order, each evicting
the least recently used expert the token does not hold; a token with more
experts than slots (or an expert twice) touches them one at a time in rank
order, each free to evict the token's earlier ones. ``lru_hits`` orders
a token's touches by ties of the heap instead and serves extras uncached,
so it can differ from the engine by a few hits.

Belady and ``lru_hits`` run in O(n log n) over the n requests, with a
lazily cleaned binary heap keyed by next use (Belady) or last use (LRU);
``engine_lru_hits`` in O(n), with a linked list in recency order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numba
import numpy as np

_NEVER = np.iinfo(np.int64).max  # next use of an expert never requested again


@dataclass(frozen=True)
class CacheReplay:
    hits: int
    requests: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def __add__(self, other: "CacheReplay") -> "CacheReplay":
        return CacheReplay(self.hits + other.hits, self.requests + other.requests)


# --- a max-heap of (key, expert) pairs in two arrays --------------------------


@numba.njit(nogil=True, cache=True)
def _heap_push(keys, ids, size, key, expert):
    i = size
    keys[i] = key
    ids[i] = expert
    while i > 0:
        parent = (i - 1) // 2
        if keys[parent] >= keys[i]:
            break
        keys[parent], keys[i] = keys[i], keys[parent]
        ids[parent], ids[i] = ids[i], ids[parent]
        i = parent
    return size + 1


@numba.njit(nogil=True, cache=True)
def _heap_pop(keys, ids, size):
    size -= 1
    keys[0] = keys[size]
    ids[0] = ids[size]
    i = 0
    while True:
        left = 2 * i + 1
        right = left + 1
        top = i
        if left < size and keys[left] > keys[top]:
            top = left
        if right < size and keys[right] > keys[top]:
            top = right
        if top == i:
            break
        keys[top], keys[i] = keys[i], keys[top]
        ids[top], ids[i] = ids[i], ids[top]
        i = top
    return size


@numba.njit(nogil=True, cache=True)
def _replay(requests, n_experts, slots, belady):
    """Replay one layer; returns (hits, requests). See the module docstring."""
    T, K = requests.shape
    # next_use[t, j]: the next token after t requesting requests[t, j] (_NEVER if none)
    next_use = np.empty((T, K), dtype=np.int64)
    upcoming = np.full(n_experts, _NEVER, dtype=np.int64)
    for t in range(T - 1, -1, -1):
        for j in range(K):
            e = requests[t, j]
            if e >= 0:
                next_use[t, j] = upcoming[e]
        for j in range(K):
            e = requests[t, j]
            if e >= 0:
                upcoming[e] = t

    # The heap holds (priority, expert); priority is next use (Belady) or
    # minus last use (LRU), so the top is the expert to evict. An entry is
    # current only while key[e] still equals its priority.
    cached = np.zeros(n_experts, dtype=np.bool_)
    key = np.zeros(n_experts, dtype=np.int64)
    heap_keys = np.empty(2 * T * K + 1, dtype=np.int64)
    heap_ids = np.empty(2 * T * K + 1, dtype=np.int32)
    size = 0
    held = 0
    hits = 0
    total = 0
    # Priority of an expert the current token t requested: never above any
    # other cached expert's, so it is evicted only when nothing else is left.
    for t in range(T):
        now = t if belady else -t
        for j in range(K):  # first every hit, so a later miss cannot evict them
            e = requests[t, j]
            if e < 0:
                continue
            total += 1
            if cached[e]:
                hits += 1
                if not belady and key[e] != now:
                    key[e] = now
                    size = _heap_push(heap_keys, heap_ids, size, now, e)
        for j in range(K):
            e = requests[t, j]
            if e < 0 or cached[e]:
                continue
            if held >= slots:
                while size > 0 and (not cached[heap_ids[0]] or key[heap_ids[0]] != heap_keys[0]):
                    size = _heap_pop(heap_keys, heap_ids, size)
                if size == 0 or heap_keys[0] <= now:
                    continue  # everything cached is needed by this token: serve e uncached
                cached[heap_ids[0]] = False
                size = _heap_pop(heap_keys, heap_ids, size)
                held -= 1
            cached[e] = True
            held += 1
            key[e] = now
            size = _heap_push(heap_keys, heap_ids, size, now, e)
        if belady:
            for j in range(K):  # from now on this token's experts rank by their next use
                e = requests[t, j]
                if e >= 0 and cached[e] and key[e] != next_use[t, j]:
                    key[e] = next_use[t, j]
                    size = _heap_push(heap_keys, heap_ids, size, key[e], e)
    return hits, total


@numba.njit(nogil=True, cache=True)
def _replay_engine_lru(requests, n_experts, slots):
    """The engine's LRU (module docstring); returns (hits, requests).

    The cached experts form a list from least to most recently used, linked
    through `nxt`/`prv` with node `n_experts` as its sentinel, so a touch and an
    eviction are O(1).
    """
    T, K = requests.shape
    end = n_experts
    nxt = np.full(n_experts + 1, end, dtype=np.int64)
    prv = np.full(n_experts + 1, end, dtype=np.int64)
    cached = np.zeros(n_experts, dtype=np.bool_)
    seen = np.full(n_experts, -1, dtype=np.int64)  # the last token listing each expert, to spot duplicates
    order = np.empty(K, dtype=np.int64)
    held = 0
    hits = 0
    total = 0
    for t in range(T):
        n = 0
        duplicate = False
        for j in range(K):
            e = requests[t, j]
            if e >= 0:
                duplicate = duplicate or seen[e] == t
                seen[e] = t
                order[n] = e
                n += 1
        if n <= slots and not duplicate:  # together: the residents first, then the misses
            m = 0
            for j in range(K):
                e = requests[t, j]
                if e >= 0 and cached[e]:
                    order[m] = e
                    m += 1
            for j in range(K):
                e = requests[t, j]
                if e >= 0 and not cached[e]:
                    order[m] = e
                    m += 1
        for i in range(n):
            e = order[i]
            total += 1
            if cached[e]:
                hits += 1
                nxt[prv[e]] = nxt[e]  # unlink, to relink as the most recent
                prv[nxt[e]] = prv[e]
            elif held < slots:
                cached[e] = True
                held += 1
            else:
                victim = nxt[end]  # the least recently used
                nxt[end] = nxt[victim]
                prv[nxt[victim]] = end
                cached[victim] = False
                cached[e] = True
            last = prv[end]
            nxt[last] = e
            prv[e] = last
            nxt[e] = end
            prv[end] = e
    return hits, total


def _as_requests(requests) -> np.ndarray:
    arr = np.asarray(requests, dtype=np.int32)
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2:
        raise ValueError("requests must be [tokens, K] for one layer")
    return np.ascontiguousarray(arr)


def _replay_layer(requests, slots: int, belady: bool) -> CacheReplay:
    arr = _as_requests(requests)
    if arr.size == 0:
        return CacheReplay(0, 0)
    n_experts = int(arr.max()) + 1 if arr.max() >= 0 else 1
    hits, total = _replay(arr, n_experts, int(slots), belady)
    return CacheReplay(int(hits), int(total))


def belady_hits(requests, slots: int) -> CacheReplay:
    """Optimal (furthest-next-use) cache replay of one layer's [tokens, K] requests."""
    return _replay_layer(requests, slots, belady=True)


def lru_hits(requests, slots: int) -> CacheReplay:
    """Least-recently-used cache replay of one layer's [tokens, K] requests."""
    return _replay_layer(requests, slots, belady=False)


def engine_lru_hits(requests, slots: int, n_experts: int | None = None) -> CacheReplay:
    """The engine's RAM cache (module docstring) replayed on one layer's [tokens, K] requests."""
    arr = _as_requests(requests)
    if arr.size == 0:
        return CacheReplay(0, 0)
    top = int(arr.max()) + 1
    n = max(top, int(n_experts or 0), 1)
    hits, total = _replay_engine_lru(arr, n, max(int(slots), 1))
    return CacheReplay(int(hits), int(total))


def _per_layer(layers, slots) -> list[tuple[np.ndarray, int]]:
    layers = list(layers)
    slot_list = [int(slots)] * len(layers) if np.isscalar(slots) else [int(s) for s in slots]
    if len(slot_list) != len(layers):
        raise ValueError("one slot count per layer")
    return list(zip(layers, slot_list))


def belady_hit_rate(layers: Sequence[np.ndarray] | np.ndarray, slots: int | Sequence[int]) -> float:
    """Belady hit rate over all layers: layers[l] is [tokens, K]; slots per layer or one for all."""
    total = sum((belady_hits(r, s) for r, s in _per_layer(layers, slots)), CacheReplay(0, 0))
    return total.hit_rate


def lru_hit_rate(layers: Sequence[np.ndarray] | np.ndarray, slots: int | Sequence[int]) -> float:
    """LRU hit rate over the same sequences, for comparison with belady_hit_rate."""
    total = sum((lru_hits(r, s) for r, s in _per_layer(layers, slots)), CacheReplay(0, 0))
    return total.hit_rate

