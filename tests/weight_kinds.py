"""Random projection weights of each storage kind the engine keeps (fp32, bf16, int8, int4),
as `checkpoint.load` gives them: a float32 or bf16 (uint16) array, or a QuantMatrix."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tierlab.engine import quant as Q
from tierlab.engine.qlinear import QuantMatrix

KINDS = ("fp32", "bf16", "int8", "int4")


def random_weights(kind: str, rows: int, cols: int, rng: np.random.Generator):
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if kind == "fp32":
        return w
    if kind == "bf16":
        return w.astype(ml_dtypes.bfloat16).view(np.uint16)
    bits = 4 if kind == "int4" else 8
    q, s = Q.quantize(w, bits)
    return QuantMatrix(Q.pack_int4(q) if bits == 4 else q.astype(np.int8), s, bits)
