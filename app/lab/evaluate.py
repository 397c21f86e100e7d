"""Evaluation runs: reference matching, teacher-forced NLL, meters.

A reference file is `{"prompt_ids": [...], "full_ids": [...]}`. `run_eval`
greedy-decodes the continuation and counts position-by-position matches,
optionally teacher-forces the reference to get its NLL, and gathers every
meter of the run (cache, Belady bound, routing lever, GPU tier, timings)
from the run's own events (`RunMeters`) into the dict `tierlab eval --json`
prints. A knob script (`--knobs-at`, app/lab/knob_script.py) changes knobs
during the generation and the teacher forcing alike; each run's segments
(one per knob setting) go into the result.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from tierlab.app.lab.knob_script import KnobStep, ScriptedRun
from tierlab.app.lab.oracle import OracleBand, OracleReading
from tierlab.engine.atomic import write_atomic
from tierlab.engine.bounded_read import read_text
from tierlab.engine.errors import FormatError
from tierlab.engine.meters import METER_BY_KEY, MeterFold
from tierlab.engine.model import TIMER_NAMES, Engine
from tierlab.engine.routing import format_footer


#: a token id beyond this is no model's vocabulary (engine/config.py caps vocab_size below it)
MAX_TOKEN_ID = 1 << 31


def read_ref(path: str | Path, vocab_size: int | None = None) -> tuple[list[int], list[int]]:
    """A reference's prompt and full ids; ids must be integers in [0, vocab_size) (one line otherwise)."""
    path = Path(path)
    text = read_text(path, "reference", FormatError)
    try:
        data = json.loads(text)
        raw_prompt, raw_full = data["prompt_ids"], data["full_ids"]
        if not isinstance(raw_prompt, list) or not isinstance(raw_full, list):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise FormatError('not a reference file (expected {"prompt_ids": [...], "full_ids": [...]})', path) from None
    limit = MAX_TOKEN_ID if vocab_size is None else vocab_size
    for key, ids in (("prompt_ids", raw_prompt), ("full_ids", raw_full)):
        for pos, value in enumerate(ids):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise FormatError(f"{key}[{pos}] = {shown} is not a token id (an integer in 0..{limit - 1})", path)
    prompt, full = list(raw_prompt), list(raw_full)
    if not prompt or len(full) <= len(prompt) or full[: len(prompt)] != prompt:
        raise FormatError("full_ids must extend prompt_ids by at least one token", path)
    return prompt, full


def check_ref_fits(path: str | Path, prompt: list[int], full: list[int], engine: Engine) -> None:
    """A reference must use the model's vocabulary and fit its context (one line naming the file)."""
    vocab = int(engine.config.vocab_size)
    bad = next((i for i in full if i >= vocab), None)
    if bad is not None:
        raise FormatError(f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})", path)
    context = int(engine.config.max_positions)
    if context and len(full) - 1 > context:
        raise FormatError(f"the reference needs {len(full) - 1} positions, more than the model's context "
                          f"({context}, max_position_embeddings)", path)


def write_ref(path: str | Path, prompt: list[int], full: list[int]) -> None:
    """Write atomically: a failed write (a full disk) leaves an existing reference as it was."""
    try:
        write_atomic(path, json.dumps({"prompt_ids": list(prompt), "full_ids": list(full)}) + "\n")
    except OSError as exc:
        raise FormatError(f"cannot write reference: {exc.strerror or exc}", path) from None


def log_softmax_nll(logits: np.ndarray, target: int) -> float:
    z = np.asarray(logits, dtype=np.float64)
    m = z.max()
    return float(m + math.log(np.exp(z - m).sum()) - z[target])


