"""Scripted knob changes (`--knobs-at "T:KEY=V[,KEY=V]"`) and the segments they cut a run into.

A script is a list of steps, each "before token T, set these knobs". T
counts the tokens a run produces, from 0: in a generation the generated
tokens, in teacher forcing the reference tokens after the prompt. Token 0
is predicted by the prompt's pass (so a step at 0 is a setting from the
start); token T > 0 by the decode pass that feeds token T-1, which is the
first pass to run with the step's knobs.

A step changes knobs as the app's sliders do: `engine.knobs.set` (a live
change that the engine takes at its next token, numbered and heard by every
listener), and `CACHE=N` resizes the RAM cache with `set_cache_slots`.

`ScriptedRun` applies a script to one run and records one segment per knob
setting: its token range, its knobs and cache size, and the meters of the
"since knob change" window of `WindowedMeters` at the segment's end.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from tierlab.engine.errors import TierlabError
from tierlab.engine.knobs import SPEC_BY_NAME, KnobError, parse_value
from tierlab.engine.meters import WindowedMeters, meters_json, read_store_counters

CACHE_KEY = "CACHE"
"""The step key that resizes the RAM cache (slots per layer) instead of setting a knob."""

KNOBS_AT_HELP = (
    'before token T, set knobs: "T:KEY=V[,KEY=V]" (repeatable). T counts the tokens this run produces, from 0 '
    "(generated tokens; in teacher forcing the reference tokens after the prompt): token 0 comes from the "
    "prompt's pass, token T>0 from the decode pass that feeds token T-1, the first to run with the new knobs. "
    "KEY is a knob (CACHE_ROUTE, ROUTE_J, ...) or CACHE (RAM cache slots per layer). "
    "--json prints one segment per knob setting"
)


@dataclass(frozen=True)
class KnobStep:
    """Before token `at`, set these knobs (in the order given)."""

    at: int
    settings: tuple[tuple[str, object], ...]


def parse_knobs_at(text: str) -> KnobStep:
    """One `--knobs-at` value, checked; raises TierlabError (one line) for a bad one."""
    where = f"--knobs-at {text!r}"
    head, sep, body = text.partition(":")
    if not sep or not body.strip():
        raise TierlabError(f"{where}: expected T:KEY=V[,KEY=V]")
    if not re.fullmatch(r"\s*\d+\s*", head):
        raise TierlabError(f"{where}: token {head.strip()!r} is not a whole number >= 0")
    settings = []
    for item in body.split(","):
        name, eq, raw = item.strip().partition("=")
        name, raw = name.strip(), raw.strip()
        if not eq or not name or not raw:
            raise TierlabError(f"{where}: {item.strip()!r} is not KEY=V")
        if name == CACHE_KEY:
            if not re.fullmatch(r"\d+", raw) or int(raw) < 1:
                raise TierlabError(f"{where}: CACHE must be a whole number of slots >= 1, not {raw!r}")
            settings.append((name, int(raw)))
            continue
        spec = SPEC_BY_NAME.get(name)
        if spec is None:
            raise TierlabError(f"{where}: unknown knob {name}")
        try:
            value = parse_value(spec, raw)
        except KnobError as exc:
            raise TierlabError(f"{where}: {exc}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise TierlabError(f"{where}: {name}: {raw!r} is not a finite number")
        settings.append((name, value))
    return KnobStep(int(head), tuple(settings))


def parse_script(texts: list[str] | None) -> list[KnobStep]:
    """Every `--knobs-at` value, in token order (steps at one token keep the order given)."""
    steps = [parse_knobs_at(t) for t in texts or ()]
    return sorted(steps, key=lambda step: step.at)


def _shown(value: object) -> object:
    return int(value) if isinstance(value, bool) else value


class ScriptedRun:
    """One run under a script: applies its steps, cuts the run into segments.

    Create it right before the run's first pass (it applies the steps at
    token 0), call `before(T)` before the pass that predicts token T, and
    `finish(end)` after the last token: it returns the segments and puts the
    knobs and the cache back as they were, so the next run starts alike.
    """

    def __init__(self, engine, steps: list[KnobStep]) -> None:
        self.engine = engine
        self.steps = list(steps)
        self.initial_knobs = engine.knobs.snapshot()
        self.initial_slots = engine.cache_slots()
        self.meters = WindowedMeters(baseline=read_store_counters(engine))
        self.segments: list[dict[str, Any]] = []
        self._first = 0
        self._set: dict[str, object] = {}
        self._next = 0
        engine.subscribe(self.meters.add)
        self._apply(0)
        self._set = self._pending

    def _setting(self) -> tuple[int, int]:
        return self.engine.knobs.seq, self.engine.cache_slots()

    def _apply(self, token: int) -> bool:
        """Apply the steps due at `token`; whether the knob setting changed."""
        before = self._setting()
        self._pending: dict[str, object] = {}
        while self._next < len(self.steps) and self.steps[self._next].at <= token:
            for name, value in self.steps[self._next].settings:
                if name == CACHE_KEY:
                    self.engine.set_cache_slots(int(value))
                else:
                    self.engine.knobs.set(name, value)
                self._pending[name] = _shown(value)
            self._next += 1
        return self._setting() != before

    def before(self, token: int) -> None:
        """Apply the steps at `token`; a new setting closes the segment before it."""
        if self._next >= len(self.steps) or self.steps[self._next].at > token:
            return
        first_knobs, first_slots = self.engine.knobs.snapshot(), self.engine.cache_slots()
        if self._apply(token):
            self._close(token, first_knobs, first_slots)
            self._first = token
            self._set = self._pending
        else:
            self._set.update(self._pending)

    def _close(self, end: int, knobs, slots: int) -> None:
        meters = meters_json(self.meters.summary("knob", knobs))
        self.segments.append({"from": self._first, "to": end, "set": dict(self._set),
                              "knobs": {k: _shown(v) for k, v in knobs.as_dict().items()},
                              "cache_slots": slots, "meters": meters})

    def finish(self, end: int) -> list[dict[str, Any]]:
        """Close the last segment, stop listening, restore the knobs and the cache; the segments."""
        self._close(end, self.engine.knobs.snapshot(), self.engine.cache_slots())
        self.engine.unsubscribe(self.meters.add)
        for name, value in self.initial_knobs.as_dict().items():
            self.engine.knobs.set(name, value)
        if self.engine.cache_slots() != self.initial_slots:
            self.engine.set_cache_slots(self.initial_slots)
        return self.segments
