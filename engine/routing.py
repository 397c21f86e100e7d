"""Cache-aware routing (arXiv 2412.00099): which K experts one token runs.

The MoE router ranks experts by probability; this module may swap the tail
of that top-K for experts that are already resident (GPU tier, then RAM
cache), trading a little fidelity for far fewer disk reads. Three strategies:

- ``maxrank``: keep the true top-J, fill the other slots with
  resident experts ranked inside a window of M (or of mass P when 0<P<1).
- ``cumprob``: the same fill, but the window is set by cumulative mass P
  alone (M does not bound it); P outside (0, 1) falls back to ``maxrank``.
- ``prior`` (Cache-Prior): re-rank with logits biased towards resident
  experts by lambda times a per-layer EMA of the logit range; top-J kept.

``route_select`` is the pure contract of docs/routing.md ("The three strategies"), written for
reading; ``route_select_numba`` is its twin for the hot path, and the tests
hold them equal. ``plain_topk`` is the stock router's choice (softmax
order, top-K, optional renormalisation) that every path starts from; its
kernels (kernels/dense.py `topk_weights`, and `route_rows` with the softmax)
are what the MoE block runs for all of a prompt's tokens in one call.
``Router`` is what the engine calls once per layer per token: it keeps the
per-layer Cache-Prior state and writes each decision as an events
``LayerRoute`` with its meter counts; summing them is engine/meters.py's job.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numba
import numpy as np

from tierlab.engine.events import LayerRoute
from tierlab.engine.kernels.dense import PAIRWISE_BLOCK, topk_desc, topk_weights
from tierlab.engine.knobs import KnobValues

LEVEL_GPU = 2
LEVEL_RAM = 1

# Guards of the KL meter (docs/routing.md, "Meters").
KL_GUARD = 1e-20
KL_MISSING = 1e-12

# Weight of the newest token in the Cache-Prior EMA of the logit range.
PRIOR_EMA_RATE = 0.1


_NO_LOGITS = np.zeros(0, dtype=np.float32)


class RoutingWarning(UserWarning):
    """Routing degraded (fewer eligible experts than K): said once per Router."""


@dataclass
class RouteStats:
    """Meter counts of one routing decision of the reference functions."""

    slots: int  # filled slots, min(K, eligible experts)
    swaps: int  # filled slots holding an expert outside the true top-K
    swaps_vram: int  # of those, experts at the GPU tier (level 2)
    agree_hit: int  # |chosen ∩ true top-K|
    agree_tot: int  # size of the true top-K (= slots)
    kl: float  # KL(true top-K mass || chosen mass), nats


# --------------------------------------------------------------------------
# The readable reference
# --------------------------------------------------------------------------


def _rank(probs: np.ndarray, mask: np.ndarray, depth: int) -> list[int]:
    """Eligible expert ids by falling probability, ties to the lower id."""
    eligible = np.flatnonzero(mask).tolist()
    eligible.sort(key=lambda e: (-float(probs[e]), e))
    return eligible[:depth]


def _alpha_applies(alpha: float) -> bool:
    return 0.0 < alpha < 1.0


def _chosen_values(probs, chosen: list[int], true_set: set[int], K: int, alpha: float) -> np.ndarray:
    """Original probabilities of the chosen, substitutes scaled by alpha, zero-padded to K."""
    val = np.zeros(K, dtype=np.float32)
    for slot, e in enumerate(chosen):
        p = float(probs[e])
        if e not in true_set and _alpha_applies(alpha):
            p *= alpha
        val[slot] = np.float32(p)
    return val


def topk_kl(true_ids, true_mass, chosen_ids, chosen_mass) -> float:
    """KL(true top-K mass || chosen mass) in nats, each side normalised over its own set.

    The meter of docs/routing.md: 1e-20 guards, and a true expert that was not
    chosen counts with probability 1e-12. Ids of -1 (unfilled) are ignored.
    """
    true = [(e, float(m)) for e, m in zip(true_ids, true_mass) if e >= 0]
    chosen = {e: float(m) for e, m in zip(chosen_ids, chosen_mass) if e >= 0}
    p_total = max(sum(m for _, m in true), KL_GUARD)
    q_total = max(sum(chosen.values()), KL_GUARD)
    kl = 0.0
    for e, mass in true:
        p = mass / p_total
        if p <= 0.0:
            continue
        q = chosen[e] / q_total if e in chosen else KL_MISSING
        kl += p * math.log(max(p, KL_GUARD) / max(q, KL_GUARD))
    return kl


def _finish(probs, level, chosen: list[int], true_topk: list[int], K: int, alpha: float):
    """Turn a chosen list into (idx, val, stats): the part every strategy shares."""
    true_set = set(true_topk)
    idx = np.full(K, -1, dtype=np.int32)
    idx[: len(chosen)] = chosen
    val = _chosen_values(probs, chosen, true_set, K, alpha)
    substitutes = [e for e in chosen if e not in true_set]
    stats = RouteStats(
        slots=len(chosen),
        swaps=len(substitutes),
        swaps_vram=sum(1 for e in substitutes if level[e] == LEVEL_GPU),
        agree_hit=len(chosen) - len(substitutes),
        agree_tot=len(true_topk),
        kl=topk_kl(true_topk, [probs[e] for e in true_topk], chosen, val[: len(chosen)]),
    )
    return idx, val, stats


def route_select(probs, mask, level, K: int, J: int, M: int, P: float, alpha: float):
    """The maxrank contract of docs/routing.md, step by step: returns (idx int32[K], val float32[K], RouteStats).

    ``val`` holds the weights after alpha and before renormalisation; unfilled
    slots have idx -1 and val 0.
    """
    probs = np.asarray(probs, dtype=np.float32)
    mask = np.asarray(mask, dtype=bool)
    level = np.asarray(level)
    J = min(max(J, 0), K)
    by_mass = 0.0 < P < 1.0
    cap = min(max(M, 4 * K) if by_mass else max(M, K), len(probs))
    ranked = _rank(probs, mask, cap)
    n = len(ranked)
    kt = min(K, n)

    win = n
    if by_mass:
        target = P * sum(float(probs[e]) for e in ranked)
        cum = 0.0
        for r, e in enumerate(ranked):
            cum += float(probs[e])
            if cum >= target:
                win = r + 1
                break
        win = max(win, kt)

    taken = list(range(min(J, n)))
    for wanted_level in (LEVEL_GPU, LEVEL_RAM):
        taken += [r for r in range(J, win) if level[ranked[r]] == wanted_level]
    taken += [r for r in range(n) if r not in taken]
    chosen = [ranked[r] for r in taken[:K]]
    return _finish(probs, level, chosen, ranked[:kt], K, alpha)


def prior_select(logits, probs, mask, level, K: int, J: int, bias: float, alpha: float):
    """Cache-Prior: keep the true top-J, fill the rest by logits + bias*[resident].

    ``bias`` is lambda times the layer's logit-range EMA. Weights are the
    original probabilities (substitutes scaled by alpha). Same returns as
    ``route_select``.
    """
    probs = np.asarray(probs, dtype=np.float32)
    mask = np.asarray(mask, dtype=bool)
    level = np.asarray(level)
    J = min(max(J, 0), K)
    ranked = _rank(probs, mask, len(probs))
    kt = min(K, len(ranked))

    chosen = ranked[:J]
    rest = [e for e in ranked if e not in chosen]
    rest.sort(key=lambda e: (-(float(logits[e]) + (bias if level[e] >= LEVEL_RAM else 0.0)), e))
    chosen = chosen + rest[: K - len(chosen)]
    return _finish(probs, level, chosen, ranked[:kt], K, alpha)


# --------------------------------------------------------------------------
# The hot-path twin (numba)
# --------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def _top_nb(keys, eligible, depth):
    """Eligible ids by falling key, ties to the lower id, at most depth of them.

    Insertion into a short sorted buffer: most experts fail the first
    comparison, and unlike np.argsort it compiles in a fraction of a second.
    """
    buf = np.empty(max(depth, 0), dtype=np.int32)
    n = 0
    for e in range(keys.shape[0]):
        if not eligible[e] or depth <= 0:
            continue
        k = keys[e]
        if n == depth:
            if not k > keys[buf[n - 1]]:
                continue
            pos = n - 1  # e displaces the last one
        else:
            pos = n
            n += 1
        while pos > 0 and keys[buf[pos - 1]] < k:  # equal keys stay ahead: lower ids came first
            buf[pos] = buf[pos - 1]
            pos -= 1
        buf[pos] = e
    return buf[:n]


@numba.njit(nogil=True, cache=True)
def _finish_nb(probs, level, chosen, n_chosen, ranked, kt, K, alpha):
    """Values, swapped flags and meter counts of a chosen list (see _finish)."""
    idx = np.full(K, -1, dtype=np.int32)
    val = np.zeros(K, dtype=np.float32)
    swapped = np.zeros(K, dtype=np.bool_)
    counts = np.zeros(5, dtype=np.int64)  # slots, swaps, swaps_vram, agree_hit, agree_tot
    scale = 0.0 < alpha < 1.0
    for s in range(n_chosen):
        e = chosen[s]
        idx[s] = e
        in_true = False
        for r in range(kt):
            if ranked[r] == e:
                in_true = True
                break
        p = np.float64(probs[e])
        if not in_true:
            swapped[s] = True
            counts[1] += 1
            if level[e] == 2:
                counts[2] += 1
            if scale:
                p *= alpha
        val[s] = np.float32(p)
    counts[0] = n_chosen
    counts[3] = n_chosen - counts[1]
    counts[4] = kt

    p_total = 0.0
    for r in range(kt):
        p_total += np.float64(probs[ranked[r]])
    p_total = max(p_total, 1e-20)
    q_total = 0.0
    for s in range(n_chosen):
        q_total += np.float64(val[s])
    q_total = max(q_total, 1e-20)
    kl = 0.0
    for r in range(kt):
        e = ranked[r]
        p = np.float64(probs[e]) / p_total
        if p <= 0.0:
            continue
        q = 1e-12
        for s in range(n_chosen):
            if idx[s] == e:
                q = np.float64(val[s]) / q_total
                break
        kl += p * math.log(max(p, 1e-20) / max(q, 1e-20))
    return idx, val, swapped, counts, kl


@numba.njit(nogil=True, cache=True)
def _route_core_nb(probs, mask, level, K, J, M, P, alpha):
    """route_select's loops; also returns the swapped flags and the true top-K."""
    J = min(max(J, 0), K)
    by_mass = 0.0 < P < 1.0
    cap = max(M, 4 * K) if by_mass else max(M, K)
    cap = min(cap, probs.shape[0])
    ranked = _top_nb(probs.astype(np.float64), mask, cap)
    n = ranked.shape[0]
    kt = min(K, n)

    win = n
    if by_mass:
        target = 0.0
        for r in range(n):
            target += np.float64(probs[ranked[r]])
        target *= P
        cum = 0.0
        for r in range(n):
            cum += np.float64(probs[ranked[r]])
            if cum >= target:
                win = r + 1
                break
        win = max(win, kt)

    used = np.zeros(n, dtype=np.bool_)
    chosen = np.empty(K, dtype=np.int32)
    filled = 0
    for r in range(min(J, n)):
        chosen[filled] = ranked[r]
        used[r] = True
        filled += 1
    for wanted_level in range(2, 0, -1):  # GPU tier first, then RAM
        for r in range(J, win):
            if filled == K:
                break
            if not used[r] and level[ranked[r]] == wanted_level:
                chosen[filled] = ranked[r]
                used[r] = True
                filled += 1
    for r in range(n):
        if filled == K:
            break
        if not used[r]:
            chosen[filled] = ranked[r]
            used[r] = True
            filled += 1
    idx, val, swapped, counts, kl = _finish_nb(probs, level, chosen, filled, ranked, kt, K, alpha)
    return idx, val, swapped, ranked[:kt].copy(), counts, kl


