"""A decoded token's MoE block in two compiled calls: the router block, then its resident experts.

Why: in decode the block was eight calls from Python (the router block's matvec,
the shared expert's step, the stock routing, the store's claims, the experts' two
launches, the release, the weighted sum), and the Python after each streaming
call paid cache misses on the interpreter's state, 10-30 us a gap
(docs/benchmarks.md, "What a call costs right after a streaming one"). Here the
same kernels run from compiled code on the same operands, in the same order, so
the block's bits are those of the eight calls (tests/test_moe_step.py):

- `router_block` (`RouterCall` holds its operands and outputs): the router block's
  one launch (router logits | shared gate | up | shared gate logit), the shared
  expert's term (`shared_step`), and with the stock router the routing
  (`route_rows`). A layer's mixer step runs it in its own call, on the post norm it
  has just written (`deltanet_step`, `attention_step`);
- `resident_experts_step`: the store's claims on the experts' RAM slots
  (`slot_claims`), both launches of `qmatvec._experts`, the release, and the
  weighted sum and the shared term into the block's output, with the store's lock
  held by the caller. When an expert is not ready in a slot it changes nothing and
  says so; the caller takes the general path.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tierlab.engine.kernels.clock import monotonic_ns
from tierlab.engine.kernels.dense import add_weighted, route_rows
from tierlab.engine.kernels.qmatvec import _WEIGHT_MARKER, ADD, GATE_UP, SET, _experts, _pass, _stack_pass, _thread_count
from tierlab.engine.kernels.shared_step import _shared_kernels
from tierlab.engine.kernels.slot_claims import claim_resident, release_slots

@njit(nogil=True, cache=True)
def router_block(wa, qb, sb, wc, x, fused, wd, sd, start, size, h, gate, term, plain, k, norm, probs, chosen,
                 true_topk, top_probs, weights, threads):
    """The router block's launch (one matrix qb/sb when wa is None, else the RowStack's one
    launch), the shared expert's step unless wd is None, and with `plain` the stock routing.
    A None operand is known when numba compiles: its branch is left out of the code."""
    if wa is None:
        _pass(qb, sb, qb, sb, x, fused[0], SET, 1.0, threads)
    else:
        _stack_pass(wa, qb, sb, wc, x, fused[0])
    if wd is not None:
        _shared_kernels(wd, sd, fused, start, size, h, gate, term, threads)
    if plain:
        route_rows(fused[:, :start], k, norm, probs, chosen, true_topk, top_probs, weights)


@njit(nogil=True, cache=True)
def timed_router_block(router_args, stamps):
    """`router_block(*router_args)` with the monotonic clock read at its start and end into
    stamps int64[2]: its share of a mixer step's call (the "router" timer)."""
    stamps[0] = monotonic_ns()
    router_block(*router_args)
    stamps[1] = monotonic_ns()


def router_operands(w_in) -> tuple | None:
    """The router block as `router_block` launches it: (wa, q, scales, wc) for a RowStack that
    `qmatvec.stack_parts` accepted, (None, w, scales, None) for one matrix that
    `qlinear.pass_operands` accepts, None where neither holds."""
    from tierlab.engine.qlinear import pass_operands

    stack = getattr(w_in, "one_launch", None)
    if stack is not None:
        return stack
    single = pass_operands(w_in)
    if single is None:
        return None
    w, scales = single
    return None, w, scales, None


