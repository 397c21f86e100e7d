"""The shared expert of one decoded token in one compiled call: its SiLU-gated hidden row
from the router block's output, its down projection and its sigmoid gate.

Why: in decode these were three calls from Python (`shared_expert_inputs`, the down
projection's matvec, NumPy's gate multiply), and the Python between them cost cache
misses on the interpreter's state after the router block's weights had streamed
through the caches (docs/benchmarks.md, "What a call costs right after a streaming
one"). The same kernels run here from compiled code and the gate multiplies each
element once, as NumPy did, so the term's bits are those of the three calls
(tests/test_shared_step.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tierlab.engine.kernels.dense import shared_expert_inputs
from tierlab.engine.kernels.qmatvec import SET, _pass, _thread_count


@njit(nogil=True, cache=True)
def _shared_kernels(wd, sd, fused, start, size, h, gate, term, threads):
    shared_expert_inputs(fused, start, size, h, gate)
    _pass(wd, sd, wd, sd, h[0], term[0], SET, 1.0, threads)
    g = gate[0]
    row = term[0]
    for i in range(row.shape[0]):
        row[i] = row[i] * g


def shared_expert_step(w_down: tuple, fused: np.ndarray, start: int, size: int) -> np.ndarray:
    """sigmoid(gate) * down(silu(g) * u) for one token: float32[1, H], from the router block's
    output fused float32[1, E + 2S + 1] (router logits | g | u | gate logit), start = E,
    size = S, and the down projection as `qlinear.pass_operands` gives it."""
    wd, sd = w_down
    h = np.empty((1, size), dtype=np.float32)
    gate = np.empty(1, dtype=np.float32)
    term = np.empty((1, wd.shape[0]), dtype=np.float32)
    _shared_kernels(wd, sd, np.ascontiguousarray(fused, dtype=np.float32), start, size, h, gate, term, _thread_count())
    return term