@numba.njit(nogil=True, cache=True)
def _prior_core_nb(logits, probs, mask, level, K, J, bias, alpha):
    """prior_select's loops; same returns as _route_core_nb."""
    J = min(max(J, 0), K)
    ranked = _top_nb(probs.astype(np.float64), mask, K)  # the true top-K
    kt = ranked.shape[0]
    protected = min(J, kt)
    scores = logits.astype(np.float64)
    open_ = mask.copy()
    for r in range(protected):
        open_[ranked[r]] = False
    for e in range(scores.shape[0]):
        if level[e] >= 1:
            scores[e] += bias
    rest = _top_nb(scores, open_, K - protected)
    chosen = np.empty(K, dtype=np.int32)
    filled = 0
    for r in range(protected):
        chosen[filled] = ranked[r]
        filled += 1
    for r in range(rest.shape[0]):
        chosen[filled] = rest[r]
        filled += 1
    idx, val, swapped, counts, kl = _finish_nb(probs, level, chosen, filled, ranked, kt, K, alpha)
    return idx, val, swapped, ranked.copy(), counts, kl


# Strategies as the Router numbers them (_PLAIN never reaches numba: it is plain_topk).
_PLAIN, _MAXRANK, _CUMPROB, _PRIOR = 0, 1, 2, 3


