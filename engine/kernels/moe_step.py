"""A decoded token's MoE block in two compiled calls: the router block, then its resident experts.

Why: in decode the block was eight calls from Python (the router block's matvec,
the shared expert's step, the stock routing, the store's claims, the experts' two
launches, the release, the weighted sum), and the Python after each streaming
call paid cache misses on the interpreter's state, 10-30 us a gap
(docs/benchmarks.md, "What a call costs right after a streaming one"). Here the
same kernels run from compiled code on the same operands, in the same order, so
the block's bits are those of the eight calls (tests/test_moe_step.py):

- `router_step`: the router block's one launch (router logits | shared gate | up |
  shared gate logit), the shared expert's term (`shared_step`), and with the stock
  router the routing (`route_rows`);
- `resident_experts_step`: the store's claims on the experts' RAM slots
  (`slot_claims`), both launches of `qmatvec._experts`, the release, and the
  weighted sum into the block's output, with the store's lock held by the caller.
  When an expert is not ready in a slot it changes nothing and says so; the
  caller takes the general path.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tierlab.engine.kernels.dense import add_weighted, route_rows
from tierlab.engine.kernels.qmatvec import _WEIGHT_MARKER, ADD, GATE_UP, SET, _experts, _pass, _stack_pass, _thread_count
from tierlab.engine.kernels.shared_step import _shared_kernels
from tierlab.engine.kernels.slot_claims import claim_resident, release_slots

# stand-ins for the operands a call does not use (one launch kind, no shared expert)
_NO_ROWS_PLAIN = np.empty((0, 0), np.uint16)
_NO_ROWS_QUANT = np.empty((0, 0), np.uint8)
_NO_SCALES = np.empty((0, 0), np.float32)


@njit(nogil=True, cache=True)
def _shared_and_route(fused, has_shared, wd, sd, start, size, h, gate, term, plain, k, norm, probs, chosen,
                      true_topk, top_probs, weights, threads):
    if has_shared:
        _shared_kernels(wd, sd, fused, start, size, h, gate, term, threads)
    if plain:
        route_rows(fused[:, :start], k, norm, probs, chosen, true_topk, top_probs, weights)


@njit(nogil=True, cache=True)
def _stacked_router_kernels(wa, qb, sb, wc, x, fused, has_shared, wd, sd, start, size, h, gate, term, plain, k,
                            norm, probs, chosen, true_topk, top_probs, weights, threads):
    _stack_pass(wa, qb, sb, wc, x, fused[0])
    _shared_and_route(fused, has_shared, wd, sd, start, size, h, gate, term, plain, k, norm, probs, chosen,
                      true_topk, top_probs, weights, threads)


@njit(nogil=True, cache=True)
def _router_kernels(w, s, x, fused, has_shared, wd, sd, start, size, h, gate, term, plain, k, norm, probs, chosen,
                    true_topk, top_probs, weights, threads):
    _pass(w, s, w, s, x, fused[0], SET, 1.0, threads)
    _shared_and_route(fused, has_shared, wd, sd, start, size, h, gate, term, plain, k, norm, probs, chosen,
                      true_topk, top_probs, weights, threads)


def router_operands(w_in) -> tuple | None:
    """The router block as `router_step` launches it: (True, wa, q, scales, wc) for a RowStack
    that `qmatvec.stack_parts` accepted, (False, -, w, scales, -) for one matrix that
    `qlinear.pass_operands` accepts, None where neither holds."""
    from tierlab.engine.qlinear import pass_operands

    stack = getattr(w_in, "one_launch", None)
    if stack is not None:
        wa, q, scales, wc = stack
        return True, wa, q, scales, wc
    single = pass_operands(w_in)
    if single is None:
        return None
    w, scales = single
    return False, _NO_ROWS_PLAIN, w, scales, _NO_ROWS_PLAIN


def router_step(operands: tuple, shared_down: tuple | None, x: np.ndarray, n_experts: int, shared_inter: int,
                top_k: int, norm: bool, plain: bool) -> tuple:
    """The router block of one token x float32[H]: (fused float32[1, E + 2S + 1], the shared
    expert's term float32[1, H] or None, and with `plain` the stock router's choices as
    `MoEBlock._plain_choices` gives them, else None). `norm` renormalises the top-k in the
    kernel (top_k <= dense.PAIRWISE_BLOCK)."""
    stacked, wa, qb, sb, wc = operands
    rows = wa.shape[0] + qb.shape[0] + wc.shape[0]
    fused = np.empty((1, rows), dtype=np.float32)
    has_shared = shared_down is not None
    wd, sd = shared_down if has_shared else (_NO_ROWS_PLAIN, _NO_ROWS_PLAIN)
    h = np.empty((1, shared_inter), dtype=np.float32)
    gate = np.empty(1, dtype=np.float32)
    term = np.empty((1, wd.shape[0] if has_shared else 0), dtype=np.float32)
    probs = np.empty((1, n_experts), dtype=np.float32)
    chosen = np.empty((2, 1, top_k), dtype=np.int32)
    values = np.empty((2, 1, top_k), dtype=np.float32)
    tail = (np.ascontiguousarray(x, dtype=np.float32), fused, has_shared, wd, sd, n_experts, shared_inter, h, gate,
            term, plain, top_k, norm, probs, chosen[0], chosen[1], values[0], values[1], _thread_count())
    if stacked:
        _stacked_router_kernels(wa, qb, sb, wc, *tail)
    else:
        _router_kernels(qb, sb, *tail)
    choices = (probs, chosen[0], chosen[1], values[0], values[1]) if plain else None
    return fused, (term if has_shared else None), choices


@njit(nogil=True, cache=True)
def _resident_kernels(slot_of, loading, pf_pass, busy, last, store, marker, hidden, inter, experts, clock, slots,
                      stock, shadow, x, outputs, rows, weights, y, add):
    clock = claim_resident(slot_of, loading, pf_pass, busy, last, experts, clock, slots, stock, shadow)
    if clock < 0:
        return clock
    h = np.empty((slots.shape[0], inter), np.float32)
    _experts(store, slots, marker, hidden, inter, x, h, outputs, rows, GATE_UP, 1.0)
    _experts(store, slots, marker, hidden, inter, x, h, outputs, rows, ADD, 1.0)
    release_slots(busy, slots)
    if add:
        add_weighted(y, experts, weights, outputs)
    return clock


def resident_experts_step(layer_state: dict, kind: str, hidden: int, inter: int, experts: np.ndarray,
                          clock: int, slots: np.ndarray, stock: np.ndarray, shadow: np.ndarray, x: np.ndarray,
                          outputs: np.ndarray, rows: np.ndarray, weights: np.ndarray | None,
                          y: np.ndarray | None) -> int:
    """Claims, both launches, release (and with `weights`, y += the weighted sum in rank
    order) for `experts` int64[K] that are all ready in the layer's RAM slots: outputs
    [K, hidden] float32, zero, gets each expert's output (rows: 0..K-1). The caller holds
    the store's lock. Returns the new LRU clock, or -1 having changed nothing when an
    expert is not ready."""
    st = layer_state
    add = weights is not None
    return _resident_kernels(st["slot_of"], st["loading"], st["pf_pass"], st["busy"], st["last"], st["store"],
                             _WEIGHT_MARKER[kind],
                             hidden, inter, experts, clock, slots, stock, shadow, x, outputs, rows,
                             weights if add else _NO_WEIGHTS, y if add else _NO_WEIGHTS, add)


_NO_WEIGHTS = np.empty(0, np.float32)
