"""The engine: a loaded model, its sequence state, its tiers and its levers.

`load_engine(dir)` accepts a Hugging Face folder (config.json + safetensors
+ tokenizer) or a tierlab quantised container. Dense weights are loaded up
front; experts never are: the expert store (`expert_store`) streams them
through its RAM cache (and the GPU tier when one is attached) as the router
asks for them, and computes each where it lives.

One forward pass takes T >= 1 new tokens: a prompt uses matrix-matrix work
for the projections, decode is T = 1. After each pass the engine publishes
one TokenEvent per token to its subscribers (session logs, meters, the app).
"""

from __future__ import annotations

import copy
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tierlab.engine import load_follow, readahead
from tierlab.engine.checkpoint import Checkpoint
from tierlab.engine.config import ModelConfig
from tierlab.engine.container import ChecksumMismatch
from tierlab.engine.errors import ModelError
from tierlab.engine.events import TokenEvent
from tierlab.engine.expert_store import ExpertStore, ResidencyState, StoreStats
from tierlab.engine.heat import add_routed
from tierlab.engine.heat_log import HeatLog
from tierlab.engine.kernels.dense import embed_rows, linear, rmsnorm
from tierlab.engine.knobs import Knobs
from tierlab.engine.meters import MeterFold, read_store_counters
from tierlab.engine.model_files import open_model_files
from tierlab.engine.models import ARCHITECTURES
from tierlab.engine.moe import DenseBlock, MoEBlock
from tierlab.engine.prefetch import Pilot, RouterHead
from tierlab.engine.prompt_heap import prompt_heap
from tierlab.engine.qlinear import QuantMatrix, RowStack
from tierlab.engine.sampling import Sampler
from tierlab.engine.tiering import TierOptions

TIMER_NAMES = ("attention", "deltanet", "router", "fetch", "compute", "shared", "tier", "pilot", "lm_head", "other")


class Layer:
    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, index: int) -> None:
        arch = ARCHITECTURES[cfg.arch]
        H = cfg.hidden_size
        self.index = index
        self.kind = cfg.layer_types[index]
        self.mixer = arch.build_mixer(ckpt, cfg, index)
        self.input_norm = ckpt.load_f32(f"layers.{index}.input_layernorm.weight", (H,))
        self.post_norm = ckpt.load_f32(f"layers.{index}.post_attention_layernorm.weight", (H,))
        self.mlp = MoEBlock(ckpt, cfg, index) if cfg.moe_layers[index] else DenseBlock(ckpt, cfg, index)


