"""Replay: re-run a recorded session's token stream under other knobs, paired with the recording.

A session log (version 2) holds what a replay needs: the model's
fingerprint, the knobs at the start and every change with its token index,
the cache size and tier settings, and the token stream (prompt and generated
ids). `read_recording` takes these from a log; `run_replay` opens the model
(refusing one whose fingerprint differs), and teacher-forces the stream:

- the baseline: under the recorded knobs and their changes, where they were
  made (a change recorded before the pass that fed token T-1 is a
  `--knobs-at T` step here);
- each row: its knobs (and CACHE) from the first token.

Each row is paired with the baseline token by token (app/lab/paired.py) and
judged by the quality gates (app/lab/gates.py); then each runs a greedy free
generation from the prompt, as long as the recorded one, for the first
token where it leaves the baseline's generation and its share of repeated
4-grams. Every run starts from the same captured state (app/lab/arms.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tierlab.app.lab.ab import RowSpec, open_row_engine, parse_row
from tierlab.app.lab.abtable import knob_label
from tierlab.app.lab.arms import ArmState
from tierlab.app.lab.evaluate import greedy_decode
from tierlab.app.lab.gates import Gates, judge
from tierlab.app.lab.knob_script import CACHE_KEY, KnobStep
from tierlab.app.lab.paired import first_divergence, paired_metrics, repeated_4grams, trace_teacher_forced
from tierlab.engine.errors import FormatError, TierlabError
from tierlab.engine.fingerprint import model_fingerprint, short
from tierlab.engine.knobs import SPEC_BY_NAME, KnobError, Knobs, KnobValues, parse_value
from tierlab.engine.sessionlog import SessionLogWarning, read_session_log

BASELINE = "recorded"
#: Knob records that are not knobs: the app notes a RAM cache resize under this name.
CACHE_NOTES = ("cache_slots", CACHE_KEY)


@dataclass
class Recording:
    """What a replay takes from a session log."""

    path: Path
    model: Path
    fingerprint: str | None
    prompt: list[int]
    generated: list[int]
    knobs: KnobValues
    steps: list[KnobStep]
    engine: dict[str, str]  # engine settings (CACHE, TIER, ...) as an A/B row writes them
    sampling: dict = field(default_factory=dict)

    @property
    def full(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def label(self) -> str:
        changes = len(self.steps)
        return f"{BASELINE} ({knob_label(self.knobs.as_dict())}" + (f", {changes} changes)" if changes else ")")


def _knobs(path: Path, raw) -> KnobValues:
    if not isinstance(raw, dict):
        raise FormatError("header has no knobs", path)
    values = {}
    for name, value in raw.items():
        spec = SPEC_BY_NAME.get(name)
        if spec is None:
            raise FormatError(f"header knob {name} is unknown to this tierlab", path)
        try:
            values[name] = parse_value(spec, value)
        except KnobError as exc:
            raise FormatError(f"header knob {exc}", path) from None
    return KnobValues(**values)


def _stream(path: Path, log) -> tuple[list[int], list[int]]:
    if log.stream is not None:
        return list(log.stream["prompt_ids"]), list(log.stream["generated_ids"])
    if log.version >= 2:
        raise FormatError("no token stream record (the run did not end cleanly?); nothing to replay", path)
    # a version-1 log: the prompt is the first prefill, the generation the tokens the decode passes fed
    prompt = [int(t["token"]) for t in log.tokens if t.get("phase") == "prefill"]
    generated = [int(t["token"]) for t in log.tokens if t.get("phase") == "decode"]
    if any(t.get("phase") == "prefill" and int(t["index"]) != i for i, t in enumerate(log.tokens[: len(prompt)])):
        raise FormatError("more than one prompt in this log; replay reads one", path)
    return prompt, generated


def _steps(path: Path, log, prompt_len: int, generated_len: int) -> list[KnobStep]:
    """The recorded knob changes as a knob script over the generated tokens (a change after the
    last generated token changes nothing of the stream and is left out)."""
    steps = []
    for change in log.knob_changes:
        name, new = change["name"], change.get("new")
        at = int(change["at_token"])
        token = 0 if at < prompt_len else at - prompt_len + 1
        if token >= generated_len:
            continue
        if name in CACHE_NOTES:
            try:
                slots = int(new)
            except (TypeError, ValueError):
                raise FormatError(f"knob record {name}={new!r} is not a number of slots", path) from None
            steps.append(KnobStep(token, ((CACHE_KEY, slots),)))
            continue
        spec = SPEC_BY_NAME.get(name)
        if spec is None:
            raise FormatError(f"knob record names {name}, unknown to this tierlab", path)
        try:
            steps.append(KnobStep(token, ((name, parse_value(spec, new)),)))
        except KnobError as exc:
            raise FormatError(f"knob record {exc}", path) from None
    return sorted(steps, key=lambda s: s.at)


def _engine_settings(header: dict) -> dict[str, str]:
    settings: dict[str, str] = {}
    slots = (header.get("cache") or {}).get("ram_slots")
    if isinstance(slots, int) and slots > 0:
        settings["CACHE"] = str(slots)
    tier = header.get("tier") or {}
    if tier.get("enabled") or (not tier and (header.get("cache") or {}).get("gpu_tier")):
        settings["TIER"] = "1"
        if tier.get("budget") not in (None, "auto"):
            settings["TIER_GB"] = str(tier["budget"])
        if tier.get("device"):
            settings["TIER_DEVICE"] = str(tier["device"])
        if tier.get("warmstart") is False:
            settings["TIER_NO_WARMSTART"] = "1"
        heat = tier.get("heat_file")
        if heat and Path(heat).exists():  # plans the same warmstart; never written (arms freeze it)
            settings["HEAT_FILE"] = str(heat)
    return settings


def read_recording(path: str | Path, warn: Callable[[str], None] = lambda s: None) -> Recording:
    """The recording in a session log; FormatError (one line) for a log that cannot be replayed:
    not a log, truncated or damaged, without a token stream, or with settings this tierlab lacks."""
    path = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SessionLogWarning)
        log = read_session_log(path)
    if log.damage:
        raise FormatError(f"{log.damage}; replay needs a whole log", path)
    header = log.header
    prompt, generated = _stream(path, log)
    if not prompt or not generated:
        raise FormatError("the log's token stream has no prompt or no generated tokens; nothing to replay", path)
    model = (header.get("model") or {}).get("path")
    if log.fingerprint is None and log.version < 2:
        warn(f"{path}: a version-{log.version} log without a model fingerprint; "
             "the model it names cannot be checked")
    return Recording(path, Path(model) if isinstance(model, str) else None, log.fingerprint, prompt, generated,
                     _knobs(path, header.get("knobs")), _steps(path, log, len(prompt), len(generated)), _engine_settings(header),
                     dict(header.get("sampling") or {}))


def check_model(recording: Recording, model: Path | None) -> Path:
    """The model folder to replay on; refuses (one line) a missing one or one of another fingerprint."""
    folder = model or recording.model
    if folder is None:
        raise TierlabError(f"{recording.path}: the log names no model; pass --model DIR")
    if not Path(folder).is_dir():
        raise TierlabError(f"{recording.path}: model {folder} is not a folder here; pass --model DIR")
    if recording.fingerprint is not None:
        found = model_fingerprint(folder)
        if found != recording.fingerprint:
            raise TierlabError(f"{recording.path}: recorded on model {short(recording.fingerprint)}, "
                               f"but {folder} is model {short(found)}; replay refuses another model")
    return Path(folder)


def parse_rows(recording: Recording, texts: list[str]) -> list[RowSpec]:
    """The `--row` values over the recording's engine settings (a row may change CACHE or the tier)."""
    return [parse_row(text, recording.engine) for text in texts]


