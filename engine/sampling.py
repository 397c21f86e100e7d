"""Choosing the next token: greedy, or temperature with nucleus (top-p) sampling."""

from __future__ import annotations

import numpy as np


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> None:
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
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
