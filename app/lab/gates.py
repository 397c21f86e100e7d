"""Quality gates: does a row's output stay close enough to the baseline's?

A setting that changes which experts run changes the output; a row passes
when the evidence says the change is small. Four gates, each on one paired
figure (the row against its baseline, token by token):

- ``dnll_hi``: the upper end of the 95% bootstrap interval of Δ NLL
  (row − baseline, nats/token) is at most ``dnll`` (default 0.02);
- ``agree``: top-1 agreement with the baseline's next token is at least
  ``agree`` (default 0.95);
- ``kl_p99``: the 99th percentile of KL(baseline ‖ row) of the next-token
  distribution is at most ``kl99`` nats (default 0.5);
- ``flips``: the share of tokens where the baseline's top-1 had p > 0.5 and
  the row's top-1 differs is at most ``flips`` (default 0.01).

A figure that was not measured (absent or None) is not judged: the verdict
lists it under ``unmeasured`` and the row still passes on what was measured.
`judge` is the one place a row's pass/fail is decided (ab, compare, replay
and sweep call it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from tierlab.engine.errors import TierlabError

#: metric key -> (gate field, "max" or "min", title)
GATE_METRICS: dict[str, tuple[str, str, str]] = {
    "dnll_hi": ("dnll", "max", "ΔNLL hi"),
    "agree": ("agree", "min", "agree"),
    "kl_p99": ("kl99", "max", "KL p99"),
    "flips": ("flips", "max", "flips"),
}


@dataclass(frozen=True)
class Gates:
    """The thresholds (see the module docstring for each gate's meaning and unit)."""

    dnll: float = 0.02
    agree: float = 0.95
    kl99: float = 0.5
    flips: float = 0.01

    def __post_init__(self) -> None:
        for name in ("dnll", "agree", "kl99", "flips"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TierlabError(f"--gate-{name}: {value!r} is not a finite number")
        if not 0.0 <= self.agree <= 1.0:
            raise TierlabError(f"--gate-agree: {self.agree} must be a fraction in [0, 1]")
        if not 0.0 <= self.flips <= 1.0:
            raise TierlabError(f"--gate-flips: {self.flips} must be a fraction in [0, 1]")
        if self.kl99 < 0:
            raise TierlabError(f"--gate-kl99: {self.kl99} must be >= 0")

    def as_dict(self) -> dict[str, float]:
        return {"dnll": self.dnll, "agree": self.agree, "kl99": self.kl99, "flips": self.flips}


@dataclass(frozen=True)
class GateVerdict:
    """Whether a row passed; the gates it failed and the figures it could not be judged on."""

    passed: bool
    failed: tuple[str, ...] = ()
    unmeasured: tuple[str, ...] = field(default=())

    def label(self) -> str:
        """'pass', 'FAIL agree,kl_p99', or 'pass (dnll_hi unmeasured)'."""
        if not self.passed:
            return "FAIL " + ",".join(self.failed)
        if self.unmeasured and len(self.unmeasured) == len(GATE_METRICS):
            return "–"
        return "pass"

    def as_dict(self) -> dict:
        return {"passed": self.passed, "failed": list(self.failed), "unmeasured": list(self.unmeasured)}


def judge(metrics: Mapping[str, float | None], gates: Gates) -> GateVerdict:
    """Judge a row's paired figures (keys ``dnll_hi``, ``agree``, ``kl_p99``, ``flips``) against `gates`."""
    failed: list[str] = []
    unmeasured: list[str] = []
    for key, (limit_name, sense, _title) in GATE_METRICS.items():
        value = metrics.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            unmeasured.append(key)
            continue
        limit = getattr(gates, limit_name)
        ok = value <= limit if sense == "max" else value >= limit
        if not ok:
            failed.append(key)
    return GateVerdict(not failed, tuple(failed), tuple(unmeasured))