@dataclass
class ReplayRow:
    label: str
    metrics: dict
    verdict: object
    generated: list[int]

    def as_row(self) -> dict:
        return {"row": self.label, **self.metrics, "gate": self.verdict.label(),
                "gate_verdict": self.verdict.as_dict()}


def run_replay(recording: Recording, model: Path, row_texts: list[str], gates: Gates | None = None,
               seed: int = 0, resamples: int = 2000, generate: bool = True,
               progress: Callable[[str], None] = lambda s: None) -> list[ReplayRow]:
    """The baseline row (the recording's knobs and changes) and one row per `row_texts`."""
    gates = gates or Gates()
    specs = parse_rows(recording, row_texts)
    base_key = tuple(sorted(recording.engine.items()))
    arms: dict = {}
    engines: dict = {}
    try:
        def engine_for(key):
            if key not in engines:
                engines[key] = open_row_engine(model, key)
                arms[key] = ArmState.capture(engines[key])
            return engines[key], arms[key]

        runs = [(recording.label, base_key, recording.knobs, recording.steps)]
        runs += [(spec.label, spec.engine, spec.knobs, []) for spec in specs]
        rows: list[ReplayRow] = []
        baseline = None
        base_gen: list[int] | None = None
        for label, key, knobs, steps in runs:
            engine, arm = engine_for(key)
            progress(f"teacher-forced: {label}")
            engine.knobs = Knobs(knobs)
            arm.restore(engine)
            trace = trace_teacher_forced(engine, recording.prompt, recording.full, steps)
            baseline = baseline or trace
            metrics = paired_metrics(baseline, trace, seed=seed, resamples=resamples)
            generated: list[int] = []
            if generate:
                progress(f"free generation: {label}")
                engine.knobs = Knobs(knobs)
                arm.restore(engine)
                generated, _ = greedy_decode(engine, recording.prompt, len(recording.generated), steps)
                base_gen = generated if base_gen is None else base_gen
                metrics["diverge"] = first_divergence(base_gen, generated)
                metrics["rep4"] = repeated_4grams(generated)
            rows.append(ReplayRow(label, metrics, judge(metrics, gates), generated))
        return rows
    finally:
        for engine in engines.values():
            engine.close()