@numba.njit(nogil=True, cache=True)
def _update_range_nb(range_ema, layer, logits, mask):
    """Fold this token's logit range into the layer's EMA; returns the EMA (0 before any)."""
    lo = np.inf
    hi = -np.inf
    for e in range(logits.shape[0]):
        if mask[e]:
            lo = min(lo, np.float64(logits[e]))
            hi = max(hi, np.float64(logits[e]))
    if hi >= lo:
        old = range_ema[layer]
        range_ema[layer] = hi - lo if np.isnan(old) else old + PRIOR_EMA_RATE * (hi - lo - old)
    return 0.0 if np.isnan(range_ema[layer]) else range_ema[layer]


@numba.njit(nogil=True, cache=True)
def _router_nb(strategy, logits, probs, mask, level, K, J, M, P, alpha, lam, range_ema, layer, norm):
    """Everything Router.select computes for a lever strategy, in one call (no numpy overhead per layer)."""
    delta = _update_range_nb(range_ema, layer, logits, mask) if logits.shape[0] > 0 else 0.0
    if strategy == _PRIOR:
        idx, val, swapped, ranked, counts, kl = _prior_core_nb(logits, probs, mask, level, K, J, lam * delta, alpha)
    elif strategy == _CUMPROB:
        idx, val, swapped, ranked, counts, kl = _route_core_nb(probs, mask, level, K, J, probs.shape[0], P, alpha)
    else:  # _MAXRANK
        idx, val, swapped, ranked, counts, kl = _route_core_nb(probs, mask, level, K, J, M, P, alpha)
    weights = val.copy()
    if norm:
        total = 0.0
        for s in range(K):
            total += np.float64(val[s])
        if total > 0.0:
            for s in range(K):
                weights[s] = np.float32(np.float64(val[s]) / total)
    true_topk = np.full(K, -1, dtype=np.int32)
    true_weights = np.zeros(K, dtype=np.float32)
    for r in range(ranked.shape[0]):
        true_topk[r] = ranked[r]
        true_weights[r] = probs[ranked[r]]
    chosen_level = np.zeros(K, dtype=np.int8)
    for s in range(K):
        if idx[s] >= 0:
            chosen_level[s] = level[idx[s]]
    return idx, weights, true_topk, true_weights, swapped, chosen_level, counts, kl


