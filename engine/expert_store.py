"""The expert store: where each expert lives, and running it there.

Three residency levels (`levels`): the GPU tier (2, an OpenCL device filled
at start), the RAM cache (1, a fixed number of slots per MoE layer) and disk
(0, the expert source). The MoE block routes and sums; for each token it
asks the store to compute the chosen experts (`compute`): those the tier
holds run on the device while the CPU computes the others from RAM slots,
each output in its own row so the caller sums them in rank order, whichever
level served them. Moving an expert between levels never changes a result.

The RAM cache: a miss reads the expert into a free slot, or into the slot of
a victim chosen in this order: an expert the GPU tier already holds, then
the least-recently-used unpinned one, then the least-recently-used pinned
one; never a slot being loaded or in use. Prefetch (PILOT) and pins (HOT)
fill and protect slots without counting hits or misses.

The prefetch ledger (PILOT's reads only): a slot PILOT loaded carries the
pass it was predicted for until its first use or eviction. Its first demand
hit is a prefetch hit, one saved miss; a hit in that same pass is a hit for
the token it was fetched for, and records how many layers ahead the read
finished (the layer using it minus the layer the engine was at when the read
completed; `ledger_position` says where the engine is).

The shadow meter is counted here too, where the realised hits are decided:
given the router's stock top-K (`stock`), the store says how many of those
experts the GPU tier held, how many a RAM slot held and how many would have
been read from disk, in the same cache state. A stock expert that was also
chosen counts as what it realised; one that was not chosen counts by where
it lived when the token's experts were claimed (a RAM slot holding it or
loading it counts as RAM, as a claim would have waited for the load). With
the routing lever off the stock top-K is the chosen set, so the shadow
equals the realised figures exactly.

A prompt's experts through a small cache (`begin_prompt`, `claim_prompt_token`,
`stream_batches`): the bookkeeping of each token's claims runs first, token by
token, exactly as `compute` would run it (the same claims in the same order,
so the same hits, misses, victims, LRU clock and residency levels), with every
read deferred. Then each expert the prompt used is read at most once: into
the slot the bookkeeping left it in, or, when it did not stay resident, into a
scratch buffer; the store's reader threads read the next experts while the
caller computes the current batch (`forward_batch`). At the end the slots hold what the
bookkeeping says they hold, as if the prompt had run token by token.

A device failure (`TierFailure`) is handled here: the store drops the tier,
says so once through its notice callback, and computes on the CPU.

Thread safety: the decode thread and the PILOT loader thread share the RAM
cache; disk reads happen outside the lock, with the slot marked as loading.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from tierlab.engine import budget, hugepages
from tierlab.engine.errors import TierlabError
from tierlab.engine.events import LEVEL_GPU
from tierlab.engine.kernels.experts_tokens import experts_tokens, few_token_limit
from tierlab.engine.kernels.qmatmat import expert_matmat, experts_matmat
from tierlab.engine.kernels.dense import add_weighted
from tierlab.engine.kernels.moe_step import resident_experts_step
from tierlab.engine.kernels.qmatvec import expert_forward_tokens, experts_forward
from tierlab.engine.tiering import TierOptions
from tierlab.engine.tiers.opencl_tier import TierFailure


@dataclass(frozen=True)
class StoreStats:
    """Counters of the store since the last `reset_counters`, and its current shape."""

    hits: np.ndarray  # int64[n_layers]: RAM cache hits per layer
    misses: np.ndarray  # int64[n_layers]: RAM cache misses per layer
    bytes_read: int  # bytes read from the expert source (misses, prefetches, pins)
    prefetch_reads: int  # reads issued by prefetch (PILOT and HOT), not counted as misses
    slots: int  # RAM slots per MoE layer
    tier_on: bool  # a GPU tier is attached (and has not failed)
    tier_residents: int
    tier_uploads: int
    tier_bytes: int
    expert_kind: str  # how the source stores an expert: fp32, bf16, int8 or int4
    blob_nbytes: int  # bytes of one expert

    @property
    def ram_hits(self) -> int:
        return int(self.hits.sum())

    @property
    def ram_misses(self) -> int:
        return int(self.misses.sum())

    @property
    def hit_rate(self) -> float:
        """RAM hits over RAM requests, 0..1 (0 before any request)."""
        total = self.ram_hits + self.ram_misses
        return self.ram_hits / total if total else 0.0


@dataclass(frozen=True)
class PrefetchLedger:
    """PILOT's reads per layer (int64[n_layers] each), since the store's last `reset_counters`."""

    ISSUED, HITS, OWN, AHEAD = range(4)  # rows of the store's count array

    issued: np.ndarray  # reads PILOT issued (the expert was not resident)
    hits: np.ndarray  # of those, hit by a later demand before eviction: misses saved
    own: np.ndarray  # of the hits, by the token (pass) the read was predicted for
    ahead_sum: np.ndarray  # over the own hits: layers between the read's completion and its use
    blob_nbytes: int  # bytes of one read


class Shadow(NamedTuple):
    """Where the router's stock top-K experts of one token and layer were: the shadow meter's counts.
    A named tuple: one is made per decoded token and layer, where a frozen dataclass took
    several microseconds right after the experts' launches."""

    ram_hits: int  # held by a RAM slot
    ram_misses: int  # would have been read from disk
    vram: int  # held by the GPU tier


def stock_outside(stock: np.ndarray | None, chosen) -> bool:
    """Whether the stock top-K names an expert that is not among `chosen` (ids; -1 ignored):
    only then does its shadow count need where that expert lived (`count_shadow`'s `where`)."""
    if stock is None:
        return False
    chosen = set(chosen.tolist() if isinstance(chosen, np.ndarray) else chosen)
    return any(e >= 0 and e not in chosen for e in stock.tolist())


def count_shadow(stock: np.ndarray, where: dict[int, int], realised: dict[int, int]) -> Shadow:
    """The shadow counts of a stock top-K: each expert's realised level if it was chosen, else
    where it lived (`where`); levels 2 GPU tier, 1 RAM, 0 disk."""
    counts = [0, 0, 0]
    for e in stock.tolist():
        if e >= 0:
            counts[realised.get(e, where.get(e, 0))] += 1
    return Shadow(ram_hits=counts[1], ram_misses=counts[0], vram=counts[2])


