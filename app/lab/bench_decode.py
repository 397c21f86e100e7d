"""`tierlab bench decode`: the engine end to end, next to this machine's roofline.

Decode is bound by reading weights: every token reads the dense weights of
every layer, the K chosen experts of every MoE layer, the shared experts and
the LM head. Dividing the memory bandwidth measured in the same run by
those bytes gives the roofline tok/s; the engine's decode tok/s is reported
as a share of it.

The bandwidth is read between the decode's chunks of tokens, not once
before it: on the shared VMs of docs/benchmarks.md the stream read moves by
half from one minute to the next, and decode with it, so a reading taken
seconds away from the tokens it divides put the same engine at 61% or 123%
of its roofline. Each chunk's tok/s is divided by the mean of the readings
just before and just after it; the share reported is the median over the
chunks (`roofline_share`), the bandwidth the median reading.

By default the run is warm, as in a chat: other traffic (a different random
prompt and its decode) has filled the RAM slots before the measured prompt
and decode, so the figure is what a session sees after its first turn.
`--cold` empties the slots first, so decode also pays for copying in the
experts the prompt did not touch; `--drop-page-cache` (root only) makes those
copies come from the disk rather than from the page cache.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field

import numpy as np

from tierlab.app.lab.bench_kernels import StreamProbe
from tierlab.engine.meters import meters_json
from tierlab.engine.model import TIMER_NAMES
from tierlab.engine.qlinear import QuantMatrix, RowStack
from tierlab.engine.surface import EngineSurface


def weight_bytes_per_token(engine: EngineSurface) -> dict:
    """Bytes of weights one decode token reads (dense, experts, lm_head), ignoring caches."""
    cfg = engine.config
    weights = engine.weight_nbytes()
    dense = weights["dense"] + weights["embed_row"]
    lm_head = weights["lm_head"]
    experts = sum(cfg.moe_layers) * cfg.top_k * engine.store_stats().blob_nbytes
    return {"dense": int(dense), "experts": int(experts), "lm_head": int(lm_head),
            "total": int(dense + experts + lm_head)}


def state_bytes_per_token(cfg, position: float) -> int:
    """Bytes of sequence state one decode token at `position` moves: each DeltaNet layer's
    recurrent matrices and conv inputs read and written back, each attention layer's keys
    and values read at every position up to this one. Not weights, so not in the roofline,
    but memory time all the same."""
    total = 0.0
    for kind in cfg.layer_types:
        if kind == "linear_attention":
            channels = 2 * cfg.lin_k_heads * cfg.lin_k_dim + cfg.lin_v_heads * cfg.lin_v_dim
            per_layer = cfg.lin_v_heads * cfg.lin_k_dim * cfg.lin_v_dim + max(cfg.conv_kernel - 1, 0) * channels
            total += 2 * 4 * per_layer
        else:
            total += 2 * cfg.n_kv_heads * cfg.head_dim * 4 * (position + 1)
    return int(total)


def dense_kind(engine: EngineSurface) -> str:
    """How the dense projections are stored: int8/int4 (a --dense-bits container), bf16 or fp32."""
    for value in engine.dense_matrices():
        if isinstance(value, RowStack):
            value = next((p for p in value.parts if isinstance(p, QuantMatrix)), value.parts[0])
        if isinstance(value, QuantMatrix):
            return value.kind
        if isinstance(value, np.ndarray) and value.ndim == 2 and value.dtype in (np.uint16, np.float32):
            return "bf16" if value.dtype == np.uint16 else "fp32"
    return "?"


def drop_page_cache() -> bool:
    """Ask the kernel to drop clean page-cache pages (root only); False if not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


#: tokens decoded between two readings of the stream bandwidth
CHUNK_TOKENS = 16
#: bytes one reading streams (twice, the faster taken), as the single reading before the decode
#: did: well past a last-level cache (with a 32 MiB L3, 32 MiB read 30-50% fast and 64 MiB 5%)
PROBE_BYTES = 256 * 2**20


@dataclass
class DecodeReport:
    model: str
    kind: str
    cache_slots: int
    n_experts: int
    prompt_tokens: int
    decode_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    ms_per_token: dict = field(default_factory=dict)
    ram_hit: float = 0.0
    disk_mb_per_token: float = 0.0
    weight_bytes: dict = field(default_factory=dict)
    bandwidth_gbs: float = 0.0
    roofline_tok_s: float = 0.0
    peak_rss_mb: float = 0.0
    cold: bool = False
    roofline_share: float = 0.0  # median over the chunks of tok/s / the roofline at that chunk's bandwidth
    chunk_shares: list = field(default_factory=list)  # each chunk's share, in decode order
    bandwidth_range: list = field(default_factory=list)  # [lowest, highest] reading of the run
    bandwidth_given: bool = False  # the caller's figure, not read in the run
    dense_kind: str = ""
    page_cache_dropped: bool = False
    state_bytes: int = 0  # sequence state per decode token (state_bytes_per_token), mid-decode
    threading: str = ""  # the pool, its waiting, and the load-following thread count at the end

    def to_json(self) -> dict:
        return dict(vars(self))


def _greedy(engine: EngineSurface, prompt: list[int], steps: int) -> None:
    logits = engine.prefill(prompt)
    for _ in range(steps):
        logits = engine.step(int(np.argmax(logits)))


