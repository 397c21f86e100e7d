"""Meters: one fold over token events, and the one catalogue of their names and units.

Every figure the CLI, the app, A/B tables and session-log summaries show is
computed here from `TokenEvent`s: the engine feeds its own `MeterFold`,
`tierlab eval` and `ab` feed one per run, `tierlab compare` feeds one from a
session log's records, and the app's watch keeps its own. `add` only adds
integers (and one float per measured routing decision); `summary` turns the
counts into rates in [0, 1], milliseconds, nats and counts. A meter without
samples is None, shown as "–", never as 0. Percent appears only where a
value is shown (`Meter.show`) or written as JSON (`meters_json`).

`WindowedMeters` keeps three folds over the same events (docs/app.md
"Meters and windows"): the last N tokens, the tokens since the last knob
change (a new `knob_seq` or a new RAM cache size) and every token since it
started. The app's watch, the CLI's `--knobs-at` segments and session logs
all use it. Its timing rule: tok/s, fetch ms and compute ms fold decode
tokens only, and never the first decode token it sees (a fresh engine's
first pass may include compile time).

The store's counters arrive in each event as totals since the last reset;
the fold turns them into per-token deltas (`store_deltas`), so a window's
"MiB read from disk per token" and prefetch figures are that window's own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tierlab.engine.events import TokenEvent

RATE, MS, NATS, TOK_S, MIB, TEXT = "rate", "ms", "nats", "tok/s", "MiB", "text"
MISSING = "–"


@dataclass(frozen=True)
class Meter:
    """One meter: its key in summaries and rows, its titles, its unit and how it is shown."""

    key: str
    title: str  # column title of tables
    label: str  # short label of the app's meter panel
    unit: str  # RATE (a fraction, shown as percent), MS, NATS, TOK_S, MIB or TEXT
    table: str  # format spec in tables
    panel: str  # format spec in the app's panel (fixed width)
    help: str

    def scaled(self, value: float) -> float:
        """The value in the unit it is shown in (percent for rates)."""
        return 100.0 * value if self.unit == RATE else value

    def show(self, value: Any, where: str = "table") -> str:
        """The value as text for a table or the panel; None is '–'."""
        if value is None:
            return MISSING
        if self.unit == TEXT:
            return str(value)
        text = format(self.scaled(float(value)), self.table if where == "table" else self.panel)
        return text + "%" if self.unit == RATE else text

    @property
    def timing(self) -> bool:
        """Timings are noisy: tables show their repeats as a median with a band."""
        return self.unit in (MS, TOK_S)


CATALOGUE: tuple[Meter, ...] = (
    Meter("tok_s", "tok/s", "tok/s", TOK_S, ".2f", "6.1f", "tokens per second"),
    Meter("fetch_ms", "fetch ms/tok", "fetch ms", MS, ".1f", "6.2f", "expert fetch time per token"),
    Meter("compute_ms", "compute ms/tok", "compute ms", MS, ".1f", "6.2f", "compute time per token"),
    Meter("disk_mib", "disk MiB/tok", "disk MiB", MIB, ".3f", "6.3f", "MiB read from disk per token"),
    Meter("ram_hit", "RAM hit", "RAM hit", RATE, ".1f", "5.1f", "experts found in the RAM cache"),
    Meter("shadow_hit", "shadow", "shadow", RATE, ".1f", "5.1f",
          "RAM hit rate the router's stock top-K would have had in the same cache state"),
    Meter("ram_hit_without_prefetch", "RAM hit w/o prefetch", "w/o PILOT", RATE, ".1f", "5.1f",
          "RAM hit rate without the hits prefetch bought"),
    Meter("vram_hit", "VRAM hit", "VRAM hit", RATE, ".1f", "5.1f", "experts served by the GPU tier"),
    Meter("shadow_vram", "VRAM shadow", "VRAM shadow", RATE, ".1f", "5.1f",
          "stock top-K experts the GPU tier held in the same state"),
    Meter("oracle_hit", "oracle hit", "oracle hit", RATE, ".1f", "5.1f",
          "hit rate of an optimal (Belady) cache on the same requests"),
    Meter("swap", "swap", "swap", RATE, ".1f", "5.1f", "chosen slots filled by a resident substitute"),
    Meter("route_agree", "agree", "agree", RATE, ".1f", "5.1f", "overlap of chosen experts with the true top-K"),
    Meter("route_kl", "KL", "KL", NATS, ".2f", "6.3f", "KL(true top-K || chosen), nats"),
    Meter("ids_match", "ids match", "ids match", TEXT, "", "", "greedy ids equal to the reference (m/n)"),
    Meter("tf_nll", "TF-NLL", "TF-NLL", NATS, ".4f", "7.4f", "teacher-forced NLL of the reference, nats/token"),
    # -- the oracle band (app/lab/oracle.py): the engine's LRU replayed on the same window at other sizes --
    Meter("lru_half", "LRU ½×", "LRU ½×", RATE, ".1f", "5.1f", "hit rate of an LRU cache of half the slots"),
    Meter("lru_1x", "LRU 1×", "LRU 1×", RATE, ".1f", "5.1f", "hit rate of an LRU cache of the same slots"),
    Meter("lru_2x", "LRU 2×", "LRU 2×", RATE, ".1f", "5.1f", "hit rate of an LRU cache of twice the slots"),
    Meter("lru_4x", "LRU 4×", "LRU 4×", RATE, ".1f", "5.1f", "hit rate of an LRU cache of four times the slots"),
    Meter("lru_all_but_one", "LRU E-1", "LRU E-1", RATE, ".1f", "5.1f",
          "hit rate of an LRU cache holding all but one expert per layer"),
    # -- the prefetch ledger (PILOT; engine/expert_store.py) --
    Meter("prefetch_precision", "prefetch precision", "pf precision", RATE, ".1f", "5.1f",
          "PILOT reads used by the token they were read for"),
    Meter("prefetch_recall", "prefetch recall", "pf recall", RATE, ".1f", "5.1f",
          "would-be misses that PILOT turned into hits"),
    Meter("prefetch_ahead", "prefetch ahead", "pf ahead", "layers", ".2f", "5.2f",
          "layers between a PILOT read finishing and its use (mean)"),
    Meter("prefetch_bytes_per_saved", "prefetch bytes/saved", "pf bytes/saved", "ratio", ".2f", "5.2f",
          "bytes PILOT read per byte of miss it saved"),
    # -- a row paired with its baseline, token by token (app/lab/paired.py) and its gates (app/lab/gates.py) --
    Meter("dram_hit", "ΔRAM hit", "ΔRAM hit", RATE, "+.1f", "+5.1f", "RAM hit rate minus the baseline's"),
    Meter("dvram_hit", "ΔVRAM hit", "ΔVRAM hit", RATE, "+.1f", "+5.1f", "VRAM hit rate minus the baseline's"),
    Meter("dnll", "ΔNLL", "ΔNLL", NATS, "+.4f", "+7.4f", "mean NLL per token minus the baseline's, nats"),
    Meter("dnll_lo", "ΔNLL lo", "ΔNLL lo", NATS, "+.4f", "+7.4f", "low end of the paired bootstrap 95% interval of ΔNLL"),
    Meter("dnll_hi", "ΔNLL hi", "ΔNLL hi", NATS, "+.4f", "+7.4f", "high end of the paired bootstrap 95% interval of ΔNLL"),
    Meter("agree", "top-1 agree", "top-1 agree", RATE, ".1f", "5.1f", "tokens whose top-1 is the baseline's"),
    Meter("kl_mean", "KL mean", "KL mean", NATS, ".4f", "7.4f", "mean KL(baseline‖row) of the next-token distribution"),
    Meter("kl_p50", "KL p50", "KL p50", NATS, ".4f", "7.4f", "median KL(baseline‖row) of the next-token distribution"),
    Meter("kl_p99", "KL p99", "KL p99", NATS, ".4f", "7.4f", "99th percentile of KL(baseline‖row)"),
    Meter("flips", "flips", "flips", RATE, ".2f", "5.2f",
          "tokens whose baseline top-1 had p > 0.5 and whose top-1 changed"),
    Meter("diverge", "diverges at", "diverges at", TEXT, "", "", "first token where the free generation differs"),
    Meter("rep4", "rep 4-grams", "rep 4-grams", RATE, ".1f", "5.1f", "share of repeated 4-grams in the free generation"),
    Meter("gate", "gate", "gate", TEXT, "", "", "quality gates: pass, or FAIL and the gates failed"),
)
METER_BY_KEY: dict[str, Meter] = {m.key: m for m in CATALOGUE}


def select(keys: tuple[str, ...]) -> tuple[Meter, ...]:
    """Catalogue entries in the order given (a table's columns, the panel's rows)."""
    return tuple(METER_BY_KEY[k] for k in keys)


def meters_json(summary: Mapping[str, Any]) -> dict[str, Any]:
    """A summary as the JSON outputs write it: rates in percent, everything else as it is."""
    out = {}
    for key, value in summary.items():
        meter = METER_BY_KEY.get(key)
        out[key] = meter.scaled(value) if meter is not None and meter.unit == RATE and value is not None else value
    return out


def read_store_counters(engine) -> dict[str, int]:
    """The expert store's, the GPU tier's and the prefetcher's own counters, totals since the last reset.

    The one place meter code reads counters the engine's parts keep; the
    engine calls it once per pass and the pass's events carry the result.
    """
    stats = engine.store_stats()
    out = {"ram_slots": int(stats.slots), "bytes_read": int(stats.bytes_read)}
    if stats.tier_on:
        out.update(tier_residents=int(stats.tier_residents), tier_uploads=int(stats.tier_uploads),
                   tier_bytes=int(stats.tier_bytes))
    pilot = engine.pilot
    if pilot is not None:
        out.update(pilot.meters())
        out["prefetch_hits"] = int(pilot.prefetch_hits)
    return out


STATE_KEYS = frozenset({"ram_slots", "tier_residents"})
"""Store entries that describe a state (taken from the latest event); every other entry is a counter."""
DERIVED_KEYS = frozenset({"prefetch_wasted"})
"""Store entries computed from other counters: the summary recomputes them from the window's counts."""

