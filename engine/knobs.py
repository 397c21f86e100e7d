"""The levers of tierlab in one object.

Every lever is an environment variable with the name and default that
docs/guide.md ("Knobs and their defaults") lists. The engine
takes a snapshot at the start of each token, so a change made from another
thread (the terminal app's sliders) applies at the next token and never in
the middle of one. Changes are numbered and handed to listeners so that
session logs and plots can mark them.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass, fields
from typing import Callable, Mapping

ROUTE_MODES = ("maxrank", "cumprob", "prior")


class KnobError(ValueError):
    """A knob was given a value it cannot take (one line, names the knob)."""


@dataclass(frozen=True)
class KnobSpec:
    name: str
    kind: type  # int, float, bool or str
    default: object
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] | None = None
    help: str = ""


SPECS: tuple[KnobSpec, ...] = (
    KnobSpec("CACHE_ROUTE", bool, False, help="1 turns cache-aware routing on"),
    KnobSpec("ROUTE_J", int, 2, 0, None, help="true top-J experts are always taken"),
    KnobSpec("ROUTE_M", int, 12, 1, None, help="rank window in which resident experts are preferred"),
    KnobSpec("ROUTE_P", float, 0.0, 0.0, 1.0, help="0<P<1: window by cumulative probability mass instead of M"),
    KnobSpec("ROUTE_ALPHA", float, 1.0, 0.0, 1.0, help="0<alpha<1: scale a substitute's mass before renormalising"),
    KnobSpec("ROUTE_AGREE", str, "auto", choices=("auto", "0", "1"), help="agreement/KL meters; auto = on with CACHE_ROUTE"),
    KnobSpec("ROUTE_MODE", str, "maxrank", choices=ROUTE_MODES, help="maxrank (M window), cumprob (P window) or prior (Cache-Prior)"),
    KnobSpec("ROUTE_LAMBDA", float, 0.2, 0.0, 2.0, help="Cache-Prior logit bias, in units of the layer's logit range"),
    KnobSpec("PILOT", int, 0, 0, 3, help="prefetch experts 1..3 layers ahead into the RAM cache"),
    KnobSpec("WIDE", int, 1, 1, 8, help="PILOT takes at most K*WIDE experts per layer"),
    KnobSpec("SMOOTH", float, 0.3, 0.0, 1.0, help="PILOT blend with the per-layer logit EMA"),
    KnobSpec("CONF_LIMIT", float, 0.92, 0.0, 1.0, help="PILOT takes experts until their mass reaches this"),
    KnobSpec("HOT", int, 0, 0, None, help="pin the n most-routed experts per layer after WARMUP tokens"),
    KnobSpec("WARMUP", int, 5, 0, None, help="tokens before HOT pins"),
    KnobSpec("PREFILL_EXACT", bool, False,
             help="1: a prompt's experts and DeltaNet give each token exactly what decode gives it (slower prefill; attention does either way)"),
)
SPEC_BY_NAME = {s.name: s for s in SPECS}


def parse_value(spec: KnobSpec, raw: object) -> object:
    """Turn a string (environment, CLI) or Python value into the knob's type, or raise KnobError."""
    try:
        if spec.kind is bool:
            if isinstance(raw, str):
                low = raw.strip().lower()
                if low in ("1", "true", "on", "yes"):
                    value: object = True
                elif low in ("0", "false", "off", "no", ""):
                    value = False
                else:
                    raise ValueError(raw)
            else:
                value = bool(raw)
        elif spec.kind is int:
            value = int(raw) if not isinstance(raw, str) else int(raw.strip())
        elif spec.kind is float:
            value = float(raw)
        else:
            value = str(raw).strip()
    except (TypeError, ValueError):
        raise KnobError(f"{spec.name}: cannot read {raw!r} as {spec.kind.__name__}") from None
    if spec.choices is not None and value not in spec.choices:
        raise KnobError(f"{spec.name}: {value!r} is not one of {', '.join(spec.choices)}")
    if spec.lo is not None and value < spec.lo:  # type: ignore[operator]
        raise KnobError(f"{spec.name}: {value} is below {spec.lo}")
    if spec.hi is not None and value > spec.hi:  # type: ignore[operator]
        raise KnobError(f"{spec.name}: {value} is above {spec.hi}")
    return value


