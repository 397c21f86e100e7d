"""The paired bootstrap: a confidence interval for the mean of per-token differences.

A row and its baseline score the same tokens, so their difference per token
is one sample; resampling tokens with replacement (seeded, numpy only) gives
the spread of the mean without assuming a distribution. The interval is the
percentile interval of the resampled means.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
_CHUNK = 256  # resamples drawn at once: bounds the index array at _CHUNK x n


def paired_bootstrap(diffs, resamples: int = RESAMPLES, seed: int = 0,
                     level: float = LEVEL) -> tuple[float, float, float]:
    """(mean, low, high) of the per-token differences `diffs`; an empty sample gives NaNs."""
    d = np.asarray(diffs, dtype=np.float64).ravel()
    n = d.size
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(d.mean())
    if np.all(d == d[0]):  # every resample has the same mean
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, _CHUNK):
        count = min(_CHUNK, resamples - start)
        idx = rng.integers(0, n, size=(count, n))
        means[start:start + count] = d[idx].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return mean, float(low), float(high)