LEVER_KEYS = ("swap", "swaps_to_vram")
"""Meters of the lever itself: None while CACHE_ROUTE is off."""
ROUTE_METER_KEYS = ("route_agree", "route_kl")
"""Meters of the routing meters: None while they are off (ROUTE_AGREE)."""


def store_deltas(previous: Mapping[str, int], current: Mapping[str, int]) -> dict[str, int]:
    """How much each store counter grew from `previous` to `current` (a counter that went down
    was reset: its whole value is new). State entries are left out."""
    out = {}
    for key, value in current.items():
        if key in STATE_KEYS or key in DERIVED_KEYS:
            continue
        out[key] = _grown(previous.get(key), value)
    return out


def _grown(previous, current):
    """A counter's growth; per-layer counters (a dict of lists, e.g. `prefetch_layers`) grow per entry."""
    if isinstance(current, dict):
        previous = previous if isinstance(previous, dict) else {}
        return {k: [_grown(p, c) for p, c in zip(previous.get(k, [0] * len(v)), v)] for k, v in current.items()}
    grown = current - (previous or 0)
    return grown if grown >= 0 else current


def _added(total, value, sign: int):
    """`total + sign * value` for a counter or a dict of per-layer lists."""
    if isinstance(value, dict):
        total = total if isinstance(total, dict) else {}
        return {k: [t + sign * v for t, v in zip(total.get(k, [0] * len(vs)), vs)] for k, vs in value.items()}
    return (total or 0) + sign * value


