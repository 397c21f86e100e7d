"""Quantised dense matrices: int8 / int4 projections outside the experts.

Why: quantising only the experts leaves most of a token's bytes in bf16. On
Qwen3.6-35B-A3B at int4 the attention, DeltaNet, shared-expert and lm_head
projections are 540 of the 664 MiB one token reads. `tierlab convert
--dense-bits 8|4` stores them in the experts' format (symmetric, groups of
64 along a row, float32 scale per group; int4 as planar nibbles), and the
engine multiplies them with the expert kernels. The router, the embedding
and every norm stay as they were: they are small, and the router's choice
is what cache-aware routing studies.

A `QuantMatrix` stands where a weight array stood; `linear()` in
kernels/dense.py dispatches on it. One token uses the int8/int4 matvec; a
prompt uses the matrix-matrix kernels: on a VNNI CPU the integer tiles of
kernels/dense_vnni.py, otherwise kernels/qmatmat.py, which widens each row
once for all its tokens; either way the weights are read once per block of
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierlab.engine import hugepages
from tierlab.engine.blob_layout import GROUP, quant_kind
from tierlab.engine.kernels import dense_vnni, qmatvec
from tierlab.engine.kernels.qmatmat import dequantize_rows, matmat
from tierlab.engine.quant import pack_weights, quantize_fast


@dataclass(frozen=True)
class QuantMatrix:
    """A [rows, cols] weight matrix stored as int8 or planar-nibble int4 with group scales."""

    q: np.ndarray  # int8 [rows, cols] (8 bits) or uint8 [rows, cols / 2] (4 bits)
    scales: np.ndarray  # float32 [rows, cols / 64]
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.scales.shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes

    @property
    def kind(self) -> str:
        return quant_kind(self.bits)

    def dequantize(self) -> np.ndarray:
        """The float32 matrix the kernels multiply with (q * scale, exactly)."""
        out = np.empty(self.shape, dtype=np.float32)
        dequantize_rows(self.q, self.scales, out)
        return out


def quantize_matrix(w: np.ndarray, bits: int) -> QuantMatrix:
    """Quantise a float matrix (float32 / bf16-as-float32) the way `convert` does."""
    q, s = quantize_fast(w, bits)
    packed = pack_weights(q, bits).reshape(q.shape[0], -1)
    return QuantMatrix(np.ascontiguousarray(packed if bits == 4 else packed.view(np.int8)), s, bits)


def check_quant_parts(q: np.ndarray, scales: np.ndarray, shape: tuple[int, int] | None) -> str | None:
    """Why a (q, scales) pair is not a valid quantised matrix (of `shape`), or None."""
    if q.ndim != 2 or scales.ndim != 2 or scales.dtype != np.float32:
        return "needs a 2-D qweight and a 2-D float32 qscales"
    if q.dtype not in (np.int8, np.uint8):
        return f"qweight must be I8 (int8) or U8 (int4), got {q.dtype}"
    rows, cols = q.shape[0], scales.shape[1] * GROUP
    per_row = cols if q.dtype == np.int8 else cols // 2
    if scales.shape[0] != rows or q.shape[1] != per_row:
        return f"qweight {list(q.shape)} and qscales {list(scales.shape)} do not describe one matrix"
    if shape is not None and (rows, cols) != tuple(shape):
        return f"is {rows}x{cols} but config.json implies {shape[0]}x{shape[1]}"
    if not np.all(np.isfinite(scales)):
        return "qscales holds NaN or infinity"
    return None


def qlinear(m: QuantMatrix, x: np.ndarray) -> np.ndarray:
    """x @ dequant(m).T for one token x [cols] or several x [T, cols]."""
    if x.ndim == 1 or x.shape[0] == 1:
        out = np.empty(m.shape[0], dtype=np.float32)
        matvec = qmatvec.matvec_int8 if m.bits == 8 else qmatvec.matvec_int4
        matvec(m.q, m.scales, np.ascontiguousarray(x.reshape(-1), dtype=np.float32), out)
        return out if x.ndim == 1 else out[None, :]
    if dense_vnni.usable(*m.shape):  # integer tiles, 16 rows to a vector
        out = np.empty((x.shape[0], m.shape[0]), dtype=np.float32)
        dense_vnni.matmat_integer(m.q, m.scales, np.ascontiguousarray(x, dtype=np.float32), out)
        return out
    return matmat(m.kind, (m.q, m.scales), x)


def pass_operands(w) -> tuple[np.ndarray, np.ndarray] | None:
    """A weight matrix as `qmatvec._pass` takes it (quantised: weights and scales; bf16 or float32:
    the matrix twice), or None where one pass cannot take it (a RowStack of mixed kinds)."""
    if isinstance(w, QuantMatrix):
        return w.q, w.scales
    if isinstance(w, np.ndarray) and w.ndim == 2 and w.dtype in (np.uint16, np.float32) and w.flags.c_contiguous:
        return w, w
    return None


def fuse_quant(mats: list[QuantMatrix]) -> QuantMatrix:
    """Stack quantised matrices of one kind that multiply the same input (one kernel pass)."""
    return QuantMatrix(hugepages.concat_rows([m.q for m in mats]),
                       hugepages.concat_rows([m.scales for m in mats]), mats[0].bits)


class RowStack:
    """Row blocks of different storage kinds that multiply the same input.

    Why: the MoE block fuses the router (kept in bf16) with the shared expert's
    projections (quantised with --dense-bits); the output is the blocks'
    outputs side by side, as if they were one matrix.
    """

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        # a token's product in one launch (qmatvec.matvec_stack) where the parts allow it
        self.one_launch = qmatvec.stack_parts(parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def first_rows(self, n: int):
        """The first n rows, when they are exactly the first part (the router)."""
        return self.parts[0] if self.parts[0].shape[0] == n else None
