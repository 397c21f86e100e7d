"""A/B runs: rows of settings, one table.

Protocol: every run of every row starts from the same state (a clean arm,
app/lab/arms.py: the residency and heat captured once when the row's engine
opened, restored after a cold start; HEAT_FILE is never written); the first run of each row is a discarded warm-up whose routing
meters are kept (they are deterministic); then `repeat` rounds run the rows
interleaved, so a noisy neighbour hurts every row alike, and the timing
columns are their median with a min-max band; finally each row
teacher-forces the reference once for its TF-NLL, paired token by token
with the first row (the baseline: app/lab/paired.py) and judged by the
quality gates (app/lab/gates.py).

A knob script (`--knobs-at`) runs inside every run of every row, on top of
the row's settings; a row keeps the segments of its warm-up run and of its
teacher-forced run.

A row is `NAME=VALUE` words. Knobs (CACHE_ROUTE, ROUTE_J, ...) change per
run on one engine; engine settings (CACHE, TIER, TIER_GB, TIER_DEVICE,
HEAT_FILE, TIER_NO_WARMSTART) get an engine of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tierlab.engine.errors import TierlabError
from tierlab.app.lab.arms import ArmState
from tierlab.app.lab.evaluate import greedy_decode
from tierlab.app.lab.gates import Gates, GateVerdict, judge
from tierlab.app.lab.paired import paired_metrics, trace_teacher_forced
from tierlab.app.lab.oracle import SIZE_KEYS
from tierlab.app.lab.knob_script import KnobStep
from tierlab.engine.knobs import SPEC_BY_NAME, Knobs, KnobValues
from tierlab.engine.options import EngineOptions
from tierlab.engine.tiering import TierOptions
from tierlab.engine.tiers.opencl_device import parse_budget

ENGINE_SETTINGS = ("CACHE", "TIER", "TIER_GB", "TIER_DEVICE", "HEAT_FILE", "TIER_NO_WARMSTART")
BAND_KEYS = tuple(key for key, _ in SIZE_KEYS)  # the oracle band's LRU figures in each row
LEDGER_KEYS = ("prefetch_precision", "prefetch_recall", "prefetch_ahead", "prefetch_bytes_per_saved")
PAIRED_KEYS = ("dnll", "dnll_lo", "dnll_hi", "agree", "kl_mean", "kl_p50", "kl_p99", "flips")


@dataclass
class RowSpec:
    label: str
    knobs: KnobValues
    engine: tuple[tuple[str, str], ...] = ()  # sorted engine settings


@dataclass
class RowResult:
    spec: RowSpec
    meters: dict = field(default_factory=dict)  # the generation's (RunMeters.summary: rates as fractions)
    tok_s: list[float] = field(default_factory=list)
    fetch_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    matching: int = 0
    total: int = 0
    tf_nll: float | None = None
    tf_meters: dict = field(default_factory=dict)  # the routing meters of the teacher-forced run
    segments: list = field(default_factory=list)  # the warm-up run's segments (one per knob setting)
    tf_segments: list = field(default_factory=list)  # the teacher-forced run's segments
    paired: dict = field(default_factory=dict)  # the TF run against the first row's (app/lab/paired.py)
    verdict: GateVerdict | None = None  # the quality gates on `paired`

    def as_row(self, meters_from: str = "generation") -> dict:
        """A table row; `meters_from="teacher_forced"` takes hit rates and routing meters from the
        teacher-forced run (real text) instead of the greedy generation (which may loop)."""
        m = self.tf_meters if meters_from == "teacher_forced" else self.meters
        lever = self.spec.knobs.CACHE_ROUTE
        meters_on = self.spec.knobs.meters_on
        return {
            "row": self.spec.label,
            "tok_s": self.tok_s, "fetch_ms": self.fetch_ms, "compute_ms": self.compute_ms,
            "ram_hit": m["ram_hit"],
            "shadow_hit": m.get("shadow_hit"),
            "vram_hit": m["vram_hit"],
            "oracle_hit": m["oracle_hit"],
            **{key: m.get(key) for key in BAND_KEYS + LEDGER_KEYS}, "lru_sizes": m.get("lru_sizes"),
            "swap": m["swap"] if lever else None,
            "route_agree": m["route_agree"] if meters_on else None,
            "route_kl": m["route_kl"] if meters_on else None,
            "ids_match": f"{self.matching}/{self.total}",
            "tf_nll": self.tf_nll,
            **{key: self.paired.get(key) for key in PAIRED_KEYS},
            "gate": self.verdict.label() if self.verdict is not None else None,
            "segments": self.tf_segments if meters_from == "teacher_forced" else self.segments,
        }


def parse_row(text: str, default_engine: dict[str, str]) -> RowSpec:
    knob_env: dict[str, str] = {}
    engine = dict(default_engine)
    for word in text.split():
        if word.lower() in ("off", "default", "baseline"):
            continue
        name, sep, value = word.partition("=")
        if not sep:
            raise TierlabError(f"row {text!r}: {word!r} is not NAME=VALUE")
        if name in SPEC_BY_NAME:
            knob_env[name] = value
        elif name in ENGINE_SETTINGS:
            engine[name] = value
        else:
            raise TierlabError(f"row {text!r}: unknown setting {name}")
    _check_engine_settings(text, engine)
    knobs = Knobs.from_env(knob_env).snapshot()
    return RowSpec(text.strip() or "off", knobs, tuple(sorted(engine.items())))


def _check_engine_settings(text: str, engine: dict[str, str]) -> None:
    """Refuse a row's unreadable engine settings before any row runs."""
    cache = engine.get("CACHE")
    if cache:
        try:
            slots = int(cache)
        except ValueError:
            slots = 0
        if slots < 1:
            raise TierlabError(f"row {text!r}: CACHE={cache} must be a positive whole number of slots")
    try:
        parse_budget(engine.get("TIER_GB"))
    except ValueError as exc:
        raise TierlabError(f"row {text!r}: {exc}") from None


