"""The MoE block: route each token, have the expert store compute its experts, sum them.

This is where the levers plug in without touching the math around them:
- routing: the router's plain top-K, or, when the cache-aware lever or its
  meters are on, `Router.select` with each expert's residency level;
- residency: the expert store's levels (2 GPU tier, 1 RAM cache, 0 disk);
  the store computes each expert where it lives;
- events: what was chosen, what hit, what the stock top-K would have hit
  (the store counts it), what it cost.
Expert outputs are summed in rank order whichever tier computed them, so
moving an expert between tiers never changes the result.
"""

from __future__ import annotations

import time

import numpy as np

from tierlab.engine.checkpoint import Checkpoint, fuse_rows
from tierlab.engine.config import ModelConfig
from tierlab.engine.events import LEVEL_GPU, LayerRoute
from tierlab.engine.kernels.dense import (PAIRWISE_BLOCK, add_weighted_rows, linear, route_rows, shared_expert_inputs,
                                          softmax_row)
from tierlab.engine.kernels.moe_step import RouterCall, router_operands
from tierlab.engine.kernels.shared_step import shared_expert_step
from tierlab.engine.qlinear import pass_operands


class SwiGLU:
    """A dense SwiGLU MLP (the shared expert, or a dense layer of Qwen3-MoE)."""

    def __init__(self, ckpt: Checkpoint, prefix: str, hidden: int, inter: int) -> None:
        self.gate = ckpt.load(prefix + "gate_proj.weight", (inter, hidden))
        self.up = ckpt.load(prefix + "up_proj.weight", (inter, hidden))
        self.down = ckpt.load(prefix + "down_proj.weight", (hidden, inter))

    def forward(self, x: np.ndarray) -> np.ndarray:
        g = linear(self.gate, x)
        u = linear(self.up, x)
        h = g / (1.0 + np.exp(-g)) * u
        return linear(self.down, np.ascontiguousarray(h, dtype=np.float32))