def _total_ms(timings: Mapping[str, float]) -> float:
    """A token's time: its 'total' entry, else the sum of its parts."""
    total = timings.get("total")
    return float(total) if total is not None else float(sum(v for v in timings.values() if v))


@dataclass
class MeterFold:
    """Meter counts summed over token events (see the module docstring)."""

    timing_phase: str | None = None  # fold the timings of this phase's tokens only (None: every token)
    tokens: int = 0
    ram_hits: int = 0
    ram_misses: int = 0
    layer_hits: list[int] = field(default_factory=list)  # per MoE layer index
    layer_misses: list[int] = field(default_factory=list)
    vram_served: int = 0
    vram_slots: int = 0  # slots of every decision, the denominator of the VRAM hit rate
    gpu_tier: bool = False
    decisions: int = 0  # routing decisions measured; the routing meters below sum over these only
    slots: int = 0
    swaps: int = 0
    swaps_vram: int = 0
    agree_hit: int = 0
    agree_tot: int = 0
    kl_sum: float = 0.0
    kl_count: int = 0
    shadow_hits: int = 0  # the stock top-K's RAM hits in the same cache state (the shadow meter)
    shadow_misses: int = 0
    shadow_vram: int = 0
    shadow_slots: int = 0  # stock top-K slots of the decisions the store counted, the VRAM shadow's denominator
    layer_shadow_hits: list[int] = field(default_factory=list)
    layer_shadow_misses: list[int] = field(default_factory=list)
    timed_tokens: int = 0
    total_ms: float = 0.0
    ms: dict[str, float] = field(default_factory=dict)  # per timer, summed over timed tokens
    counts: dict[str, int] = field(default_factory=dict)  # store counters grown over the folded tokens
    store: dict[str, int] = field(default_factory=dict)  # the latest event's store counters
    last_store: dict[str, int] = field(default_factory=dict)  # totals at the latest event, for `store_deltas`

    def reset(self) -> None:
        """Forget every count (the timing phase stays)."""
        self.__init__(timing_phase=self.timing_phase)

    def add(self, event: TokenEvent, timed: bool | None = None, deltas: Mapping[str, int] | None = None) -> None:
        """Fold one token in. `timed`: fold its timings (default: it has some, of the timing
        phase); `deltas`: how much the store's counters grew with it (default: from the
        previous event this fold saw)."""
        if timed is None:
            timed = bool(event.timings_ms) and (self.timing_phase is None or event.phase == self.timing_phase)
        if deltas is None:
            deltas = store_deltas(self.last_store, event.store) if event.store else {}
            if event.store:
                self.last_store = event.store
        self._apply(event, timed, deltas, 1)
        if event.gpu_tier:
            self.gpu_tier = True
        if event.store:
            self.store = event.store

    def remove(self, event: TokenEvent, timed: bool, deltas: Mapping[str, int]) -> None:
        """Take out a token folded in earlier with the same `timed` and `deltas` (a sliding window)."""
        self._apply(event, timed, deltas, -1)

    def _apply(self, event: TokenEvent, timed: bool, deltas: Mapping[str, int], sign: int) -> None:
        self.tokens += sign
        hits, misses = self.layer_hits, self.layer_misses
        shadow_hits, shadow_misses = self.layer_shadow_hits, self.layer_shadow_misses
        for route in event.layers:
            layer = route.layer
            if layer >= len(hits):
                grow = layer + 1 - len(hits)
                for counts in (hits, misses, shadow_hits, shadow_misses):
                    counts.extend([0] * grow)
            hits[layer] += sign * route.ram_hits
            misses[layer] += sign * route.ram_misses
            self.ram_hits += sign * route.ram_hits
            self.ram_misses += sign * route.ram_misses
            self.vram_served += sign * route.vram_served
            self.vram_slots += sign * route.chosen.shape[0]
            if route.shadow_ram_hits or route.shadow_ram_misses or route.shadow_vram:
                shadow_hits[layer] += sign * route.shadow_ram_hits
                shadow_misses[layer] += sign * route.shadow_ram_misses
                self.shadow_hits += sign * route.shadow_ram_hits
                self.shadow_misses += sign * route.shadow_ram_misses
                self.shadow_vram += sign * route.shadow_vram
                self.shadow_slots += sign * route.true_topk.shape[0]
            if route.measured:
                self.decisions += sign
                self.slots += sign * route.slots
                self.swaps += sign * route.swaps
                self.swaps_vram += sign * route.swaps_vram
                self.agree_hit += sign * (route.slots - route.swaps)
                self.agree_tot += sign * route.slots
                if route.kl is not None:
                    self.kl_sum += sign * route.kl
                    self.kl_count += sign
        if timed:
            timings = event.timings_ms
            self.timed_tokens += sign
            self.total_ms += sign * _total_ms(timings)
            ms = self.ms
            for key, value in timings.items():
                if key != "total" and value is not None:
                    ms[key] = ms.get(key, 0.0) + sign * value
        counts = self.counts
        for key, value in deltas.items():
            counts[key] = _added(counts.get(key), value, sign)

    def layer_hit_rates(self) -> list[float | None]:
        """RAM hit rate of each layer (None where nothing was requested)."""
        return [h / (h + m) if h + m else None for h, m in zip(self.layer_hits, self.layer_misses)]

    def layer_shadow_rates(self) -> list[float | None]:
        """The shadow meter of each layer: the stock top-K's RAM hit rate (None without samples)."""
        return [h / (h + m) if h + m else None for h, m in zip(self.layer_shadow_hits, self.layer_shadow_misses)]

    def summary(self) -> dict[str, Any]:
        """Rates in [0, 1], ms per token, nats, counts; None for a meter without samples."""
        requests = self.ram_hits + self.ram_misses
        timed = self.timed_tokens
        out: dict[str, Any] = {
            "tokens": self.tokens,
            "ram_hit": self.ram_hits / requests if requests else None,
            "ram_hits": self.ram_hits,
            "ram_misses": self.ram_misses,
            "vram_hit": (self.vram_served / self.vram_slots
                         if (self.gpu_tier or self.vram_served) and self.vram_slots else None),
            "vram_served": self.vram_served,
            "tok_s": 1000.0 * timed / self.total_ms if timed and self.total_ms > 0 else None,
            "fetch_ms": self.ms.get("fetch", 0.0) / timed if timed else None,
            "compute_ms": self.ms.get("compute", 0.0) / timed if timed else None,
            "ms_per_token": {k: v / timed for k, v in self.ms.items()} if timed else {},
            "swap": self.swaps / self.slots if self.slots else None,
            "swaps_to_vram": self.swaps_vram if self.slots else None,
            "route_agree": self.agree_hit / self.agree_tot if self.agree_tot else None,
            "route_kl": self.kl_sum / self.kl_count if self.kl_count else None,
            "decisions": self.decisions,
            "slots": self.slots,
            "swaps": self.swaps,
            "swaps_vram": self.swaps_vram,
            "agree_hit": self.agree_hit,
            "agree_tot": self.agree_tot,
            "kl_sum": self.kl_sum,
            "kl_count": self.kl_count,
            "shadow_hit": (self.shadow_hits / (self.shadow_hits + self.shadow_misses)
                           if self.shadow_hits + self.shadow_misses else None),
            "shadow_hits": self.shadow_hits,
            "shadow_misses": self.shadow_misses,
            "shadow_vram": (self.shadow_vram / self.shadow_slots
                            if (self.gpu_tier or self.shadow_vram) and self.shadow_slots else None),
            "shadow_vram_served": self.shadow_vram,
            "layer_ram_hit": self.layer_hit_rates(),
            "layer_shadow_hit": self.layer_shadow_rates(),
        }
        out.update({k: v for k, v in self.store.items() if k in STATE_KEYS})
        out.update(self.counts)
        bytes_read = self.counts.get("bytes_read")
        out["disk_mib"] = bytes_read / 2**20 / self.tokens if bytes_read is not None and self.tokens else None
        if "prefetch_issued" in self.counts and "prefetch_useful" in self.counts:
            out["prefetch_wasted"] = max(self.counts["prefetch_issued"] - self.counts["prefetch_useful"], 0)
        if "prefetch_hits" in self.counts:
            without = max(self.ram_hits - self.counts["prefetch_hits"], 0)
            out["ram_hit_without_prefetch"] = without / requests if requests else None
        out.update(prefetch_ledger_meters(self.counts, self.layer_misses))
        return out