class Engine:
    def __init__(self, model_dir: Path, cfg: ModelConfig, ckpt: Checkpoint, source, cache_slots: int | None,
                 knobs: Knobs | None, tokenizer=None, tier: TierOptions | None = None) -> None:
        self.model_dir = model_dir
        self.config = cfg
        self.ckpt = ckpt
        self.knobs = knobs or Knobs.from_env()
        self.tokenizer = tokenizer
        self.embed = ckpt.load("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        self.final_norm = ckpt.load_f32("norm.weight", (cfg.hidden_size,))
        if cfg.tie_embeddings or not ckpt.has("lm_head.weight"):
            self.lm_head = self.embed
        else:
            self.lm_head = ckpt.load("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        self.layers = [Layer(ckpt, cfg, i) for i in range(cfg.n_layers)]
        slots = cfg.n_experts if cache_slots is None else cache_slots
        if slots < 1:
            raise ModelError(f"--cache must be at least 1 (got {slots})")
        tier = tier or TierOptions()
        self.tier_options = tier
        self._fingerprint: str | None = None
        self.notices: list[str] = []
        self.expert_source = source
        #: HEAT_FILE: the profile read at start, this process's routings, the write on close
        self.heat_log = HeatLog(tier.heat_file, cfg.n_layers, cfg.n_experts)
        #: where every expert lives (GPU tier, RAM cache, disk) and where it is computed
        self.store = ExpertStore(source, cfg.n_layers, cfg.n_experts, slots, cfg.moe_layers, self.notice)
        self.router = None
        self.heat = np.zeros((cfg.n_layers, cfg.n_experts), dtype=np.int64)  # since the last reset_meters
        self.meter_fold = MeterFold()  # every token since the last reset_meters
        self.timers: dict[str, float] = defaultdict(float)
        self.tokens_timed = 0
        self._listeners: list[Callable[[TokenEvent], None]] = []
        self._lock = threading.RLock()
        self.pilot: Pilot | None = None
        #: this process's thread count for the kernels, following the machine's load
        self.threads = load_follow.for_process()
        self._hot_pinned = False
        self.sequence_serial = 0
        #: the page-cache read-ahead of the experts that load_engine starts (engine/readahead.py)
        self.readahead: threading.Thread | None = None
        self.reset()
        self.store.attach_tier(tier, self.heat_log.plan_file)

    # -- public state ------------------------------------------------------------
    def subscribe(self, listener: Callable[[TokenEvent], None]) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[TokenEvent], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def notice(self, text: str) -> None:
        """One line for the user (CLI prints it to stderr, the app as a notification)."""
        self.notices.append(text)

    def residency(self, layer: int) -> np.ndarray:
        """Residency level of every expert of a layer, int8[E]: 2 GPU tier, 1 RAM cache, 0 disk."""
        return self.store.levels(layer)

    def ram_order(self, layer: int) -> list[int]:
        """The experts the RAM cache holds for a layer, least recently used first."""
        return self.store.ram_order(layer)

    def cache_slots(self) -> int:
        """RAM cache slots per MoE layer."""
        return self.store.slots

    def set_cache_slots(self, slots: int) -> None:
        with self._lock:
            self.store.set_slots(slots)

    def store_stats(self) -> StoreStats:
        """The expert store's counters (RAM hits and misses per layer, bytes read, tier) and shape."""
        return self.store.stats()

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint (engine/fingerprint.py), read once from the folder's headers."""
        if self._fingerprint is None:
            from tierlab.engine.fingerprint import model_fingerprint

            self._fingerprint = model_fingerprint(self.model_dir)
        return self._fingerprint

    def residency_state(self) -> ResidencyState:
        """Where every expert is now (RAM slots in LRU order, pins, GPU tier residents)."""
        return self.store.residency_state()

    def restore_residency(self, state: ResidencyState) -> None:
        """Put the experts back where `state` says (clean A/B arms: app/lab/arms.py)."""
        with self._lock:
            self.store.restore_residency(state)

    def freeze_heat_file(self) -> None:
        """From now on this engine's routings are not added to HEAT_FILE (A/B arms, replays)."""
        self.heat_log.frozen = True

    def tier_description(self) -> dict | None:
        """The GPU tier (device, capacity, warmstart order, uploads, bytes, seconds); None without one."""
        return self.store.tier_report()

    def reset(self) -> None:
        """Forget the sequence (KV cache, DeltaNet state); keep caches, tiers and meters."""
        with self._lock:
            self.states = [layer.mixer.new_state() for layer in self.layers]
            self.pos = 0
            self.fed: list[int] = []  # the ids the sequence state holds, in order
            self.sequence_serial += 1  # snapshots of an earlier sequence no longer restore

    # -- coming back to a prefix of the sequence ----------------------------------
    def sequence_ids(self) -> list[int]:
        """The token ids the sequence state holds (a copy)."""
        return list(self.fed)

    def rewinds_anywhere(self) -> bool:
        """True when every layer's state can be cut back to any prefix (attention only)."""
        return all(state.rewinds_anywhere for state in self.states)

    def rewind(self, pos: int) -> None:
        """Keep the first `pos` tokens of the sequence; only when `rewinds_anywhere()`."""
        with self._lock:
            if not (0 <= pos <= self.pos) or not self.rewinds_anywhere():
                raise ValueError(f"cannot rewind to {pos} (at {self.pos})")
            self.pos = pos
            del self.fed[pos:]

    def save_state(self) -> "SequenceSnapshot":
        """The sequence state at this position, to come back to with `restore_state`."""
        with self._lock:
            return SequenceSnapshot(self.sequence_serial, tuple(self.fed), [s.snapshot() for s in self.states])

    def can_restore(self, snapshot: "SequenceSnapshot") -> bool:
        """True when the sequence still starts with the snapshot's tokens, computed the same way."""
        n = snapshot.pos
        return (snapshot.serial == self.sequence_serial and n <= self.pos
                and tuple(self.fed[:n]) == snapshot.ids)

    def restore_state(self, snapshot: "SequenceSnapshot") -> None:
        """Go back to a snapshot of this sequence: its DeltaNet states, its length."""
        with self._lock:
            if not self.can_restore(snapshot):
                raise ValueError("the snapshot is not a prefix of this sequence")
            for state, saved in zip(self.states, snapshot.states):
                state.restore(saved)
            self.pos = snapshot.pos
            del self.fed[snapshot.pos:]

    def reset_meters(self) -> None:
        self.store.reset_counters()
        self.heat[:] = 0
        self.meter_fold.reset()
        self.timers = defaultdict(float)
        self.tokens_timed = 0
        if self.pilot is not None:
            self.pilot.reset_meters()

    def scratch_twin(self, layer_ids: list[int], slots: int, knobs: Knobs) -> "Engine":
        """An engine that shares this one's weights, layers and expert source but owns its
        sequence state, RAM cache (only for `layer_ids`, no GPU tier), router, prefetcher,
        meters, heat and knobs, and runs only the layers in `layer_ids`: the kernel warm-up
        runs it and leaves this engine exactly as it was. Close it with `close_twin`."""
        from tierlab.engine.routing import Router

        cfg = self.config
        twin = copy.copy(self)
        twin.knobs = knobs
        twin.layers = [self.layers[i] for i in layer_ids]
        chosen = set(layer_ids)
        moe = [bool(m) and i in chosen for i, m in enumerate(cfg.moe_layers)]
        twin.notices = []
        twin.store = ExpertStore(_BorrowedSource(self.expert_source), cfg.n_layers, cfg.n_experts, slots, moe,
                                 twin.notice)
        twin.heat_log = HeatLog(None, cfg.n_layers, cfg.n_experts)
        twin.heat = np.zeros_like(self.heat)
        twin.meter_fold = MeterFold()
        twin.timers = defaultdict(float)
        twin.tokens_timed = 0
        twin._listeners = []
        twin._lock = threading.RLock()
        twin._hot_pinned = False
        twin.router = Router(cfg.n_layers, cfg.n_experts, cfg.top_k, cfg.norm_topk_prob)
        heads = [RouterHead(layer.post_norm, layer.mlp.router_w) if isinstance(layer.mlp, MoEBlock) else None
                 for layer in self.layers]
        twin.pilot = Pilot(cfg, twin.store, heads)
        twin.reset()
        return twin

    def close_twin(self) -> None:
        """Stop a scratch twin's prefetcher and readers; the shared expert source stays open."""
        if self.pilot is not None:
            self.pilot.close()
            self.pilot = None
        self.store.close()

    def cold_start(self) -> None:
        """Make the next run independent of earlier ones: empty RAM cache, fresh router and
        prefetch state, no pins, zeroed meters. The GPU tier keeps its warmstart residents."""
        if self.pilot is not None:
            self.pilot.close()
            self.pilot = None
        self.store.clear()
        self._hot_pinned = False
        if self.router is not None:
            from tierlab.engine.routing import Router

            cfg = self.config
            self.router = Router(cfg.n_layers, cfg.n_experts, cfg.top_k, cfg.norm_topk_prob)
        self.reset_meters()
        self.reset()

    # -- the forward pass -------------------------------------------------------
    def forward(self, ids: list[int] | np.ndarray, all_logits: bool = False, phase: str | None = None) -> np.ndarray:
        """Feed T tokens at the current position; logits of the last (or all) positions."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        low, high = (int(ids[0]),) * 2 if ids.size == 1 else (int(ids.min()), int(ids.max()))  # decode: no reductions
        if low < 0 or high >= self.config.vocab_size:
            raise ModelError(f"token id out of range 0..{self.config.vocab_size - 1}")
        context = self.config.max_positions
        if context and self.pos + ids.size > context:
            if self.pos == 0:
                raise ModelError(f"the prompt has {ids.size} tokens, more than the model's context "
                                 f"({context} tokens, max_position_embeddings)")
            raise ModelError(f"the sequence would reach {self.pos + ids.size} tokens, more than the model's "
                             f"context ({context} tokens, max_position_embeddings)")
        with self._lock:
            if ids.size == 1:
                return self._forward(ids, all_logits, phase or "decode")
            # a prompt's large temporaries reuse the previous layer's pages; under load it runs
            # every thread with short waits (LoadFollower.prompt)
            with prompt_heap(), self.threads.prompt():
                return self._forward(ids, all_logits, phase or "prefill")

    def _mixer_half(self, layer: Layer, state, x: np.ndarray, ctx: "_PassContext", router=None) -> np.ndarray:
        """x += mixer(input norm(x)) in place; returns the post norm of the new x (the MLP's input).

        A decoded token takes the norms and the residual add in the mixer's one compiled call
        where it has one (`decode_residual`; the same kernels in the same order, so the same
        bits), booked with the mixer, and the MoE `router` block too when given (booked as
        "router", by the clock readings the call takes around it); PILOT reads x after the
        add either way."""
        cfg = self.config
        timers = ctx.timers
        t0 = time.perf_counter()
        h = None
        router_s = 0.0
        if x.shape[0] == 1:
            stamps = np.zeros(2, dtype=np.int64)
            h = layer.mixer.decode_residual(x, self.pos, state, (layer.input_norm, layer.post_norm, cfg.rms_eps),
                                            router, stamps)
            if h is not None and router is not None:
                router.ran = True
                router_s = 1e-9 * float(stamps[1] - stamps[0])
        if h is None:
            x += layer.mixer.forward(rmsnorm(x, layer.input_norm, cfg.rms_eps), self.pos, state,
                                     exact=ctx.knobs.PREFILL_EXACT)
        timers["deltanet" if layer.kind == "linear_attention" else "attention"] += time.perf_counter() - t0 - router_s
        timers["router"] += router_s
        if ctx.knobs.PILOT:
            t0 = time.perf_counter()
            self._pilot().after_mixer(layer.index, x, ctx.knobs)
            timers["pilot"] += time.perf_counter() - t0
        return rmsnorm(x, layer.post_norm, cfg.rms_eps) if h is None else h

    def _forward(self, ids: np.ndarray, all_logits: bool, phase: str) -> np.ndarray:
        cfg = self.config
        T = ids.size
        ctx = _PassContext(self)
        timers = ctx.timers
        t_start = time.perf_counter()
        x = embed_rows(self.embed, ids)
        routes_by_layer = []
        # only the last row of the last layer's MLP is read unless every token's logits are
        # wanted: its routed experts run for the last token's experts alone (MoEBlock.forward)
        trim_last = T > 1 and not all_logits
        last = self.layers[-1]
        for layer, state in zip(self.layers, self.states):
            self.threads.follow()  # a reading of the load at most every SAMPLE_S; the count per layer
            # a decoded token's router block runs in its mixer's call (not with PILOT: its
            # prefetch reads start between the two)
            router = layer.mlp.decode_router(ctx) if T == 1 and not ctx.knobs.PILOT else None
            h = self._mixer_half(layer, state, x, ctx, router)
            out, routes = layer.mlp.forward(h, ctx, last_row_only=trim_last and layer is last, router=router)
            x += out
            routes_by_layer.append(routes)
        self._count_routes(routes_by_layer)
        t0 = time.perf_counter()
        if all_logits:
            xn = rmsnorm(x, self.final_norm, cfg.rms_eps)
            logits = linear(self.lm_head, xn)
        else:
            xn = rmsnorm(x[-1:], self.final_norm, cfg.rms_eps)
            logits = linear(self.lm_head, xn[0])
        timers["lm_head"] += time.perf_counter() - t0
        total = time.perf_counter() - t_start
        timers["other"] += max(0.0, total - sum(timers[k] for k in TIMER_NAMES if k != "other"))
        for k, v in timers.items():
            self.timers[k] += v
        self.timers["total"] += total
        self.tokens_timed += T
        start = self.pos
        self.pos += T
        self.fed.extend(ids.tolist())
        self._publish(ids, start, phase, routes_by_layer, timers, T, ctx.knob_seq)
        knobs = ctx.knobs
        if knobs.HOT and not self._hot_pinned and self.pos >= knobs.WARMUP:
            self.store.pin_hot(self.heat, knobs.HOT)
            self._hot_pinned = True
        return logits

    def _count_routes(self, routes_by_layer: list[list]) -> None:
        """The pass's routings into the heat counts once its last layer is done, one kernel call
        per count: a pass cut short (ctrl+c, SIGTERM) counts none of its tokens."""
        routes = [route for routes in routes_by_layer for route in routes]
        if not routes:
            return
        layers = np.array([route.layer for route in routes], dtype=np.int64)
        chosen = np.stack([route.chosen for route in routes])
        add_routed(self.heat, layers, chosen)
        self.heat_log.record_many(layers, chosen)

    def _pilot(self):
        if self.pilot is None:
            heads = [RouterHead(layer.post_norm, layer.mlp.router_w) if isinstance(layer.mlp, MoEBlock) else None
                     for layer in self.layers]
            self.pilot = Pilot(self.config, self.store, heads)
        return self.pilot

    def _publish(self, ids, start, phase, routes_by_layer, timers, T, seq: int) -> None:
        """One TokenEvent per token: into the engine's own meter fold, then to every listener."""
        per_token_ms = {k: 1000.0 * v / T for k, v in timers.items()}
        store = read_store_counters(self)
        gpu_tier = self.store.has_tier
        listeners = list(self._listeners)
        for t in range(T):
            layers = [routes[t] for routes in routes_by_layer if routes]
            event = TokenEvent(index=start + t, token_id=int(ids[t]), phase=phase, layers=layers,
                               timings_ms=per_token_ms, knob_seq=seq, gpu_tier=gpu_tier, store=store)
            self.meter_fold.add(event)
            for listener in listeners:
                listener(event)

    # -- generation -----------------------------------------------------------------
    def prefill(self, ids, all_logits: bool = False) -> np.ndarray:
        """Start a new sequence from `ids`."""
        self.reset()
        return self.forward(ids, all_logits=all_logits, phase="prefill")

    def step(self, token_id: int) -> np.ndarray:
        return self.forward([int(token_id)], phase="decode")

    def generate(self, prompt_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, stop_event: threading.Event | None = None, eos_ids=None,
                 conversation=None) -> Iterator[int]:
        """Yield new token ids; greedy at temperature 0; stops at EOS, max tokens, stop_event or the
        end of the model's context.
        With a `conversation` (engine/conversation.py) the prompt continues its sequence state:
        only what the state does not hold is prefilled."""
        if conversation is not None:
            yield from conversation.generate(prompt_ids, max_new_tokens, temperature, top_p, seed, stop_event,
                                             eos_ids)
            return
        logits = self.prefill(prompt_ids)
        yield from self.continue_from(logits, max_new_tokens, temperature, top_p, seed, stop_event, eos_ids)

    def continue_from(self, logits: np.ndarray, max_new_tokens: int = 64, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int = 0, stop_event: threading.Event | None = None,
                      eos_ids=None) -> Iterator[int]:
        """Yield new token ids after the sequence so far, whose next-token logits are `logits`.
        Each token is fed before the next is picked, the last one too when max_new_tokens
        ends the reply; an EOS or a stop is not fed."""
        sampler = Sampler(temperature, top_p, seed)
        eos = set(self.eos_ids() if eos_ids is None else eos_ids)
        if self.config.max_positions:  # prompt + new tokens never exceed max_position_embeddings
            max_new_tokens = min(max_new_tokens, self.config.max_positions - self.pos)
        for _ in range(max_new_tokens):
            if stop_event is not None and stop_event.is_set():
                return
            token = sampler.pick(logits)
            yield token
            if token in eos:
                return
            if stop_event is not None and stop_event.is_set():
                return
            logits = self.step(token)

    def eos_ids(self) -> list[int]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_ids)
        return sorted(ids)

    # -- meters ----------------------------------------------------------------------
    def meters(self) -> dict:
        """The engine's meters since the last reset_meters (engine/meters.py: rates as fractions, None = no samples)."""
        return self.meter_fold.summary()

    def close(self) -> None:
        """Write HEAT_FILE (if set), stop the prefetcher, release files and the device."""
        self.heat_log.write(self.notice)
        if self.pilot is not None:
            self.pilot.close()
        self.store.close()

    # -- weights ---------------------------------------------------------------------
    def dense_matrices(self) -> list:
        """Every dense weight matrix the layers hold, once each (projections, router, shared
        expert, dense MLPs; the router's view of the fused matrix is not listed again)."""
        found = []
        for layer in self.layers:
            found += [v for v in vars(layer.mixer).values() if _is_matrix(v)]
            mlp = layer.mlp
            found += [v for name, v in vars(mlp).items() if name != "router_w" and _is_matrix(v)]
            if isinstance(mlp, DenseBlock):
                found += [mlp.mlp.gate, mlp.mlp.up, mlp.mlp.down]
        return found

    def weight_nbytes(self) -> dict:
        """Bytes of weights outside the experts: "dense" (all layers), "embed_row" (one token's
        embedding) and "lm_head"."""
        return {"dense": sum(int(m.nbytes) for m in self.dense_matrices()),
                "embed_row": int(self.embed.nbytes // max(self.config.vocab_size, 1)),
                "lm_head": int(self.lm_head.nbytes)}


class SequenceSnapshot:
    """A point of one sequence to come back to: its tokens and the copies of the states
    that cannot rewind (DeltaNet); attention layers keep nothing."""

    def __init__(self, serial: int, ids: tuple[int, ...], states: list) -> None:
        self.serial = serial
        self.ids = ids
        self.states = states

    @property
    def pos(self) -> int:
        return len(self.ids)


class _BorrowedSource:
    """An expert source lent to a scratch twin's store: everything but `close` goes to the owner."""

    def __init__(self, source) -> None:
        self._source = source

    def __getattr__(self, name: str):
        return getattr(self._source, name)

    def close(self) -> None:
        pass


def _is_matrix(value) -> bool:
    return isinstance(value, (QuantMatrix, RowStack)) or (isinstance(value, np.ndarray) and value.ndim == 2)


class _PassContext:
    """What the MoE blocks see during one forward pass."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.knob_seq, self.knobs = engine.knobs.versioned()  # events carry the seq their knobs had
        self.store = engine.store
        self.router = engine.router
        self.timers: dict[str, float] = defaultdict(float)
        self.wants_levels = bool(engine._listeners) or engine.store.has_tier

    def residency(self, layer: int) -> np.ndarray:
        return self.store.levels(layer)

    def after_route(self, layer: int, route, logits: np.ndarray) -> None:
        """PILOT hears each routing in token order (the heat counts take the pass's at its end)."""
        engine = self.engine
        if engine.pilot is not None:
            engine.pilot.observe(layer, logits, route.chosen, route.ram_hits, self.knobs)


def load_engine(model_dir: str | Path, cache_slots: int | None = None, knobs: Knobs | None = None,
                with_tokenizer: bool = True, tier: TierOptions | None = None, warmup: bool = True,
                progress=None) -> Engine:
    """Load a model folder or container; raises ModelError (one line) on bad input.

    With `warmup`, every kernel a session can reach is compiled (or loaded from numba's
    on-disk cache) before this returns (engine/warmup.py); `progress(done, total, label,
    compiled)` hears each step."""
    model_dir = Path(model_dir)
    files = open_model_files(model_dir)  # the checks `tierlab inspect` runs too
    cfg, ckpt, source = files.config, files.checkpoint, files.source
    tokenizer = None
    if with_tokenizer and (model_dir / "tokenizer.json").exists():
        from tierlab.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_folder(model_dir)
    engine = Engine(model_dir, cfg, ckpt, source, cache_slots, knobs, tokenizer,
                    tier if tier is not None else TierOptions.from_env())
    from tierlab.engine.routing import Router

    engine.router = Router(cfg.n_layers, cfg.n_experts, cfg.top_k, cfg.norm_topk_prob)
    # after the dense weights (which the disk then serves first), before the warm-up's compiles
    engine.readahead = readahead.start(source.expert_ranges())
    if warmup:
        from tierlab.engine.warmup import warm_up

        try:
            warm_up(engine, progress)
        except ChecksumMismatch:  # the warm-up's reads found a damaged blob: the model cannot load
            engine.close()
            raise
        except Exception as exc:  # the engine itself is intact: kernels then compile on first use
            engine.notice(f"kernel warm-up failed ({type(exc).__name__}: {exc}); kernels compile on first use")
        except BaseException:
            engine.close()
            raise
    return engine