def _stats_from(counts: np.ndarray, kl: float) -> RouteStats:
    return RouteStats(*(int(c) for c in counts), kl=float(kl))


def route_select_numba(probs, mask, level, K: int, J: int, M: int, P: float, alpha: float):
    """The numba twin of route_select (same arguments, same returns)."""
    idx, val, _, _, counts, kl = _route_core_nb(
        np.ascontiguousarray(probs, dtype=np.float32),
        np.ascontiguousarray(mask, dtype=np.bool_),
        np.ascontiguousarray(level, dtype=np.int8),
        int(K), int(J), int(M), float(P), float(alpha),
    )
    return idx, val, _stats_from(counts, kl)


def prior_select_numba(logits, probs, mask, level, K: int, J: int, bias: float, alpha: float):
    """The numba twin of prior_select."""
    idx, val, _, _, counts, kl = _prior_core_nb(
        np.ascontiguousarray(logits, dtype=np.float32),
        np.ascontiguousarray(probs, dtype=np.float32),
        np.ascontiguousarray(mask, dtype=np.bool_),
        np.ascontiguousarray(level, dtype=np.int8),
        int(K), int(J), float(bias), float(alpha),
    )
    return idx, val, _stats_from(counts, kl)


# --------------------------------------------------------------------------
# The engine's entry point
# --------------------------------------------------------------------------