# --- the prefetch ledger: PILOT's reads as meters ---------------------------------------------


def prefetch_ledger_meters(store: Mapping[str, Any], layer_misses: list[int]) -> dict[str, Any]:
    """Precision, recall, layers ahead and bytes per saved byte, overall and per layer (lists).

    From the store counters `Pilot.meters` adds, as grown over the folded
    tokens, and the fold's misses per layer; every figure is None without PILOT or
    without samples (docs/tiers.md, the prefetch ledger).
    """
    layers = store.get("prefetch_layers")
    out: dict[str, Any] = {"prefetch_precision": None, "prefetch_recall": None, "prefetch_ahead": None,
                           "prefetch_bytes_per_saved": None, "prefetch_layer_precision": None,
                           "prefetch_layer_recall": None, "prefetch_layer_ahead": None}
    if layers is None:
        return out

    def ratios(issued: int, hits: int, own: int, ahead: int, misses: int) -> tuple:
        return (own / issued if issued else None, hits / (misses + hits) if misses + hits else None,
                ahead / own if own else None)

    misses = list(layer_misses) + [0] * max(0, len(layers["issued"]) - len(layer_misses))
    per_layer = [ratios(*counts) for counts in zip(layers["issued"], layers["hits"], layers["own"],
                                                    layers["ahead_sum"], misses)]
    hits = store["prefetch_useful"]
    out["prefetch_precision"], out["prefetch_recall"], out["prefetch_ahead"] = ratios(
        store["prefetch_issued"], hits, store["prefetch_own_hits"], store["prefetch_ahead_sum"], sum(misses))
    out["prefetch_bytes_per_saved"] = store["prefetch_bytes"] / store["prefetch_saved_bytes"] if hits else None
    out["prefetch_layer_precision"] = [p for p, _, _ in per_layer]
    out["prefetch_layer_recall"] = [r for _, r, _ in per_layer]
    out["prefetch_layer_ahead"] = [a for _, _, a in per_layer]
    return out


