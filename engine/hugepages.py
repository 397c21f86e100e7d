"""Large weight buffers on transparent huge pages.

Why: decode streams hundreds of MiB of weights per token through a few
kernels; on 4 KiB pages every 4 KiB of a row is another TLB entry. The RAM
cache's slots and the dense weights are allocated here, on anonymous
memory advised MADV_HUGEPAGE (2 MiB pages where the kernel has them), where
the matvecs need far fewer TLB entries (figures: docs/benchmarks.md, Kernels).
Small arrays, and systems without the advice, get a plain numpy array.

`empty(..., prefault=True)` also makes every page resident at once: the RAM
cache's slots are allocated while loading, and without it the first prompt
that fills them stops on a page fault (a 2 MiB page zeroed, with compaction
when free memory is short) every 2 MiB it writes, after "ready".
"""

from __future__ import annotations

import mmap

import numpy as np

#: below this many bytes a buffer is not worth a huge page of its own
MIN_HUGE_BYTES = 4 << 20
#: Linux 5.14's advice to fault a range in, writable, now (Python 3.11's mmap lacks the name)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PAGE = mmap.PAGESIZE


def empty(shape, dtype, prefault: bool = False) -> np.ndarray:
    """An uninitialised C-contiguous array, on huge pages when it is large enough;
    with `prefault`, every page of it resident before this returns."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if nbytes < MIN_HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return _plain(shape, dtype, prefault)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return _plain(shape, dtype, prefault)
    # the array keeps the mapping alive (it is the array's base)
    out = np.frombuffer(region, dtype=dtype, count=count).reshape(shape)
    if prefault:
        try:
            region.madvise(MADV_POPULATE_WRITE)
        except OSError:  # a kernel before 5.14: fault the pages in by writing to each
            _touched(out)
    return out


def _plain(shape, dtype, prefault: bool) -> np.ndarray:
    """A numpy array of its own (small, or no huge-page advice here), its pages written if asked."""
    arr = np.empty(shape, dtype=dtype)
    return _touched(arr) if prefault else arr


def _touched(arr: np.ndarray) -> np.ndarray:
    """`arr` with one byte of every page written (the contents are uninitialised anyway)."""
    flat = arr.reshape(-1).view(np.uint8)
    flat[::PAGE] = 0
    return arr


def concat_rows(mats: list[np.ndarray]) -> np.ndarray:
    """np.concatenate(mats) along the first axis, into a buffer from `empty`."""
    out = empty((sum(m.shape[0] for m in mats),) + tuple(mats[0].shape[1:]), mats[0].dtype)
    row = 0
    for m in mats:
        out[row:row + m.shape[0]] = m
        row += m.shape[0]
    return out