class HeldExperts:
    """One token's experts held in RAM slots (from `ExpertStore.acquire`, until `release`).

    `plan[i]` is (expert, slot, must_load) for the i-th expert asked for; `futures` maps an
    expert to its background read, `loaded` lists the misses already read in this thread.
    """

    __slots__ = ("layer", "plan", "futures", "loaded", "shadow")

    def __init__(self, layer: int, plan: list[tuple[int, int, bool]]) -> None:
        self.layer = layer
        self.plan = plan
        self.futures: dict = {}
        self.loaded: set[int] = set()
        self.shadow: Shadow | None = None  # the stock top-K's count, when acquire was given one

    def hit(self, i: int) -> bool:
        return not self.plan[i][2]


#: no expert ids (`_compute_resident` without a stock top-K)
_NO_EXPERTS = np.empty(0, dtype=np.int64)

#: a streamed prompt's reads in flight or done ahead of the expert being computed
PROMPT_READS_AHEAD = 4


class PromptLayer:
    """One layer of a prompt between `begin_prompt` and `end_prompt`: the layer's slot table
    (`st`), the expert each slot held before the prompt (`before`), and the slots a read has
    filled with the new expert the bookkeeping put there (`filled`)."""

    __slots__ = ("layer", "st", "before", "filled")

    def __init__(self, layer: int, st: dict, before: np.ndarray) -> None:
        self.layer = layer
        self.st = st
        self.before = before
        self.filled: set[int] = set()


@dataclass(frozen=True)
class ResidencyState:
    """Where the experts were, as far as the next run's hits depend on it: the RAM slots per
    layer, each MoE layer's RAM experts from least to most recently used with their pin flags
    (None for a layer without experts), and the GPU tier's residents as (layer, expert)."""

    slots: int
    ram: tuple[tuple[tuple[int, bool], ...] | None, ...]
    tier: tuple[tuple[int, int], ...]


