"""Reference (numpy) group quantisation for the tierlab expert container.

Why: the numba kernels and the OpenCL tier must agree byte for byte with one
readable definition of the format. These helpers are that definition; they are
written for clarity and exactness (float64 where it matters), not for speed.
A compiled twin at the end (quantize_fast, build_blob_fast) gives the same
bytes fast enough for the converter.

Format summary (see docs/formats.md, "Quantised expert container"):
- symmetric per group of ``GROUP`` (64) consecutive columns of a row;
- int8: scale = absmax/127, q = round(w/scale) in [-127, 127], one signed byte;
- int4: scale = absmax/7, q = round(w/scale) in [-8, 7], stored "planar": per
  group 32 bytes, byte j = (q[j]+8) | ((q[j+32]+8) << 4);
- a zero group has scale 0 and q 0; dequantised weight = q * scale.
- one expert blob = [q(gate) | q(up) | q(down) | scales(gate) | scales(up) |
  scales(down)], scales float32 little-endian, rows x (cols/64) row-major
  (offsets: `tierlab.engine.blob_layout.BlobLayout`).
"""

from __future__ import annotations

import numpy as np

from tierlab.engine.blob_layout import GROUP, BlobLayout, check_dims, quant_kind

QMAX = {8: 127, 4: 7}
QMIN = {8: -127, 4: -8}