def run_decode_bench(engine: EngineSurface, prompt_tokens: int = 32, decode_tokens: int = 32, cold: bool = False,
                     seed: int = 0, bandwidth_gbs: float | None = None,
                     drop_cache: bool = False) -> DecodeReport:
    """Prefill a random prompt and decode greedily; warm slots unless `cold`."""
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    prompt = [int(t) for t in rng.integers(0, vocab, prompt_tokens)]
    # compile every kernel on a short run
    _greedy(engine, prompt[:4], 1)
    given = bandwidth_gbs
    if given is None:
        read_bandwidth = StreamProbe(PROBE_BYTES).read_gbs
        read_bandwidth()  # the first read pays for compiling it
    else:
        def read_bandwidth() -> float:
            return float(given)
    engine.cold_start()
    if not cold:
        # another conversation's traffic fills the slots, as earlier turns of a chat do
        other = [int(t) for t in np.random.default_rng(seed + 1).integers(0, vocab, prompt_tokens)]
        _greedy(engine, other, decode_tokens)
        engine.reset_meters()
    dropped = drop_page_cache() if drop_cache else False
    t0 = time.perf_counter()
    logits = engine.prefill(prompt)
    prefill_s = time.perf_counter() - t0
    before = dict(engine.timers)
    misses_before = engine.store_stats().ram_misses
    wb = weight_bytes_per_token(engine)
    readings = [read_bandwidth()]
    decode_s, shares = 0.0, []
    for start in range(0, decode_tokens, CHUNK_TOKENS):
        n = min(CHUNK_TOKENS, decode_tokens - start)
        t0 = time.perf_counter()
        for _ in range(n):
            logits = engine.step(int(np.argmax(logits)))
        chunk_s = time.perf_counter() - t0
        decode_s += chunk_s
        readings.append(read_bandwidth())
        chunk_bw = 0.5 * (readings[-2] + readings[-1])
        shares.append(n / chunk_s * wb["total"] / (chunk_bw * 1e9))
    ms = {k: 1000.0 * (engine.timers.get(k, 0.0) - before.get(k, 0.0)) / decode_tokens for k in TIMER_NAMES}
    stats = engine.store_stats()
    misses = stats.ram_misses - misses_before
    bandwidth_gbs = float(np.median(readings))
    return DecodeReport(
        model=str(engine.model_dir), kind=stats.expert_kind, cache_slots=stats.slots,
        n_experts=engine.config.n_experts, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
        prefill_tok_s=prompt_tokens / prefill_s, decode_tok_s=decode_tokens / decode_s, ms_per_token=ms,
        ram_hit=meters_json(engine.meters())["ram_hit"] or 0.0,
        disk_mb_per_token=misses * stats.blob_nbytes / decode_tokens / 2**20,
        weight_bytes=wb, bandwidth_gbs=bandwidth_gbs, roofline_tok_s=bandwidth_gbs * 1e9 / wb["total"],
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, cold=cold,
        dense_kind=dense_kind(engine), page_cache_dropped=dropped,
        state_bytes=state_bytes_per_token(engine.config, prompt_tokens + decode_tokens / 2),
        threading=_threading_line(engine),
        roofline_share=float(np.median(shares)) if shares else 0.0, chunk_shares=shares,
        bandwidth_range=[min(readings), max(readings)], bandwidth_given=given is not None,
    )


def _threading_line(engine) -> str:
    from tierlab.engine import threading_layer

    follower = getattr(engine, "threads", None)
    state = follower.describe() if follower is not None else ""
    return threading_layer.describe() + (f" ({state})" if state else "")


def format_decode_report(r: DecodeReport) -> str:
    ms = r.ms_per_token
    low, high = r.bandwidth_range or [r.bandwidth_gbs, r.bandwidth_gbs]
    lines = [
        f"model {r.model} ({r.kind} experts, {r.dense_kind} dense), cache {r.cache_slots}/{r.n_experts} slots per layer, "
        + ("cold slots" if r.cold else "warm slots") + (", page cache dropped" if r.page_cache_dropped else ""),
        f"prefill {r.prefill_tok_s:.1f} tok/s ({r.prompt_tokens} tokens) | decode {r.decode_tok_s:.2f} tok/s "
        f"({r.decode_tokens} tokens)",
        f"weights read per token {r.weight_bytes['total'] / 2**20:.1f} MiB (dense {r.weight_bytes['dense'] / 2**20:.1f}, "
        f"experts {r.weight_bytes['experts'] / 2**20:.1f}, lm_head {r.weight_bytes['lm_head'] / 2**20:.1f}); "
        f"from disk {r.disk_mb_per_token:.1f} MiB/token (RAM hit {r.ram_hit:.1f}%)",
        (f"bandwidth {r.bandwidth_gbs:.1f} GB/s (given) -> roofline {r.roofline_tok_s:.1f} tok/s; decode is "
         f"{100 * r.roofline_share:.0f}% of it (median over chunks of {CHUNK_TOKENS} tokens)" if r.bandwidth_given else
         f"bandwidth {r.bandwidth_gbs:.1f} GB/s (median between chunks of {CHUNK_TOKENS} tokens; {low:.1f}-{high:.1f}) "
         f"-> roofline {r.roofline_tok_s:.1f} tok/s; decode is {100 * r.roofline_share:.0f}% of it (median over "
         f"the chunks, each against the bandwidth read around it)"),
        f"state read and written per token {r.state_bytes / 2**20:.1f} MiB (DeltaNet recurrence, KV cache; not in "
        f"the roofline) -> with it {r.bandwidth_gbs * 1e9 / (r.weight_bytes['total'] + r.state_bytes):.1f} tok/s",
        "ms/token: " + " ".join(f"{k} {ms[k]:.2f}" for k in TIMER_NAMES),
        f"peak RSS {r.peak_rss_mb:.0f} MiB",
    ] + ([r.threading] if r.threading else [])
    return "\n".join(lines)
