"""Evaluation runs of the seed engine: reference matching, teacher-forced NLL, meters.

A reference file is `{"prompt_ids": [...], "full_ids": [...]}`. `run_eval`
greedy-decodes the continuation and counts position-by-position matches,
optionally teacher-forces the reference to get its NLL, and gathers every
meter (cache, Belady bound, routing lever, GPU tier, timings) into one dict
that `tierlab eval --json`, `tierlab ab` and the app all read.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from tierlab.engine.errors import FormatError
from tierlab.engine.model import TIMER_NAMES, Engine


def read_ref(path: str | Path) -> tuple[list[int], list[int]]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        prompt = [int(i) for i in data["prompt_ids"]]
        full = [int(i) for i in data["full_ids"]]
    except FileNotFoundError:
        raise FormatError("no such reference file", path) from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise FormatError('not a reference file (expected {"prompt_ids": [...], "full_ids": [...]})', path) from None
    if not prompt or len(full) <= len(prompt) or full[: len(prompt)] != prompt:
        raise FormatError("full_ids must extend prompt_ids by at least one token", path)
    return prompt, full


def write_ref(path: str | Path, prompt: list[int], full: list[int]) -> None:
    Path(path).write_text(json.dumps({"prompt_ids": list(prompt), "full_ids": list(full)}) + "\n")


def log_softmax_nll(logits: np.ndarray, target: int) -> float:
    z = np.asarray(logits, dtype=np.float64)
    m = z.max()
    return float(m + math.log(np.exp(z - m).sum()) - z[target])


def greedy_decode(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], dict]:
    """Greedy continuation of n tokens; also returns decode-only timers."""
    logits = engine.prefill(prompt)
    before = dict(engine.timers)
    tokens_before = engine.tokens_timed
    out = []
    for i in range(n):
        token = int(np.argmax(logits))
        out.append(token)
        if i + 1 < n:
            logits = engine.step(token)
    decode = {k: engine.timers.get(k, 0.0) - before.get(k, 0.0) for k in (*TIMER_NAMES, "total")}
    decode["tokens"] = engine.tokens_timed - tokens_before
    return out, decode


def teacher_forced_nll(engine: Engine, prompt: list[int], full: list[int]) -> tuple[float, int]:
    """Mean NLL (nats/token) of full_ids after the prompt, feeding the reference tokens."""
    logits = engine.prefill(prompt)
    total = 0.0
    n = 0
    for i in range(len(prompt), len(full)):
        total += log_softmax_nll(logits, full[i])
        n += 1
        if i + 1 < len(full):
            logits = engine.step(full[i])
    return total / max(n, 1), n


def run_eval(engine: Engine, prompt: list[int], full: list[int], ppl: bool = False,
             on_generated=None) -> dict:
    """One evaluation run: matching, optional TF-NLL, and every meter.

    `on_generated()` is called after the generation, before teacher forcing
    (a session log stops recording there)."""
    engine.reset_meters()
    n = len(full) - len(prompt)
    t0 = time.perf_counter()
    generated, decode = greedy_decode(engine, prompt, n)
    wall = time.perf_counter() - t0
    reference = full[len(prompt):]
    matching = sum(int(a == b) for a, b in zip(generated, reference))
    result = {"matching": matching, "total": n, "generated": generated}
    result.update(collect_meters(engine, decode))
    result["wall_s"] = wall
    from tierlab.engine.routing import format_footer

    result["route_footer"] = format_footer(engine.knobs.snapshot(), engine.router.meters)
    if on_generated is not None:
        on_generated()
    if ppl:
        # the meters above are the generation's; teacher forcing starts cold, as a separate run would
        engine.cold_start()
        nll, count = teacher_forced_nll(engine, prompt, full)
        result["tf_nll"] = nll
        result["ppl"] = math.exp(nll)
        result["tf_tokens"] = count
    else:
        result["tf_nll"] = None
        result["ppl"] = None
    return result


def collect_meters(engine: Engine, decode: dict) -> dict:
    meters = engine.meters()
    tokens = max(int(decode.get("tokens", 0)), 1)
    ms = {k: 1000.0 * decode.get(k, 0.0) / tokens for k in TIMER_NAMES}
    out = dict(meters)
    out["tok_s"] = tokens / decode["total"] if decode.get("total") else 0.0
    out["fetch_ms"] = ms["fetch"]
    out["compute_ms"] = ms["compute"]
    out["ms_per_token"] = ms
    out["decode_tokens"] = int(decode.get("tokens", 0))
    out["cache_slots"] = engine.cache_slots()
    out["oracle_hit"] = engine.oracle_hit()
    return out


def format_report(engine: Engine, result: dict) -> list[str]:
    """The seed's footer lines, in its order."""
    lines = [f"Matching tokens: {result['matching']}/{result['total']}"]
    if result.get("tf_nll") is not None:
        lines.append(f"TF-NLL: {result['tf_nll']:.4f} nats/token over {result['tf_tokens']} tokens | ppl = {result['ppl']:.4f}")
    lines.append(
        f"Expert cache hit rate: {result['ram_hit']:.1f}% (hit={result['ram_hits']} miss={result['ram_misses']}) "
        f"| Belady bound {result['oracle_hit']:.1f}% at {result['cache_slots']} slots/layer"
    )
    if engine.tier_description() is not None:
        lines.append(f"VRAM hit rate: {result['vram_hit']:.1f}% ({result.get('tier_residents', 0)} experts resident)")
    lines.extend(result["route_footer"])
    ms = result["ms_per_token"]
    lines.append(
        f"decode {result['tok_s']:.2f} tok/s | ms/token: fetch {ms['fetch']:.2f} compute {ms['compute']:.2f} "
        f"attention {ms['attention']:.2f} deltanet {ms['deltanet']:.2f} router {ms['router']:.2f} "
        f"shared {ms['shared']:.2f} tier {ms['tier']:.2f} lm_head {ms['lm_head']:.2f} other {ms['other']:.2f}"
    )
    return lines