class RouterCall:
    """One decoded token's router block: its operands and the fresh arrays its compiled call
    fills. `x` is the block's input (the layer's post norm): a mixer's one-call step writes
    it and runs the block in the same call (`args`); `run` runs the block alone."""

    def __init__(self, operands: tuple, shared_down: tuple | None, hidden: int, n_experts: int, shared_inter: int,
                 top_k: int, norm: bool, plain: bool, x: np.ndarray | None = None) -> None:
        wa, qb, sb, wc = operands
        rows = qb.shape[0] + (0 if wa is None else wa.shape[0] + wc.shape[0])
        self.x = np.empty((1, hidden), dtype=np.float32) if x is None else np.ascontiguousarray(x, dtype=np.float32)
        self.ran = False  # set once the block has run (alone, or in a mixer's call)
        self.fused = np.empty((1, rows), dtype=np.float32)
        wd, sd = shared_down if shared_down is not None else (None, None)
        self.term = np.empty((1, hidden), dtype=np.float32) if wd is not None else None
        self.plain = plain
        self.probs = np.empty((1, n_experts), dtype=np.float32)
        chosen = np.empty((2, 1, top_k), dtype=np.int32)
        values = np.empty((2, 1, top_k), dtype=np.float32)
        self._chosen, self._values = chosen, values
        h = np.empty((1, shared_inter), dtype=np.float32)
        gate = np.empty(1, dtype=np.float32)
        self.args = (wa, qb, sb, wc, self.x[0], self.fused, wd, sd, n_experts, shared_inter, h, gate,
                     self.term if wd is not None else _NO_TERM, plain, top_k, norm, self.probs, chosen[0], chosen[1],
                     values[0], values[1], _thread_count())

    def run(self) -> None:
        router_block(*self.args)
        self.ran = True

    @property
    def choices(self) -> tuple | None:
        """With the stock router, its choices as `MoEBlock._plain_choices` gives them."""
        if not self.plain:
            return None
        return self.probs, self._chosen[0], self._chosen[1], self._values[0], self._values[1]


_NO_TERM = np.empty((1, 0), dtype=np.float32)


@njit(nogil=True, cache=True)
def _resident_kernels(slot_of, loading, pf_pass, busy, last, store, marker, hidden, inter, experts, clock, slots,
                      stock, shadow, x, outputs, rows, weights, y, term, hits, layer, threads):
    clock = claim_resident(slot_of, loading, pf_pass, busy, last, experts, clock, slots, stock, shadow)
    if clock < 0:
        return clock
    hits[layer] += experts.shape[0]
    h = np.empty((slots.shape[0], inter), np.float32)
    _experts(store, slots, marker, hidden, inter, x, h, outputs, rows, GATE_UP, 1.0, threads)
    _experts(store, slots, marker, hidden, inter, x, h, outputs, rows, ADD, 1.0, threads)
    release_slots(busy, slots)
    if weights is not None:
        add_weighted(y, experts, weights, outputs)
        if term is not None:  # the shared expert's term, after the routed experts' sum (as `MoEBlock.forward`)
            for i in range(y.shape[0]):
                y[i] = y[i] + term[i]
    return clock


def resident_experts_step(layer_state: dict, kind: str, hidden: int, inter: int, experts: np.ndarray,
                          clock: int, slots: np.ndarray, stock: np.ndarray, shadow: np.ndarray, x: np.ndarray,
                          outputs: np.ndarray, rows: np.ndarray, hits: np.ndarray, layer: int,
                          weights: np.ndarray | None = None, y: np.ndarray | None = None,
                          term: np.ndarray | None = None) -> int:
    """Claims, both launches, release, hits[layer] += K (and with `weights`, y += the weighted
    sum in rank order, then + `term` when given) for `experts` int64[K] that are all ready in
    the layer's RAM slots: outputs [K, hidden] float32, zero, gets each expert's output
    (rows: 0..K-1). The caller holds the store's lock, from the claims to the release, so
    no other thread sees the slots held. Returns the new LRU clock, or -1 having changed
    nothing when an expert is not ready."""
    st = layer_state
    return _resident_kernels(st["slot_of"], st["loading"], st["pf_pass"], st["busy"], st["last"], st["store"],
                             _WEIGHT_MARKER[kind], hidden, inter, experts, clock, slots, stock, shadow, x, outputs,
                             rows, weights, y, term, hits, layer, _thread_count())
