"""Meters: one fold over token events, and the one catalogue of their names and units.

Every figure the CLI, the app, A/B tables and session-log summaries show is
computed here from `TokenEvent`s: the engine feeds its own `MeterFold`,
`tierlab eval` and `ab` feed one per run, `tierlab compare` feeds one from a
session log's records, and the app's watch keeps its own. `add` only adds
integers (and one float per measured routing decision); `summary` turns the
counts into rates in [0, 1], milliseconds, nats and counts. A meter without
samples is None, shown as "–", never as 0. Percent appears only where a
value is shown (`Meter.show`) or written as JSON (`meters_json`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from tierlab.engine.events import TokenEvent

RATE, MS, NATS, TOK_S, TEXT = "rate", "ms", "nats", "tok/s", "text"
MISSING = "–"


@dataclass(frozen=True)
class Meter:
    """One meter: its key in summaries and rows, its titles, its unit and how it is shown."""

    key: str
    title: str  # column title of tables
    label: str  # short label of the app's meter panel
    unit: str  # RATE (a fraction, shown as percent), MS, NATS, TOK_S or TEXT
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
    Meter("ram_hit", "RAM hit", "RAM hit", RATE, ".1f", "5.1f", "experts found in the RAM cache"),
    Meter("ram_hit_without_prefetch", "RAM hit w/o prefetch", "no prefetch", RATE, ".1f", "5.1f",
          "RAM hit rate without the hits prefetch bought"),
    Meter("vram_hit", "VRAM hit", "VRAM hit", RATE, ".1f", "5.1f", "experts served by the GPU tier"),
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
    timed_tokens: int = 0
    total_ms: float = 0.0
    ms: dict[str, float] = field(default_factory=dict)  # per timer, summed over timed tokens
    store: dict[str, int] = field(default_factory=dict)  # the latest event's store counters

    def reset(self) -> None:
        """Forget every count (the timing phase stays)."""
        self.__init__(timing_phase=self.timing_phase)

    def add(self, event: TokenEvent) -> None:
        """Fold one token in."""
        self.tokens += 1
        hits, misses = self.layer_hits, self.layer_misses
        for route in event.layers:
            layer = route.layer
            if layer >= len(hits):
                grow = layer + 1 - len(hits)
                hits.extend([0] * grow)
                misses.extend([0] * grow)
            hits[layer] += route.ram_hits
            misses[layer] += route.ram_misses
            self.ram_hits += route.ram_hits
            self.ram_misses += route.ram_misses
            self.vram_served += route.vram_served
            self.vram_slots += route.chosen.shape[0]
            if route.measured:
                self.decisions += 1
                self.slots += route.slots
                self.swaps += route.swaps
                self.swaps_vram += route.swaps_vram
                self.agree_hit += route.slots - route.swaps
                self.agree_tot += route.slots
                if route.kl is not None:
                    self.kl_sum += route.kl
                    self.kl_count += 1
        timings = event.timings_ms
        if timings and (self.timing_phase is None or event.phase == self.timing_phase):
            self.timed_tokens += 1
            self.total_ms += _total_ms(timings)
            ms = self.ms
            for key, value in timings.items():
                if key != "total" and value is not None:
                    ms[key] = ms.get(key, 0.0) + value
        if event.gpu_tier:
            self.gpu_tier = True
        if event.store:
            self.store = event.store

    def layer_hit_rates(self) -> list[float | None]:
        """RAM hit rate of each layer (None where nothing was requested)."""
        return [h / (h + m) if h + m else None for h, m in zip(self.layer_hits, self.layer_misses)]

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
            "tok_s": 1000.0 * timed / self.total_ms if self.total_ms > 0 else None,
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
        }
        out.update(self.store)
        if "prefetch_hits" in self.store:
            without = max(self.ram_hits - self.store["prefetch_hits"], 0)
            out["ram_hit_without_prefetch"] = without / requests if requests else None
        out.update(prefetch_ledger_meters(self.store, self.layer_misses))
        return out


# --- the prefetch ledger: PILOT's reads as meters ---------------------------------------------


def prefetch_ledger_meters(store: Mapping[str, Any], layer_misses: list[int]) -> dict[str, Any]:
    """Precision, recall, layers ahead and bytes per saved byte, overall and per layer (lists).

    From the store counters `Pilot.meters` adds (totals since the last reset)
    and the fold's misses per layer; every figure is None without PILOT or
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
