"""Belady (optimal) and LRU cache replays over per-token expert sets."""

from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierlab.app.lab.belady import CacheReplay, belady_hit_rate, belady_hits, lru_hit_rate, lru_hits

TEXTBOOK = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]


def test_textbook_single_page_sequence():
    # 3 frames: the optimal policy faults 7 times, LRU 10 times.
    assert belady_hits(TEXTBOOK, 3) == CacheReplay(hits=5, requests=12)
    assert lru_hits(TEXTBOOK, 3) == CacheReplay(hits=2, requests=12)


def test_same_token_experts_are_never_evicted_for_each_other():
    # t1 brings 2 and 3 into 3 slots: 3 must evict 0 or 1, never 2 (needed by t1).
    req = [[0, 1], [2, 3], [0, 1]]
    assert belady_hits(req, 3) == CacheReplay(hits=1, requests=6)
    assert lru_hits(req, 3) == CacheReplay(hits=1, requests=6)


def test_hand_worked_sets_where_belady_beats_lru():
    req = [[0, 1], [2, 1], [4, 1], [0, 1], [2, 4]]
    # Belady, 3 slots: t0 misses 0, 1 | t1 hit 1, miss 2 | t2 hit 1, miss 4 evicts 2
    # (next use t4, furthest) | t3 hits 0, 1 | t4 hit 4, miss 2 evicts 0 or 1 -> 5 hits
    assert belady_hits(req, 3) == CacheReplay(hits=5, requests=10)
    # LRU: t2 evicts 0 (used t0) | t3 hit 1, miss 0 evicts 2 | t4 hit 4, miss 2 -> 4 hits
    assert lru_hits(req, 3) == CacheReplay(hits=4, requests=10)


def test_minus_one_entries_are_skipped():
    assert belady_hits([[0, -1], [0, -1]], 1) == CacheReplay(hits=1, requests=2)
    assert lru_hits([[-1, -1]], 2) == CacheReplay(hits=0, requests=0)


def test_more_requests_than_slots_serves_extras_uncached():
    assert belady_hits([[0, 1, 2], [0, 1, 2]], 2) == CacheReplay(hits=2, requests=6)
    assert lru_hits([[0, 1, 2], [0, 1, 2]], 2) == CacheReplay(hits=2, requests=6)


def test_cache_as_large_as_the_experts_only_misses_compulsorily():
    rng = np.random.default_rng(3)
    req = np.stack([rng.choice(20, 4, replace=False) for _ in range(200)])
    distinct = len(np.unique(req))
    for replay in (belady_hits, lru_hits):
        out = replay(req, distinct)
        assert out.requests - out.hits == distinct


def test_rates_over_layers_with_per_layer_slots():
    layers = [np.array([[0], [0], [0]]), np.array([[0], [1], [0]])]
    assert belady_hit_rate(layers, [1, 2]) == pytest.approx(3 / 6)
    assert lru_hit_rate(layers, 1) == pytest.approx(2 / 6)
    with pytest.raises(ValueError):
        belady_hit_rate(layers, [1])


def exhaustive_optimum(requests: list[list[int]], slots: int) -> int:
    """Most hits any demand cache can reach: every eviction choice tried."""

    @lru_cache(maxsize=None)
    def best(t: int, cached: frozenset) -> int:
        if t == len(requests):
            return 0
        need = set(requests[t])
        hits = len(need & cached)
        missing = need - cached
        overflow = max(0, len(cached) + len(missing) - slots)
        evictable = sorted(cached - need)
        return hits + max(
            best(t + 1, frozenset((cached - set(out)) | missing))
            for out in itertools.combinations(evictable, overflow)
        )

    return best(0, frozenset())


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3).flatmap(
        lambda k: st.tuples(
            st.just(k),
            st.integers(k, k + 2),
            st.lists(st.lists(st.integers(0, 5), min_size=k, max_size=k, unique=True), min_size=1, max_size=7),
        )
    )
)
def test_belady_equals_the_exhaustive_optimum(case):
    _, slots, requests = case
    assert belady_hits(requests, slots).hits == exhaustive_optimum(requests, slots)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24), st.integers(0, 2**31 - 1))
def test_belady_never_below_lru(k, slots, seed):
    rng = np.random.default_rng(seed)
    n_experts = int(rng.integers(k, 40))
    weights = 1.0 / np.arange(1, n_experts + 1) ** rng.uniform(0, 1.5)
    weights /= weights.sum()
    req = np.stack([rng.choice(n_experts, k, replace=False, p=weights) for _ in range(150)])
    slots = max(slots, k)
    assert belady_hits(req, slots).hits >= lru_hits(req, slots).hits