WINDOWS = ("recent", "knob", "total")
"""The windows of `WindowedMeters`: the last N tokens, since the last knob change, since start."""
RECENT_TOKENS = 32
"""Tokens in the recent window unless told otherwise."""


def window_title(window: str, recent: int = RECENT_TOKENS) -> str:
    """A window's name as the app shows it."""
    return {"recent": f"last {recent} tok", "knob": "since knob change", "total": "since start"}[window]


@dataclass
class Segment:
    """One knob setting's tokens: which setting, where it started and ended, and its meters."""

    knob_seq: int
    ram_slots: int | None
    first: int  # the setting's first token, counted from the first token the meters saw
    end: int  # one past its last token
    meters: dict[str, Any]  # the setting's fold summary (rates as fractions)


SEGMENTS_KEPT = 256
"""Closed segments `WindowedMeters` remembers (the oldest are dropped first)."""


class WindowedMeters:
    """The last N tokens, since the last knob change, and since start: three folds of one stream.

    `add` folds an event into all three; the recent fold takes out the token
    that leaves its window; a new knob setting (the event's `knob_seq` or RAM
    cache size differs from the previous event's) closes the current
    `Segment` and starts the knob fold afresh. `changed` says a change was made
    before the next token arrives, so the knob window reads empty at once.
    Not thread-safe: the caller holds its own lock.
    """

    def __init__(self, recent: int = RECENT_TOKENS, baseline: Mapping[str, int] | None = None,
                 on_segment: Callable[[Segment], None] | None = None) -> None:
        if recent < 1:
            raise ValueError("the recent window needs at least one token")
        self.recent = int(recent)
        self.folds = {window: MeterFold() for window in WINDOWS}
        self.on_segment = on_segment
        self.segments: deque[Segment] = deque(maxlen=SEGMENTS_KEPT)
        self.setting: tuple[int, int | None] | None = None  # (knob_seq, RAM slots) of the knob fold
        self.setting_first = 0
        self.stale = False  # a change was made; the knob fold is the old setting's until its first token
        self._window: deque = deque()  # (event, timed, deltas) of the recent window
        self._previous = dict(baseline or {})
        self._decode_seen = False

    @property
    def tokens(self) -> int:
        """Tokens folded since start."""
        return self.folds["total"].tokens

    def add(self, event: TokenEvent) -> None:
        deltas = store_deltas(self._previous, event.store) if event.store else {}
        if event.store:
            self._previous = event.store
        timed = bool(event.timings_ms) and event.phase == "decode"
        if timed and not self._decode_seen:
            self._decode_seen = True
            timed = False
        setting = (int(event.knob_seq), event.store.get("ram_slots") if event.store else None)
        if self.setting is None:
            self.setting, self.setting_first = setting, self.tokens
        elif setting != self.setting:
            self._close()
            self.setting, self.setting_first = setting, self.tokens
        for fold in self.folds.values():
            fold.add(event, timed=timed, deltas=deltas)
        window = self._window
        window.append((event, timed, deltas))
        while len(window) > self.recent:
            self.folds["recent"].remove(*window.popleft())

    def _close(self) -> None:
        knob = self.folds["knob"]
        segment = Segment(self.setting[0], self.setting[1], self.setting_first, self.tokens, knob.summary())
        self.segments.append(segment)
        knob.reset()
        self.stale = False
        if self.on_segment is not None:
            self.on_segment(segment)

    def changed(self) -> None:
        """A knob or the cache size changed: the knob window is empty until the new setting's first token."""
        self.stale = True

    def current(self) -> Segment | None:
        """The setting being folded, as a segment that is still open (None before any token)."""
        if self.setting is None:
            return None
        return Segment(self.setting[0], self.setting[1], self.setting_first, self.tokens,
                       self.folds["knob"].summary())

    def set_recent(self, n: int) -> None:
        """Change the recent window's length (a longer one fills up from the next token)."""
        if n < 1:
            raise ValueError("the recent window needs at least one token")
        self.recent = int(n)
        window = self._window
        while len(window) > self.recent:
            self.folds["recent"].remove(*window.popleft())

    def fold(self, window: str) -> MeterFold:
        """One window's fold (an empty one for the knob window right after a change)."""
        if window == "knob" and self.stale:
            return MeterFold()
        return self.folds[window]

    def summary(self, window: str, knobs=None) -> dict[str, Any]:
        """One window's meters; with `knobs` (the KnobValues now in force) the lever's meters are
        None while CACHE_ROUTE is off and agree/KL while the routing meters are off."""
        out = self.fold(window).summary()
        if knobs is not None:
            if not knobs.CACHE_ROUTE:
                for key in LEVER_KEYS:
                    out[key] = None
            if not knobs.meters_on:
                for key in ROUTE_METER_KEYS:
                    out[key] = None
        return out