def open_row_engine(model_dir: Path, settings: tuple[tuple[str, str], ...]):
    """An engine with a row's settings; its knobs start at their defaults (each run sets its own)."""
    env = dict(settings)
    cache = int(env["CACHE"]) if env.get("CACHE") else None
    tier = TierOptions.from_env({k: v for k, v in env.items() if k != "CACHE"})
    return EngineOptions(model_dir, cache, tier, knobs_from_env=False).open(with_tokenizer=False)


def _run_once(engine, arm: ArmState, spec: RowSpec, prompt, full,
              steps: list[KnobStep] | None) -> tuple[dict, list[int]]:
    engine.knobs = Knobs(spec.knobs)
    arm.restore(engine)
    generated, meters = greedy_decode(engine, prompt, len(full) - len(prompt), steps)
    return meters, generated


def run_ab(model_dir: str | Path, prompt: list[int], full: list[int], row_texts: list[str], repeat: int = 3,
           default_engine: dict[str, str] | None = None, tf_nll: bool = True,
           progress: Callable[[str], None] = lambda s: None,
           steps: list[KnobStep] | None = None, gates: Gates | None = None,
           seed: int = 0) -> list[RowResult]:
    """Run every row; returns one RowResult per row, in the order given. With `tf_nll`, each
    row's teacher-forced run is paired with the first row's and judged by `gates`; `seed`
    seeds the bootstrap of the Δ NLL interval."""
    specs = [parse_row(t, default_engine or {}) for t in row_texts]
    engines: dict = {}
    arms: dict = {}
    try:
        for spec in specs:
            if spec.engine not in engines:
                engines[spec.engine] = open_row_engine(Path(model_dir), spec.engine)
                arms[spec.engine] = ArmState.capture(engines[spec.engine])
        results = [RowResult(s) for s in specs]
        reference = full[len(prompt):]
        for res in results:  # warm-up: discarded timings, kept routing meters
            progress(f"warm-up: {res.spec.label}")
            meters, generated = _run_once(engines[res.spec.engine], arms[res.spec.engine], res.spec, prompt, full,
                                          steps)
            res.meters = meters
            res.segments = meters["segments"]
            res.total = len(reference)
            res.matching = sum(int(a == b) for a, b in zip(generated, reference))
        for r in range(repeat):
            for res in results:
                progress(f"round {r + 1}/{repeat}: {res.spec.label}")
                meters, _ = _run_once(engines[res.spec.engine], arms[res.spec.engine], res.spec, prompt, full, steps)
                res.tok_s.append(meters["tok_s"])
                res.fetch_ms.append(meters["fetch_ms"])
                res.compute_ms.append(meters["compute_ms"])
        if tf_nll:
            baseline = None
            for res in results:
                progress(f"TF-NLL: {res.spec.label}")
                engine = engines[res.spec.engine]
                engine.knobs = Knobs(res.spec.knobs)
                arms[res.spec.engine].restore(engine)
                trace = trace_teacher_forced(engine, prompt, full, steps)
                baseline = baseline or trace
                res.tf_nll, res.tf_meters = trace.tf_nll, trace.meters
                res.tf_segments = res.tf_meters["segments"]
                res.paired = paired_metrics(baseline, trace, seed=seed)
                res.verdict = judge(res.paired, gates or Gates())
        return results
    finally:
        for engine in engines.values():
            engine.close()