def plain_topk(probs: np.ndarray, K: int, norm: bool, mask=None) -> tuple[np.ndarray, np.ndarray]:
    """The stock router: the K most probable experts (ties to the lower id) and their weights.

    Returns (chosen int32[K], weights float32[K]); the weights are the
    probabilities, renormalised over the chosen set when ``norm``. With a
    ``mask``, ineligible experts are never chosen: fewer eligible than K
    leaves -1 slots with weight 0 at the end.
    """
    if mask is None:  # the kernel the MoE block's plain path runs (`route_rows`)
        chosen = np.empty((2, K), dtype=np.int32)
        values = np.empty((2, K), dtype=np.float32)
        topk_weights(probs, K, norm and K <= PAIRWISE_BLOCK, chosen[0], chosen[1], values[0], values[1])
        w = values[1]
        if norm and K > PAIRWISE_BLOCK:
            w = (values[0] / values[0].sum()).astype(np.float32)
        return chosen[0], w
    keys = np.where(mask, probs, -np.inf).astype(np.float32)
    idx = np.empty(K, dtype=np.int64)
    topk_desc(keys, K, idx)
    w = probs[idx].astype(np.float32)
    chosen = idx.astype(np.int32)
    unfilled = ~np.asarray(mask, dtype=bool)[idx]
    chosen[unfilled] = -1
    w[unfilled] = 0.0
    if norm and w.sum() > 0:
        w = (w / w.sum()).astype(np.float32)
    return chosen, w


