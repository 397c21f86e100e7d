"""Choosing the next token: greedy, or temperature with nucleus (top-p) sampling."""

from __future__ import annotations

import math

import numpy as np

from tierlab.engine.errors import SettingError

SETTING_NAMES = ("temperature", "top_p", "seed")


def check_settings(temperature: float, top_p: float, seed: int, names: tuple[str, str, str] = SETTING_NAMES) -> None:
    """Refuse sampling settings numpy would reject or misuse; `names` are what the caller calls
    them (flags on the command line), so the one line names what the user typed."""
    t_name, p_name, s_name = names
    if not (math.isfinite(temperature) and temperature >= 0):
        raise SettingError(f"{t_name} must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise SettingError(f"{p_name} must be in (0, 1], got {top_p!r}")
    if isinstance(seed, bool) or int(seed) != seed or seed < 0:
        raise SettingError(f"{s_name} must be a non-negative integer, got {seed!r}")


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> None:
        check_settings(temperature, top_p, seed)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.rng = np.random.default_rng(seed)

    def pick(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.temperature == 0.0:
            return int(np.argmax(logits))
        z = logits / self.temperature
        z -= z.max()
        p = np.exp(z)
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, self.top_p) + 1)]
            mask = np.zeros_like(p)
            mask[keep] = p[keep]
            p = mask / mask.sum()
        return int(self.rng.choice(p.size, p=p))