def quantize(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a [rows, cols] matrix; returns (q int8 [rows, cols], scales float32 [rows, cols/64]).

    The scale is rounded to float32 first and q is computed against that
    float32 scale, so dequantising with the stored scale is what we quantised to.
    """
    if bits not in QMAX:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    w = np.asarray(w, dtype=np.float64)
    rows, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"columns ({cols}) must be a multiple of {GROUP}")
    g = w.reshape(rows, cols // GROUP, GROUP)
    absmax = np.abs(g).max(axis=2)
    scales = (absmax / QMAX[bits]).astype(np.float32)
    s64 = scales.astype(np.float64)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s64 > 0, np.rint(g / np.where(s64 > 0, s64, 1.0)), 0.0)
    q = np.clip(q, QMIN[bits], QMAX[bits]).astype(np.int8).reshape(rows, cols)
    return q, scales


def dequantize(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Exact float64 weights q * scale of a [rows, cols] matrix."""
    rows, cols = q.shape
    g = q.astype(np.float64).reshape(rows, cols // GROUP, GROUP)
    return (g * scales.astype(np.float64)[:, :, None]).reshape(rows, cols)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Planar nibbles: [rows, cols] int8 in [-8, 7] -> uint8 [rows, cols/2]."""
    rows, cols = q.shape
    u = (q.astype(np.int16) + 8).astype(np.uint8).reshape(rows, cols // GROUP, GROUP)
    lo, hi = u[:, :, : GROUP // 2], u[:, :, GROUP // 2 :]
    return (lo | (hi << 4)).reshape(rows, cols // 2)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack_int4: uint8 [rows, cols/2] -> int8 [rows, cols]."""
    rows, half = packed.shape
    b = packed.reshape(rows, half * 2 // GROUP, GROUP // 2)
    lo = (b & 0x0F).astype(np.int8) - 8
    hi = (b >> 4).astype(np.int8) - 8
    return np.concatenate([lo, hi], axis=2).reshape(rows, half * 2)


def pack_weights(q: np.ndarray, bits: int) -> np.ndarray:
    """Section-1 bytes of one matrix."""
    if bits == 4:
        return pack_int4(q)
    return q.astype(np.int8).view(np.uint8)


def unpack_weights(raw: np.ndarray, rows: int, cols: int, bits: int) -> np.ndarray:
    if bits == 4:
        return unpack_int4(raw.reshape(rows, cols // 2))
    return raw.view(np.int8).reshape(rows, cols)


def build_blob(gate: np.ndarray, up: np.ndarray, down: np.ndarray, bits: int) -> np.ndarray:
    """Quantise one expert (gate [I,H], up [I,H], down [H,I]) into its uint8 blob."""
    inter, hidden = gate.shape
    check_dims(hidden, inter)
    if up.shape != (inter, hidden) or down.shape != (hidden, inter):
        raise ValueError(f"expert shapes {gate.shape}, {up.shape}, {down.shape} do not fit [I,H],[I,H],[H,I]")
    layout = BlobLayout(quant_kind(bits), hidden, inter)
    blob = np.empty(layout.nbytes, dtype=np.uint8)
    for m, w in enumerate((gate, up, down)):
        q, s = quantize(w, bits)
        blob[layout.weight_offset(m) : layout.weight_offset(m) + layout.weight_bytes] = pack_weights(q, bits).reshape(-1)
        blob[layout.scale_offset(m) : layout.scale_offset(m) + layout.scale_bytes] = s.astype("<f4").reshape(-1).view(np.uint8)
    return blob


def blob_matrices(blob: np.ndarray, bits: int, hidden: int, inter: int) -> list[np.ndarray]:
    """Float64 dequantised [gate, up, down] of a blob (the test oracle)."""
    layout = BlobLayout(quant_kind(bits), hidden, inter)
    out = []
    for m in range(3):
        rows, cols = layout.shape(m)
        raw = blob[layout.weight_offset(m) : layout.weight_offset(m) + layout.weight_bytes]
        q = unpack_weights(raw, rows, cols, bits)
        s = blob[layout.scale_offset(m) : layout.scale_offset(m) + layout.scale_bytes].view("<f4").reshape(rows, cols // GROUP)
        out.append(dequantize(q, s))
    return out


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def expert_reference(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 SwiGLU expert: down(silu(gate x) * (up x))."""
    x = np.asarray(x, dtype=np.float64)
    g = np.asarray(gate, dtype=np.float64) @ x
    u = np.asarray(up, dtype=np.float64) @ x
    return np.asarray(down, dtype=np.float64) @ (silu(g) * u)


# --- fast path for the converter -------------------------------------------------------------
# The numpy reference above is too slow for the 31 G expert weights of
# Qwen3.6-35B-A3B (docs/benchmarks.md, "Converter"). This numba twin makes the same
# float64 decisions (same division, same round-half-even, same float32 scale),
# so its bytes are identical; tests compare the converter's blobs with
# build_blob.


def _numba_quantize_rows():
    from numba import njit

    @njit(nogil=True, cache=True)
    def quantize_rows(w, qmax, qmin, q_out, s_out):
        rows, cols = w.shape
        for r in range(rows):
            for g in range(cols // GROUP):
                c0 = g * GROUP
                amax = 0.0
                for j in range(GROUP):
                    a = abs(np.float64(w[r, c0 + j]))
                    if a > amax:
                        amax = a
                s32 = np.float32(amax / qmax)
                s_out[r, g] = s32
                s64 = np.float64(s32)
                for j in range(GROUP):
                    v = 0.0
                    if s64 > 0.0:
                        v = np.rint(np.float64(w[r, c0 + j]) / s64)
                        v = min(max(v, qmin), qmax)
                    q_out[r, c0 + j] = np.int8(v)

    return quantize_rows


_quantize_rows = None


def quantize_fast(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Same result as quantize(), compiled; w may be float32/float16/bf16/float64."""
    global _quantize_rows
    if _quantize_rows is None:
        _quantize_rows = _numba_quantize_rows()
    rows, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"columns ({cols}) must be a multiple of {GROUP}")
    w = np.ascontiguousarray(w, dtype=np.float64 if w.dtype == np.float64 else np.float32)
    q = np.empty((rows, cols), dtype=np.int8)
    s = np.empty((rows, cols // GROUP), dtype=np.float32)
    _quantize_rows(w, float(QMAX[bits]), float(QMIN[bits]), q, s)
    return q, s


def build_blob_fast(gate: np.ndarray, up: np.ndarray, down: np.ndarray, bits: int) -> np.ndarray:
    """build_blob with the compiled quantiser (byte-identical)."""
    inter, hidden = gate.shape
    layout = BlobLayout(quant_kind(bits), hidden, inter)
    blob = np.empty(layout.nbytes, dtype=np.uint8)
    for m, w in enumerate((gate, up, down)):
        if w.shape != layout.shape(m):
            raise ValueError(f"expert matrix {m} has shape {w.shape}, expected {layout.shape(m)}")
        q, s = quantize_fast(w, bits)
        blob[layout.weight_offset(m) : layout.weight_offset(m) + layout.weight_bytes] = pack_weights(q, bits).reshape(-1)
        blob[layout.scale_offset(m) : layout.scale_offset(m) + layout.scale_bytes] = s.reshape(-1).view(np.uint8)
    return blob