class MoEBlock:
    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, layer: int) -> None:
        p = f"layers.{layer}.mlp."
        H = cfg.hidden_size
        self.layer = layer
        self.cfg = cfg
        E, S = cfg.n_experts, cfg.shared_inter
        rows = [ckpt.load(p + "gate.weight", (E, H))]
        self.shared_down = None
        if S:
            # router, shared gate/up and the shared expert's sigmoid gate all read x: one matrix
            rows += [ckpt.load(p + "shared_expert.gate_proj.weight", (S, H)),
                     ckpt.load(p + "shared_expert.up_proj.weight", (S, H)),
                     ckpt.load(p + "shared_expert_gate.weight", (1, H))]
            self.shared_down = ckpt.load(p + "shared_expert.down_proj.weight", (H, S))
        # a decoded token's shared expert in one compiled call, where its down projection is one pass
        self._shared_step_weights = pass_operands(self.shared_down) if S else None
        self.w_in = fuse_rows(rows)
        # PILOT runs the router alone: a view of the fused matrix, or the router's own
        # block where the shared expert is quantised and the router is not
        self.router_w = self.w_in[:E] if isinstance(self.w_in, np.ndarray) else self.w_in.first_rows(E)
        if self.router_w is None:  # a quantised router fused with its neighbours
            self.router_w = rows[0]
        # a decoded token's router block, shared expert and stock routing in one compiled
        # call, where the router block is one launch and the shared expert's down one pass
        self._router_block = router_operands(self.w_in)
        if S and self._shared_step_weights is None:
            self._router_block = None

    # -- routing ---------------------------------------------------------------
    def route(self, logits: np.ndarray, ctx) -> LayerRoute:
        """This token's routing record: the router's when the lever or its meters are on, else the plain top-K."""
        if self._routes_plainly(ctx):
            return self._plain_route(self._plain_choices(logits[None, :]), 0, ctx)
        probs = np.empty(self.cfg.n_experts, dtype=np.float32)
        softmax_row(logits, probs)
        route = ctx.router.select(self.layer, logits, probs, ctx.residency(self.layer), ctx.knobs)
        route.probs = probs  # this call's own array: kept by reference, for the app's drill-down
        return route

    @staticmethod
    def _routes_plainly(ctx) -> bool:
        """The stock top-K routes this pass: no router, or neither the lever nor its meters on."""
        knobs = ctx.knobs
        return ctx.router is None or not (knobs.CACHE_ROUTE or knobs.meters_on)

    def _plain_choices(self, logits: np.ndarray) -> tuple[np.ndarray, ...]:
        """The stock router's choices for every row of logits [T, E], in one kernel call:
        (probs, chosen, true_topk, top_probs, weights), each with one row per token."""
        T = logits.shape[0]
        E, K = self.cfg.n_experts, self.cfg.top_k
        probs = np.empty((T, E), dtype=np.float32)
        chosen = np.empty((2, T, K), dtype=np.int32)
        values = np.empty((2, T, K), dtype=np.float32)
        norm = self.cfg.norm_topk_prob
        route_rows(logits, K, norm and K <= PAIRWISE_BLOCK, probs, chosen[0], chosen[1], values[0], values[1])
        if norm and K > PAIRWISE_BLOCK:  # numpy's own sum: the kernel reproduces it up to one block
            for t in range(T):
                values[1, t] = values[0, t] / values[0, t].sum()
        return probs, chosen[0], chosen[1], values[0], values[1]

    def _plain_route(self, choices: tuple[np.ndarray, ...], t: int, ctx) -> LayerRoute:
        """Token t's plain routing record, with its experts' residency levels as they are now."""
        probs, chosen, true_topk, top_probs, weights = choices
        K = chosen.shape[1]
        c = chosen[t]
        level = ctx.residency(self.layer)[c] if ctx.wants_levels else np.zeros(K, dtype=np.int8)
        return LayerRoute(self.layer, c, weights[t], true_topk[t], top_probs[t], level.astype(np.int8, copy=False),
                          np.zeros(K, dtype=np.bool_), slots=K, probs=probs[t])

    # -- compute ---------------------------------------------------------------
    def decode_router(self, ctx, x: np.ndarray | None = None) -> RouterCall | None:
        """A decoded token's router block as one compiled call (`moe_step.RouterCall`): the block's
        launch, the shared expert and, with the stock router, the routing; its input x, or one
        that the layer's mixer step writes and runs the block on in its own call. None where
        the block is not one launch (`forward` takes the calls one by one)."""
        if self._router_block is None:
            return None
        cfg = self.cfg
        K = cfg.top_k
        plain = self._routes_plainly(ctx) and (K <= PAIRWISE_BLOCK or not cfg.norm_topk_prob)
        return RouterCall(self._router_block, self._shared_step_weights, cfg.hidden_size, cfg.n_experts,
                          cfg.shared_inter, K, cfg.norm_topk_prob, plain, x)

    def forward(self, x: np.ndarray, ctx, last_row_only: bool = False,
                router: RouterCall | None = None) -> tuple[np.ndarray, list[LayerRoute]]:
        """x: normed hidden states [T, H]; returns the block output and each token's route.

        `last_row_only`: only the output's last row will be read (a prompt's last layer when
        only the next token's logits are wanted). Every token is still routed and claimed, so
        routing records, meters, heat and residency are what they would be, but a grouped
        prompt computes only the experts the last token uses (with all their tokens, so its
        row keeps its bits); the other rows hold the shared expert's output alone.

        `router`: this token's `decode_router`, already run by the layer's mixer step when
        its `ran` is set."""
        T, H = x.shape
        if T == 1 and self._router_block is not None:
            return self._decode(x, ctx, router)
        timers = ctx.timers
        t0 = time.perf_counter()
        fused = linear(self.w_in, x).reshape(T, -1)
        E, S = self.cfg.n_experts, self.cfg.shared_inter
        logits_all = fused[:, :E]
        timers["router"] += time.perf_counter() - t0
        # the shared expert needs only the router block's output: its down projection runs
        # next to it, while the stream of small reads goes on (docs/benchmarks.md, "The shared
        # expert beside the router"); its term is added after the routed experts, as before
        shared = self._shared_expert(fused, E, S, timers) if self.shared_down is not None else None
        out = np.zeros((T, H), dtype=np.float32)
        if T > 1 and self._can_group(ctx):
            routes = self._grouped_experts(x, logits_all, out, ctx, last_row_only)
        else:
            routes = self._token_by_token(x, logits_all, out, ctx)
        if shared is not None:
            out += shared
        return out, routes

    def _decode(self, x: np.ndarray, ctx, router: RouterCall | None) -> tuple[np.ndarray, list[LayerRoute]]:
        """`forward` for one token, the router block in one compiled call (`decode_router`; run
        here unless the mixer's step ran it), booked as "router": the same kernels in the
        same order as `forward`'s general path, so the same bits (tests/test_moe_step.py)."""
        timers = ctx.timers
        t0 = time.perf_counter()
        if router is None or not router.ran:
            router = self.decode_router(ctx, x)
            router.run()
        logits = router.fused[0, :self.cfg.n_experts]
        if router.plain:
            route = self._plain_route(router.choices, 0, ctx)
        else:
            route = self.route(np.ascontiguousarray(logits), ctx)
        timers["router"] += time.perf_counter() - t0
        out = np.zeros((1, x.shape[1]), dtype=np.float32)
        self._experts(x[0], route, out[0], ctx, None if router.term is None else router.term[0])
        ctx.after_route(self.layer, route, logits)
        return out, [route]

    def _shared_expert(self, fused: np.ndarray, E: int, S: int, timers) -> np.ndarray:
        """sigmoid(gate) * down(silu(g) * u) of the shared expert, from the router block's output
        [T, E + 2S + 1] (router logits | g | u | gate)."""
        t0 = time.perf_counter()
        T = fused.shape[0]
        if T == 1 and self._shared_step_weights is not None:
            term = shared_expert_step(self._shared_step_weights, fused, E, S)
            timers["shared"] += time.perf_counter() - t0
            return term
        h = np.empty((T, S), dtype=np.float32)
        gate = np.empty(T, dtype=np.float32)
        shared_expert_inputs(fused, E, S, h, gate)
        term = linear(self.shared_down, h)
        term *= gate[:, None]
        timers["shared"] += time.perf_counter() - t0
        return term

    def _token_by_token(self, x: np.ndarray, logits_all: np.ndarray, out: np.ndarray, ctx) -> list[LayerRoute]:
        """Route and compute each token in turn (decode, and prompts when experts can be evicted)."""
        timers = ctx.timers
        routes = []
        t1 = time.perf_counter()
        # the stock top-K depends on no residency: every token's in one call, as a grouped prompt's
        choices = self._plain_choices(logits_all) if self._routes_plainly(ctx) else None
        timers["router"] += time.perf_counter() - t1
        for t in range(x.shape[0]):
            t1 = time.perf_counter()
            if choices is not None:
                route = self._plain_route(choices, t, ctx)
            else:
                route = self.route(np.ascontiguousarray(logits_all[t]), ctx)
            timers["router"] += time.perf_counter() - t1
            self._experts(x[t], route, out[t], ctx)
            routes.append(route)
            ctx.after_route(self.layer, route, logits_all[t])
        return routes

    def _can_group(self, ctx) -> bool:
        """A prompt's experts may be computed per expert unless a GPU tier takes a share of them."""
        return ctx.store.can_group()

    def _grouped_experts(self, x: np.ndarray, logits_all: np.ndarray, out: np.ndarray, ctx,
                         last_row_only: bool = False) -> list[LayerRoute]:
        """A prompt's experts, each read at most once and run once for all the tokens routed to it.

        Why it equals `_token_by_token`: every decision that depends on residency is taken in
        token order on the same state. Each token is routed (the router's residency levels,
        with CACHE_ROUTE on) after the previous token's claims; the stock top-K reads no
        residency, so with the lever and its meters off every token's is computed in one call
        first and only its record's levels are read in token order. A token's claims are those that
        `ExpertStore.compute` makes (`claim_prompt_token`: the same hits, misses, victims, LRU
        order, pins' protection and shadow counts, a miss resident from then on), with only the
        reads deferred. Pins change between passes only (HOT pins after a pass); the GPU tier
        (its residents run on the device and are evicted first) keeps a prompt token by token
        (`_can_group`); PILOT's prefetch reads land in this layer before its prompt or after
        it (`ExpertStore.begin_prompt`), one of the timings its loader can take token by
        token, so with CACHE_ROUTE off the logits are those of PILOT off, bit for bit. Then
        the work is regrouped (`stream_batches`): one pass over an expert's weights
        serves all its tokens, the experts at hand running as one batch (`forward_batch`:
        matrix-matrix products in one pair of launches, the one-token kernel for an expert of
        a few tokens, or with the PREFILL_EXACT knob the one-token kernel's exact
        results), the next experts are read while a batch runs, and each token still sums
        its experts in rank order. An expert that
        did not stay resident runs from a scratch buffer, so a prompt needs no slot per expert.
        """
        layer, store, timers = self.layer, ctx.store, ctx.timers
        T, K = x.shape[0], self.cfg.top_k
        routes: list[LayerRoute] = []
        users: dict[int, list[tuple[int, int]]] = {}  # expert -> [(token, slot)] in token order
        prompt = store.begin_prompt(layer)
        try:
            t1 = time.perf_counter()
            # the stock top-K depends on no residency: every token's in one call
            choices = self._plain_choices(logits_all) if self._routes_plainly(ctx) else None
            timers["router"] += time.perf_counter() - t1
            for t in range(T):
                t1 = time.perf_counter()
                if choices is not None:
                    route = self._plain_route(choices, t, ctx)
                else:
                    route = self.route(np.ascontiguousarray(logits_all[t]), ctx)
                t2 = time.perf_counter()
                timers["router"] += t2 - t1
                ids = route.chosen.tolist()
                slots = [s for s, e in enumerate(ids) if e >= 0]
                experts = [ids[s] for s in slots]
                hits, shadow = store.claim_prompt_token(prompt, experts, stock=route.true_topk)
                _add_shadow(route, shadow)
                route.ram_hits += sum(hits)
                route.ram_misses += len(hits) - sum(hits)
                for s, e in zip(slots, experts):
                    users.setdefault(e, []).append((t, s))
                timers["fetch"] += time.perf_counter() - t2
                routes.append(route)
                ctx.after_route(layer, route, logits_all[t])
            # every (token, slot) with an expert is written by its batch; the rest is never read
            outputs = np.empty((T, K, x.shape[1]), dtype=np.float32)
            rows = outputs.reshape(T * K, x.shape[1])
            exact = ctx.knobs.PREFILL_EXACT
            xc = np.ascontiguousarray(x, dtype=np.float32)
            needed = {e for e in routes[-1].chosen.tolist() if e >= 0} if last_row_only else None

            def run(batch: list[tuple[int, np.ndarray]]) -> None:
                if needed is not None:  # the other experts' reads still land (residency), their work is skipped
                    batch = [(e, blob) for e, blob in batch if e in needed]
                    if not batch:
                        return
                store.forward_batch([blob for _, blob in batch], [[t for t, _ in users[e]] for e, _ in batch], xc,
                                    rows, [[t * K + s for t, s in users[e]] for e, _ in batch], exact=exact)

            store.stream_batches(prompt, list(users), run, timers)
            t3 = time.perf_counter()
            first = T - 1 if last_row_only else 0  # rows before it: experts not run, outputs never written
            chosen = np.stack([route.chosen for route in routes[first:]])
            weights = np.stack([route.weights for route in routes[first:]]).astype(np.float32, copy=False)
            add_weighted_rows(out[first:], chosen, weights, outputs[first:])
            timers["compute"] += time.perf_counter() - t3
        finally:
            store.end_prompt(prompt)
        return routes

    def _experts(self, x: np.ndarray, route: LayerRoute, y: np.ndarray, ctx, term: np.ndarray | None = None) -> None:
        """y += sum over slots in rank order of weight * expert(x), each expert computed where it
        lives; then y += term (the shared expert's, when given)."""
        hits, misses, on_gpu, shadow = ctx.store.compute_weighted(self.layer, route.chosen, route.weights, x, y,
                                                                  ctx.timers, stock=route.true_topk, term=term)
        _add_shadow(route, shadow)
        route.ram_hits += hits
        route.ram_misses += misses
        if on_gpu:
            for s in on_gpu:
                route.level[s] = LEVEL_GPU
            route.vram_served = len(on_gpu)


def _add_shadow(route: LayerRoute, shadow) -> None:
    """The store's count of the stock top-K (the shadow meter) into the routing record."""
    if shadow is not None:
        route.shadow_ram_hits += shadow.ram_hits
        route.shadow_ram_misses += shadow.ram_misses
        route.shadow_vram += shadow.vram


class DenseBlock:
    """The MLP of a Qwen3-MoE layer listed in mlp_only_layers."""

    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, layer: int) -> None:
        self.mlp = SwiGLU(ckpt, f"layers.{layer}.mlp.", cfg.hidden_size, cfg.dense_inter)

    def decode_router(self, ctx, x: np.ndarray | None = None) -> None:
        """No router: nothing for the mixer's step to run."""
        return None

    def forward(self, x: np.ndarray, ctx, last_row_only: bool = False, router=None) -> tuple[np.ndarray, list]:
        return self.mlp.forward(x), []