@dataclass(frozen=True)
class KnobValues:
    """An immutable snapshot: what one token runs with."""

    CACHE_ROUTE: bool = False
    ROUTE_J: int = 2
    ROUTE_M: int = 12
    ROUTE_P: float = 0.0
    ROUTE_ALPHA: float = 1.0
    ROUTE_AGREE: str = "auto"
    ROUTE_MODE: str = "maxrank"
    ROUTE_LAMBDA: float = 0.2
    PILOT: int = 0
    WIDE: int = 1
    SMOOTH: float = 0.3
    CONF_LIMIT: float = 0.92
    HOT: int = 0
    WARMUP: int = 5
    PREFILL_EXACT: bool = False

    @property
    def meters_on(self) -> bool:
        """Agreement/KL meters: ROUTE_AGREE=1, or auto with the lever on."""
        if self.ROUTE_AGREE == "1":
            return True
        if self.ROUTE_AGREE == "0":
            return False
        return self.CACHE_ROUTE

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def changed_from_default(self) -> dict[str, object]:
        return {s.name: getattr(self, s.name) for s in SPECS if getattr(self, s.name) != s.default}


assert [f.name for f in fields(KnobValues)] == [s.name for s in SPECS]


@dataclass
class KnobChange:
    seq: int
    name: str
    old: object
    new: object


class Knobs:
    """Thread-safe, live-changeable knobs with change notification."""

    def __init__(self, values: KnobValues | None = None) -> None:
        self._values = values or KnobValues()
        self._lock = threading.Lock()
        self._seq = 0
        self._listeners: list[Callable[[KnobChange], None]] = []

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> "Knobs":
        """Read every knob from the environment; overrides (e.g. CLI flags, None = unset) win."""
        env = os.environ if env is None else env
        updates: dict[str, object] = {}
        for spec in SPECS:
            if spec.name in env:
                updates[spec.name] = parse_value(spec, env[spec.name])
        for name, raw in overrides.items():
            if raw is None:
                continue
            spec = SPEC_BY_NAME.get(name)
            if spec is None:
                raise KnobError(f"unknown knob {name}")
            updates[name] = parse_value(spec, raw)
        return cls(dataclasses.replace(KnobValues(), **updates))

    @classmethod
    def from_assignments(cls, text: str) -> "Knobs":
        """Parse 'CACHE_ROUTE=1 ROUTE_J=4' (an A/B row); 'off' or '' means all defaults."""
        env: dict[str, str] = {}
        for word in text.split():
            if word.lower() in ("off", "default", "baseline"):
                continue
            if "=" not in word:
                raise KnobError(f"row {text!r}: {word!r} is not NAME=VALUE")
            name, _, raw = word.partition("=")
            if name not in SPEC_BY_NAME:
                raise KnobError(f"row {text!r}: unknown knob {name}")
            env[name] = raw
        return cls.from_env(env)

    @property
    def seq(self) -> int:
        """Number of the last change (0 = none yet): events carry it so plots can mark changes."""
        return self._seq

    def snapshot(self) -> KnobValues:
        return self._values

    def versioned(self) -> tuple[int, KnobValues]:
        """The snapshot and the number of the last change it includes, read together."""
        with self._lock:
            return self._seq, self._values

    def get(self, name: str) -> object:
        return getattr(self._values, name)

    def set(self, name: str, raw: object) -> KnobChange | None:
        """Change one knob; returns the change (None if the value is the same)."""
        spec = SPEC_BY_NAME.get(name)
        if spec is None:
            raise KnobError(f"unknown knob {name}")
        value = parse_value(spec, raw)
        with self._lock:
            old = getattr(self._values, name)
            if old == value:
                return None
            self._values = dataclasses.replace(self._values, **{name: value})
            self._seq += 1
            change = KnobChange(self._seq, name, old, value)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(change)
        return change

    def reset(self) -> list[KnobChange]:
        """Every knob back to its default; returns the changes made."""
        changes = []
        for spec in SPECS:
            change = self.set(spec.name, spec.default)
            if change is not None:
                changes.append(change)
        return changes

    def subscribe(self, listener: Callable[[KnobChange], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[KnobChange], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)