class ExpertStore:
    def __init__(self, source, n_layers: int, n_experts: int, slots: int, moe_layers: list[bool],
                 notice: Callable[[str], None]) -> None:
        self._source = source
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.moe_layers = moe_layers
        self._notice = notice
        self._slots = max(1, min(int(slots), n_experts))
        self._cond = threading.Condition()
        self._resizing = 0  # set_slots calls waiting for the slots to drain: prefetch holds off
        self._streaming: set[int] = set()  # layers a prompt streams (`begin_prompt`): prefetch holds off
        self._scratch: list[np.ndarray] = []  # buffers for a prompt's experts that leave no slot
        self._row_ids: dict[int, np.ndarray] = {}  # `_rows`' arrays
        self._clock = 0
        self._hits = np.zeros(n_layers, dtype=np.int64)
        self._misses = np.zeros(n_layers, dtype=np.int64)
        self._bytes_read = 0
        self._prefetch_reads = 0
        self._in_ram = np.zeros((n_layers, n_experts), dtype=np.int8)  # 1 where a slot holds it, ready
        self._ledger = np.zeros((4, n_layers), dtype=np.int64)  # PrefetchLedger's rows, per layer
        self._at = (-1, -1)  # (pass, layer) the engine is at, for the ledger
        self._pool = None  # background readers for acquire
        prefault = self._fits_in_memory(self._slots, held=0)
        self._layers = [self._new_layer(self._slots, prefault) if moe else None for moe in moe_layers]
        self._tier = None
        self._tier_report: dict = {}

    def _slot_bytes(self, slots: int) -> int:
        """Bytes of `slots` slots in every MoE layer."""
        return slots * self._source.blob_nbytes * sum(1 for m in self.moe_layers if m)

    def _fits_in_memory(self, slots: int, held: int) -> bool:
        """Whether every MoE layer's `slots` slots fit in the memory this process may use now,
        counting `held` bytes of slots it already holds (and will give back) as free."""
        room = budget.auto_budget()
        return room is not None and self._slot_bytes(slots) <= room + held

    def _new_layer(self, slots: int, prefault: bool = False) -> dict:
        """A layer's slots; with `prefault`, their memory resident now, while loading or
        resizing, rather than page by page under the first prompt that fills them."""
        return {
            "store": hugepages.empty((slots, self._source.blob_nbytes), np.uint8, prefault=prefault),
            "expert": np.full(slots, -1, dtype=np.int64),  # expert held by each slot
            "slot_of": np.full(self.n_experts, -1, dtype=np.int64),
            "last": np.zeros(slots, dtype=np.int64),
            "busy": np.zeros(slots, dtype=np.int64),  # in-use refcount
            "loading": np.zeros(slots, dtype=np.bool_),
            "pinned": np.zeros(slots, dtype=np.bool_),
            "pf_pass": np.full(slots, -1, dtype=np.int64),  # pass a PILOT read was for, until first use
            "pf_done": np.full((slots, 2), -1, dtype=np.int64),  # (pass, layer) when that read completed
        }

    # -- the GPU tier --------------------------------------------------------------
    def attach_tier(self, opts: TierOptions, plan_file: str | None = None) -> None:
        """Open the tier and warm it (heat order from `plan_file`, else index order); on any
        device trouble the store runs without it, after one notice."""
        from tierlab.engine.tiers.opencl_tier import OpenCLTier

        if not opts.enabled:
            return
        source = self._source
        try:
            tier = OpenCLTier.open(source.kind, source.hidden, source.inter, source.blob_nbytes,
                                   budget=opts.budget, device=opts.device, notice=self._notice)
        except ValueError as exc:  # a malformed TIER_GB
            raise TierlabError(str(exc)) from None
        if tier is None:
            return
        self._tier = tier
        self._tier_report = {"device": tier.device_label, "capacity": tier.capacity, "cpu_device": tier.is_cpu_device}
        if opts.warmstart:
            self._warm(tier, plan_file)

    def _warm(self, tier, plan_file: str | None) -> None:
        from tierlab.engine.tiers.warmstart import warmstart

        report = warmstart(tier, self._source.read, self.n_layers, self.n_experts, heat_file=plan_file,
                           moe_layers=self.moe_layers)
        self._tier_report.update(warmstart=report.order, uploaded=report.uploaded, bytes=int(tier.stats.bytes),
                                 seconds=report.seconds)
        self._notice(f"GPU tier on {tier.device_label}: {report.uploaded} experts resident ({report.order} order, "
                     f"{tier.stats.bytes / 2**20:.1f} MiB)")

    @property
    def has_tier(self) -> bool:
        return self._tier is not None

    def tier_report(self) -> dict | None:
        """The attached tier: device, capacity, warmstart order, uploads, bytes, seconds; None without one."""
        return dict(self._tier_report) if self._tier is not None else None

    def _tier_enqueue(self, tier, layer: int, experts: list[int], x: np.ndarray):
        try:
            return tier.enqueue(layer, experts, np.ascontiguousarray(x, dtype=np.float32))
        except TierFailure as exc:
            self._drop_tier(tier, exc)
            return None

    def _tier_collect(self, tier, handle):
        try:
            return tier.collect(handle)
        except TierFailure as exc:
            self._drop_tier(tier, exc)
            return None

    def _drop_tier(self, tier, exc: TierFailure) -> None:
        """The device failed: carry on with the CPU, saying so once (the tier says why when it
        disabled itself)."""
        if self._tier is not tier:
            return
        self._tier = None
        if not tier.failed:
            self._notice(f"GPU tier off: {exc}; experts run on the CPU")
        tier.close()

    # -- queries ---------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """RAM slots per MoE layer."""
        return self._slots

    def levels(self, layer: int) -> np.ndarray:
        """Residency level of every expert of a layer, int8[E]: 2 GPU tier, 1 RAM cache, 0 disk."""
        level = self._in_ram[layer].copy()
        tier = self._tier
        if tier is not None:
            level[tier.resident_mask(layer, self.n_experts)] = LEVEL_GPU
        return level

    def ram_order(self, layer: int) -> list[int]:
        """The experts a RAM slot of a layer holds ready, least recently used first (empty for a dense layer)."""
        st = self._layers[layer]
        if st is None:
            return []
        with self._cond:
            held = [(int(st["last"][s]), int(e)) for s, e in enumerate(st["expert"]) if e >= 0 and not st["loading"][s]]
        return [e for _, e in sorted(held)]

    def in_ram(self, layer: int, expert: int) -> bool:
        return bool(self._in_ram[layer, expert])

    def pinned(self, layer: int) -> list[int]:
        """The experts of a layer whose RAM slots are pinned."""
        st = self._layers[layer]
        with self._cond:
            return [int(e) for e, p in zip(st["expert"], st["pinned"]) if p and e >= 0]

    def can_group(self) -> bool:
        """A prompt's experts may be computed per expert (`begin_prompt`) when no GPU tier takes a
        share of them."""
        return self._tier is None

    def stats(self) -> StoreStats:
        tier = self._tier
        return StoreStats(
            hits=self._hits.copy(), misses=self._misses.copy(), bytes_read=int(self._bytes_read),
            prefetch_reads=int(self._prefetch_reads), slots=self._slots, tier_on=tier is not None,
            tier_residents=int(tier.stats.residents) if tier is not None else 0,
            tier_uploads=int(tier.stats.uploads) if tier is not None else 0,
            tier_bytes=int(tier.stats.bytes) if tier is not None else 0,
            expert_kind=self._source.kind, blob_nbytes=int(self._source.blob_nbytes),
        )

    def reset_counters(self) -> None:
        self._hits[:] = 0
        self._misses[:] = 0
        self._bytes_read = 0
        self._prefetch_reads = 0
        with self._cond:  # the ledger counts only reads issued after the reset
            self._ledger[:] = 0
            for st in self._layers:
                if st is not None:
                    st["pf_pass"][:] = -1

    def _where(self, layer: int, stock: np.ndarray | None, tier) -> dict[int, int]:
        """Under the lock: the level of each stock expert now (2 GPU tier, 1 a RAM slot holds or
        loads it, 0 disk)."""
        if stock is None:
            return {}
        slot_of = self._layers[layer]["slot_of"]
        where = {}
        for e in stock:
            e = int(e)
            if e >= 0:
                if tier is not None and tier.is_resident(layer, e):
                    where[e] = LEVEL_GPU
                else:
                    where[e] = 1 if slot_of[e] >= 0 else 0
        return where

    # -- computing a token's experts ---------------------------------------------------
    def compute(self, layer: int, chosen: np.ndarray, x: np.ndarray, outputs: np.ndarray,
                timers: dict, stock: np.ndarray | None = None) -> tuple[int, int, list[int], Shadow | None]:
        """outputs[s] = expert chosen[s] applied to x, unweighted, for every slot with chosen[s] >= 0.

        GPU-resident experts run on the device while the CPU computes the rest from RAM: the
        RAM-resident ones in one launch pair for all of them (`experts_forward`), while the
        token's misses after the first are read in the background, then the misses one by
        one (a token whose experts are all resident, a warm chat's usual token, takes
        `_compute_resident`: the same steps, compiled). Adds to timers "fetch", "compute" and
        "tier". Returns (RAM hits, RAM misses, the
        slots the device computed, the shadow counts of `stock` — the router's stock top-K —
        or None without one).
        """
        K = chosen.shape[0]
        if self._tier is None and K > 1:
            shadow = self._compute_resident(layer, chosen, x, outputs, timers, stock)
            if shadow is not False:
                return K, 0, [], shadow
        return self._compute_general(layer, chosen, x, outputs, timers, stock)

    def _compute_general(self, layer: int, chosen: np.ndarray, x: np.ndarray, outputs: np.ndarray,
                         timers: dict, stock: np.ndarray | None) -> tuple[int, int, list[int], Shadow | None]:
        """`compute` for a token with a miss, a GPU tier or a single slot: acquire, the resident
        experts' launch pair while the misses are read, the misses one by one, release."""
        K = chosen.shape[0]
        source = self._source
        tier = self._tier
        hits = misses = 0
        on_gpu: list[int] = []
        ids = chosen.tolist()  # Python ints: the bookkeeping below reads each id several times
        where = {}
        if stock_outside(stock, ids):
            with self._cond:
                where = self._where(layer, stock, tier)
        realised: dict[int, int] = {}  # chosen expert -> level it was served from
        if tier is not None:
            on_gpu = [s for s in range(K) if ids[s] >= 0 and tier.is_resident(layer, ids[s])]
        handle = None
        if on_gpu:
            handle = self._tier_enqueue(tier, layer, [ids[s] for s in on_gpu], x)
            if handle is None:
                on_gpu = []
        cpu_slots = [s for s in range(K) if ids[s] >= 0 and s not in on_gpu]
        held = self.acquire(layer, [ids[s] for s in cpu_slots]) if len(cpu_slots) > 1 else None
        if held is not None:
            try:
                resident = [i for i in range(len(cpu_slots)) if held.hit(i)]
                if resident:  # one launch pair for all of them, while the misses are read
                    t0 = time.perf_counter()
                    experts_forward(source.kind, self._layers[layer]["store"],
                                    np.array([held.plan[i][1] for i in resident], dtype=np.int64),
                                    source.hidden, source.inter, x, outputs,
                                    np.array([cpu_slots[i] for i in resident], dtype=np.int64))
                    timers["compute"] += time.perf_counter() - t0
                    hits += len(resident)
                    for i in resident:
                        realised[ids[cpu_slots[i]]] = 1
                for i, s in enumerate(cpu_slots):
                    if held.hit(i):
                        continue
                    t0 = time.perf_counter()
                    blob = self.blob(held, i)
                    t1 = time.perf_counter()
                    source.forward(blob, x, outputs[s], 1.0)
                    timers["fetch"] += t1 - t0
                    timers["compute"] += time.perf_counter() - t1
                    misses += 1
                    realised[ids[s]] = 0
            finally:
                self.release(held)
            cpu_slots = []
        for s in cpu_slots:
            e = int(chosen[s])
            t0 = time.perf_counter()
            blob, hit = self._acquire_one(layer, e)
            t1 = time.perf_counter()
            try:
                source.forward(blob, x, outputs[s], 1.0)
            finally:
                self._release_one(layer, e)
            timers["fetch"] += t1 - t0
            timers["compute"] += time.perf_counter() - t1
            if hit:
                hits += 1
            else:
                misses += 1
            realised[e] = int(hit)
        if handle is not None:
            t0 = time.perf_counter()
            results = self._tier_collect(tier, handle)
            timers["tier"] += time.perf_counter() - t0
            if results is None:  # the tier failed mid-token: compute these on the CPU
                for s in on_gpu:
                    e = int(chosen[s])
                    blob, hit = self._acquire_one(layer, e)
                    try:
                        source.forward(blob, x, outputs[s], 1.0)
                    finally:
                        self._release_one(layer, e)
                    hits += int(hit)
                    misses += int(not hit)
                    realised[e] = int(hit)
                on_gpu = []
            else:
                for i, s in enumerate(on_gpu):
                    outputs[s] = results[i]
                    realised[int(chosen[s])] = LEVEL_GPU
        shadow = count_shadow(stock, where, realised) if stock is not None else None
        return hits, misses, on_gpu, shadow

    def compute_weighted(self, layer: int, chosen: np.ndarray, weights: np.ndarray, x: np.ndarray, y: np.ndarray,
                         timers: dict, stock: np.ndarray | None = None,
                         term: np.ndarray | None = None) -> tuple[int, int, list[int], Shadow | None]:
        """y += weights[s] * expert chosen[s] applied to x, over the slots with an expert, in rank
        order, then y += term (the shared expert's, when given): `compute`, the weighted sum
        (`dense.add_weighted`) and the add, or for a token whose experts are all ready in RAM
        slots all in one compiled call. Returns what `compute` returns."""
        K = chosen.shape[0]
        outputs = np.zeros((K, x.shape[0]), dtype=np.float32)
        if self._tier is None and K > 1:
            shadow = self._compute_resident(layer, chosen, x, outputs, timers, stock, weights, y, term)
            if shadow is not False:
                return K, 0, [], shadow
        result = self._compute_general(layer, chosen, x, outputs, timers, stock)
        add_weighted(y, chosen, weights, outputs)
        if term is not None:
            y += term
        return result

    def _compute_resident(self, layer: int, chosen: np.ndarray, x: np.ndarray, outputs: np.ndarray,
                          timers: dict, stock: np.ndarray | None, weights: np.ndarray | None = None,
                          y: np.ndarray | None = None, term: np.ndarray | None = None) -> Shadow | None | bool:
        """`compute` for a token whose experts are all ready in RAM slots (a warm chat's
        usual token), in one compiled call (`moe_step.resident_experts_step`) under the
        store's lock: the same holds, LRU stamps and hit counts as `acquire` and `release`,
        one launch pair for the experts, and with `weights` the weighted sum into y (then
        y += term, when given).
        Returns the shadow counts (None without `stock`), or False, having changed nothing,
        when an expert is not ready (the caller takes the general path).

        Why the lock is held through the launches: the claims and the release were two
        calls from Python with the launches between them, each after a streaming call
        (docs/benchmarks.md, "A decoded MoE layer in two compiled calls"); a reader that
        wants the lock waits one layer's experts, a few hundred microseconds."""
        source = self._source
        H = source.hidden
        if not (outputs.dtype == np.float32 and outputs.flags.c_contiguous and x.shape == (H,)
                and outputs.shape == (chosen.shape[0], H)
                and (weights is None or (weights.shape == chosen.shape and y.shape == (H,) and y.dtype == np.float32
                                         and (term is None or (term.shape == (H,) and term.dtype == np.float32))))):
            return False  # the general path's checks name what is wrong
        experts = np.ascontiguousarray(chosen, dtype=np.int64)
        slots = np.empty(experts.shape[0], dtype=np.int64)
        shadow = np.empty(2, dtype=np.int64)
        stock_ids = _NO_EXPERTS if stock is None else np.ascontiguousarray(stock, dtype=np.int64)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if weights is not None:
            weights = np.ascontiguousarray(weights, dtype=np.float32)
        t0 = time.perf_counter()
        with self._cond:
            # under the lock: set_slots may replace the layer until then
            clock = resident_experts_step(self._layers[layer], source.kind, source.hidden, source.inter, experts,
                                          self._clock, slots, stock_ids, shadow, x, outputs,
                                          self._rows(experts.shape[0]), self._hits, layer, weights, y, term)
            if clock < 0:
                return False
            self._clock = clock
            # no notify: the slots were held and given back under this one hold of the lock
        timers["compute"] += time.perf_counter() - t0
        return None if stock is None else Shadow(ram_hits=int(shadow[0]), ram_misses=int(shadow[1]), vram=0)

    def _rows(self, n: int) -> np.ndarray:
        """0..n-1 as int64 (a token's output rows), made once per n."""
        rows = self._row_ids.get(n)
        if rows is None:
            rows = self._row_ids[n] = np.arange(n, dtype=np.int64)
        return rows

    def forward_tokens(self, blob: np.ndarray, xs: np.ndarray, exact: bool = False) -> np.ndarray:
        """One expert (a RAM blob from `blob`) on several tokens at once: float32[T, H], by
        matrix-matrix products (within 1e-5 of decode), or with `exact` each row bit-identical
        to the one-token kernel."""
        source = self._source
        forward = expert_forward_tokens if exact else expert_matmat
        return forward(source.kind, blob, source.hidden, source.inter, xs)

    def forward_batch(self, blobs: list[np.ndarray], token_rows: list[list[int]], x: np.ndarray, out: np.ndarray,
                      out_rows: list[list[int]], exact: bool = False) -> None:
        """out[out_rows[e][i]] = expert e (blobs[e]) of x[token_rows[e][i]] for a batch of a
        prompt's experts: those with more than `few_token_limit(kind, hidden, inter)` tokens by matrix-matrix
        products in one pair of launches (within 1e-5 of decode), the others by the one-token
        kernel's dots in another pair (`experts_tokens`: for so few tokens, dots that need no
        widened rows cost less), bit-identical to decode; with `exact` all of them so. Which
        kernel an expert gets depends on its own token count only, so results never depend on
        the batch."""
        source = self._source
        limit = few_token_limit(source.kind, source.hidden, source.inter)
        wide = [i for i, rows in enumerate(token_rows) if len(rows) > limit and not exact]
        if wide:
            experts_matmat(source.kind, [blobs[i] for i in wide], source.hidden, source.inter, x,
                           [token_rows[i] for i in wide], out, [out_rows[i] for i in wide])
        few = [i for i, rows in enumerate(token_rows) if exact or len(rows) <= limit]
        if few:
            experts_tokens(source.kind, [blobs[i] for i in few], source.hidden, source.inter, x,
                           [token_rows[i] for i in few], out, [out_rows[i] for i in few])

    # -- a prompt's experts, streamed -------------------------------------------------------
    def begin_prompt(self, layer: int) -> "PromptLayer":
        """Start a prompt's bookkeeping in one layer, once its in-flight loads have finished.

        Until `end_prompt`, prefetch starts no read in this layer (PILOT's other layers go on):
        a token-by-token prompt races PILOT's loader, whose reads land between any two tokens'
        claims or not at all before the layer is done; holding them off is one of those
        timings, the one where the loader did not get there in time."""
        with self._cond:
            st = self._layers[layer]
            while np.any(st["busy"]) or np.any(st["loading"]):
                self._cond.wait()
            self._streaming.add(layer)
            return PromptLayer(layer, st, st["expert"].copy())

    def claim_prompt_token(self, prompt: "PromptLayer", experts: list[int],
                           stock: np.ndarray | None = None) -> tuple[list[bool], Shadow | None]:
        """One token's claims, as `compute` makes them, with the reads deferred: whether each
        expert hit, and the shadow counts of `stock`. A miss's expert counts as resident from
        here on (the router's levels, the next claims), as it would once `compute` had read it."""
        layer, st = prompt.layer, prompt.st
        with self._cond:
            if self._layers[layer] is not st:
                raise RuntimeError("the RAM cache was resized during a prompt")
            where = self._where(layer, stock, None) if stock_outside(stock, experts) else {}
            if self._claim_resident(layer, st, experts):  # a warm cache's usual token, in one step
                hits = [True] * len(experts)
                return hits, (None if stock is None else count_shadow(stock, where, dict.fromkeys(experts, 1)))
            taken: list = [None] * len(experts)
            if 1 < len(experts) <= self._slots and len(set(experts)) == len(experts):
                # `acquire`'s order: the token's resident experts first, then its misses in rank order
                resident = [i for i, e in enumerate(experts) if st["slot_of"][e] >= 0]
                for i in resident + [i for i in range(len(experts)) if i not in resident]:
                    taken[i] = self._take(layer, experts[i])
                for i, (s, must) in enumerate(taken):
                    self._mark_read(st, layer, experts[i], s, must)
            else:  # `_acquire_one`: each expert read and released before the next is claimed
                for i, e in enumerate(experts):
                    taken[i] = self._take(layer, e)
                    self._mark_read(st, layer, e, *taken[i])
        hits = [not must for _, must in taken]
        if stock is None:
            return hits, None
        return hits, count_shadow(stock, where, {e: int(h) for e, h in zip(experts, hits)})

    def _claim_resident(self, layer: int, st: dict, experts: list[int]) -> bool:
        """Under the lock: when each expert (none twice) is in a slot that is not loading, what
        `_take` then `_mark_read` do for each in turn, done at once: the slots made recent in
        the token's order, all counted hits, PILOT's ledger told; else nothing, and False.
        Why: a prompt claims every token's experts, and on a warm cache nearly all of them hit;
        one token's claims one by one cost ~50 us of Python (a fifth of a 128-token prompt's
        routing and claims)."""
        k = len(experts)
        if k == 0 or len(set(experts)) != k:
            return False
        slot_of, loading = st["slot_of"], st["loading"]
        slots = [int(slot_of[e]) for e in experts]
        if min(slots) < 0 or any(loading[s] for s in slots):
            return False
        last, pf_pass, clock = st["last"], st["pf_pass"], self._clock
        for s in slots:
            clock += 1
            last[s] = clock
            if pf_pass[s] >= 0:
                self._ledger_hit(layer, st, s)
        self._clock = clock
        self._hits[layer] += k
        return True

    def _mark_read(self, st: dict, layer: int, expert: int, s: int, must_load: bool) -> None:
        """Under the lock: a claim of `claim_prompt_token` released, its read taken as done."""
        st["busy"][s] -= 1
        if must_load:
            st["loading"][s] = False
            self._in_ram[layer, expert] = 1

    def stream_prompt(self, prompt: "PromptLayer", experts: list[int], run: Callable[[int, np.ndarray], None],
                      timers: dict) -> None:
        """run(expert, blob) once for every expert the prompt's claims used, one at a time, in
        the order and with the reads of `stream_batches`."""
        self.stream_batches(prompt, experts, lambda batch: [run(e, blob) for e, blob in batch], timers)

    def stream_batches(self, prompt: "PromptLayer", experts: list[int],
                       run: Callable[[list[tuple[int, np.ndarray]]], None], timers: dict) -> None:
        """run(batch of (expert, blob)) so that every expert the prompt's claims used runs once,
        each read at most once.

        An expert's bytes come from its slot when the bookkeeping left it in the slot that held
        it before the prompt; else they are read, into the slot the bookkeeping put it in or,
        when it stayed in none, into a scratch buffer. Experts whose slot goes to another expert
        run first (their bytes are still there), then those that stay, then the read ones; the
        reader threads keep `PROMPT_READS_AHEAD` reads ahead of the expert running, so reading
        and computing overlap (a read no reader has started when its expert is due is made in
        this thread: on a busy machine a reader may wait long to be scheduled). The experts
        whose slot goes to another run as one batch, those that stay as the next (while it
        runs, the first batch's slots are read into); each read one runs with the reads after
        it that have already finished, so a batch is as large as the reads allow without waiting.
        Adds the waits to timers["fetch"], the runs to timers["compute"]."""
        layer, st, before = prompt.layer, prompt.st, prompt.before
        first, kept, reads = [], [], []
        with self._cond:
            for e in experts:
                s = int(st["slot_of"][e])
                if s >= 0 and before[s] == e:
                    kept.append((e, s))
                elif s >= 0:
                    reads.append((e, s))
                    st["loading"][s] = True  # until its read: a resize or clear waits for it
                else:
                    old = np.flatnonzero(before == e)
                    if old.size:
                        first.append((e, int(old[0])))
                    else:
                        reads.append((e, -1))
            for _, s in first + kept:
                st["busy"][s] += 1
        overwrites = {s: e for e, s in first}  # a read into slot s waits for the expert it held to run
        done: set[int] = set()
        free = list(self._scratch_buffers())
        futures: list = []

        def read_ahead(consumed: int) -> None:
            while len(futures) < len(reads) and len(futures) - consumed < PROMPT_READS_AHEAD:
                e, s = reads[len(futures)]
                held_before = overwrites.get(s) if s >= 0 else None
                if (held_before is not None and held_before not in done) or (s < 0 and not free):
                    return
                buf = st["store"][s] if s >= 0 else free.pop()
                futures.append((self._readers().submit(self._source.read, layer, e, buf), buf))

        def arrived(i: int, wait: bool) -> bool:
            """Whether read i is done (waiting for it, or making it here, when `wait`); books it."""
            e, s = reads[i]
            future, buf = futures[i]
            if wait:
                if future.cancel():  # no reader has started it: read it here rather than wait for one
                    self._source.read(layer, e, buf)
                else:
                    future.result()
            elif not future.done() or future.cancelled():
                return False
            else:
                future.result()
            with self._cond:
                self._bytes_read += self._source.blob_nbytes
                if s >= 0:
                    st["loading"][s] = False
                    prompt.filled.add(s)
                    self._cond.notify_all()
            return True

        try:
            for batch in (first, kept):  # the reads into first's slots start while kept's batch runs
                if not batch:
                    continue
                read_ahead(0)
                t0 = time.perf_counter()
                run([(e, st["store"][s]) for e, s in batch])
                with self._cond:
                    for e, s in batch:
                        done.add(e)
                        st["busy"][s] -= 1
                    self._cond.notify_all()
                timers["compute"] += time.perf_counter() - t0
            i = 0
            while i < len(reads):
                read_ahead(i)
                t0 = time.perf_counter()
                arrived(i, wait=True)
                n = 1
                while i + n < len(futures) and arrived(i + n, wait=False):
                    n += 1
                t1 = time.perf_counter()
                run([(reads[j][0], futures[j][1]) for j in range(i, i + n)])
                for j in range(i, i + n):
                    done.add(reads[j][0])
                    if reads[j][1] < 0:
                        free.append(futures[j][1])
                timers["fetch"] += t1 - t0
                timers["compute"] += time.perf_counter() - t1
                i += n
        finally:
            for future, _ in futures:
                try:
                    future.result()
                except Exception:
                    pass
            with self._cond:  # after a failed run: the slots it had not reached are not in use
                for e, s in first + kept:
                    if e not in done:
                        st["busy"][s] -= 1
                self._cond.notify_all()

    def _scratch_buffers(self) -> list[np.ndarray]:
        while len(self._scratch) < PROMPT_READS_AHEAD:
            self._scratch.append(np.empty(self._source.blob_nbytes, dtype=np.uint8))
        return self._scratch

    def end_prompt(self, prompt: "PromptLayer") -> None:
        """Close a prompt's layer: a slot that the bookkeeping gave a new expert whose bytes never
        arrived (a failed read or run) is emptied; prefetch may use the layer again."""
        layer, st, before = prompt.layer, prompt.st, prompt.before
        with self._cond:
            for s in range(st["expert"].shape[0]):
                e = int(st["expert"][s])
                if e >= 0 and e != before[s] and s not in prompt.filled:
                    st["loading"][s] = False
                    st["expert"][s] = -1
                    st["slot_of"][e] = -1
                    self._in_ram[layer, e] = 0
            self._streaming.discard(layer)
            self._cond.notify_all()

    # -- holding RAM slots ---------------------------------------------------------------
    def acquire(self, layer: int, experts: list[int], stock: np.ndarray | None = None) -> HeldExperts | None:
        """Claim RAM slots for all of one token's experts at once, counting hits and misses; a
        token's resident experts are held before its misses pick victims (the K experts of a
        token are needed together). Misses after the first are read in the background; `blob`
        waits for one. None when the layer has fewer slots than experts (or an expert twice).
        With `stock` (the router's stock top-K) the held experts carry its shadow counts.
        Pair with `release`."""
        if len(experts) > self._slots or len(set(experts)) != len(experts):
            return None
        st = self._layers[layer]
        plan: list = [None] * len(experts)
        with self._cond:
            where = self._where(layer, stock, self._tier)
            # first hold the experts already resident, so that loading this token's misses
            # never evicts one of its own hits; then claim slots for the misses in rank order
            resident = [i for i, e in enumerate(experts)
                        if st["slot_of"][e] >= 0 and not st["loading"][st["slot_of"][e]]]
            for i in resident + [i for i in range(len(experts)) if i not in resident]:
                plan[i] = (experts[i], *self._take(layer, experts[i]))
        held = HeldExperts(layer, plan)
        if stock is not None:
            held.shadow = count_shadow(stock, where, {e: int(not must) for e, _, must in plan})
        missing = [(e, s) for e, s, must in plan if must]
        for e, s in missing[1:]:
            held.futures[e] = self._readers().submit(self._load, layer, e, s)
        return held

    def blob(self, held: HeldExperts, i: int) -> np.ndarray:
        """The i-th held expert's bytes, waiting for (or doing) its read."""
        e, s, must_load = held.plan[i]
        if must_load and e not in held.loaded:
            future = held.futures.get(e)
            if future is not None:
                future.result()
            else:
                self._load(held.layer, e, s)
            held.loaded.add(e)
        return self._layers[held.layer]["store"][s]

    def release(self, held: HeldExperts) -> None:
        """Release every slot; wait for background reads; abandon loads that never started."""
        st = self._layers[held.layer]
        for e, s, must_load in held.plan:
            future = held.futures.get(e)
            if future is not None:
                try:
                    future.result()
                except Exception:
                    pass
            elif must_load and e not in held.loaded:
                with self._cond:
                    st["loading"][s] = False
                    st["expert"][s] = -1
                    st["slot_of"][e] = -1
        with self._cond:
            for e, s, _ in held.plan:
                if st["busy"][s] > 0:
                    st["busy"][s] -= 1
            self._cond.notify_all()

    def _acquire_one(self, layer: int, expert: int) -> tuple[np.ndarray, bool]:
        """The expert's blob, loading it on a miss; counts a hit or miss. Pair with _release_one."""
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

    def _release_one(self, layer: int, expert: int) -> None:
        st = self._layers[layer]
        with self._cond:
            s = int(st["slot_of"][expert])
            if s >= 0 and st["busy"][s] > 0:
                st["busy"][s] -= 1
                self._cond.notify_all()

    def _take(self, layer: int, expert: int) -> tuple[int, bool]:
        """Under the lock: claim the expert's slot, mark it in use and recent, count hit or miss."""
        s, must_load = self._claim(layer, expert)
        st = self._layers[layer]  # after _claim: its waits may have let set_slots replace the layer
        st["busy"][s] += 1
        self._clock += 1
        st["last"][s] = self._clock
        if must_load:
            self._misses[layer] += 1
        else:
            self._hits[layer] += 1
            if st["pf_pass"][s] >= 0:
                self._ledger_hit(layer, st, s)
        return s, must_load

    def _victim(self, layer: int, st: dict) -> int:
        free = np.flatnonzero(st["expert"] < 0)
        if free.size:
            return int(free[0])
        tier = self._tier
        best = -1
        best_key = None
        for s in range(st["expert"].shape[0]):
            if st["busy"][s] or st["loading"][s]:
                continue
            on_gpu = tier is not None and tier.is_resident(layer, int(st["expert"][s]))
            # smaller key = better victim: GPU-held first, then unpinned, then LRU
            key = (0 if on_gpu else 1, 1 if st["pinned"][s] else 0, int(st["last"][s]))
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best

    def _claim(self, layer: int, expert: int) -> tuple[int, bool]:
        """Under the lock: the slot for `expert`, and whether it must be loaded."""
        while True:
            st = self._layers[layer]  # again after each wait: set_slots may have replaced the layer
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
                self._in_ram[layer, old] = 0
            st["expert"][s] = expert
            st["slot_of"][expert] = s
            st["loading"][s] = True
            st["pinned"][s] = False
            st["pf_pass"][s] = -1
            return s, True

    def _load(self, layer: int, expert: int, s: int) -> None:
        st = self._layers[layer]
        try:
            self._source.read(layer, expert, st["store"][s])
        except BaseException:
            with self._cond:
                st["loading"][s] = False
                st["expert"][s] = -1
                st["slot_of"][expert] = -1
                self._cond.notify_all()
            raise
        with self._cond:
            st["loading"][s] = False
            self._in_ram[layer, expert] = 1
            self._bytes_read += self._source.blob_nbytes
            if st["pf_pass"][s] >= 0:
                st["pf_done"][s] = self._at
                self._ledger[PrefetchLedger.ISSUED, layer] += 1
            self._cond.notify_all()

    def _readers(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierlab-read")
        return self._pool

    # -- prefetch, pins, shape -------------------------------------------------------------
    def prefetch(self, layer: int, expert: int, for_pass: int | None = None) -> bool:
        """Load into RAM without counting a hit or miss (PILOT, HOT); True if a read was issued.

        `for_pass` (PILOT): the pass the read is for; the read then enters the prefetch ledger."""
        with self._cond:  # the layer as it is now: set_slots replaces it under this lock
            st = self._layers[layer]
            if st is None or self._resizing or layer in self._streaming:  # a resize waits for loads
                return False  # to drain, a streamed prompt decides this layer's slots itself: start none
                return False
            s = int(st["slot_of"][expert])
            if s >= 0:
                return False
            s = self._victim(layer, st)
            if s < 0:
                return False
            s, must_load = self._claim(layer, expert)
            if must_load and for_pass is not None:
                self._layers[layer]["pf_pass"][s] = int(for_pass)
        if must_load:
            self._load(layer, expert, s)
            with self._cond:
                self._prefetch_reads += 1
        return must_load

    def ledger_position(self, pass_no: int, layer: int) -> None:
        """Where the engine is (PILOT calls it after each layer's mixer; pass -1: a pass without PILOT)."""
        self._at = (int(pass_no), int(layer))

    def _ledger_hit(self, layer: int, st: dict, s: int) -> None:
        """Under the lock: the first demand hit on a slot PILOT loaded."""
        ledger = self._ledger
        ledger[PrefetchLedger.HITS, layer] += 1
        at_pass, _ = self._at
        done_pass, done_layer = (int(v) for v in st["pf_done"][s])
        if at_pass >= 0 and int(st["pf_pass"][s]) == at_pass == done_pass and 0 <= done_layer <= layer:
            ledger[PrefetchLedger.OWN, layer] += 1
            ledger[PrefetchLedger.AHEAD, layer] += layer - done_layer
        st["pf_pass"][s] = -1

    def prefetch_ledger(self) -> "PrefetchLedger":
        """PILOT's reads, their hits and how early they finished, per layer, since the last reset."""
        with self._cond:
            counts = self._ledger.copy()
        return PrefetchLedger(counts[PrefetchLedger.ISSUED], counts[PrefetchLedger.HITS],
                              counts[PrefetchLedger.OWN], counts[PrefetchLedger.AHEAD],
                              int(self._source.blob_nbytes))

    def pin(self, layer: int, experts) -> None:
        """Mark these experts' slots as pinned (they are evicted last)."""
        st = self._layers[layer]
        with self._cond:
            for e in experts:
                s = int(st["slot_of"][int(e)])
                if s >= 0:
                    st["pinned"][s] = True

    def pin_hot(self, heat: np.ndarray, n: int) -> None:
        """Load and pin the n most-routed experts of each MoE layer (HOT=n); heat is int64[L, E]."""
        for layer, is_moe in enumerate(self.moe_layers):
            if not is_moe:
                continue
            hot = [int(e) for e in np.argsort(-heat[layer], kind="stable")[:n] if heat[layer, e] > 0]
            for e in hot[: self._slots]:
                self.prefetch(layer, e)
            self.pin(layer, hot[: self._slots])

    def clear(self) -> None:
        """Empty every RAM slot (a cold start for the next run); counters and the GPU tier's
        warmstart residents are kept."""
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
                st["pf_pass"][:] = -1
            self._in_ram[:] = 0

    def residency_state(self) -> ResidencyState:
        """The RAM cache's experts in LRU order with their pins, and the GPU tier's residents."""
        with self._cond:
            ram = []
            for st in self._layers:
                if st is None:
                    ram.append(None)
                    continue
                held = [s for s in np.argsort(st["last"], kind="stable") if st["expert"][s] >= 0 and not st["loading"][s]]
                ram.append(tuple((int(st["expert"][s]), bool(st["pinned"][s])) for s in held))
            tier = self._tier
            residents = tuple(tier.residents()) if tier is not None else ()
        return ResidencyState(self._slots, tuple(ram), residents)

    def restore_residency(self, state: ResidencyState) -> None:
        """Put the RAM cache and the GPU tier back as `state` holds them: the same experts in the
        same LRU order and pins. Counts no hit, miss, read or prefetch (the counters are kept)."""
        if len(state.ram) != self.n_layers:
            raise TierlabError(f"residency state has {len(state.ram)} layers; this model has {self.n_layers}")
        counters = (self._bytes_read, self._prefetch_reads, self._ledger.copy())
        self.clear()
        self.set_slots(state.slots)
        for layer, held in enumerate(state.ram):
            st = self._layers[layer]
            if st is None or not held:
                continue
            for expert, pinned in held[-self._slots:]:
                self.prefetch(layer, int(expert))
                with self._cond:
                    s = int(st["slot_of"][int(expert)])
                    self._clock += 1
                    st["last"][s] = self._clock
                    st["pinned"][s] = bool(pinned)
        self._restore_tier(set(state.tier))
        with self._cond:
            self._bytes_read, self._prefetch_reads = counters[0], counters[1]
            self._ledger[:] = counters[2]

    def _restore_tier(self, wanted: set[tuple[int, int]]) -> None:
        tier = self._tier
        if tier is None:
            return
        held = set(tier.residents())
        for layer, expert in sorted(held - wanted):
            tier.evict(layer, expert)
        missing = sorted(wanted - held)
        if missing:
            blob = np.empty(self._source.blob_nbytes, dtype=np.uint8)
            for layer, expert in missing:
                self._source.read(layer, expert, blob)
                if not tier.upload(layer, expert, blob):
                    break

    def set_slots(self, slots: int) -> None:
        """Change the RAM slots per layer, keeping the most recently used experts."""
        slots = max(1, min(int(slots), self.n_experts))
        with self._cond:
            if slots == self._slots:
                return
            self._resizing += 1
            try:
                self._resize_layers(slots)
            finally:
                self._resizing -= 1

    def _resize_layers(self, slots: int) -> None:
        """Under the lock: each layer drained of loads and uses, then rebuilt with `slots` slots.
        Prefetches hold off meanwhile (`_resizing`), so a loader in a loop cannot starve it."""
        prefault = self._fits_in_memory(slots, held=self._slot_bytes(self._slots))
        for layer, st in enumerate(self._layers):
            if st is None:
                continue
            while np.any(st["busy"]) or np.any(st["loading"]):
                self._cond.wait()
            new = self._new_layer(slots, prefault)
            held = [s for s in np.argsort(-st["last"]) if st["expert"][s] >= 0][:slots]
            for i, s in enumerate(held):
                e = int(st["expert"][s])
                new["store"][i] = st["store"][s]
                new["expert"][i] = e
                new["slot_of"][e] = i
                new["last"][i] = st["last"][s]
                new["pinned"][i] = st["pinned"][s]
            self._in_ram[layer, :] = 0
            for e in new["expert"]:
                if e >= 0:
                    self._in_ram[layer, e] = 1
            self._layers[layer] = new
        self._slots = slots

    def close(self) -> None:
        """Stop the background readers, release the source's files and the device."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._source.close()
        if self._tier is not None:
            self._tier.close()
            self._tier = None
