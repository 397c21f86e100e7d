"""Refusing weights that hold NaN or infinity, once, when they are read.

A NaN in an embedding, a router or an expert does not fail where it is:
it spreads through every later token and ends in a division by zero or a
compiled kernel's exception far from the file that caused it. The check
runs where a tensor is loaded (or an expert first read, or a checkpoint
converted), never per token. It looks only at the exponent bits (all ones
means NaN or infinity) in pieces of a few MiB, so it costs one pass over
the bytes and no large temporaries; bf16 is checked in its uint16 storage.
"""

from __future__ import annotations

import numpy as np

from tierlab.engine.errors import ModelError

#: per float storage dtype: the integer view and the mask of its exponent bits
_EXPONENT = {
    "F32": (np.uint32, 0x7F800000),
    "BF16": (np.uint16, 0x7F80),
    "F16": (np.uint16, 0x7C00),
    "F64": (np.uint64, 0x7FF0000000000000),
}
_PIECE = 1 << 20  # elements per piece


def count_nonfinite(arr: np.ndarray, dtype: str) -> int:
    """How many elements of `arr` (storage dtype `dtype`: F32, BF16 as uint16, F16, F64) are NaN or ±inf."""
    spec = _EXPONENT.get(dtype)
    if spec is None or arr.size == 0:
        return 0
    view_dtype, mask = spec
    bits = np.ascontiguousarray(arr).reshape(-1).view(view_dtype)
    mask = view_dtype(mask)
    bad = 0
    scratch = np.empty(min(bits.size, _PIECE), dtype=view_dtype)
    for start in range(0, bits.size, _PIECE):
        piece = bits[start:start + _PIECE]
        out = scratch[: piece.size]
        np.bitwise_and(piece, mask, out=out)
        bad += int(np.count_nonzero(out == mask))
    return bad


def require_finite(arr: np.ndarray, dtype: str, what: str, path) -> None:
    """ModelError naming `what` in `path` if any element is NaN or infinite."""
    bad = count_nonfinite(arr, dtype)
    if bad:
        raise ModelError(f"{what}: {bad} NaN/Inf value{'s' if bad != 1 else ''} (a model's weights must be finite)",
                         path)


def float_kind(arr: np.ndarray) -> str | None:
    """The storage-dtype name `count_nonfinite` takes for a numpy float array (None for others)."""
    return {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16"}.get(arr.dtype)