class RunMeters:
    """A run's own meters: a fold of its events (timings of decode tokens only) and its requests for the oracle.

    Subscribes to the engine on creation; `close` unsubscribes. Both hold
    this run's tokens only, however long the engine has been running.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.fold = MeterFold(timing_phase="decode")
        self.oracle = OracleBand(window=None, n_experts=int(engine.config.n_experts))
        engine.subscribe(self._on_token)

    def _on_token(self, event) -> None:
        self.fold.add(event)
        self.oracle.add(event)

    def close(self) -> None:
        self.engine.unsubscribe(self._on_token)

    def summary(self) -> dict:
        """The fold's summary plus the run's oracle band (Belady bound, LRU at other sizes: fractions),
        decode tokens and ms per timer."""
        out = self.fold.summary()
        reading = self.oracle.reading()
        out.update(reading.meters() if reading is not None else OracleReading(0, 0, None).meters())
        out["lru_sizes"] = dict(reading.sizes) if reading is not None else {}
        out["decode_tokens"] = self.fold.timed_tokens
        out["ms_per_token"] = {k: out["ms_per_token"].get(k, 0.0) for k in TIMER_NAMES}
        out["cache_slots"] = self.oracle.slots
        return out


def greedy_decode(engine: Engine, prompt: list[int], n: int,
                  steps: list[KnobStep] | None = None) -> tuple[list[int], dict]:
    """Greedy continuation of n tokens; also returns the run's meters (RunMeters.summary) with
    its "segments" (one per knob setting; `steps` change knobs before given tokens)."""
    context = int(engine.config.max_positions)
    if context and len(prompt) + n - 1 > context:  # a fixed count is refused, not cut short
        raise FormatError(f"{len(prompt)} prompt + {n} new tokens need {len(prompt) + n - 1} positions, more than "
                          f"the model's context ({context}, max_position_embeddings)")
    run = RunMeters(engine)
    script = ScriptedRun(engine, steps or [])
    out: list[int] = []
    try:
        logits = engine.prefill(prompt)
        for i in range(n):
            token = int(np.argmax(logits))
            out.append(token)
            if i + 1 < n:
                script.before(i + 1)
                logits = engine.step(token)
    finally:
        segments = script.finish(len(out))
        run.close()
    summary = run.summary()
    summary["segments"] = segments
    return out, summary


def teacher_forced_nll(engine: Engine, prompt: list[int], full: list[int],
                       script: ScriptedRun | None = None, on_logits=None) -> tuple[float, int]:
    """Mean NLL (nats/token) of full_ids after the prompt, feeding the reference tokens; a
    `script` gets `before(T)` ahead of the pass that predicts reference token T, and
    `on_logits(T, logits)` hears the logits that predict it (paired runs: app/lab/paired.py)."""
    logits = engine.prefill(prompt)
    total = 0.0
    n = 0
    for i in range(len(prompt), len(full)):
        if on_logits is not None:
            on_logits(n, logits)
        total += log_softmax_nll(logits, full[i])
        n += 1
        if i + 1 < len(full):
            if script is not None:
                script.before(n)
            logits = engine.step(full[i])
    return total / max(n, 1), n


def teacher_forced_run(engine: Engine, prompt: list[int], full: list[int],
                       steps: list[KnobStep] | None = None, on_logits=None) -> tuple[float, dict]:
    """Teacher-forced NLL of a reference and the meters of that run (RunMeters.summary, with
    its "segments"); `on_logits` as in teacher_forced_nll."""
    run = RunMeters(engine)
    script = ScriptedRun(engine, steps or [])
    count = 0
    try:
        nll, count = teacher_forced_nll(engine, prompt, full, script, on_logits)
    finally:
        segments = script.finish(count)
        run.close()
    summary = run.summary()
    summary["segments"] = segments
    return nll, summary


def run_eval(engine: Engine, prompt: list[int], full: list[int], ppl: bool = False,
             on_generated=None, steps: list[KnobStep] | None = None) -> dict:
    """One evaluation run: matching, optional TF-NLL, and every meter.

    Meters as RunMeters.summary gives them (rates as fractions; `tierlab eval
    --json` writes them through meters_json). `on_generated()` is called after
    the generation, before teacher forcing (a session log stops recording there).
    `steps` (a knob script) run in the generation and again in the teacher forcing:
    "segments" and "tf_segments" hold their segments."""
    engine.reset_meters()
    n = len(full) - len(prompt)
    t0 = time.perf_counter()
    generated, meters = greedy_decode(engine, prompt, n, steps)
    wall = time.perf_counter() - t0
    reference = full[len(prompt):]
    matching = sum(int(a == b) for a, b in zip(generated, reference))
    result = {"matching": matching, "total": n, "generated": generated}
    result.update(meters)
    result["wall_s"] = wall
    result["route_footer"] = format_footer(engine.knobs.snapshot(), meters)
    if on_generated is not None:
        on_generated()
    if ppl:
        # the meters above are the generation's; teacher forcing starts cold, as a separate run would
        engine.cold_start()
        nll, tf_meters = teacher_forced_run(engine, prompt, full, steps)
        result["tf_nll"] = nll
        result["ppl"] = math.exp(nll)
        result["tf_tokens"] = len(full) - len(prompt)
        result["tf_segments"] = tf_meters["segments"]
    else:
        result["tf_nll"] = None
        result["ppl"] = None
    return result


def format_report(engine: Engine, result: dict) -> list[str]:
    """The footer lines of an eval run, in their fixed order (`result` as run_eval returns it)."""
    lines = [f"Matching tokens: {result['matching']}/{result['total']}"]
    if result.get("tf_nll") is not None:
        lines.append(f"TF-NLL: {result['tf_nll']:.4f} nats/token over {result['tf_tokens']} tokens | ppl = {result['ppl']:.4f}")
    lines.append(
        f"Expert cache hit rate: {_show(result, 'ram_hit')} (hit={result['ram_hits']} miss={result['ram_misses']}) "
        f"| Belady bound {_show(result, 'oracle_hit')} at {result['cache_slots']} slots/layer"
    )
    lines.append(f"Shadow (stock top-K, same cache state): {_show(result, 'shadow_hit')} "
                 f"(hit={result['shadow_hits']} miss={result['shadow_misses']})")
    if engine.tier_description() is not None:
        lines.append(f"VRAM hit rate: {_show(result, 'vram_hit')} ({result.get('tier_residents', 0)} experts resident)")
    lines.extend(result["route_footer"])
    ms = result["ms_per_token"]
    lines.append(
        f"decode {_show(result, 'tok_s')} tok/s | ms/token: fetch {ms['fetch']:.2f} compute {ms['compute']:.2f} "
        f"attention {ms['attention']:.2f} deltanet {ms['deltanet']:.2f} router {ms['router']:.2f} "
        f"shared {ms['shared']:.2f} tier {ms['tier']:.2f} lm_head {ms['lm_head']:.2f} other {ms['other']:.2f}"
    )
    segments = result.get("segments") or []
    if len(segments) > 1:  # a knob script: each setting's own figures (meters in percent, as JSON writes them)
        for seg in segments:
            m = seg["meters"]
            shown = " ".join(f"{k}={v}" for k, v in seg["set"].items()) or "start"
            lines.append(f"segment {seg['from']}-{seg['to']} ({shown}): RAM hit {_pct(m.get('ram_hit'))} "
                         f"shadow {_pct(m.get('shadow_hit'))} swap {_pct(m.get('swap'))} "
                         f"agree {_pct(m.get('route_agree'))}")
    return lines


def _pct(value) -> str:
    return "–" if value is None else f"{value:.1f}%"


def _show(result: dict, key: str) -> str:
    return METER_BY_KEY[key].show(result[key])