class Router:
    """Chooses each layer's experts for the engine and writes each decision's meter counts.

    Call ``select`` once per MoE layer per token, only when the lever or its
    meters are on; with ``CACHE_ROUTE`` off it returns the plain top-K.
    """

    def __init__(self, n_layers: int, n_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self._all_eligible = np.ones(n_experts, dtype=np.bool_)
        self._range_ema = np.full(n_layers, np.nan)
        self._warned_short = False

    def logit_range_ema(self, layer: int) -> float:
        """Cache-Prior's Delta for a layer (nan before the layer's first token)."""
        return float(self._range_ema[layer])

    def _strategy(self, knobs: KnobValues) -> int:
        if not knobs.CACHE_ROUTE:
            return _PLAIN
        if knobs.ROUTE_MODE == "prior":
            return _PRIOR
        if knobs.ROUTE_MODE == "cumprob" and 0.0 < knobs.ROUTE_P < 1.0:
            return _CUMPROB
        return _MAXRANK  # maxrank, or cumprob without a usable P

    def select(self, layer: int, logits, probs, level, knobs: KnobValues, mask=None) -> LayerRoute:
        """Route one token through one layer: ``logits`` float32[E] (needed by the
        prior mode and its range EMA; None otherwise allowed), ``probs`` their
        softmax, ``level`` int8[E] residency, ``mask`` bool[E] (None = all eligible).

        A decision that substitutes nothing is the plain top-K, bit for bit
        (its stock weights included)."""
        strategy = self._strategy(knobs)
        if logits is None:
            if strategy == _PRIOR:
                raise ValueError("ROUTE_MODE=prior needs the router logits")
            logits = _NO_LOGITS
        probs = np.ascontiguousarray(probs, dtype=np.float32)
        level = np.ascontiguousarray(level, dtype=np.int8)
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        eligible = self._all_eligible if mask is None else np.ascontiguousarray(mask, dtype=np.bool_)
        chosen, weights = plain_topk(probs, self.top_k, self.norm_topk_prob, mask)
        slots = self.top_k if mask is None else int((chosen >= 0).sum())
        route = None
        if strategy == _PLAIN:
            if logits.shape[0] > 0:
                _update_range_nb(self._range_ema, layer, logits, eligible)
        else:
            idx, lever_weights, true_topk, true_weights, swapped, chosen_level, counts, kl = _router_nb(
                strategy, logits, probs, eligible, level, self.top_k, knobs.ROUTE_J, knobs.ROUTE_M,
                float(knobs.ROUTE_P), float(knobs.ROUTE_ALPHA), float(knobs.ROUTE_LAMBDA), self._range_ema,
                layer, self.norm_topk_prob,
            )
            if np.any(swapped) or not np.array_equal(idx, chosen):
                route = LayerRoute(layer, idx, lever_weights, true_topk, true_weights, chosen_level, swapped,
                                   slots=int(counts[0]), swaps=int(counts[1]), swaps_vram=int(counts[2]),
                                   measured=True, kl=float(kl))
        if route is None:  # the plain top-K: every true expert chosen, so the KL is exactly 0
            safe = np.maximum(chosen, 0)
            route = LayerRoute(layer, chosen, weights, chosen.copy(), np.where(chosen >= 0, probs[safe], 0.0).astype(np.float32),
                               np.where(chosen >= 0, level[safe], 0).astype(np.int8), np.zeros(self.top_k, dtype=np.bool_),
                               slots=slots, measured=True, kl=0.0)
        if route.slots < self.top_k and not self._warned_short:
            self._warned_short = True
            warnings.warn(
                f"layer {layer}: only {route.slots} eligible experts for top-{self.top_k}; "
                "unfilled slots are -1 and skipped (said once)",
                RoutingWarning,
                stacklevel=2,
            )
        return route


# --------------------------------------------------------------------------
# Footer
# --------------------------------------------------------------------------


def format_footer(knobs: KnobValues, summary: dict) -> list[str]:
    """The footer lines (`CACHE_ROUTE J=.. | swap ..%`, `route_agree ..`) from a meter summary (engine/meters.py; rates as fractions).

    Empty when neither the lever nor its meters are on. As in the seed,
    routing nothing reads as 100% agreement and KL 0.
    """
    lines = []
    if knobs.CACHE_ROUTE:
        mode = ""
        if knobs.ROUTE_MODE == "prior":
            mode = f" mode=prior lambda={knobs.ROUTE_LAMBDA:g}"
        elif knobs.ROUTE_MODE == "cumprob":
            mode = " mode=cumprob"
        swap = summary.get("swap") or 0.0
        lines.append(
            f"CACHE_ROUTE{mode} J={knobs.ROUTE_J} M={knobs.ROUTE_M} P={knobs.ROUTE_P:g} "
            f"alpha={knobs.ROUTE_ALPHA:g} | swap {100.0 * swap:.1f}% "
            f"({summary.get('swaps', 0)}/{summary.get('slots', 0)}, {summary.get('swaps_vram', 0)} to VRAM)"
        )
    if knobs.meters_on:
        agree = summary.get("route_agree")
        kl = summary.get("route_kl")
        lines.append(f"route_agree {100.0 * (1.0 if agree is None else agree):.1f}% | "
                     f"route_kl {0.0 if kl is None else kl:.2f}")
    return lines
