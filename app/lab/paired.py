"""Paired runs: a row against its baseline, token by token, on the same tokens.

`trace_teacher_forced` runs a reference teacher-forced and keeps, for every
predicted token, the next-token distribution (log-probabilities, float32),
the NLL of the reference token and the top-1. `paired_metrics` compares two
traces of the same tokens:

- ``dnll``, ``dnll_lo``, ``dnll_hi``: mean Δ NLL (row − baseline, nats/token)
  and its paired bootstrap 95% interval (app/lab/bootstrap.py);
- ``agree``: share of tokens whose top-1 is the baseline's;
- ``kl_mean``, ``kl_p50``, ``kl_p99``: KL(baseline ‖ row) of the next-token
  distribution, nats, over the tokens;
- ``flips``: share of tokens where the baseline's top-1 had p > 0.5 and the
  row's top-1 differs (``flips_n``: how many);
- ``ram_hit``/``vram_hit`` and their deltas from the runs' meter folds.

`first_divergence` and `repeated_4grams` describe free generations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tierlab.app.lab.bootstrap import RESAMPLES, paired_bootstrap
from tierlab.app.lab.evaluate import teacher_forced_run
from tierlab.app.lab.knob_script import KnobStep

CONFIDENT = 0.5  # a baseline top-1 above this probability is a confident token


@dataclass
class Trace:
    """One teacher-forced run: per predicted token, its distribution and scores, and the run's meters."""

    logprobs: np.ndarray  # float32[N, V]
    nll: np.ndarray  # float64[N]
    top1: np.ndarray  # int64[N]
    tf_nll: float  # mean NLL as teacher_forced_run reports it
    meters: dict = field(default_factory=dict)  # RunMeters.summary of the run (rates as fractions)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log probabilities of one logits vector, in float64."""
    z = np.asarray(logits, dtype=np.float64).ravel()
    m = z.max()
    return z - (m + math.log(np.exp(z - m).sum()))


def trace_teacher_forced(engine, prompt: list[int], full: list[int],
                         steps: list[KnobStep] | None = None) -> Trace:
    """Teacher-force `full` after `prompt` (with a knob script `steps`), keeping every distribution."""
    n = len(full) - len(prompt)
    vocab = int(engine.config.vocab_size)
    logprobs = np.empty((n, vocab), dtype=np.float32)
    nll = np.empty(n, dtype=np.float64)
    top1 = np.empty(n, dtype=np.int64)

    def keep(t: int, logits: np.ndarray) -> None:
        lp = log_softmax(logits)
        logprobs[t] = lp[:vocab]
        nll[t] = -lp[full[len(prompt) + t]]
        top1[t] = int(np.argmax(lp))

    tf_nll, meters = teacher_forced_run(engine, prompt, full, steps, on_logits=keep)
    return Trace(logprobs, nll, top1, tf_nll, meters)


def _kl_rows(base: np.ndarray, row: np.ndarray, chunk: int = 64) -> np.ndarray:
    """KL(base‖row) per token from log-probabilities, in float64, a few tokens at a time (a
    release vocabulary makes the full float64 array large)."""
    out = np.empty(base.shape[0], dtype=np.float64)
    for start in range(0, base.shape[0], chunk):
        lb = base[start:start + chunk].astype(np.float64)
        lr = row[start:start + chunk].astype(np.float64)
        out[start:start + chunk] = (np.exp(lb) * (lb - lr)).sum(axis=1)
    return np.maximum(out, 0.0)  # rounding can leave a tiny negative for equal distributions


def _delta(row: float | None, base: float | None) -> float | None:
    if row is None or base is None:
        return None
    return row - base


def paired_metrics(base: Trace, row: Trace, seed: int = 0, resamples: int = RESAMPLES) -> dict:
    """The row's paired figures against the baseline (see the module docstring)."""
    if base.nll.shape != row.nll.shape:
        raise ValueError("paired traces must score the same tokens")
    diffs = row.nll - base.nll
    dnll, lo, hi = paired_bootstrap(diffs, resamples=resamples, seed=seed)
    kl = _kl_rows(base.logprobs, row.logprobs)
    same = row.top1 == base.top1
    top_p = np.exp(base.logprobs[np.arange(base.top1.size), base.top1].astype(np.float64))
    confident = top_p > CONFIDENT
    flips = confident & ~same
    n = max(int(diffs.size), 1)
    bm, rm = base.meters, row.meters
    return {
        "tokens": int(diffs.size),
        "nll": row.tf_nll,
        "dnll": dnll, "dnll_lo": lo, "dnll_hi": hi,
        "agree": float(same.sum()) / n,
        "kl_mean": float(kl.mean()) if kl.size else None,
        "kl_p50": float(np.percentile(kl, 50)) if kl.size else None,
        "kl_p99": float(np.percentile(kl, 99)) if kl.size else None,
        "flips": float(flips.sum()) / n, "flips_n": int(flips.sum()), "confident_n": int(confident.sum()),
        "ram_hit": rm.get("ram_hit"), "dram_hit": _delta(rm.get("ram_hit"), bm.get("ram_hit")),
        "vram_hit": rm.get("vram_hit"), "dvram_hit": _delta(rm.get("vram_hit"), bm.get("vram_hit")),
    }


def first_divergence(base: list[int], row: list[int]) -> int | None:
    """The first token index where two generations differ (None: identical)."""
    for i, (a, b) in enumerate(zip(base, row)):
        if a != b:
            return i
    return None if len(base) == len(row) else min(len(base), len(row))


def repeated_4grams(ids: list[int]) -> float | None:
    """Share of a generation's 4-grams that already occurred earlier in it (0: no loop; None: under 4 tokens)."""
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    if not grams:
        return None
    seen: set = set()
    repeated = 0
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / len(grams)
