"""`tierlab bench rss`: does the process stay inside its memory budget over a long decode?

The budget (engine/budget.py) is a plan; this measures it. It opens the model
under `--ram-gb`, decodes N tokens greedily from a random prompt and samples
the resident set (/proc/self/status VmRSS) after every token, with the
kernel's high-water mark (VmHWM) at the end. It reports the peak against
the budget, and the growth after the RAM cache is full (every slot holds an
expert): a cache that respects its slots, reads by pread into them and keeps
no mapped file pages should not grow at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierlab.engine.surface import EngineSurface

STATUS = Path("/proc/self/status")


def status_bytes(field: str, status: Path = STATUS) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM); 0 where the system has none."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


@dataclass
class RssReport:
    model: str
    budget_bytes: int
    origin: str
    cache_slots: int
    n_experts: int
    prompt_tokens: int
    decode_tokens: int
    rss_open: int  # after loading (weights in, cache empty)
    rss_cache_full: int  # when every slot first held an expert (0: it never filled)
    cache_full_at: int  # decode token at which it filled (-1: never)
    rss_end: int
    peak_sampled: int  # the highest VmRSS sample
    peak_hwm: int  # VmHWM at the end (the kernel's own peak, loading included), or the highest sample above it
    decode_tok_s: float
    ram_hit: float

    @property
    def peak_over_budget(self) -> float:
        return self.peak_hwm / self.budget_bytes - 1.0 if self.budget_bytes else 0.0

    @property
    def growth_after_full(self) -> int:
        return self.rss_end - self.rss_cache_full if self.cache_full_at >= 0 else 0

    def to_json(self) -> dict:
        return {**vars(self), "peak_over_budget": self.peak_over_budget, "growth_after_full": self.growth_after_full}


def cache_filled(engine: EngineSurface) -> bool:
    """Whether every MoE layer's RAM slots all hold an expert."""
    slots = engine.cache_slots()
    return all(int((engine.residency(layer) >= 1).sum()) >= slots
               for layer, moe in enumerate(engine.config.moe_layers) if moe)


def run_rss_bench(engine: EngineSurface, budget_bytes: int, origin: str, prompt_tokens: int = 32,
                  decode_tokens: int = 2000, seed: int = 0, progress=None) -> RssReport:
    from tierlab.engine.meters import meters_json

    rss_open = status_bytes("VmRSS")
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, engine.config.vocab_size, prompt_tokens)]
    logits = engine.prefill(prompt)
    # the sample after open counts too: the warm-up's temporaries may be returned to the system
    # during the prompt, leaving every later sample below it
    peak, full_at, rss_full = max(rss_open, status_bytes("VmRSS")), -1, 0
    t0 = time.perf_counter()
    for i in range(decode_tokens):
        logits = engine.step(int(np.argmax(logits)))
        rss = status_bytes("VmRSS")
        peak = max(peak, rss)
        if full_at < 0 and cache_filled(engine):
            full_at, rss_full = i, rss
        if progress and (i + 1) % 100 == 0:
            progress(i + 1, rss)
    decode_s = time.perf_counter() - t0
    return RssReport(
        model=str(engine.model_dir), budget_bytes=budget_bytes, origin=origin, cache_slots=engine.cache_slots(),
        n_experts=engine.config.n_experts, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
        rss_open=rss_open, rss_cache_full=rss_full, cache_full_at=full_at, rss_end=status_bytes("VmRSS"),
        # VmHWM is raised lazily (on some of the paths that lower RSS, from per-thread counters),
        # so a sample can read a few pages above it (69 KiB seen in a test run)
        peak_sampled=peak, peak_hwm=max(status_bytes("VmHWM"), peak), decode_tok_s=decode_tokens / decode_s,
        ram_hit=meters_json(engine.meters())["ram_hit"] or 0.0,
    )


def format_rss_report(r: RssReport) -> str:
    def mib(n: int) -> str:
        return f"{n / 2**20:,.0f} MiB"

    full = (f"cache full after {r.cache_full_at + 1} tokens at {mib(r.rss_cache_full)}; "
            f"growth after that {r.growth_after_full / 2**20:+,.0f} MiB") if r.cache_full_at >= 0 \
        else "cache never filled"
    return "\n".join([
        f"model {r.model}, budget {mib(r.budget_bytes)} ({r.origin}), cache {r.cache_slots}/{r.n_experts} slots per layer",
        f"decode {r.decode_tokens} tokens at {r.decode_tok_s:.2f} tok/s, RAM hit {r.ram_hit:.1f}%",
        f"RSS after open {mib(r.rss_open)}; {full}; at the end {mib(r.rss_end)}",
        f"peak RSS {mib(r.peak_hwm)} (VmHWM; sampled {mib(r.peak_sampled)}) = "
        f"{100 * (1 + r.peak_over_budget):.1f}% of the budget",
    ])
