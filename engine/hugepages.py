"""Large weight buffers on transparent huge pages.

Why: decode streams hundreds of MiB of weights per token through a few
kernels; on 4 KiB pages every 4 KiB of a row is another TLB entry. The RAM
cache's slots and the dense weights are allocated here, on anonymous
memory advised MADV_HUGEPAGE (2 MiB pages where the kernel has them), where
the matvecs need far fewer TLB entries (figures: docs/benchmarks.md, Kernels).
Small arrays, and systems without the advice, get a plain numpy array.
"""

from __future__ import annotations

import mmap

import numpy as np

#: below this many bytes a buffer is not worth a huge page of its own
MIN_HUGE_BYTES = 4 << 20


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array, on huge pages when it is large enough."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if nbytes < MIN_HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return np.empty(shape, dtype=dtype)
    # the array keeps the mapping alive (it is the array's base)
    return np.frombuffer(region, dtype=dtype, count=count).reshape(shape)


def concat_rows(mats: list[np.ndarray]) -> np.ndarray:
    """np.concatenate(mats) along the first axis, into a buffer from `empty`."""
    out = empty((sum(m.shape[0] for m in mats),) + tuple(mats[0].shape[1:]), mats[0].dtype)
    row = 0
    for m in mats:
        out[row:row + m.shape[0]] = m
        row += m.shape[0]
    return out
